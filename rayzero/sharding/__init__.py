"""Pure-torch sharding: flat buffers, range maps, and one `Strategy` composed of the policies
that the table `STRATEGIES` (strategies.py) chooses per strategy. Never imports ray.
The strategies (and torch with them) are imported on first use: reading a config imports
this package for its `ShardingConfig`, and must stay fast."""

from rayzero.sharding.config import OptimConfig, ShardingConfig
from rayzero.sharding.layout import Layout, Range, build_layout
from rayzero.sharding.mesh import Mesh, MeshError


def __getattr__(name: str):
    if name in ("Strategy", "STRATEGIES"):
        from rayzero.sharding import strategies

        return getattr(strategies, name)
    raise AttributeError(f"module 'rayzero.sharding' has no attribute {name!r}")


def build_strategy(name: str, model, mesh: Mesh, sharding: ShardingConfig, *args, **kwargs):
    """The strategy `name` (as `sharding.strategy` names them) for `model`."""
    from rayzero.sharding.strategies import Strategy

    if sharding.strategy != name:
        sharding = sharding.model_copy(update={"strategy": name})
    return Strategy(model, mesh, sharding, *args, **kwargs)


__all__ = [
    "Layout", "Mesh", "MeshError", "OptimConfig", "Range", "STRATEGIES", "ShardingConfig", "Strategy",
    "build_layout", "build_strategy",
]
