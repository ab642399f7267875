"""rayzero: sharded PyTorch training driven phase by phase over Ray actors."""

__version__ = "0.1.0"
