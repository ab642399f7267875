"""LoRA on real gloo groups: every world size and strategy (with activation checkpointing too)
trains the adapters a single-process PEFT run trains; the ledger holds optimizer state and gradients for the adapters only and the
base in the compute dtype only; resume is bitwise and reshards; the merged and the adapter
exports load with transformers and PEFT and give rayzero's logits."""

import json

import pytest
import torch
import torch.multiprocessing as mp
from safetensors.torch import load_file

from rayzero.checkpoint.manifest import open_checkpoint
from rayzero.checkpoint.tools import export_checkpoint
from rayzero.cluster.schedule import lr_at
from rayzero.config import load_config
from rayzero.workers.rank import Rank
from tests.conftest import free_port
from tests.dist import ckpt_helpers
from tests.dist.pool import spawn
from tests.dist.reference import global_rows, rel_error, train_reference
from tests.models import save_hf_model

pytestmark = pytest.mark.slow

STEPS = 10
LORA = ["model.lora.r=4", "model.lora.alpha=8", "model.lora.target_modules=q_proj,v_proj,down_proj"]


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return save_hf_model("llama-untied", tmp_path_factory.mktemp("lora") / "llama")


def config(llama, world: int, strategy: str, extra=()):
    return load_config(None, [f"cluster.num_workers={world}", "model.kind=hf", f"model.path={llama}", *LORA,
                              "train.seq_len=32", "train.global_batch_size=8", "train.micro_batch_size=2",
                              f"train.steps={STEPS}", f"sharding.strategy={strategy}", "sharding.shard_align=1",
                              "optim.lr=1e-2", "optim.grad_clip=0.05", "optim.warmup_steps=2", *extra])


def _worker(rank, world, runs, ports, data_path, out):
    torch.set_num_threads(1)
    for (label, cfg), port in zip(runs, ports):
        r = Rank(cfg, rank, world, data_path)
        info = r.setup("127.0.0.1", port)
        initial = r.full_state_dict()
        losses = []
        for k in range(STEPS):
            res = r.iteration({"step": k, "lr": lr_at(k, STEPS, cfg.optim)})
            losses.append((res["loss_sum"], res["tokens"]))
        grads = {n for n, p in r.model.named_parameters() if p.grad is not None}
        out[(label, rank)] = {"info": info, "initial": initial if rank == 0 else None, "losses": losses,
                              "state": r.full_state_dict(), "memory": res["memory"], "grads": grads,
                              "optimizer_numel": r.strategy.optimizer.exp_avg.numel()}
        r.close()


def run(runs, world, data_path):
    with mp.Manager() as manager:
        out = manager.dict()
        spawn(_worker, args=(world, runs, [free_port() for _ in runs], data_path, out), nprocs=world)
        return dict(out)


def peft_reference(llama, cfg, initial, data_path):
    """The same model as PEFT builds it, starting from rayzero's initial adapters, trained
    with torch's AdamW on the adapters alone over the same batches."""
    import transformers as tf
    from peft import LoraConfig, get_peft_model

    base = tf.AutoModelForCausalLM.from_pretrained(str(llama), dtype=torch.float32)
    lora = cfg.model.lora
    model = get_peft_model(base, LoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=0.0,
                                            target_modules=list(lora.target_modules)))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_" in n:
                p.copy_(initial[rayzero_name(n)])
    state, losses = train_reference(model, cfg, data_path, STEPS)
    return {rayzero_name(k): v for k, v in state.items()}, losses


def rayzero_name(peft_name: str) -> str:
    return peft_name.removeprefix("base_model.model.").replace(".base_layer.", ".")


def global_losses(out, label, world):
    return [sum(out[(label, r)]["losses"][k][0] for r in range(world)) /
            sum(out[(label, r)]["losses"][k][1] for r in range(world)) for k in range(STEPS)]


