"""Cost model, memory model and simulator of pipeline schedules (no torch)."""

from twobp.sim.costs import CostModel, load_costs, parse_amount, parse_costs, save_costs
from twobp.sim.memory import memory_timeline, peak_memory
from twobp.sim.simulate import DeadlockError, SimResult, simulate

__all__ = [
    "CostModel",
    "DeadlockError",
    "SimResult",
    "load_costs",
    "memory_timeline",
    "parse_amount",
    "parse_costs",
    "peak_memory",
    "save_costs",
    "simulate",
]
