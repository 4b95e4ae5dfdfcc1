"""Where weights live: budgets, the tier plan, the disk reader and the layer stores that hand
the engine one layer at a time (resident, or streamed from disk)."""

from .budget import parse_size
from .planner import Plan, plan_layers
from .store import DiskLayerStore, MmapLayerStore, ResidentLayerStore

__all__ = ["DiskLayerStore", "MmapLayerStore", "Plan", "ResidentLayerStore", "parse_size", "plan_layers"]
