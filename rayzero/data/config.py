from pydantic import Field

from rayzero._frozen import Frozen


class DataConfig(Frozen):
    """The training text, tokenized into bytes; `rayzero data prepare SRC OUT` prepares a dataset."""

    path: str = Field(
        default="",
        description="A prepared dataset (local path or URI); empty = the Python standard library's source, "
        "prepared on first use.",
    )
    cache_dir: str = Field(
        default="~/.cache/rayzero/datasets",
        description="Where the default corpus is prepared once and kept; `~` is expanded.",
    )
