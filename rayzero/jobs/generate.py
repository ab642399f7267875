"""A look at what a model learned: text from a prompt, on this machine (no Ray, no GPU needed).

    rayzero generate WEIGHTS --prompt "def add(" [--max-new-tokens 64] [--temperature 0.8 --top-k 50]
    rayzero generate WEIGHTS --prompt "What is 2+2?" [--system "Be brief."]   # a chat model

WEIGHTS is any of
    a checkpoint              (a checkpoint directory, its newest commit, or one step-… prefix):
                              the model is rebuilt from the manifest's record of it
    a Hugging Face directory  an `hf` export, or any model directory transformers loads
    a PEFT adapter directory  a `peft` export: its LoRA adapters merged onto the base model it
                              names (or `model.path=`, which must be that model)
    a safetensors file        a `safetensors` export, with the model's config as overrides
                              (`model.preset=small`, or the training job's `--config`)

A checkpoint and a safetensors file may be in s3://, reached with the `checkpoint.s3_*`
overrides (else the AWS variables).

The tokenizer is `--tokenizer` if given, else the model directory's own (an HF export, or
`model.path`), else the one the training data was made with (kept with the dataset), else
bytes. With a tokenizer that has a chat template the prompt is a user message (and `--system`
a system prompt), rendered with the template as instruction data was, and the answer alone is
printed; `--raw` continues the prompt as plain text instead, and `--chat` insists on the
template. Generation stops at the end-of-sequence token, at the end-of-turn token the template
closes an answer with, and at the generation config's `eos_token_id`s. Greedy at temperature
0; otherwise sampled (top-k when given), under `--seed`.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import torch
import torch.nn as nn

from rayzero.config import ConfigError, RootConfig, load_config
from rayzero.data.tokenizer import ByteTokenizer, Tokenizer, load_tokenizer


class Generator:
    """A model in evaluation mode with its tokenizer. `eos_ids`: the ids the model's config
    and generation config end a sequence with (those the tokenizer knows as special count)."""

    def __init__(self, model: nn.Module, tokenizer: Tokenizer, block_size: int | None = None,
                 eos_ids: set[int] | None = None):
        self.model, self.tokenizer, self.block_size = model.eval(), tokenizer, block_size
        special = set(tokenizer.special_tokens.values())
        # A config's eos id that is an ordinary token of this tokenizer would cut answers short.
        self.stop_ids = {tokenizer.eos_id} | {i for i in (eos_ids or ()) if i in special}
        self.end_of_turn = tokenizer.end_of_turn_ids() if hasattr(tokenizer, "end_of_turn_ids") else set()

    def __call__(self, prompt: str | None = None, max_new_tokens: int = 64, temperature: float = 0.0, top_k: int = 0,
                 seed: int = 0, *, messages: list[dict] | None = None, system: str | None = None,
                 chat: bool | None = None) -> str:
        """The new text only: the prompt's continuation, or the answer to a chat.

        `chat`: None = the chat template when the tokenizer has one, True = it must have one,
        False = `prompt` is raw text. In a chat, `prompt` is the user's message after
        `system`; `messages` gives the whole conversation instead."""
        ids, chatting = self.encode(prompt, messages, system, chat)
        stop = self.stop_ids | (self.end_of_turn if chatting else set())
        return self.tokenizer.decode(self.continue_ids(ids, stop, max_new_tokens, temperature, top_k, seed))

    def encode(self, prompt: str | None, messages: list[dict] | None, system: str | None,
               chat: bool | None) -> tuple[list[int], bool]:
        """The prompt's ids, and whether they are a chat rendered with the template."""
        tok = self.tokenizer
        if self.chats(chat, messages is not None or system is not None):
            if messages is None:
                if prompt is None:
                    raise ConfigError("nothing to answer: give a prompt or messages")
                messages = ([{"role": "system", "content": system}] if system is not None else []) + [
                    {"role": "user", "content": prompt}]
            text = tok.render_chat(messages, generation_prompt=True)
            return tok.encode_batch([text])[0].tolist(), True
        if prompt is None:
            raise ConfigError("nothing to continue: give a prompt")
        ids = tok.encode_batch([prompt])[0].tolist()
        if tok.bos_id is not None:
            ids = [tok.bos_id, *ids]
        return ids or [tok.eos_id], False  # an empty prompt: start as a new document starts

    def chats(self, chat: bool | None, conversation: bool = False) -> bool:
        """Whether a prompt goes through the chat template: `chat` if said (True needs a
        template), else where there is one; a conversation (messages, a system prompt) must."""
        has_template = bool(self.tokenizer.chat_template)
        if conversation and chat is False:
            raise ConfigError("messages and a system prompt need the chat template: leave out raw")
        chatting = (has_template or conversation) if chat is None else chat
        if chatting and not has_template:
            raise ConfigError("the tokenizer has no chat template: give the prompt as plain text (--raw), "
                              "or a tokenizer that has one (--tokenizer)")
        return chatting

    @torch.no_grad()
    def continue_ids(self, ids: list[int], stop: set[int], max_new_tokens: int, temperature: float, top_k: int,
                     seed: int) -> list[int]:
        """Up to `max_new_tokens` new ids after `ids`, ending before the first one in `stop`."""
        x = torch.tensor([ids], dtype=torch.long)
        gen = torch.Generator().manual_seed(seed)
        new: list[int] = []
        for _ in range(max_new_tokens):
            context = x if self.block_size is None else x[:, -self.block_size:]
            out = self.model(context)
            logits = getattr(out, "logits", out)[0, -1].float()
            logits = logits[: self.tokenizer.vocab_size]  # a padded vocabulary never yields an id the tokenizer lacks
            if temperature <= 0:
                nxt = int(logits.argmax())
            else:
                logits = logits / temperature
                if top_k > 0:
                    cut = torch.topk(logits, min(top_k, logits.numel())).values[-1]
                    logits = logits.masked_fill(logits < cut, float("-inf"))
                nxt = int(torch.multinomial(torch.softmax(logits, -1), 1, generator=gen))
            if nxt in stop:
                break
            new.append(nxt)
            x = torch.cat([x, torch.tensor([[nxt]])], dim=1)
        return new