CASES = {1: [("zero3", "optim_grads_params", ())],
         2: [("zero3", "optim_grads_params", ()), ("zero1", "optim", ()), ("ddp", "no_shard", ()),
             ("zero2+selective", "optim_grads", ("model.activation_checkpointing=selective",)),
             ("zero3+full", "optim_grads_params", ("model.activation_checkpointing=full",)),
             ("zero3+bf16", "optim_grads_params", ("sharding.param_dtype=bf16",))],
         4: [("zero3", "optim_grads_params", ("cluster.cpus_per_worker=0.5",))]}


def test_a_lora_resume_is_bitwise_and_reshards(llama, small_dataset, tmp_path):
    """8 steps straight against 4, a checkpoint holding the adapters (no base weight), and 4
    more after a resume at the same layout (bitwise) and at another world size and strategy;
    then the merged and the adapter exports of that checkpoint give the final model's logits."""
    root = str(tmp_path / "ckpt")

    def cfg(world, strategy):
        return config(llama, world, strategy, (f"checkpoint.dir={root}", "checkpoint.every_steps=0", "train.steps=8"))

    zero3 = cfg(2, "optim_grads_params")
    straight = ckpt_helpers.run(zero3, small_dataset, 0, 8)
    first = ckpt_helpers.run(zero3, small_dataset, 0, 4, save_at=4)
    c = open_checkpoint(first["committed"])
    assert c.manifest["model"]["lora"]["r"] == 4 and c.manifest["model_source"]["lora"]["alpha"] == 8
    assert all(".lora_" in n for n in c.manifest["layout"]["param_order"] if n not in c.manifest["frozen"])
    resumed = ckpt_helpers.run(zero3, small_dataset, 4, 8, resume=(c.uri, c.manifest))
    assert resumed["losses"] == straight["losses"][4:]
    assert all(torch.equal(resumed["state"][k], v) for k, v in straight["state"].items())
    other = ckpt_helpers.run(cfg(1, "optim"), small_dataset, 4, 8, resume=(c.uri, c.manifest))
    for k, v in straight["state"].items():
        assert rel_error(other["state"][k], v) <= 1e-5, k

    # Exports of a trained checkpoint: merged (hf), adapter (peft)
    last = ckpt_helpers.run(zero3, small_dataset, 4, 8, save_at=8, resume=(c.uri, c.manifest))
    c8 = open_checkpoint(last["committed"])
    final = last["state"]
    export_checkpoint(c8, str(tmp_path / "merged"), "hf")
    export_checkpoint(c8, str(tmp_path / "adapter"), "peft")
    import transformers as tf
    from peft import PeftModel

    x = global_rows(zero3, small_dataset, 0)[:2, :-1]
    mine = rayzero_logits(zero3, final, x)
    merged = tf.AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged"), dtype=torch.float32)
    assert rel_error(merged(x).logits, mine) <= 1e-5
    base = tf.AutoModelForCausalLM.from_pretrained(str(llama), dtype=torch.float32)
    with_adapter = PeftModel.from_pretrained(base, str(tmp_path / "adapter"))
    assert rel_error(with_adapter(x).logits, mine) <= 1e-5
    # The adapter directory is PEFT's own layout; the merged export differs from the base only
    # in the targeted modules
    assert set(load_file(str(tmp_path / "adapter" / "adapter_model.safetensors"))) == {
        f"base_model.model.{n.replace('.default', '')}" for n in final if ".lora_" in n}
    config_json = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config_json["peft_type"] == "LORA" and config_json["r"] == 4 and config_json["base_model_name_or_path"] == str(llama)
    # The end of training's own exports are those of its last checkpoint
    from rayzero.checkpoint.export import save_final
    from rayzero.workers.assembly import make_spec

    save_final(make_spec(zero3), final, str(tmp_path / "final"), "hf", {})
    save_final(make_spec(zero3), final, str(tmp_path / "final-adapter"), "peft", {})
    for name in ("final", "final-adapter"):
        a, b = (load_file(str(f)) for f in (next((tmp_path / name).glob("*.safetensors")),
                                            next((tmp_path / ("merged" if name == "final" else "adapter")).glob("*.safetensors"))))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), name
    original, exported = load_file(str(llama / "model.safetensors")), load_file(str(tmp_path / "merged" / "model.safetensors"))
    assert exported.keys() == original.keys()
    targets = ("q_proj", "v_proj", "down_proj")
    for k, v in original.items():
        assert torch.equal(exported[k], v) != any(f".{t}." in k for t in targets), k


