"""A look at what a model learned: text from a prompt, on this machine (no Ray, no GPU needed).

    rayzero generate WEIGHTS --prompt "def add(" [--max-new-tokens 64] [--temperature 0.8 --top-k 50]

WEIGHTS is any of
    a checkpoint              (a checkpoint directory, its newest commit, or one step-… prefix):
                              the model is rebuilt from the manifest's record of it
    a Hugging Face directory  an `hf` export, or any model directory transformers loads
    a safetensors file        a `safetensors` export, with the model's config as overrides
                              (`model.preset=small`, or the training job's `--config`)

The tokenizer is `--tokenizer` if given, else the one in the model's directory (an HF export
or `model.path`), else bytes. Greedy at temperature 0; otherwise sampled (top-k when given),
under `--seed`.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn as nn

from rayzero.config import ConfigError, RootConfig, load_config
from rayzero.data.tokenizer import ByteTokenizer, Tokenizer, load_tokenizer, tokenizer_files


class Generator:
    """A model in evaluation mode with its tokenizer."""

    def __init__(self, model: nn.Module, tokenizer: Tokenizer, block_size: int | None = None):
        self.model, self.tokenizer, self.block_size = model.eval(), tokenizer, block_size

    @torch.no_grad()
    def __call__(self, prompt: str, max_new_tokens: int = 64, temperature: float = 0.0, top_k: int = 0,
                 seed: int = 0) -> str:
        """The prompt's continuation (the new text only); stops at the end-of-sequence token."""
        tok = self.tokenizer
        ids = tok.encode_batch([prompt])[0].tolist()
        if tok.bos_id is not None:
            ids = [tok.bos_id, *ids]
        if not ids:
            ids = [tok.eos_id]  # an empty prompt: start as a new document starts
        x = torch.tensor([ids], dtype=torch.long)
        gen = torch.Generator().manual_seed(seed)
        new: list[int] = []
        for _ in range(max_new_tokens):
            context = x if self.block_size is None else x[:, -self.block_size:]
            out = self.model(context)
            logits = getattr(out, "logits", out)[0, -1].float()
            logits = logits[: tok.vocab_size]  # a model's padded vocabulary never yields an id the tokenizer lacks
            if temperature <= 0:
                nxt = int(logits.argmax())
            else:
                logits = logits / temperature
                if top_k > 0:
                    cut = torch.topk(logits, min(top_k, logits.numel())).values[-1]
                    logits = logits.masked_fill(logits < cut, float("-inf"))
                nxt = int(torch.multinomial(torch.softmax(logits, -1), 1, generator=gen))
            if nxt == tok.eos_id:
                break
            new.append(nxt)
            x = torch.cat([x, torch.tensor([[nxt]])], dim=1)
        return tok.decode(new)


def _tokenizer_in(path: str | None) -> Tokenizer | None:
    if path and "://" not in path and tokenizer_files(Path(path).expanduser()):
        return load_tokenizer(str(Path(path).expanduser()))
    return None


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
    local = Path(weights).expanduser()
    if local.is_dir() and (local / "config.json").is_file():  # a Hugging Face directory
        import transformers as tf

        tf.logging.set_verbosity_error()
        model = tf.AutoModelForCausalLM.from_pretrained(str(local), dtype=torch.float32)
        tok = load_tokenizer(tokenizer) if tokenizer else (_tokenizer_in(str(local)) or ByteTokenizer())
        return Generator(model, tok)
    if local.is_file() and local.suffix == ".safetensors":
        from safetensors.torch import load_file

        from rayzero.workers.rank import make_spec

        spec = make_spec(cfg)
        model = _real(spec.build(), load_file(str(local)))
        tok = load_tokenizer(tokenizer) if tokenizer else (
            (cfg.model.kind == "hf" and _tokenizer_in(cfg.model.path)) or ByteTokenizer())
        return Generator(model, tok, _block_size(cfg))
    try:
        c = open_checkpoint(weights, cfg.checkpoint)
    except CheckpointError as e:
        raise ConfigError(f"{weights}: not a checkpoint, a model directory or a safetensors file ({e})") from None
    from rayzero.checkpoint.tools import CheckpointWeights, consolidated_weights

    spec = CheckpointWeights(c, cfg.checkpoint).spec
    model = _real(spec.build(), consolidated_weights(c, cfg.checkpoint))
    source = c.manifest["model"].get("path")
    tok = load_tokenizer(tokenizer) if tokenizer else (_tokenizer_in(source) or ByteTokenizer())
    return Generator(model, tok, c.manifest.get("block_size"))


def _block_size(cfg: RootConfig) -> int | None:
    return cfg.block_size if cfg.model.kind == "gpt" else None
