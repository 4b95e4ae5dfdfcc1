"""Where weights live: budgets, the tier plan, the disk reader and the layer stores that hand
the engine one layer at a time (resident, or streamed from pinned RAM or disk; every store is a
LayerStore, protocol.py; the CUDA store is in cuda_store, imported only on CUDA)."""

from .budget import parse_size
from .planner import Plan, plan_cuda, plan_layers
from .protocol import LayerStore, StoreStats
from .store import DiskLayerStore, MmapLayerStore, ResidentLayerStore, StreamDelays

__all__ = ["DiskLayerStore", "LayerStore", "MmapLayerStore", "Plan", "ResidentLayerStore",
           "StoreStats", "StreamDelays", "parse_size", "plan_cuda", "plan_layers"]
