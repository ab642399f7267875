"""Pure-torch sharding: flat buffers, range maps, one class per strategy. Never imports ray."""

from rayzero.sharding.config import OptimConfig, ShardingConfig
from rayzero.sharding.layout import Layout, Range, build_layout
from rayzero.sharding.strategies import STRATEGY_CLASSES, Strategy, build_strategy
from rayzero.sharding.topology import Topology

__all__ = [
    "Layout", "OptimConfig", "Range", "STRATEGY_CLASSES", "ShardingConfig", "Strategy",
    "Topology", "build_layout", "build_strategy",
]
