"""The in-process engine: the simulator."""

from hetfl.sim.engine import Simulation

__all__ = ["Simulation"]
