"""The decode step's copy plan (`api.plan_copies`) and its jnp reference."""

from .api import plan_copies
from .reference import CopyPlan, SlotAssignment, assign_slots, empty_table, plan_copies_reference

__all__ = ["plan_copies", "plan_copies_reference", "CopyPlan", "SlotAssignment", "assign_slots", "empty_table"]
