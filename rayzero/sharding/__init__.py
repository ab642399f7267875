"""Pure-torch sharding: flat buffers, range maps, one class per strategy. Never imports ray.
The strategies (and torch with them) are imported on first use: reading a config imports
this package for its `ShardingConfig`, and must stay fast."""

from rayzero.sharding.config import OptimConfig, ShardingConfig
from rayzero.sharding.layout import Layout, Range, build_layout
from rayzero.sharding.mesh import Mesh, MeshError


def __getattr__(name: str):
    if name == "Strategy":
        from rayzero.sharding.strategies import Strategy

        return Strategy
    if name == "STRATEGY_CLASSES":
        from rayzero.sharding.fsdp import ShardOptimGradsParams
        from rayzero.sharding.zero import NoShard, ShardOptim, ShardOptimGrads

        return {cls.name: cls for cls in (NoShard, ShardOptim, ShardOptimGrads, ShardOptimGradsParams)}
    raise AttributeError(f"module 'rayzero.sharding' has no attribute {name!r}")


def build_strategy(name: str, *args, **kwargs):
    return __getattr__("STRATEGY_CLASSES")[name](*args, **kwargs)


__all__ = [
    "Layout", "OptimConfig", "Range", "STRATEGY_CLASSES", "ShardingConfig", "Strategy",
    "Mesh", "MeshError", "build_layout", "build_strategy",
]
