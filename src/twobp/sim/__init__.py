"""Cost model, memory model and simulator of pipeline schedules (no torch)."""

from twobp.sim.contention import simulate_shared, slowdown
from twobp.sim.cost_io import (
    costs_from_json,
    costs_to_json,
    load_costs,
    parse_amount,
    parse_costs,
    save_costs,
)
from twobp.sim.costs import CostModel
from twobp.sim.memory import memory_timeline, peak_memory
from twobp.sim.simulate import DeadlockError, SimResult, simulate
from twobp.sim.steady import SteadyState, repeat_steps, steady_state

__all__ = [
    "CostModel",
    "DeadlockError",
    "SimResult",
    "SteadyState",
    "costs_from_json",
    "costs_to_json",
    "load_costs",
    "memory_timeline",
    "parse_amount",
    "parse_costs",
    "peak_memory",
    "repeat_steps",
    "save_costs",
    "simulate",
    "simulate_shared",
    "slowdown",
    "steady_state",
]
