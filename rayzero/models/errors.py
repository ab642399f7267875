"""The model seam's errors: a module of their own, so that the seam (`spec.py`) and the
pretrained weights (`weights.py`, `conversions.py`) both raise them without importing each other."""


class ModelError(ValueError):
    """A model that cannot be built, loaded or trained as configured; the message names the
    config key or the file at fault."""


class ModelUnavailable(ModelError):
    """The storage `model.path` names cannot be reached from this machine (an S3 endpoint that
    only the cluster sees, say): a dry run notes it, a training run fails on it."""
