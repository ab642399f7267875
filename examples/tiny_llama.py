"""Make a tiny Llama as a Hugging Face model directory, to fine-tune with rayzero.

    python examples/tiny_llama.py runs/tiny-llama
    rayzero train --config examples/configs/finetune_llama.yaml

The weights are random (from the model's own initialization, under a seed) and saved in bf16,
as models on the hub are; the shape is Llama's (RMSNorm, RoPE, grouped-query attention, tied
embeddings), about 0.8M parameters. The vocabulary covers the 257 ids of rayzero's
byte-level datasets (256 bytes and end-of-text).
"""

import argparse

import torch
from transformers import AutoModelForCausalLM, LlamaConfig


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", help="the model directory to write")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    config = LlamaConfig(vocab_size=320, hidden_size=128, intermediate_size=352, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         tie_word_embeddings=True, bos_token_id=256, eos_token_id=256)
    torch.manual_seed(args.seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.to(torch.bfloat16).save_pretrained(args.out)
    print(f"wrote {sum(p.numel() for p in model.parameters()):,} parameters to {args.out}")


if __name__ == "__main__":
    main()