def find_tokenizer(model_path: str | None, data_path: str | None, storage_cfg=None) -> Tokenizer:
    """The tokenizer a model was trained with: the model directory's own (as AutoTokenizer
    loads it), else the copy its dataset keeps, else bytes. A dataset made with a Hugging Face
    tokenizer that is nowhere to be found is an error, not bytes."""
    from rayzero.data.errors import DataError
    from rayzero.data.tokens import dataset_tokenizer, read_meta
    from rayzero.models.hf import model_tokenizer

    if model_path:
        try:
            tok = model_tokenizer(model_path, storage_cfg)
        except (OSError, DataError):
            tok = None
        if tok is not None:
            return tok
    if data_path:
        try:
            tok = dataset_tokenizer(data_path, storage_cfg)
            record = read_meta(data_path, storage_cfg)["tokenizer"]
        except (OSError, DataError):
            return ByteTokenizer()
        if tok is None and record["kind"] != "byte":
            raise ConfigError(f"the training data {data_path} was tokenized with {record.get('name', 'a tokenizer')}, "
                              "which neither the model directory nor the dataset holds: give --tokenizer")
        return tok or ByteTokenizer()
    return ByteTokenizer()


def _eos_ids(files: dict[str, bytes]) -> set[int]:
    """The `eos_token_id`s of a model's config.json and generation_config.json (an int or a list)."""
    ids: set[int] = set()
    for name in ("config.json", "generation_config.json"):
        try:
            value = json.loads(files[name]).get("eos_token_id")
        except (KeyError, ValueError, AttributeError):
            continue
        ids.update(v for v in (value if isinstance(value, list) else [value]) if isinstance(v, int))
    return ids


