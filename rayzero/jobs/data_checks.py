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
    meta = read_meta(path, cfg.checkpoint, tokenizer=model_tokenizer_dir(cfg), kind=default_kind(cfg))
    need = cfg.train.global_batch_size * (cfg.train.seq_len + 1)
    if meta.get("kind") not in (*MASKED_KINDS, "prompts") and meta["num_tokens"] < need:  # examples and pairs are padded out
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


def packs_examples(cfg: RootConfig, meta: dict) -> str | None:
    """What packs several examples into each training row, in words (instruction data; text
    with `data.document_masking`), or None: the model must then keep them apart."""
    kind = meta.get("kind", "text")
    if kind == "instructions":
        return "instruction data"
    return "data.document_masking" if kind == "text" and cfg.data.document_masking else None


def cut_examples(cfg: RootConfig, data_path) -> dict | None:
    """What the windows do to the training examples of instruction data (None for other data):
    {"examples", "cut": how many are longer than a window, "most": the most tokens one loses,
    "whole": the train.seq_len that keeps every one whole, "emptied": how many lose every
    response token}. A DataError when no example keeps a response token:
    there is nothing to train."""
    from rayzero.data.validation import validation_split

    ds, _ = validation_split(cfg, open_dataset(cfg, data_path))
    if ds.kind != "instructions":
        return None
    n = cfg.train.seq_len + 1
    lengths = ds.document_lengths
    try:
        prompts = ds.prompt_lengths
    except DataError:  # prepared by an older rayzero: no prompt lengths recorded
        prompts = None
    # a response token at index p of its example is a target when p <= seq_len: p < n
    emptied = int((prompts >= n).sum()) if prompts is not None else 0
    if prompts is not None and emptied == lengths.size:
        shortest = int(prompts.min())
        raise DataError(f"data.path: {getattr(ds, 'uri', data_path)}: nothing to train at train.seq_len="
                        f"{cfg.train.seq_len}: every one of the {lengths.size} instruction examples' prompts fills the "
                        f"window of train.seq_len + 1 = {n} tokens, so no response token is left (the shortest prompt is "
                        f"{shortest} tokens); train.seq_len={shortest} keeps a response token of it, "
                        f"train.seq_len={int(lengths.max()) - 1} keeps every example whole")
    cut = lengths > n
    return {"examples": int(lengths.size), "cut": int(cut.sum()), "most": int((lengths - n).max()) if cut.any() else 0,
            "whole": int(lengths.max()) - 1, "emptied": emptied}


def cut_words(cfg: RootConfig, cut: dict | None) -> str | None:
    """`cut_examples` in one line (None: nothing is cut)."""
    if not cut or not cut["cut"]:
        return None
    n = cfg.train.seq_len + 1
    emptied = (f"; {cut['emptied']} of them keep no response token at all (their prompt fills the window)"
               if cut["emptied"] else "")
    return (f"{cut['cut']} of {cut['examples']} instruction examples are longer than a window (train.seq_len + 1 = {n} "
            f"tokens) and are cut, by up to {cut['most']} tokens{emptied}; train.seq_len={cut['whole']} keeps every "
            "one whole")


def note_cut_examples(cfg: RootConfig, meta: dict, data_path) -> None:
    """Instruction examples longer than a window are cut to it, preference pairs are cut or
    dropped: say how many; refuse data that leaves nothing to train."""
    if meta.get("kind") == "preferences":
        return note_pairs(cfg, data_path)
    if meta.get("kind") != "instructions":
        return
    words = cut_words(cfg, cut_examples(cfg, data_path))
    if words:
        print(f"rayzero: note: {words}", file=sys.stderr)


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


# What each kind of prepared data is, in words, and how `rayzero data prepare` makes it.
KIND_WORDS = {"text": ("text", "prepared without --instructions or --preferences"),
              "instructions": ("instruction examples", "prepared with --instructions"),
              "preferences": ("preference pairs", "prepared with --preferences"),
              "prompts": ("prompts for online RL", "prepared with --prompts")}
PREPARE_FLAG = {"text": "", "instructions": " --instructions", "preferences": " --preferences",
                "prompts": " --prompts"}


