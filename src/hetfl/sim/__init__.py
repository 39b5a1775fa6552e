"""The in-process engine: the simulator."""

from hetfl.sim.engine import Simulation, SimulationSettings

__all__ = ["Simulation", "SimulationSettings"]