def _model_files(path: str | None, storage_cfg=None) -> dict[str, bytes]:
    """config.json and generation_config.json of a model directory, those that can be read."""
    if not path:
        return {}
    from rayzero.storage import Storage, StorageError

    files = {}
    for name in ("config.json", "generation_config.json"):
        try:
            files[name] = Storage(path, storage_cfg).read_bytes(name)
        except (FileNotFoundError, StorageError, OSError):
            pass
    return files


def _read_safetensors(uri: str, storage_cfg=None) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file, local or in storage (s3://…)."""
    from safetensors.torch import load, load_file

    from rayzero.storage import Storage

    local = Path(uri).expanduser()
    if local.is_file():
        return load_file(str(local))
    folder, name = uri.rsplit("/", 1)
    try:
        return load(Storage(folder, storage_cfg).read_bytes(name))
    except FileNotFoundError:
        raise ConfigError(f"{uri}: no such file") from None


def _real(model: nn.Module, weights: dict[str, torch.Tensor]) -> nn.Module:
    """A model built on the meta device, its parameters (and persistent buffers) from `weights`."""
    missing = [n for n, p in model.named_parameters() if n not in weights]
    if missing:
        raise ConfigError(f"the weights have no {missing[0]!r} (and {len(missing) - 1} more): another model?")
    model.load_state_dict({k: v.float() for k, v in weights.items()}, strict=False, assign=True)
    return model.float()


def load_generator(weights: str, cfg: RootConfig | None = None, tokenizer: str | None = None) -> Generator:
    """A Generator for a checkpoint, an HF directory or a safetensors file (see the module doc);
    `cfg`: the training job's config (a safetensors file's model; storage settings)."""
    from rayzero.checkpoint.manifest import CheckpointError, open_checkpoint

    cfg = cfg or load_config(None, [])
    storage = cfg.checkpoint
    chosen = load_tokenizer(tokenizer) if tokenizer else None
    local = Path(weights).expanduser()
    if "://" in weights and not weights.startswith("file://") and not weights.endswith(".safetensors"):
        local = _fetched_model_dir(weights, storage) or local  # an HF or PEFT directory in S3: read as a local one
    if local.is_dir() and (local / "adapter_config.json").is_file():  # LoRA adapters (a `peft` export)
        import transformers as tf
        from peft import PeftModel

        base = adapter_base(local, cfg)
        tf.logging.set_verbosity_error()
        tf.logging.disable_progress_bar()
        model = tf.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
        with warnings.catch_warnings():  # PEFT reads a property transformers has renamed: not the user's to fix
            warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated",
                                    category=FutureWarning)
            model = PeftModel.from_pretrained(model, str(local)).merge_and_unload()
        tok = chosen or find_tokenizer(str(local), None, storage)  # the tokenizer saved with the adapter
        if isinstance(tok, ByteTokenizer):
            tok = find_tokenizer(base, None, storage)
        return Generator(model, tok, eos_ids=_eos_ids(_model_files(base)))
    if local.is_dir() and (local / "config.json").is_file():  # a Hugging Face directory
        import transformers as tf

        tf.logging.set_verbosity_error()
        tf.logging.disable_progress_bar()  # its "Loading weights" bar is not the answer
        model = tf.AutoModelForCausalLM.from_pretrained(str(local), dtype=torch.float32)
        tok = chosen or find_tokenizer(str(local), None, storage)
        return Generator(model, tok, eos_ids=_eos_ids(_model_files(str(local))))
    if weights.endswith(".safetensors") and (local.is_file() or "://" in weights):
        from rayzero.workers.assembly import make_spec

        spec = make_spec(cfg)
        model = _real(spec.build(), _read_safetensors(weights, storage))
        path = spec.model_dir(cfg.model)
        tok = chosen or find_tokenizer(path, cfg.data.path or None, storage)
        return Generator(model, tok, spec.block_size, eos_ids=_eos_ids(_model_files(path, storage)))
    try:
        c = open_checkpoint(weights, storage)
    except CheckpointError as e:
        raise ConfigError(f"{weights}: not a checkpoint, a model directory or a safetensors file ({e})") from None
    from rayzero.checkpoint.tools import CheckpointWeights, consolidated_weights

    spec = CheckpointWeights(c, storage).spec
    model = _real(spec.build(), consolidated_weights(c, storage))
    source = spec.model_dir(spec.cfg)
    tok = chosen or find_tokenizer(source, c.manifest["data"].get("path"), storage)
    files = _model_files(source, storage)
    if "config.json" not in files and (c.manifest.get("model_source") or {}).get("config"):
        files["config.json"] = json.dumps(c.manifest["model_source"]["config"]).encode()
    return Generator(model, tok, c.manifest.get("block_size"), eos_ids=_eos_ids(files))


