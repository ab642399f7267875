"""Tokenizers for `rayzero data prepare`: bytes, or a Hugging Face tokenizer from a local directory.

    byte        256 byte values and end-of-text (257 ids); what rayzero has always used
    DIRECTORY   a `tokenizer.json` (through `tokenizers`), or anything
                `transformers.AutoTokenizer` loads from a local directory, such as a model
                directory with its tokenizer files

One tokenizer everywhere: a model directory's tokenizer is what
`AutoTokenizer.from_pretrained(MODEL_DIR)` gives, which is what the user's own inference code
will load, with its class picked from `tokenizer_config.json` or else from `config.json`'s
`model_type` (a Qwen2 directory gives `Qwen2Tokenizer`, which splits digits, where the bare
`tokenizer.json` would not). `data prepare`, training's check, `generate` and the export all
load it that way; a prepared dataset keeps a copy (`tokenizer/`, as `save_pretrained` writes
it, naming its class) that loads the same tokenizer without the model directory.

A document becomes [BOS] + its tokens + EOS: BOS where the tokenizer adds one itself
(Llama's does, GPT-2's does not), EOS always, as the separator between documents.

A tokenizer is identified by `sha256`, a hash of what it does (its vocabulary, merges,
normalizer, pre-tokenizer and special tokens, from its canonical serialization), so that the
same tokenizer saved twice, or copied into a model directory, compares equal; `files_sha256`
hashes the files it was loaded from.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import tempfile
from functools import cached_property
from pathlib import Path

import numpy as np

from rayzero.data.errors import DataError

BYTE_EOT = 256
BYTE_VOCAB = 257
# The files a tokenizer is made of (those transformers writes with save_pretrained).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "vocab.json", "vocab.txt", "merges.txt", "*.model", "chat_template.jinja", "chat_template.json")


class TokenizerError(DataError):
    """A tokenizer that cannot be loaded or used."""


class Tokenizer:
    """What preparing and checking a dataset needs of a tokenizer."""

    kind: str
    vocab_size: int  # ids run over [0, vocab_size)
    eos_id: int
    bos_id: int | None  # the id prepended to every document, if the tokenizer adds one

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        """Each text's token ids, without BOS or EOS."""
        raise NotImplementedError

    def decode(self, ids) -> str:
        raise NotImplementedError

    @property
    def sha256(self) -> str:
        raise NotImplementedError

    def documents(self, texts: list[str], dtype) -> list[np.ndarray]:
        """Each text as a document: [BOS] + tokens + EOS, in `dtype`."""
        head = [] if self.bos_id is None else [self.bos_id]
        return [np.concatenate([np.asarray(head, dtype), ids.astype(dtype, copy=False), np.asarray([self.eos_id], dtype)])
                for ids in self.encode_batch(texts)]

    def record(self) -> dict:
        """The tokenizer as meta.json records it."""
        return {"kind": self.kind, "sha256": self.sha256, "vocab_size": self.vocab_size, "eos_id": self.eos_id,
                "bos_id": self.bos_id, "special_tokens": self.special_tokens}

    @property
    def special_tokens(self) -> dict[str, int]:
        return {}

    def for_documents(self) -> "Tokenizer":
        """What encoding documents needs of this tokenizer, quick to send to another process
        and to load there (no transformers import for a fast tokenizer)."""
        return self

    @property
    def chat_template(self) -> str | None:
        return None

    def saved_files(self) -> dict[str, bytes]:
        """The tokenizer as files a directory can hold and `load_tokenizer` loads back the
        same (none for bytes, which need none)."""
        return {}


class ByteTokenizer(Tokenizer):
    kind = "byte"
    vocab_size = BYTE_VOCAB
    eos_id = BYTE_EOT
    bos_id = None
    sha256 = "byte"

    def encode_batch(self, texts):
        return [np.frombuffer(t.encode("utf-8"), dtype=np.uint8) for t in texts]

    def decode(self, ids) -> str:
        return bytes(int(t) for t in ids if t < 256).decode("utf-8", errors="replace")

    @property
    def special_tokens(self):
        return {"<|endoftext|>": BYTE_EOT}


