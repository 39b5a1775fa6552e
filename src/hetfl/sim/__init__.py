"""The in-process engine: the simulator and the executors that run its clients."""

from hetfl.sim.engine import Simulation
from hetfl.sim.executor import ClientJob, Executor, SequentialExecutor, TaskOutcome

__all__ = ["ClientJob", "Executor", "SequentialExecutor", "Simulation", "TaskOutcome"]
