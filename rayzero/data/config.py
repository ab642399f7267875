from pydantic import Field

from rayzero._frozen import Frozen


class DataConfig(Frozen):
    """The training data: token shards `rayzero data prepare SRC OUT` makes from text (documents) or
    from instruction records (examples with the loss on their responses)."""

    path: str = Field(
        default="",
        description="A prepared dataset (local path or URI; `s3://` uses the `checkpoint.s3_*` settings); empty = "
        "the Python standard library's source, prepared on first use.",
    )
    cache_dir: str = Field(
        default="~/.cache/rayzero/datasets",
        description="Where the default corpus is prepared once and kept; `~` is expanded.",
    )
    val_path: str = Field(
        default="",
        description="A prepared dataset to validate on (made with the training data's tokenizer); see "
        "`train.eval_every`. Empty = no validation unless `val_fraction`.",
    )
    val_fraction: float = Field(
        default=0.0, ge=0, lt=1,
        description="Hold out this share of the training data's documents (instruction examples; preference "
        "pairs, both sequences), whole, for validation: the same ones for every seed and world size; 0 = none.",
    )
    epochs: float = Field(
        default=0, ge=0,
        description="Passes over the data: alone (`train.steps` left unset) they set the run's length; with "
        "`train.steps` the earlier ends the run. The learning-rate schedule follows the length. 0 = `train.steps` "
        "alone; a run from pretrained weights defaults to 3 when `train.steps` is unset. Instruction data: every "
        "example once per epoch, packed in an order drawn from the seed; preference pairs: every pair once per "
        "epoch; text: as many tokens as the dataset holds.",
    )
    document_masking: bool = Field(
        default=False,
        description="Text data: each document in a training window attends to its own earlier tokens only and its "
        "positions restart at its start, and no target crosses from one document into the next (as Llama 3 "
        "trained); off, a window is one sequence, as most pretraining runs. Instruction examples are always kept "
        "apart this way.",
    )
