"""Real text through the CLI: a tiny HF Llama with its own BPE tokenizer, fine-tuned on JSONL
instruction data with held-out validation (the CLI's `main` in this process, on the session's
Ray cluster), then `rayzero generate` on the export and on the checkpoint, and from Python with
`Result.generate`."""

import json
import random
import sys
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from tests.conftest import cli_in_process, without_startup
from tests.e2e.conftest import run_cli
from tests.models import save_hf_model, save_tokenizer

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def instruction_records(n: int) -> list[dict]:
    words = Path(sys.modules["json"].__file__).read_text().split()
    rng = random.Random(0)
    out = []
    for i in range(n):
        a = rng.randrange(len(words) - 40)
        out.append({"prompt": f"Continue: {' '.join(words[a:a + 3])}\n", "response": " ".join(words[a + 3:a + 12])})
    return out


def test_fine_tune_on_instructions_with_validation_then_generate(tmp_path, capsys, monkeypatch, train_here):
    model = save_hf_model("llama", tmp_path / "tiny-llama")
    save_tokenizer(model, [Path(sys.modules["json"].__file__).read_text()], vocab=300)
    (tmp_path / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in instruction_records(200)))
    code, out, err = cli_in_process(capsys, monkeypatch, tmp_path, "data", "prepare", str(tmp_path / "chat.jsonl"),
                                    str(tmp_path / "data"), "--tokenizer", str(model), "--instructions",
                                    "--no-progress")
    assert code == 0, err
    assert "from 200 examples" in out and "tokenizer tiny-llama (300 ids" in out

    code, _, err, s = train_here("model.kind=hf", f"model.path={model}", f"data.path={tmp_path / 'data'}",
                                 "data.val_fraction=0.1", "train.eval_every=4", "train.eval_batches=2",
                                 "train.steps=10", "train.seq_len=48", "train.global_batch_size=8",
                                 "train.micro_batch_size=2", "optim.lr=3e-3", "optim.warmup_steps=2",
                                 "checkpoint.every_steps=5",
                                 f"train.save_final={tmp_path / 'final'}", "train.save_format=hf")
    assert code == 0, err[-3000:]
    # before the first step (the curve's baseline, at step -1), every 4 steps and after the last
    assert [v[0] for v in s["val_losses"]] == [-1, 3, 7, 9]
    assert s["final_val_loss"] == s["val_losses"][-1][1] < s["val_losses"][0][1]
    client = MlflowClient(s["mlflow_tracking_uri"])
    val = client.get_metric_history(s["mlflow_run_id"], "val_loss")
    ppl = client.get_metric_history(s["mlflow_run_id"], "val_perplexity")
    assert sorted(m.step for m in val) == [-1, 3, 7, 9] and len(ppl) == 4
    assert max(val, key=lambda m: m.step).value == pytest.approx(s["final_val_loss"])

    # What the model says: `rayzero generate` on the checkpoint; the same from the export (the
    # same weights, step 10), loaded in this process as `generate` loads it.
    from rayzero.config import ConfigError
    from rayzero.jobs.generate import load_generator

    prompt = instruction_records(1)[0]["prompt"]
    g = run_cli("generate", str(tmp_path / "runs" / "checkpoints"), "--prompt", prompt, "--max-new-tokens", "12",
                cwd=tmp_path)
    assert g.returncode == 0, g.stderr[-2000:]
    assert g.stdout.startswith(prompt) and len(g.stdout) > len(prompt)
    export = load_generator(str(tmp_path / "final"))
    assert g.stdout == prompt + export(prompt, max_new_tokens=12) + "\n"
    sampled = [export(prompt, max_new_tokens=12, temperature=1.0, top_k=20, seed=3) for _ in range(2)]
    assert sampled[0] == sampled[1]  # seeded
    with pytest.raises(ConfigError, match="not a checkpoint, a model directory or a safetensors file"):
        load_generator(str(tmp_path / "nothing"))


def test_bad_text_input_is_one_clear_message(tmp_path, capsys, monkeypatch):
    def rayzero(*argv):
        return cli_in_process(capsys, monkeypatch, tmp_path, *argv)

    (tmp_path / "a.jsonl").write_text('{"text": "fine"}\n{"body": "no text"}\n')
    code, _, err = rayzero("data", "prepare", str(tmp_path / "a.jsonl"), str(tmp_path / "d"))
    assert code == 2 and f"{tmp_path / 'a.jsonl'}:2: no field 'text'" in err
    (tmp_path / "empty").mkdir()
    code, _, err = rayzero("data", "prepare", str(tmp_path / "a.jsonl"), str(tmp_path / "d"), "--tokenizer",
                           str(tmp_path / "empty"))
    assert code == 2 and "holds no tokenizer files" in err
    (tmp_path / "t.txt").write_text("one two three\n" * 400)
    assert rayzero("data", "prepare", str(tmp_path / "t.txt"), str(tmp_path / "d"), "--no-progress")[0] == 0
    code, _, err = rayzero("train", f"data.path={tmp_path / 'd'}", "data.val_fraction=0.4")
    assert code == 2 and "holds out none" in err  # one document: nothing to hold out
    assert len(without_startup(err).strip().splitlines()) == 1


