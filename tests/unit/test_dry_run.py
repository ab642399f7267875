"""`rayzero train --dry-run`: the config validated and the plan printed, nothing started."""

import json

import ray

from rayzero.jobs import cli


def dry_run(tmp_path, capsys, *overrides):
    out = tmp_path / "plan.json"
    code = cli.main(["train", "--dry-run", "--summary-json", str(out), *overrides])
    captured = capsys.readouterr()
    return code, captured, (json.loads(out.read_text()) if code == 0 else None)


def test_the_plan_names_world_strategy_accumulation_and_memory(tmp_path, capsys):
    code, out, plan = dry_run(tmp_path, capsys, "model.preset=small", "cluster.num_workers=4",
                              "cluster.min_workers=2", "sharding.strategy=optim_grads_params",
                              "train.global_batch_size=24", "train.micro_batch_size=2",
                              f"train.output_dir={tmp_path}")
    assert code == 0, out.err
    assert plan["world_size"] == 4 and plan["world_sizes"] == [4, 3, 2]
    assert plan["strategy"] == "optim_grads_params" and plan["grad_accum"] == 3
    assert plan["num_params"] == 10_819_584
    assert plan["memory"]["bytes_per_param"] == 4.0  # 16 / d at d = 4
    assert plan["memory"]["bytes_per_rank"] == 4 * 10_819_584
    text = out.out
    assert text.startswith("plan (dry run: nothing started)")
    assert "4 ranks (down to 2 if the cluster shrinks)" in text and "4 ranks x 3 micro-batches x 2" in text
    assert "41.3 MiB" in text and "strategy optim_grads_params" in text
    assert not ray.is_initialized()
    assert not (tmp_path / "checkpoints").exists(), "nothing written"


def test_the_memory_estimate_follows_the_formula_for_each_strategy(tmp_path, capsys):
    want = {"no_shard": 18, "optim": 6 + 12 / 4, "optim_grads": 2 + 16 / 4, "optim_grads_params": 18 / 4}
    for strategy, per_param in want.items():
        code, out, plan = dry_run(tmp_path, capsys, "cluster.num_workers=4", f"sharding.strategy={strategy}",
                                  "sharding.param_dtype=bf16", "cluster.cpus_per_worker=0.5")
        assert code == 0, out.err
        assert plan["memory"]["bytes_per_param"] == per_param, strategy
    # Hybrid-FSDP, 2 replicas x 2 shards: params and grads over 2, optimizer state over all 4.
    code, out, plan = dry_run(tmp_path, capsys, "cluster.num_workers=4", "sharding.strategy=optim_grads_params",
                              "sharding.dp_outer=2", "sharding.outer_strategy=optim", "cluster.cpus_per_worker=0.5")
    assert plan["memory"]["bytes_per_param"] == 8 / 2 + 8 / 4 and "2 replicas" in out.out


def test_a_bad_config_fails_the_dry_run_with_one_message(tmp_path, capsys):
    code, out, _ = dry_run(tmp_path, capsys, "sharding.strategy=optim_grads_params", "sharding.fsdp_units=Blok")
    assert code == 2 and out.err.startswith("rayzero: error: sharding.fsdp_units: no module of GPT has class Blok")
    code, out, _ = dry_run(tmp_path, capsys, "cluster.num_workers=3")
    assert code == 2 and "train.global_batch_size: 16 is not divisible" in out.err


def test_overrides_may_come_before_and_after_the_options(tmp_path, capsys):
    code, out, plan = dry_run(tmp_path, capsys, "train.steps=5", "--no-progress", "cluster.num_workers=4",
                              "train.steps=7", "cluster.cpus_per_worker=0.5")
    assert code == 0, out.err
    assert plan["world_size"] == 4 and plan["steps"] == 7, "later overrides win, wherever they stand"
    try:
        cli.main(["train", "--dry-run", "--bogus"])
    except SystemExit as e:
        assert e.code == 2 and "unrecognized arguments: --bogus" in capsys.readouterr().err
    else:
        raise AssertionError("an unknown option must be refused")


