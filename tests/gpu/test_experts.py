"""A mixture of experts' local experts on CUDA (skipped on CPU): torch's grouped matmul on the
device (compute capability 8.0 and up) against the family's loop and transformers' own model, in
fp32 and bf16. (The dispatch's all-to-alls over NCCL need two GPUs: one is lent at most.)"""

import pytest
import torch

import rayzero.models.hf_experts as hf_experts
from tests.unit.test_experts import FAMILIES, model

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family", FAMILIES)
def test_the_grouped_matmul_on_cuda_runs_the_experts_as_the_loop(family, dtype, monkeypatch):
    calls = []
    grouped = hf_experts._grouped
    monkeypatch.setattr(hf_experts, "_grouped", lambda *a: calls.append(a[-1]) or grouped(*a))
    x = torch.randint(0, 64, (4, 64), generator=torch.Generator().manual_seed(1)).cuda()
    out = {}
    for kind in (None, True, False):
        m = model(family, kind).to("cuda", dtype)
        loss = m(input_ids=x, labels=x).loss
        loss.backward()
        out[kind] = (float(loss), torch.cat([p.grad.float().flatten() for p in m.parameters()]))
    assert calls, "the grouped matmul ran on the device"
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for kind in (True, False):
        assert out[kind][0] == pytest.approx(out[None][0], rel=tol), kind
        g, want = out[kind][1], out[None][1]
        assert float((g - want).norm() / want.norm()) < (1e-4 if dtype == torch.float32 else 5e-2), kind
