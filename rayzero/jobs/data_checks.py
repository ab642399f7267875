"""The training data as a run resolves and checks it before anything starts: where it is (the
default corpus prepared on first use), how many steps its epochs make, what training drops or
cuts of it (instruction examples, preference pairs), whether it fits the objective, and its
validation split."""

from __future__ import annotations

import sys
from pathlib import Path

from rayzero.config import RootConfig
from rayzero.data.corpus import ensure_default_corpus
from rayzero.data.tokens import MASKED_KINDS, DataError, read_meta


def check_data_paths(cfg: RootConfig) -> None:
    """`data.path` and `data.val_path`, where they are local paths that do not exist, refused
    with the words the full checks use (`resolve_data`, `read_meta`); cheap (no torch), so the
    CLI makes it before Ray's start, which it begins beside the rest of the checks."""
    def missing(path: str | None) -> bool:
        return bool(path) and "://" not in path and not Path(path).expanduser().exists()

    if missing(cfg.data.path):
        resolve_data(cfg)  # raises its DataError
    if missing(cfg.data.val_path):
        read_meta(cfg.data.val_path, cfg.checkpoint)


def resolve_data(cfg: RootConfig) -> str:
    """The dataset path, prepared on first use if it is the default corpus, checked for size."""
    path = cfg.data.path or ensure_default_corpus(cfg.data.cache_dir)
    meta = read_meta(path, cfg.checkpoint, tokenizer=model_tokenizer_dir(cfg),
                     kind="preferences" if cfg.train.objective == "dpo" else "")
    need = cfg.train.global_batch_size * (cfg.train.seq_len + 1)
    if meta.get("kind") not in MASKED_KINDS and meta["num_tokens"] < need:  # examples and pairs are padded out
        raise DataError(
            f"data.path: {path} holds {meta['num_tokens']} tokens, fewer than one global batch "
            f"needs (train.global_batch_size {cfg.train.global_batch_size} x "
            f"(train.seq_len {cfg.train.seq_len} + 1) = {need})"
        )
    return path


def open_dataset(cfg: RootConfig, data):
    """`data` as a TokenDataset: a path is opened, a dataset already open is used as it is (the
    driver opens the training data once for all its checks)."""
    from rayzero.data.tokens import TokenDataset

    return data if isinstance(data, TokenDataset) else TokenDataset(data, storage_cfg=cfg.checkpoint)


def steps_in_epochs(cfg: RootConfig, data_path) -> int:
    """The steps `data.epochs` passes over the data take."""
    import math

    from rayzero.data.validation import validation_split

    t = cfg.train
    ds, _ = validation_split(cfg, open_dataset(cfg, data_path))
    if ds.kind in MASKED_KINDS:
        from rayzero.data.instruct import Epochs
        from rayzero.data.preferences import pair_epochs

        epochs = pair_epochs(ds, t.seed, t.global_batch_size, t.seq_len) if ds.kind == "preferences" else \
            Epochs(ds.document_lengths, t.seed, t.global_batch_size, t.seq_len + 1)
        whole = int(cfg.data.epochs)
        steps = epochs.steps(whole)
        if cfg.data.epochs > whole:
            steps += math.ceil((cfg.data.epochs - whole) * epochs.steps_in(whole))
        return steps
    return math.ceil(cfg.data.epochs * ds.num_tokens / (t.global_batch_size * t.seq_len))


def note_cut_examples(cfg: RootConfig, meta: dict, data_path) -> None:
    """Instruction examples longer than a window are cut to it, preference pairs are cut or
    dropped: say how many."""
    if meta.get("kind") == "preferences":
        return note_pairs(cfg, data_path)
    if meta.get("kind") != "instructions":
        return
    lengths = open_dataset(cfg, data_path).document_lengths
    cut = int((lengths > cfg.train.seq_len + 1).sum())
    if cut:
        print(f"rayzero: note: {cut} of {lengths.size} instruction examples are longer than train.seq_len + 1 = "
              f"{cfg.train.seq_len + 1} tokens and are cut to it (the longest: {int(lengths.max())})", file=sys.stderr)