def test_the_plan_shows_the_buckets_the_ranks_will_build(tmp_path, capsys):
    # The small preset (10.8M parameters) at 2 ranks: `auto` cuts it into about 8 buckets.
    code, out, plan = dry_run(tmp_path, capsys, "model.preset=small", "sharding.strategy=optim")
    assert code == 0, out.err
    sizes = plan["buckets"]["numel"]
    assert plan["buckets"]["bucket_numel"] == "auto" and 6 <= len(sizes) <= 10
    assert sum(sizes) >= plan["num_params"] and all(s % 2 == 0 for s in sizes)  # padded for 2 ranks
    assert f"{len(sizes)} communication buckets (bucket_numel auto)" in out.out
    code, out, plan = dry_run(tmp_path, capsys, "model.preset=small", "sharding.bucket_numel=100000000")
    assert plan["buckets"]["numel"] == [sum(sizes)] or len(plan["buckets"]["numel"]) == 1
    assert "1 communication bucket (bucket_numel 100,000,000)" in out.out
    # The default GPT (454,144 parameters): one bucket on CPU ranks, about 8 on GPUs (the plan of a
    # GPU job given a cluster's address, which it does not reach)
    code, out, plan = dry_run(tmp_path, capsys)
    assert code == 0 and len(plan["buckets"]["numel"]) == 1, out.err
    assert "1 communication bucket (bucket_numel auto)" in out.out
    code, out, plan = dry_run(tmp_path, capsys, "cluster.use_gpu=true", "cluster.address=127.0.0.1:6379")
    assert code == 0 and 6 <= len(plan["buckets"]["numel"]) <= 10, out.err
    # ZeRO-3: one bucket per FSDP unit (the GPT's 6 blocks, 2 embeddings, final norm and head).
    code, out, plan = dry_run(tmp_path, capsys, "model.preset=small", "sharding.strategy=optim_grads_params")
    assert plan["buckets"]["per_unit"] and "(one per FSDP unit)" in out.out


def test_a_local_ray_that_cannot_hold_the_ranks_is_refused_by_the_dry_run(tmp_path, capsys, monkeypatch):
    """Only where the run would start its own Ray: with an address (a cluster's), it is the
    cluster's to place them."""
    from rayzero.cluster import local_ray

    monkeypatch.setattr(local_ray, "local_capacity", lambda gpus=True: {"CPU": 8.0, "GPU": 1.0})
    code, out, _ = dry_run(tmp_path, capsys, "cluster.num_workers=4", "cluster.use_gpu=true")
    assert code == 2 and out.err.strip() == (
        "rayzero: error: cluster.num_workers: cluster.num_workers=4 x 1 GPU each (cluster.use_gpu) = 4 GPUs, but this "
        "machine's local Ray has 1; use at most 1 worker, or set cluster.address to run on a Ray cluster")
    code, out, _ = dry_run(tmp_path, capsys, "cluster.num_workers=4", "cluster.cpus_per_worker=4")
    assert code == 2 and "= 16 CPUs, but this machine's local Ray has 8; use at most 2 workers, or a smaller " \
                         "cluster.cpus_per_worker, or set cluster.address" in out.err
    code, out, _ = dry_run(tmp_path, capsys, "cluster.num_workers=4", "cluster.min_workers=2", "cluster.cpus_per_worker=4")
    assert code == 0, "elastic: the smallest world fits"
    code, out, _ = dry_run(tmp_path, capsys, "cluster.num_workers=4", "cluster.cpus_per_worker=4",
                           "cluster.address=10.0.0.1:6379")
    assert code == 0, out.err


