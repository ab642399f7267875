"""Pure-torch sharding: flat buffers, range maps, one class per strategy. Never imports ray."""

from rayzero.sharding.config import OptimConfig, ShardingConfig
from rayzero.sharding.fsdp import ShardOptimGradsParams
from rayzero.sharding.layout import Layout, Range, build_layout
from rayzero.sharding.strategies import Strategy
from rayzero.sharding.zero import NoShard, ShardOptim, ShardOptimGrads
from rayzero.sharding.topology import Topology

STRATEGY_CLASSES: dict[str, type[Strategy]] = {
    cls.name: cls for cls in (NoShard, ShardOptim, ShardOptimGrads, ShardOptimGradsParams)
}


def build_strategy(name: str, *args, **kwargs) -> Strategy:
    return STRATEGY_CLASSES[name](*args, **kwargs)


__all__ = [
    "Layout", "OptimConfig", "Range", "STRATEGY_CLASSES", "ShardingConfig", "Strategy",
    "Topology", "build_layout", "build_strategy",
]
