"""Make a tiny Llama as a Hugging Face model directory, to fine-tune with rayzero.

    python examples/tiny_llama.py runs/tiny-llama
    rayzero train --config examples/configs/finetune_llama.yaml

The weights are random (from the model's own initialization, under a seed) and saved in bf16,
as models on the hub are; the shape is Llama's (RMSNorm, RoPE, grouped-query attention, tied
embeddings), about 0.8M parameters. The vocabulary covers the 257 ids of rayzero's
byte-level datasets (256 bytes and end-of-text).

With `--tokenizer-from FILE ...` the directory gets a tokenizer of its own, as a model on the hub
has one: a byte-level BPE of the model's 320 ids (every byte, then merges) trained on those
files, saved as `save_pretrained` writes it, for `rayzero data prepare --tokenizer DIR`:

    python examples/tiny_llama.py runs/my-llama --tokenizer-from README.md docs/reference/configuration.md

With `--chat` as well, the tokenizer is an instruct model's: ChatML's special tokens and chat
template (as Qwen2's instruct models carry), an answer ending at `<|im_end|>`, so that chat JSONL
(`{"messages": [...]}`) is rendered with it and `generate` answers as a chat:

    python examples/tiny_llama.py runs/chat-model --chat --tokenizer-from README.md docs/guides/*.md
"""

import argparse

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

VOCAB = 320
EOS = "<|endoftext|>"
CHAT = ("<|im_start|>", "<|im_end|>")  # ChatML's turn markers, special tokens of their own with --chat
CHAT_TEMPLATE = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
                 "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


def train_tokenizer(files: list[str], chat: bool = False):
    """A byte-level BPE of VOCAB ids trained on `files`: EOS (and with `chat` ChatML's markers),
    the 256 bytes (any text encodes), merges."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    special = [EOS, *CHAT] if chat else [EOS]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train(files, trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=special, show_progress=False,
                                         initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    if not chat:
        return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=CHAT[1], pad_token=EOS, chat_template=CHAT_TEMPLATE)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", help="the model directory to write")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tokenizer-from", nargs="+", metavar="FILE", help="text files to train a tokenizer on")
    ap.add_argument("--chat", action="store_true", help="an instruct model's tokenizer: ChatML's tokens and template")
    args = ap.parse_args()
    if args.chat and not args.tokenizer_from:
        ap.error("--chat needs --tokenizer-from: the chat template is the tokenizer's")
    tokenizer = train_tokenizer(args.tokenizer_from, args.chat) if args.tokenizer_from else None
    eos = tokenizer.eos_token_id if tokenizer else 256  # 256: the byte datasets' end-of-text
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=352, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         tie_word_embeddings=True, bos_token_id=eos, eos_token_id=eos)
    torch.manual_seed(args.seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.to(torch.bfloat16).save_pretrained(args.out)
    if tokenizer:
        tokenizer.save_pretrained(args.out)
    print(f"wrote {sum(p.numel() for p in model.parameters()):,} parameters to {args.out}")


if __name__ == "__main__":
    main()
