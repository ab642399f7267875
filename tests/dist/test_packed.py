"""Packed examples never see each other across a context-parallel split: at cp 2, ring and
Ulysses, each rank holding its chunks of every packed row, the loss summed over the cp group
(and the gradients) equal the examples' losses one by one, each alone, without cp; for the
built-in GPT, a Qwen2 chat model (transformers' attention through the seam) and a user's
module. Without the split: tests/unit/test_packed.py."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from rayzero.config import load_config
from rayzero.data.tokens import TokenDataset
from tests.conftest import free_port
from tests.dist.pool import spawn
from tests.unit.test_packed import chat_model, instruction_data, model_of, one_by_one, records, windows  # noqa: F401

pytestmark = pytest.mark.slow
SEQ = 64  # 2 x cp = 4 chunks of 16 tokens
GPT = ["model.n_layer=2", "model.n_embd=32", "model.n_head=4", "model.vocab_size=259"]
MODULE = ["model.kind=module", "model.factory=tests.models:TinyLM"]


def _rank(rank: int, world: int, port: int, cases: list, out: dict) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        found = {}
        for name, keys, data, seq in cases:
            batch = windows(TokenDataset(data), seq_len=seq)
            spec, whole = model_of(keys, seq)
            alone = sum(spec.loss(whole, b)[0] for b in one_by_one(batch))
            alone.backward()
            for mode in ("ring", "ulysses"):
                split = [*keys, "cluster.num_workers=2", "parallel.cp=2", f"parallel.cp_mode={mode}"]
                mesh = load_config(None, [*split, f"train.seq_len={seq}"]).mesh(world, rank).connect()
                split_spec, model = model_of(split, seq, mesh)  # the same values: the seed's and the names'
                loss, count, _ = split_spec.loss(model, batch.split(split_spec.cp))
                loss.backward()
                total = loss.detach().clone()
                dist.all_reduce(total)
                grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
                for g in grads.values():
                    dist.all_reduce(g)
                err = max(float((g - whole.get_parameter(n).grad).norm() / whole.get_parameter(n).grad.norm())
                          for n, g in grads.items())
                found[name, mode] = (float(total), float(alone), err)
        out[rank] = found
    finally:
        dist.destroy_process_group()


def test_packed_examples_are_each_alone_across_the_split(tmp_path, chat_model):  # noqa: F811
    import torch.multiprocessing as mp

    text = instruction_data(tmp_path, "byte", records(40))
    chat_path, chat_data = chat_model
    cases = [("gpt", GPT, text.uri, SEQ), ("module", MODULE, text.uri, SEQ),
             ("qwen2-chat", ["model.kind=hf", f"model.path={chat_path}"], chat_data.uri, 128)]
    with mp.Manager() as manager:
        out = manager.dict()
        spawn(_rank, args=(2, free_port(), cases, out), nprocs=2)
        out = dict(out)
    assert out[0] == out[1]  # the cp group's ranks summed the same loss
    for (name, mode), (split, alone, grad_err) in out[0].items():
        assert split == pytest.approx(alone, rel=1e-5), (name, mode)
        assert grad_err < 1e-4, (name, mode, grad_err)