def test_ray_data_preparation_gives_the_same_shards(tmp_path, ray_cluster, capsys, monkeypatch):
    """Text (a folder with a file that is not UTF-8), instruction records and preference pairs,
    each prepared by one process and by Ray Data on the cluster with 2 workers: the same tokens,
    shards, fingerprint and document index. The text through `rayzero data prepare --ray` as a
    process of its own (a driver joining the cluster); the other two by the CLI's `main` here,
    whose driver is this process's."""
    import pyarrow.parquet as pq

    model = tmp_path / "tok"
    model.mkdir()
    save_tokenizer(model, [Path(sys.modules["json"].__file__).read_text()], vocab=300)
    texts = tmp_path / "texts"
    texts.mkdir()
    for f in sorted(Path(sys.modules["json"].__file__).parent.glob("*.py")):
        (texts / f.name).write_text(f.read_text())
    (texts / "latin1.py").write_bytes("caf\xe9".encode("latin-1"))
    (tmp_path / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in instruction_records(300)))
    pairs = [{"prompt": r["prompt"], "chosen": r["response"], "rejected": " ".join(r["response"].split()[::-1])}
             for r in instruction_records(300)]
    (tmp_path / "prefs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in pairs))
    for name, src, extra in (("text", texts, []), ("instructions", tmp_path / "chat.jsonl", ["--instructions"]),
                             ("preferences", tmp_path / "prefs.jsonl", ["--preferences"])):
        argv = ["data", "prepare", str(src), "OUT", "--tokenizer", str(model), "--shard-tokens", "5000", *extra]
        # In one process (in this one), and through Ray Data on the cluster (a driver of its own).
        one = tmp_path / f"{name}-one"
        code, _, err = cli_in_process(capsys, monkeypatch, tmp_path, *[str(one) if a == "OUT" else a for a in argv],
                                      "--no-progress")
        assert code == 0, err
        on_ray = tmp_path / f"{name}-ray"
        with_ray = [*[str(on_ray) if a == "OUT" else a for a in argv],
                    "--ray", "--address", ray_cluster, "--workers", "2"]
        if name == "text":
            r = run_cli(*with_ray, cwd=tmp_path)
            assert r.returncode == 0, r.stderr[-3000:]
        else:
            code, _, err = cli_in_process(capsys, monkeypatch, tmp_path, *with_ray, "--no-progress")
            assert code == 0, err
        outs = [one, on_ray]
        one, ray_ = (json.loads((o / "meta.json").read_text()) for o in outs)
        assert len(one["shards"]) > 2, "several shards, for the comparison to mean anything"
        for key in ("fingerprint", "num_tokens", "num_documents", "shards", "dtype", "tokenizer", "skipped",
                    "num_target_tokens", "num_pairs"):
            assert one.get(key) == ray_.get(key), (name, key)
        for f in [s["file"] for s in one["shards"]] + ["documents.parquet"]:
            assert pq.read_table(outs[0] / f).equals(pq.read_table(outs[1] / f)), (name, f)
    assert one["num_pairs"] == 300


def test_a_chat_model_fine_tuned_on_conversations_answers_and_stops_at_end_of_turn(tmp_path, ray_cluster, capsys,
                                                                                   monkeypatch):
    """A Qwen2 chat model as it ships (its own BPE tokenizer, ChatML template, a generation
    config ending at <|im_end|>) fine-tuned from Python on conversations prepared with
    `data prepare --tokenizer MODEL_DIR --instructions`: training takes the dataset (the same
    Qwen2Tokenizer on both sides), `Result.generate` and `rayzero generate` on the export
    answer the question and stop at the end of the turn, and the export tokenizes as the
    dataset was tokenized."""
    import transformers as tf

    from rayzero import TrainConfig, Trainer
    from rayzero.data.tokens import TokenDataset
    from tests.models import save_chat_model

    model = save_chat_model(tmp_path / "qwen2-chat", [Path(sys.modules["json"].__file__).read_text()])
    qa = [("What is the capital of France?", "Paris."), ("What is two plus two?", "Four.")]
    (tmp_path / "chat.jsonl").write_text("".join(
        json.dumps({"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]}) + "\n"
        for _ in range(32) for q, a in qa))
    code, out, err = cli_in_process(capsys, monkeypatch, tmp_path, "data", "prepare", str(tmp_path / "chat.jsonl"),
                                    str(tmp_path / "data"), "--tokenizer", str(model), "--instructions", "--no-progress")
    assert code == 0, err
    ds = TokenDataset(str(tmp_path / "data"))
    assert ds.meta["tokenizer"]["class"] == "Qwen2Tokenizer"

    cfg = TrainConfig(model={"kind": "hf", "path": str(model)}, data={"path": str(tmp_path / "data")},
                      cluster={"address": ray_cluster}, train={"steps": 40, "seq_len": 48, "global_batch_size": 8,
                      "micro_batch_size": 4, "save_final": str(tmp_path / "final"), "save_format": "hf",
                      "output_dir": str(tmp_path / "runs")},
                      optim={"lr": 1e-2, "warmup_steps": 4}, checkpoint={"every_steps": 0})
    result = Trainer(cfg, progress=False).fit()
    assert result.metrics["final_loss"] < 0.2, result.metrics
    for q, a in qa:
        assert result.generate(q, max_new_tokens=20) == a  # and no further: it stopped at <|im_end|>
    assert result.generate(messages=[{"role": "user", "content": qa[1][0]}], max_new_tokens=20) == qa[1][1]

    code, out, err = cli_in_process(capsys, monkeypatch, tmp_path, "generate", str(tmp_path / "final"),
                                    "--prompt", qa[0][0], "--max-new-tokens", "20")
    assert code == 0 and out == qa[0][1] + "\n", err
    exported = tf.AutoTokenizer.from_pretrained(str(tmp_path / "final"))
    assert type(exported).__name__ == "Qwen2Tokenizer"
    first = ds.window(0, int(ds.document_lengths[0])).tolist()
    rendered = exported.apply_chat_template([{"role": "user", "content": qa[0][0]},
                                             {"role": "assistant", "content": qa[0][1]}], tokenize=False)
    assert exported(rendered, add_special_tokens=False)["input_ids"] == first  # what training saw