def default_kind(cfg: RootConfig) -> str:
    """The kind the default corpus is prepared as: the objective's only kind, else text."""
    from rayzero.objectives.registry import objective_class

    kinds = objective_class(cfg.train.objective).data_kinds
    return kinds[0] if len(kinds) == 1 and kinds[0] != "text" else ""


def check_objective(objective: str, key: str, path, meta: dict) -> None:
    """The data kinds the objective reads (`Objective.data_kinds`), and no other: `key`
    (data.path, data.val_path) names the dataset at `path`, `meta` its meta.json."""
    from rayzero.objectives.config import OBJECTIVES
    from rayzero.objectives.registry import objective_class

    kind, path = meta.get("kind", "text"), getattr(path, "uri", path)
    kinds = objective_class(objective).data_kinds
    if kind in kinds:
        return
    words = " or ".join(KIND_WORDS[k][0] for k in kinds)
    flags = "|".join(PREPARE_FLAG[k].strip() or "(no flag)" for k in kinds)
    readers = [n for n in OBJECTIVES if n != objective and kind in objective_class(n).data_kinds]
    other = f", or set train.objective={readers[0]}" if readers else ""
    raise DataError(f"train.objective={objective} learns from {words}, but {key}: {path} holds "
                    f"{KIND_WORDS.get(kind, (kind, ''))[0]} ({KIND_WORDS.get(kind, ('', 'of its own kind'))[1]}); "
                    f"prepare it with `rayzero data prepare SRC OUT --tokenizer ... {flags}`{other}")


def run_length(cfg: RootConfig, data_path) -> tuple[RootConfig, str | None, str]:
    """How long the run is: the config with its `train.steps`, in words what sets it (None:
    `train.steps` alone), and the key that does, as a resume's notes name it (`data.epochs=3
    (120 steps)` or `train.steps=100`). `data.epochs` alone sets `train.steps` (the schedule
    follows it); with both, the earlier ends the run."""
    steps_key = f"train.steps={cfg.train.steps}"
    if not cfg.data.epochs:
        return cfg, None, steps_key
    steps = max(steps_in_epochs(cfg, data_path), 1)
    epochs = f"data.epochs={cfg.data.epochs:g} ({steps} steps)"
    if not cfg.is_set("train.steps"):
        return cfg.override(f"train.steps={steps}"), f"{epochs} sets the run's length; the schedule follows it", epochs
    if steps < cfg.train.steps:
        return cfg.override(f"train.steps={steps}"), f"{epochs} ends the run before {steps_key}", epochs
    if steps > cfg.train.steps:
        return cfg, f"{steps_key} ends the run before {epochs}", steps_key
    return cfg, f"{epochs} and {steps_key} end the run together", steps_key


def data_plan(cfg: RootConfig) -> tuple[RootConfig, dict]:
    """What the dry run says of the training data, read as the run reads it where it can be read
    from here (not preparing the default corpus): the config with the run's length from
    `data.epochs` (`run_length`), and {"path", "kind", "packs", "length", "cut"} ("note": why
    the data was not read). DataError where the run would refuse it (nothing to train)."""
    from rayzero.data.corpus import default_corpus
    from rayzero.storage import StorageError

    path = cfg.data.path or str(default_corpus(cfg.data.cache_dir))
    shown = cfg.data.path or f"the default corpus at {path}"
    try:
        meta = read_meta(path, cfg.checkpoint)
    except (DataError, StorageError, OSError) as e:
        why = "it is prepared on first use" if not cfg.data.path else str(e)
        length = (f"data.epochs={cfg.data.epochs:g}: its steps are counted once the data can be read"
                  if cfg.data.epochs else None)
        return cfg, {"path": "the default corpus" if not cfg.data.path else shown, "kind": None, "packs": None,
                     "length": length, "cut": None, "note": f"not read from here: {why}"}
    check_objective(cfg.train.objective, "data.path", path, meta)  # as the run refuses data of another kind
    dataset = open_dataset(cfg, path)
    cut = cut_words(cfg, cut_examples(cfg, dataset)) if meta.get("kind") == "instructions" else None
    cfg, length, _ = run_length(cfg, dataset)
    return cfg, {"path": shown, "kind": meta.get("kind", "text"), "packs": packs_examples(cfg, meta),
                 "length": length, "cut": cut, "note": None}


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