def _fetched_model_dir(uri: str, storage_cfg) -> Path | None:
    """An HF model directory or a PEFT adapter directory in object storage (`ckpt export --format
    hf|peft` writes them there), copied to a temporary directory removed at exit; None where
    `uri` holds neither (a checkpoint, say)."""
    import atexit
    import shutil
    import tempfile

    import pyarrow.fs as pafs

    from rayzero.storage import Storage, StorageError

    try:
        root = Storage(uri, storage_cfg)
        if root.size("config.json") is None and root.size("adapter_config.json") is None:
            return None
        to = Path(tempfile.mkdtemp(prefix="rayzero-generate-"))
        atexit.register(shutil.rmtree, to, ignore_errors=True)
        pafs.copy_files(root.base, str(to), source_filesystem=root.fs, destination_filesystem=pafs.LocalFileSystem())
    except (StorageError, OSError) as e:
        raise ConfigError(f"{uri}: cannot read it: {e}") from None
    return to


def adapter_base(adapter: Path, cfg: RootConfig) -> str:
    """The base model a PEFT adapter directory goes onto: `model.path` where given, else the
    one it names (`base_model_name_or_path`). Where rayzero wrote the adapter (its metadata has
    the hash of the config.json it was trained on), that base must have that config; else a
    `model.path` other than the base it names must have the same config.json as that base,
    where it is here to compare. ConfigError leading with what differs, or saying the base is
    not there."""
    import hashlib

    from rayzero.models.lora import read_adapter

    found = read_adapter(str(adapter))
    named, given = found.base, cfg.model.path
    base = given or named
    if not base:
        raise ConfigError(f"{adapter}: the adapter names no base model (base_model_name_or_path): give "
                          "model.path=BASE_DIR")
    where_base = Path(base).expanduser()
    if "://" in base and not base.startswith("file://"):  # a base in object storage: read as a local one
        where_base = _fetched_model_dir(base, cfg.checkpoint) or where_base
    config = where_base / "config.json"
    if not config.is_file():
        where = "model.path" if given else "the base it names,"
        raise ConfigError(f"{adapter}: {where} {base} is not a model directory (no config.json): give "
                          "model.path=BASE_DIR")

    def digest(path: Path) -> str:
        return hashlib.sha256(path.read_bytes()).hexdigest()[:16]

    mine = digest(config)
    recorded = found.identity.get("config_sha256")
    trained_on = found.identity.get("source") or named or "another model"
    same_path = bool(named) and (named == base or Path(named).expanduser().resolve() == where_base.resolve())
    if recorded and recorded != mine:
        if same_path:
            raise ConfigError(f"{adapter}: the model at {base} is not the one the adapter was trained on: its "
                              f"config.json hash is {mine} now, {recorded} then")
        raise ConfigError(f"{adapter}: the adapter was trained on {trained_on} (config {recorded}), not on "
                          f"model.path {base} (config {mine}); give model.path={trained_on}, or leave it out")
    if not recorded and given and not same_path and named:
        other = Path(named).expanduser() / "config.json"
        if other.is_file() and digest(other) != mine:
            raise ConfigError(f"{adapter}: the adapter was trained on {named} (config {digest(other)}), not on "
                              f"model.path {base} (config {mine}); give model.path={named}, or leave it out")
    return str(where_base)
