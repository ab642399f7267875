"""Tensor parallelism through `rayzero train` as a user runs it (the CLI's `main`, on the
session's cluster): an untied HF Llama of 259 tokens at tp 2, its vocabulary split over the TP
ranks (the last rank's last row padding): it validates as a run without tensor parallelism
does; its export holds the whole vocabulary, and `rayzero generate` on its checkpoint says what
the export says.

With dropout at tp 2 x dp 2 under ZeRO-3 and sequence parallelism: the same command stopped
and run again, and a rank lost and the group rebuilt, each ending on the unbroken run's weights
bit for bit (tests/e2e/test_failures.py); a tp 2 x dp 2 checkpoint resumed bitwise and resharded
under every strategy (tests/dist/test_tensor_parallel.py); an HF model (Qwen2) at tp 2 resumed bitwise
among the configurations (tests/dist/test_combinations.py)."""

import pytest
from safetensors.torch import load_file

from tests.conftest import cli_in_process
from tests.models import save_hf_model

pytestmark = pytest.mark.slow


def test_a_tensor_parallel_run_validates_exports_and_generates(
        train_here, small_dataset, tmp_path, capsys, monkeypatch):
    from rayzero.jobs.generate import load_generator

    model = save_hf_model("llama-untied", tmp_path / "llama", vocab_size=259)
    keys = [f"data.path={small_dataset}", "model.kind=hf", f"model.path={model}", "train.seq_len=32",
            "train.global_batch_size=4", "train.micro_batch_size=2", "data.val_fraction=0.05", "train.eval_every=2",
            "train.eval_batches=1", "tracking.enabled=false"]
    command = [*keys, "cluster.num_workers=2", "parallel.tp=2", "checkpoint.every_steps=2",
               f"checkpoint.dir={tmp_path / 'ck'}", f"train.save_final={tmp_path / 'final'}", "train.save_format=hf"]
    code, _, err, first = train_here(*command, "train.steps=2", summary="first.json")
    assert code == 0, err[-3000:]
    assert first["vocab_parallel"] and [v[0] for v in first["val_losses"]] == [-1, 1]

    # Validation on logit shards: the initial weights' loss is the one a run without TP computes.
    code, _, err, whole = train_here(*keys, "cluster.num_workers=1", "checkpoint.dir=", "train.steps=1",
                                     summary="whole.json")
    assert code == 0, err[-3000:]
    assert first["val_losses"][0][1] == pytest.approx(whole["val_losses"][0][1], rel=1e-6)

    exported = load_file(tmp_path / "final" / "model.safetensors")
    assert exported["lm_head.weight"].shape == exported["model.embed_tokens.weight"].shape == (259, 32)
    prompt = "import json\n"
    code, out, err = cli_in_process(capsys, monkeypatch, tmp_path, "generate", str(tmp_path / "ck"), "--prompt", prompt,
                                    "--max-new-tokens", "8", "--raw")
    assert code == 0, err[-2000:]
    assert out == prompt + load_generator(str(tmp_path / "final"))(prompt, max_new_tokens=8, chat=False) + "\n"