class HFTokenizer(Tokenizer):
    """A Hugging Face tokenizer from a local directory (or a `tokenizer.json` file)."""

    kind = "hf"

    def __init__(self, path: str | Path, name: str | None = None):
        """`name`: what messages and records call it (default: the directory's name)."""
        self.path = Path(path).expanduser()
        self.name = name or self.path.name
        self.tok = _load_hf(self.path)
        self.files_hash = files_sha256(self.path)  # the directory may be a temporary one
        self.vocab_size = len(self.tok)
        self.eos_id = self.tok.eos_token_id
        if self.eos_id is None:
            raise TokenizerError(
                f"tokenizer {self.path}: it has no end-of-sequence token (documents are separated by it); set "
                "`eos_token` in its tokenizer_config.json")
        with_special = self.tok("a", add_special_tokens=True)["input_ids"]
        plain = self.tok("a", add_special_tokens=False)["input_ids"]
        head = with_special[: len(with_special) - len(plain)] if with_special[-len(plain):] == plain else []
        self.bos_id = head[0] if head and head[0] == self.tok.bos_token_id else None
        self._backend = getattr(self.tok, "backend_tokenizer", None) if self.tok.is_fast else None

    def encode_batch(self, texts):
        if self._backend is not None:  # the Rust tokenizer, in parallel across its threads
            return [np.asarray(e.ids, dtype=np.int64)
                    for e in self._backend.encode_batch_fast(texts, add_special_tokens=False)]
        return [np.asarray(ids, dtype=np.int64)
                for ids in self.tok(texts, add_special_tokens=False)["input_ids"]]

    def decode(self, ids) -> str:
        return self.tok.decode([int(i) for i in ids], skip_special_tokens=True)

    @cached_property
    def sha256(self) -> str:
        h = hashlib.sha256()
        if self._backend is not None:
            spec = json.loads(self._backend.to_str())
            for transient in ("truncation", "padding"):  # settings of a call, not of the tokenizer
                spec.pop(transient, None)
            h.update(json.dumps(spec, sort_keys=True).encode())
        else:
            h.update(json.dumps(sorted(self.tok.get_vocab().items())).encode())
        h.update(json.dumps([self.bos_id, self.eos_id, self.special_tokens], sort_keys=True).encode())
        return h.hexdigest()[:16]

    @property
    def special_tokens(self):
        """Every special token, by content: those the tokenizer names (bos, eos, pad, ...) and
        those its vocabulary marks special."""
        named = {t: int(self.tok.convert_tokens_to_ids(t)) for t in self.tok.all_special_tokens}
        marked = {t.content: int(i) for i, t in getattr(self.tok, "added_tokens_decoder", {}).items() if t.special}
        return dict(sorted({**marked, **named}.items()))

    @property
    def chat_template(self):
        return getattr(self.tok, "chat_template", None)

    def render_chat(self, messages: list[dict], generation_prompt: bool = True) -> str:
        """The conversation as the chat template renders it (the text `data prepare` encodes
        for instruction data), ending, with `generation_prompt`, where the answer begins."""
        return self.tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)

    def end_of_turn_ids(self) -> set[int]:
        """The special token(s) the chat template closes an assistant turn with (Qwen's
        `<|im_end|>`, Llama 3's `<|eot_id|>`), found by rendering one turn: none without a
        template, or where the template closes a turn with plain text."""
        if not self.chat_template:
            return set()
        marker = "rayzero0turn0end"
        try:
            text = self.render_chat([{"role": "user", "content": "hi"}, {"role": "assistant", "content": marker}],
                                    generation_prompt=False)
        except Exception:  # noqa: BLE001 (a template that wants other roles: no marker known)
            return set()
        after = text.rpartition(marker)[2]
        special = set(self.special_tokens.values())
        ids = self.encode_batch([after])[0].tolist() if after else []
        return {i for i in ids[:2] if i in special}

    def record(self) -> dict:
        return {**super().record(), "files_sha256": self.files_hash, "name": self.name,
                "class": type(self.tok).__name__}

    def saved_files(self) -> dict[str, bytes]:
        """`save_pretrained`'s files: tokenizer.json and a tokenizer_config.json naming the
        class, so that AutoTokenizer gives this same tokenizer from them alone."""
        with tempfile.TemporaryDirectory() as d:
            self.tok.save_pretrained(d)
            return {p.name: p.read_bytes() for p in sorted(Path(d).iterdir()) if p.is_file()}

    def for_documents(self) -> Tokenizer:
        if self._backend is None:
            return self
        return _RustDocuments(self._backend.to_str(), self.vocab_size, self.eos_id, self.bos_id)