def rayzero_logits(cfg, state, x):
    """The logits of rayzero's final model: the LoRA model the ranks train, its weights set."""
    from rayzero.workers.assembly import build_model, make_spec

    built = build_model(cfg, make_spec(cfg))
    model = built.model
    model.load_state_dict(state, strict=False, assign=True)
    named = dict(model.named_parameters())
    assert set(named) == set(state)  # every parameter set: nothing left on the meta device
    return model.eval()(x).logits


def peft_adapter(llama, out, saved=("lm_head",)):
    """An adapter as PEFT's own `save_pretrained` writes it (no rayzero metadata), its lora_B
    and saved head moved off their init so that starting from it shows."""
    import transformers as tf
    from peft import LoraConfig, get_peft_model

    base = tf.AutoModelForCausalLM.from_pretrained(str(llama), dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"],
                                            modules_to_save=list(saved)))
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n or "modules_to_save" in n:
                p.add_(torch.randn(p.shape, generator=gen) * 0.02)
    model.save_pretrained(str(out))
    return out


def test_training_starts_from_a_peft_adapter_under_every_strategy_and_tp(llama, small_dataset, tmp_path):
    """`model.adapter=DIR` (PEFT's own adapter directory): the run takes its LoRA settings, and
    its adapters and saved head are the initial values under ZeRO-1/2/3, DDP and tp 2 alike;
    the first loss is the PEFT model's, and training goes on from there as from any start."""
    import transformers as tf
    from peft import PeftModel

    from rayzero.jobs.train import adapter_start

    adapter = peft_adapter(llama, tmp_path / "adapter")
    held = load_file(str(adapter / "adapter_model.safetensors"))

    def cfg(strategy, extra=()):
        base = load_config(None, ["cluster.num_workers=2", f"model.adapter={adapter}", "train.seq_len=32",
                                  "train.global_batch_size=8", "train.micro_batch_size=2", f"train.steps={STEPS}",
                                  f"sharding.strategy={strategy}", "sharding.shard_align=1", "optim.lr=1e-2",
                                  "optim.warmup_steps=2", *extra])
        return adapter_start(base)  # as `rayzero train` resolves it: the base and settings it names

    runs = [("zero3", cfg("optim_grads_params")), ("zero1", cfg("optim")), ("ddp", cfg("no_shard")),
            ("zero2", cfg("optim_grads")), ("tp2", cfg("optim", ["parallel.tp=2"]))]
    lora = runs[0][1].model
    assert (lora.kind, lora.path, lora.lora.r, lora.lora.alpha, lora.lora.modules_to_save) == (
        "hf", str(llama), 4, 8, ("lm_head",))
    out = run(runs, 2, small_dataset)
    base = tf.AutoModelForCausalLM.from_pretrained(str(llama), dtype=torch.float32)
    peft = PeftModel.from_pretrained(base, str(adapter))
    rows = global_rows(runs[0][1], small_dataset, 0)
    with torch.no_grad():
        logits = peft(input_ids=rows[:, :-1]).logits
    first = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), rows[:, 1:].reshape(-1)).item()
    for label, c in runs:
        initial = out[(label, 0)]["initial"]
        for key, value in held.items():  # PEFT's key -> rayzero's name
            name = key.removeprefix("base_model.model.").replace(".lora_A.", ".lora_A.default.").replace(
                ".lora_B.", ".lora_B.default.")
            assert torch.equal(initial[name], value), (label, key)
        assert global_losses(out, label, 2)[0] == pytest.approx(first, rel=1e-5), label
        assert global_losses(out, label, 2)[-1] < first, label
