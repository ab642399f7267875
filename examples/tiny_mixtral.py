"""Make a tiny Mixtral (a mixture of experts) as a Hugging Face model directory, to fine-tune
with rayzero, with expert parallelism for one:

    python examples/tiny_mixtral.py runs/tiny-mixtral
    rayzero train model.kind=hf model.path=runs/tiny-mixtral cluster.num_workers=2 parallel.ep=2

The weights are random (from the model's own initialization, under a seed) and saved in bf16,
as models on the hub are, one tensor per expert as `save_pretrained` writes Mixtral; the shape
is Mixtral's (8 experts a layer, each token routed to 2, a load-balancing loss), about 0.46M
parameters. The vocabulary covers the 257 ids of rayzero's byte-level datasets.
"""

import argparse

import torch
from transformers import AutoModelForCausalLM, MixtralConfig


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", help="the model directory to write")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    config = MixtralConfig(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2,
                           max_position_embeddings=512, router_aux_loss_coef=0.02, bos_token_id=256,
                           eos_token_id=256)
    torch.manual_seed(args.seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.to(torch.bfloat16).save_pretrained(args.out)
    print(f"wrote {sum(p.numel() for p in model.parameters()):,} parameters to {args.out}")


if __name__ == "__main__":
    main()