def note_pairs(cfg: RootConfig, data_path) -> None:
    """Preference pairs training leaves out (the prompt fills train.seq_len + 1 tokens) or cuts:
    say how many; refuse data that keeps none."""
    from rayzero.data.preferences import no_pairs_left, pair_counts
    from rayzero.data.validation import validation_split

    n = cfg.train.seq_len + 1
    ds, _ = validation_split(cfg, open_dataset(cfg, data_path))
    counts = pair_counts(ds, cfg.train.seq_len)
    if not counts.kept:
        raise no_pairs_left(counts, cfg.train.seq_len, f"data.path: {ds.uri}")
    if counts.dropped:
        print(f"rayzero: note: {counts.dropped} of {counts.pairs} preference pairs are left out: the prompt alone fills "
              f"train.seq_len + 1 = {n} tokens (as TRL's DPOTrainer drops them at max_length = {n})", file=sys.stderr)
    if counts.truncated:
        print(f"rayzero: note: {counts.truncated} of {counts.pairs} preference pairs have a sequence longer than "
              f"train.seq_len + 1 = {n} tokens, cut to its first {n} (TRL's keep_start)", file=sys.stderr)


def check_objective(objective: str, key: str, path, meta: dict) -> None:
    """Preference pairs for train.objective=dpo and for it alone: `key` (data.path,
    data.val_path) names the dataset at `path`, `meta` its meta.json."""
    kind, path = meta.get("kind", "text"), getattr(path, "uri", path)
    if objective == "dpo" and kind != "preferences":
        raise DataError(f"train.objective=dpo learns from preference pairs, but {key}: {path} holds {kind} (prepared "
                        "without --preferences); prepare pairs with `rayzero data prepare SRC OUT --tokenizer ... "
                        "--preferences`, or set train.objective=lm")
    if objective != "dpo" and kind == "preferences":
        raise DataError(f"{key}: {path} holds preference pairs (prepared with --preferences), which "
                        f"train.objective={objective} does not learn from; set train.objective=dpo")


def limit_to_epochs(cfg: RootConfig, data_path) -> RootConfig:
    """`train.steps`, or fewer when `data.epochs` ends first."""
    if not cfg.data.epochs:
        return cfg
    steps = steps_in_epochs(cfg, data_path)
    if steps >= cfg.train.steps:
        return cfg
    print(f"rayzero: data.epochs={cfg.data.epochs:g} ends after {steps} steps, before train.steps="
          f"{cfg.train.steps}", file=sys.stderr)
    return cfg.override(f"train.steps={max(steps, 1)}")


def check_validation(cfg: RootConfig, meta: dict, data_path) -> None:
    """Validation data that exists, is made with the training data's tokenizer, and holds a row."""
    if not (cfg.data.val_path or cfg.data.val_fraction):
        return
    from rayzero.data.validation import ValidationRows, validation_split

    if cfg.data.val_path:
        val = read_meta(cfg.data.val_path, cfg.checkpoint)
        if val["tokenizer"]["sha256"] != meta["tokenizer"]["sha256"]:
            raise DataError(f"data.val_path: {cfg.data.val_path} was tokenized with another tokenizer "
                            f"({val['tokenizer']['sha256']}) than data.path {getattr(data_path, 'uri', data_path)} "
                            f"({meta['tokenizer']['sha256']})")
    _, rows = validation_split(cfg, open_dataset(cfg, data_path))
    ValidationRows(rows, seq_len=cfg.train.seq_len, global_batch=cfg.train.global_batch_size,
                   micro_batch=cfg.train.micro_batch_size, dp_rank=0, dp_size=1, max_batches=cfg.train.eval_batches)


def model_tokenizer_dir(cfg: RootConfig) -> str | None:
    """`model.path` where it is a local directory with tokenizer files (the model's own
    tokenizer, which its data must be prepared with), else None."""
    from rayzero.data.tokenizer import tokenizer_files

    path = cfg.model.path
    if not path or "://" in path:
        return None
    local = Path(path).expanduser()
    return path if local.is_dir() and tokenizer_files(local) else None
