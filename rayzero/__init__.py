"""rayzero: sharded PyTorch training driven phase by phase over Ray actors.

    from rayzero import Trainer, TrainConfig
    result = Trainer(TrainConfig(train={"steps": 50})).fit()
"""

from rayzero.version import __version__

__all__ = ["Trainer", "TrainConfig", "Result", "release_ranks", "__version__"]


def __getattr__(name: str):
    # The SDK (and with it Ray) is imported on first use only: `import rayzero.sharding` and
    # the other pure layers must not pull Ray in through their parent package.
    if name in ("Trainer", "TrainConfig", "Result", "release_ranks"):
        import importlib

        return getattr(importlib.import_module("rayzero.sdk"), name)
    raise AttributeError(f"module 'rayzero' has no attribute {name!r}")
