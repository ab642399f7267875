"""A forward that reads a parameter without calling the module that holds it (as the tests' `TinyLM`
reads its `nn.MultiheadAttention`'s weights) waits there for that parameter's all-gather, and
from then on at the start of the module running the read (rayzero/sharding/first_reads.py).

The all-gather is played by `Gather`, the watch's owner as `OwnShard` is: until a bucket is
waited for, its parameters hold NaN (the values a rank would read from a gather still writing
them are the step before's, on some ranks)."""

import gc
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from rayzero.sharding import first_reads
from rayzero.sharding.first_reads import FirstReads


class Direct(nn.Module):
    """A norm it calls, an attention whose weights it reads without calling it."""

    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(4)
        self.attn = nn.MultiheadAttention(4, 1, batch_first=True)

    def forward(self, x):
        return F.linear(self.norm(x), self.attn.in_proj_weight, self.attn.in_proj_bias)


class Gather:
    """Bucket 0: the norm's parameters; bucket 1: the attention's. With `hooks`, each module
    waits for the buckets of its own parameters, as ownership.py makes it."""

    def __init__(self, model: nn.Module, hooks: bool = True):
        self.params = dict(model.named_parameters())
        self.bucket = {n: 0 if n.startswith("norm.") else 1 for n in self.params}
        self.pending: set[int] = set()
        self.new = {n: torch.randn_like(p) for n, p in self.params.items()}
        self.waits: list[int] = []
        self.learned: list[tuple[nn.Module, list[int]]] = []
        if hooks:
            model.norm.register_forward_pre_hook(lambda m, a: self.finish([0]))
            model.attn.register_forward_pre_hook(lambda m, a: self.finish([1]))  # never runs: attn is not called

    def start(self):
        self.pending = {0, 1}
        with torch.no_grad():
            for p in self.params.values():
                p.fill_(math.nan)

    # what the watch asks of its owner
    def read_buckets(self):
        return {id(p): self.bucket[n] for n, p in self.params.items()}

    def in_flight(self, b):
        return b in self.pending

    def finish(self, buckets):
        for b in buckets:
            if b in self.pending:
                self.pending.discard(b)
                self.waits.append(b)
                with torch.no_grad():
                    for n, p in self.params.items():
                        if self.bucket[n] == b:
                            p.copy_(self.new[n])

    def wait_before(self, module, buckets):
        self.learned.append((module, buckets))
        module.register_forward_pre_hook(lambda m, a: self.finish(buckets))


def test_a_parameter_read_without_its_module_waits_for_its_gather():
    torch.manual_seed(0)
    model, x = Direct(), torch.randn(2, 3, 4)
    gather = Gather(model)
    reads = FirstReads(model, gather)
    with torch.no_grad():
        want = F.linear(F.layer_norm(x, (4,), gather.new["norm.weight"], gather.new["norm.bias"]),
                        gather.new["attn.in_proj_weight"], gather.new["attn.in_proj_bias"])

    gather.start()  # without the watch, the read takes what the gather has not written yet
    assert model(x).isnan().all()

    gather.start()
    reads.arm()
    assert torch.equal(model(x), want)
    assert gather.learned == [(model, [1])]  # the module that ran the read waits for the bucket from now on
    assert reads.found == [("", 1)]  # (the model itself, by its name in named_modules)
    assert reads.done and not reads.armed
    assert torch._C._len_torch_function_stack() == 0 and not first_reads._Watch._handles

    gather.start()
    gather.waits = []
    reads.arm()  # done: nothing is watched again
    assert torch.equal(model(x), want)
    assert gather.waits == [1, 0]  # at the model's start, then the norm's
    assert len(gather.learned) == 1


def test_a_watch_without_a_forward_stays_for_the_next_gather():
    """A gather waited for whole (before a step, after loading a checkpoint) ends the watch; it
    is armed again by the next gather, and learns from that one's forward (here without the
    modules' own waits: each read is learned where it runs)."""
    model, x = Direct(), torch.randn(2, 3, 4)
    gather = Gather(model, hooks=False)
    reads = FirstReads(model, gather)
    gather.start()
    reads.arm()
    gather.finish([0, 1])
    reads.gathered()
    assert not reads.armed and not reads.done
    gather.start()
    reads.arm()
    assert not model(x).isnan().any()
    assert gather.learned == [(model.norm, [0]), (model, [1])] and reads.done


def test_a_forward_of_another_model_is_not_watched():
    model, other = Direct(), Direct()
    gather = Gather(model)
    reads = FirstReads(model, gather)
    gather.start()
    reads.arm()
    other(torch.randn(1, 2, 4))
    assert gather.pending == {0, 1} and reads.forwards == 0
    gather.finish([0, 1])
    reads.gathered()


def test_a_watch_whose_owner_was_dropped_ends_and_keeps_nothing_alive():
    """A rank that leaves its group drops the strategy (and the watch's owner with it) while a
    gather may still be watched: the watch holds neither, and its hooks go at the next forward."""
    model = Direct()
    gather = Gather(model)
    reads = FirstReads(model, gather)
    gather.start()
    reads.arm()
    assert first_reads._Watch._handles
    owner = __import__("weakref").ref(gather)
    del gather, model
    gc.collect()
    assert owner() is None
    Direct()(torch.randn(1, 2, 4))  # the next run's model
    assert not first_reads._Watch.watches and not first_reads._Watch._handles


class AsksDtype(Direct):
    """Reads its attention's dtype before the norm (as PEFT's LoRA layer asks its adapter's), and
    its attention's values after."""

    def forward(self, x):
        return super().forward(x.to(self.attn.in_proj_weight.dtype))


def test_a_parameter_s_metadata_is_not_a_read():
    """Asking a parameter's dtype, shape or device reads no value: the wait stays where the
    values are read, after the norm, not before it."""
    model, x = AsksDtype(), torch.randn(2, 3, 4)
    gather = Gather(model)
    gather.start()
    reads = FirstReads(model, gather)
    reads.arm()
    assert not model(x).isnan().any()
    assert gather.waits == [0, 1]  # the norm's bucket first, at the norm; the attention's at its read
    assert gather.learned == [(model, [1])]
