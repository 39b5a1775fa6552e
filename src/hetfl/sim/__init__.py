"""The in-process engine: the simulator and the executors that run its units of work."""

from hetfl.sim.engine import Simulation
from hetfl.sim.executor import Executor, SequentialExecutor
from hetfl.sim.factory import make_executor
from hetfl.sim.processes import ProcessExecutor
from hetfl.sim.ray_executor import RayExecutor
from hetfl.sim.tasks import ClientJob, TaskOutcome
from hetfl.sim.vectorised import VectorisedExecutor

__all__ = [
    "ClientJob",
    "Executor",
    "ProcessExecutor",
    "RayExecutor",
    "SequentialExecutor",
    "Simulation",
    "TaskOutcome",
    "VectorisedExecutor",
    "make_executor",
]
