"""The activation meter's sample: which forwards it measures, and what it says of the others."""

import torch
import torch.nn as nn

from rayzero.workers.activations import ActivationMeter


def test_the_meter_measures_each_kinds_first_forwards_then_one_in_every():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))
    meter = ActivationMeter()
    measured, bytes_of = [], []
    for n in range(2 * ActivationMeter.EVERY + 1):
        x = torch.randn(3 if n % 2 else 5, 8)  # two kinds, alternating
        with meter.sampled(tuple(x.shape)):
            measured.append(ActivationMeter.current() is meter)
            loss = model(x).sum()
        bytes_of.append(meter.bytes)
        loss.backward()
    # each kind's forwards are counted apart: its first FIRST, then every EVERY-th of its own
    per_kind = [k for k in range(ActivationMeter.EVERY + 1)]
    expect = [k < ActivationMeter.FIRST or k % ActivationMeter.EVERY == 0 for k in per_kind]
    assert measured[0::2] == expect and measured[1::2] == expect[:-1]
    # a forward not measured reports what its kind's last measured forward left, not another kind's
    assert bytes_of[0::2] == [bytes_of[0]] * len(bytes_of[0::2]) and bytes_of[1::2] == [bytes_of[1]] * len(bytes_of[1::2])
    assert bytes_of[0] > bytes_of[1] > 0  # 5 rows save more than 3
    assert ActivationMeter.current() is None


def test_a_saved_tensor_freed_before_the_forward_ends_is_not_counted_and_its_address_not_confused():
    x = torch.randn(1000, requires_grad=True)
    meter = ActivationMeter()
    with meter.sampled("k"):
        unused = (x * 2).exp()  # exp saves its output: 4,000 bytes, freed with `unused`
        del unused
        kept = (x * 3).sin()  # sin saves its input, maybe at the freed output's address
    assert meter.bytes == 4000
    with meter.sampled("k"):
        a = x * 3
        kept = a.sin() + a.cos()  # one storage saved twice: counted once
    assert meter.bytes == 4000
    kept.sum().backward()