class _RustDocuments(Tokenizer):
    """A fast tokenizer's Rust core with the ids documents are wrapped in: encodes documents
    exactly as the HFTokenizer it came from, loading in milliseconds."""

    kind = "hf"

    def __init__(self, spec: str, vocab_size: int, eos_id: int, bos_id: int | None):
        self.spec, self.vocab_size, self.eos_id, self.bos_id = spec, vocab_size, eos_id, bos_id
        self._tok = None

    def encode_batch(self, texts):
        if self._tok is None:
            from tokenizers import Tokenizer as RustTokenizer

            self._tok = RustTokenizer.from_str(self.spec)
        return [np.asarray(e.ids, dtype=np.int64) for e in self._tok.encode_batch_fast(texts, add_special_tokens=False)]

    def __getstate__(self):
        return {**self.__dict__, "_tok": None}


def _load_hf(path: Path):
    import transformers

    transformers.logging.set_verbosity_error()
    if path.is_file() and path.suffix == ".json":  # a bare tokenizer.json
        try:
            return transformers.PreTrainedTokenizerFast(tokenizer_file=str(path))
        except Exception as e:
            raise TokenizerError(f"tokenizer {path}: not a tokenizer.json `tokenizers` loads ({_first_line(e)})") from None
    if not path.is_dir():
        raise TokenizerError(f"tokenizer {path}: no such directory (give `byte`, or a directory with a Hugging Face "
                             "tokenizer, such as the model's)")
    if not tokenizer_files(path):
        raise TokenizerError(f"tokenizer {path}: the directory holds no tokenizer files (tokenizer.json, "
                             "tokenizer_config.json, vocab/merges or a sentencepiece model)")
    try:
        tok = transformers.AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except Exception as e:
        if (path / "tokenizer.json").is_file():  # a tokenizer.json without transformers' config
            try:
                tok = transformers.PreTrainedTokenizerFast(tokenizer_file=str(path / "tokenizer.json"))
            except Exception:
                raise TokenizerError(f"tokenizer {path}: it loads nothing ({_first_line(e)})") from None
        else:
            raise TokenizerError(f"tokenizer {path}: it loads nothing ({_first_line(e)})") from None
    if isinstance(tok, bool) or not hasattr(tok, "convert_tokens_to_ids"):
        raise TokenizerError(f"tokenizer {path}: it loads nothing")
    if tok.eos_token_id is None:
        _guess_eos(tok)
    return tok


def _guess_eos(tok) -> None:
    """A bare tokenizer.json names no EOS: take the one special token with a conventional name."""
    special = {t.content for t in tok.backend_tokenizer.get_added_tokens_decoder().values() if t.special} \
        if tok.is_fast else set()
    for name in ("</s>", "<|endoftext|>", "<|end_of_text|>", "<eos>", "<EOS_TOKEN>", "<|eot_id|>", "[SEP]"):
        if name in special:
            tok.eos_token = name
            return


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def is_tokenizer_file(name: str) -> bool:
    return any(fnmatch.fnmatch(name, pat) for pat in TOKENIZER_FILES)


def tokenizer_files(path: Path) -> list[Path]:
    if not path.is_dir():
        return [path] if path.is_file() else []
    return sorted(p for p in path.iterdir() if p.is_file() and is_tokenizer_file(p.name))


def files_sha256(path: Path) -> str:
    h = hashlib.sha256()
    for p in tokenizer_files(path):
        h.update(p.name.encode() + b"\0" + p.read_bytes() + b"\0")
    return h.hexdigest()[:16]


def tokenizer_from_files(files: dict[str, bytes], name: str) -> "HFTokenizer":
    """A tokenizer from a directory's files held in memory (read from storage): written to a
    temporary directory and loaded from there as from the directory itself (so include
    `config.json` where the directory has one: it can pick the tokenizer's class)."""
    with tempfile.TemporaryDirectory() as d:
        for file, data in files.items():
            (Path(d) / file).write_bytes(data)
        return HFTokenizer(d, name=name)


def load_tokenizer(spec: str | Path | Tokenizer | None) -> Tokenizer:
    """`byte` (or None), a directory or tokenizer.json file, or a Tokenizer already made."""
    if isinstance(spec, Tokenizer):
        return spec
    if spec is None or str(spec) == "byte":
        return ByteTokenizer()
    if "://" in str(spec) and not str(spec).startswith("file://"):
        raise TokenizerError(f"tokenizer {spec}: give a local directory (copy the tokenizer files from storage first)")
    return HFTokenizer(str(spec).removeprefix("file://"))


def token_dtype(vocab_size: int) -> np.dtype:
    """The narrowest unsigned type that holds every id."""
    return np.dtype(np.uint16) if vocab_size <= 1 << 16 else np.dtype(np.uint32)