def test_the_dry_run_says_where_the_run_resumes_or_refuses_as_the_run_would(tmp_path, capsys, monkeypatch):
    """A checkpoint of this model (committed as the controller commits one, no training: see
    tests/combinations.py's `commit_on_meta`) is resumed, is at the end already, or, of another
    objective, is refused, with the exit code the run gives."""
    from rayzero.config import load_config
    from tests.combinations import commit_on_meta, rank_identity

    gpt = ["model.n_layer=2", "model.n_embd=32", "model.n_head=4", f"checkpoint.dir={tmp_path / 'ck'}",
           f"train.output_dir={tmp_path}"]
    code, out, plan = dry_run(tmp_path, capsys, *gpt, "train.steps=4")
    assert code == 0 and plan["checkpoint"]["start"]["from"] is None, out.err
    assert "starts at step 0 of 4: no checkpoint to resume yet" in out.out
    cfg = load_config(None, gpt)
    written = commit_on_meta(cfg, [rank_identity(cfg, 0)], step=2)
    code, out, plan = dry_run(tmp_path, capsys, *gpt, "train.steps=4")
    assert code == 0 and f"resuming from {written} at step 2 of 4" in out.out, out.out + out.err
    code, out, _ = dry_run(tmp_path, capsys, *gpt, "train.steps=2")
    assert code == 0 and f"nothing to train: {written} is at step 2, train.steps=2" in out.out
    code, out, _ = dry_run(tmp_path, capsys, *gpt, "train.steps=4", "checkpoint.resume=none")
    assert code == 0 and "starts at step 0 of 4: checkpoint.resume=none" in out.out
    code, out, _ = dry_run(tmp_path, capsys, *gpt, "train.steps=4", "model.n_layer=3")
    assert code == 2 and "holds a different model: " in out.err and "checkpoint.resume=none" in out.err, out.err
    (tmp_path / "resume_mine.py").write_text("from rayzero.objectives import Objective\n\nclass Mine(Objective):\n"
                                      "    def loss(self, out, batch):\n        return -out.token_logps.sum(), {}\n")
    monkeypatch.chdir(tmp_path)  # a user's objective, from the working directory
    code, out, _ = dry_run(tmp_path, capsys, *gpt, "train.steps=4", "train.objective=resume_mine:Mine")
    assert code == 2 and out.err.startswith(f"rayzero: error: checkpoint.dir: cannot resume {written}: it was trained "
                                            "with train.objective=lm, this run has train.objective=resume_mine:Mine; "), out.err
    assert "or set checkpoint.resume=none" in out.err


def test_the_batch_is_split_over_the_data_parallel_ranks_only(tmp_path, capsys):
    code, out, plan = dry_run(tmp_path, capsys, "cluster.num_workers=4", "parallel.pp=2", "model.n_layer=4",
                              "train.global_batch_size=16", "train.micro_batch_size=2", "cluster.cpus_per_worker=0.5")
    assert code == 0, out.err
    assert plan["dp_size"] == 2 and "16 sequences per step = 2 data-parallel ranks x 4 micro-batches x 2" in out.out
    code, out, plan = dry_run(tmp_path, capsys, "cluster.num_workers=4", "parallel.tp=2", "parallel.pp=2",
                              "model.n_layer=4", "train.global_batch_size=16", "train.micro_batch_size=2",
                              "cluster.cpus_per_worker=0.5")
    assert code == 0 and "16 sequences per step = 1 data-parallel ranks x 8 micro-batches x 2" in out.out, out.err


def test_warm_spares_are_promised_only_where_they_fit(tmp_path, capsys, monkeypatch):
    """On this machine for a run that starts its own Ray; on the cluster's free resources at
    `cluster.address` (read with this process's connection, or one made and closed again)."""
    from rayzero.cluster import local_ray
    from rayzero.jobs import plan as planning

    monkeypatch.setattr(local_ray, "local_capacity", lambda gpus=True: {"CPU": 2.0, "GPU": 0.0})
    code, out, plan = dry_run(tmp_path, capsys, "failure.spares=1")
    assert code == 0 and plan["failure"]["spare_room"]["fit"] == 0, out.err
    assert ("1 warm spare asked, but none can be placed on this machine (2 CPU; the 2 ranks take 2 CPU): the run "
            "would go on without spares") in out.out
    monkeypatch.setattr(local_ray, "local_capacity", lambda gpus=True: {"CPU": 5.0, "GPU": 0.0})
    code, out, plan = dry_run(tmp_path, capsys, "failure.spares=4")
    assert "4 warm spares asked, but only 3 can be placed on this machine (5 CPU; the 2 ranks take 2 CPU)" in out.out
    code, out, plan = dry_run(tmp_path, capsys, "failure.spares=2")
    assert "2 warm spares, room for them on this machine (5 CPU; the 2 ranks take 2 CPU)" in out.out

    monkeypatch.setattr(planning, "cluster_free", lambda address: {"CPU": 3.0})
    code, out, plan = dry_run(tmp_path, capsys, "failure.spares=2", "cluster.address=10.0.0.1:6379")
    assert ("2 warm spares asked, but only 1 can be placed on the cluster at 10.0.0.1:6379, free now (3 CPU; the 2 "
            "ranks take 2 CPU)") in out.out
    monkeypatch.undo()
    code, out, plan = dry_run(tmp_path, capsys, "failure.spares=1", "cluster.address=127.0.0.1:9")  # nobody there
    assert code == 0 and "1 warm spare, room not measured: 127.0.0.1:9 is not reachable" in out.out, out.out



def test_the_plan_says_the_blocks_are_compiled_and_with_what(tmp_path, capsys, monkeypatch):
    code, out, plan = dry_run(tmp_path, capsys, "train.compile=true", "train.compile_backend=aot_eager",
                              f"train.output_dir={tmp_path}")
    assert code == 0, out.err
    assert plan["compile"] == "aot_eager"
    assert "each block compiled (torch.compile, aot_eager) at the first step" in out.out
    assert "inductor's caches" not in out.out, "aot_eager generates no code to cache"
    code, out, plan = dry_run(tmp_path, capsys, "train.compile=true", f"train.output_dir={tmp_path}")
    assert code == 0 and plan["compile"] == "inductor" and plan["compile_cache"] is None
    assert "and sharding hooks eager; inductor's caches in the run directory's compile_cache\n" in out.out
    code, out, plan = dry_run(tmp_path, capsys, "train.compile=true", f"train.compile_cache={tmp_path / 'cc'}",
                              f"train.output_dir={tmp_path}")
    assert f"; inductor's caches in {tmp_path / 'cc'}\n" in out.out
    monkeypatch.chdir(tmp_path)  # a relative path: said, and given to the ranks, made absolute
    code, out, plan = dry_run(tmp_path, capsys, "train.compile=true", "train.compile_cache=cc",
                              f"train.output_dir={tmp_path}")
    assert plan["compile_cache"] == str(tmp_path.resolve() / "cc")
    code, out, plan = dry_run(tmp_path, capsys, f"train.output_dir={tmp_path}")
    assert plan["compile"] is None and "compiled (torch.compile" not in out.out


def test_the_ranks_get_inductor_s_caches_in_the_run_directory_unless_given_elsewhere(tmp_path, monkeypatch):
    from rayzero.config import load_config
    from rayzero.jobs.train import with_compile_cache

    monkeypatch.chdir(tmp_path)
    run = tmp_path / "runs" / "r1"
    for extra, want in ((["train.compile=true"], str(run / "compile_cache")),
                        (["train.compile=true", "train.compile_cache=cc"], str(tmp_path.resolve() / "cc")),
                        (["train.compile=true", "train.compile_backend=aot_eager"], None),  # no code to cache
                        ([], None)):
        assert with_compile_cache(load_config(None, extra), run).train.compile_cache == want, extra


def test_the_dry_run_builds_the_model_on_meta_once(tmp_path, capsys, monkeypatch):
    """Every check (units, recompute, LoRA, TP, the pipeline's split), the vocabulary note, the
    plan and the resume preview read one build of the model."""
    from rayzero.models.gpt import GPTSpec

    builds = []
    build = GPTSpec.build
    monkeypatch.setattr(GPTSpec, "build", lambda self, *a, **k: builds.append(1) or build(self, *a, **k))
    code, out, plan = dry_run(tmp_path, capsys, "cluster.num_workers=8", "cluster.cpus_per_worker=0.25",
                              "parallel.tp=2", "parallel.pp=2", "model.n_layer=4", "sharding.strategy=optim_grads_params",
                              "model.lora.r=4", "model.lora.target_modules=qkv,fc", "train.global_batch_size=16",
                              "train.micro_batch_size=2", f"checkpoint.dir={tmp_path / 'ck'}", f"train.output_dir={tmp_path}")
    assert code == 0, out.err
    assert plan["checkpoint"]["start"]["from"] is None and plan["dp_size"] == 2
    assert len(builds) == 1
