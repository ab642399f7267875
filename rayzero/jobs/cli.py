"""The `rayzero` command: each subcommand's work, on the arguments `commands` parses."""

from __future__ import annotations

import json
import logging
import math
import os
import signal
import sys
from contextlib import ExitStack
from pathlib import Path

from rayzero.objectives.config import objective_line
from rayzero.config import ConfigError, load_config
from rayzero.data.errors import DataError
from rayzero.jobs.commands import parse_args


def _ckpt(args) -> int:
    from rayzero.checkpoint.export import parse_size
    from rayzero.checkpoint.manifest import CheckpointError, open_checkpoint
    from rayzero.checkpoint.shard_file import ChecksumError
    from rayzero.storage import StorageError
    from rayzero.checkpoint.tools import export_checkpoint, list_checkpoints, verify_checkpoint
    from rayzero.models import ModelError

    cfg = load_config(None, args.overrides).checkpoint
    try:
        if args.ckpt_command == "ls":
            rows = list_checkpoints(args.uri, cfg)
            if not rows:
                print(f"no committed checkpoints under {args.uri}")
            for r in rows:
                stages = f" pp {r['pp']}" if r["pp"] > 1 else ""
                print(f"{r['uri']}  step {r['step']}  {r['bytes'] / 2**20:.1f} MiB  "
                      f"world {r['world_size']}{stages}  {r['strategy']}  {r['created']}")
            return 0
        c = open_checkpoint(args.uri, cfg)
        if args.ckpt_command == "verify":
            n = verify_checkpoint(c)
            print(f"{c.uri}: {len(c.manifest['shards'])} shard(s), {n:,} bytes, every checksum matches")
            return 0
        try:
            shard_bytes = parse_size(args.max_shard_size)
        except ValueError as e:
            raise _UserError(f"--max-shard-size: {e}") from None
        n = export_checkpoint(c, args.out, args.format, args.dtype, shard_bytes, cfg)
        what = {"hf": "a Hugging Face directory", "peft": "a PEFT adapter directory"}.get(args.format, "safetensors")
        print(f"wrote {n} tensors from {c.uri} (step {c.step}) to {args.out} ({what})")
        return 0
    except (CheckpointError, ChecksumError, StorageError, ModelError) as e:
        raise _UserError(str(e)) from None


def _train(args, after: ExitStack, own_process: bool = False) -> int:
    """`rayzero train`. `own_process`: the CLI runs in a process of its own (`command`), where
    Ray's start begins before torch is imported (`LocalRay`), and is stopped by `after` once the
    run's outcome is said (a refusal found while Ray was starting is said first, then what was
    started is shut down); a caller's process (tests, Python calling `main`) has imported torch
    already, and starts Ray after the checks."""
    cfg = load_config(args.config, args.overrides)  # before torch and Ray are imported: a typo fails at once
    if args.dry_run:
        from rayzero.jobs.plan import plan

        p = plan(cfg)  # ConfigError: the refusal the run would give, the same exit code
        _print_plan(p)
        if args.summary_json:
            Path(args.summary_json).write_text(json.dumps(p, indent=2))
        return 0
    from rayzero.cluster.startup import CHECKS, Startup

    startup = Startup()
    startup.stage("checks", CHECKS)  # said before the imports below: torch and Ray take seconds
    previous = _on_sigterm()  # before training; the controller takes SIGTERM over while it trains
    local_ray = None  # (LocalRay.stop, by `after`: a refusal after it began included, nothing left behind)
    try:
        if own_process:
            from rayzero.cluster.local_ray import LocalRay
            from rayzero.jobs.data_checks import check_data_paths

            check_data_paths(cfg)  # a mistyped path refused before anything starts
            local_ray = LocalRay.begin(cfg, began_s=startup.elapsed())  # None: the run joins a Ray
            if local_ray is not None:
                after.callback(local_ray.stop)
        code, summary = _run_train(args, cfg, startup, local_ray)
    except KeyboardInterrupt as e:  # Ctrl-C, SIGTERM: one line, the shell's code for the signal, no traceback
        # (not imported here: a signal that came during the imports left torch half imported)
        failure = sys.modules.get("rayzero.cluster.failure")
        if failure is not None and isinstance(e, failure.Stopped):
            said, signum = str(e), e.signal
        else:
            terminated = isinstance(e, _Terminated)
            said = ("terminated (SIGTERM): " if terminated else "") + "stopped before training began"
            signum = 15 if terminated else 2
        print(f"\nrayzero: {said}", file=sys.stderr)
        return 128 + signum
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    if code:
        return code
    _print_summary(summary)
    if args.summary_json:
        Path(args.summary_json).write_text(json.dumps(summary, indent=2))
    return 0


def _run_train(args, cfg, startup, local_ray) -> tuple[int, dict | None]:
    """The run itself, its failures said in one line: (exit code, summary)."""
    from rayzero.checkpoint.manifest import CheckpointError
    from rayzero.storage import StorageError
    from rayzero.cluster.failure import TrainingFailed
    from rayzero.cluster.worker_group import PlacementError
    from rayzero.jobs.train import ClusterUnreachable, run_train

    try:
        return 0, run_train(cfg, progress=not args.no_progress, startup=startup, local_ray=local_ray)
    except (PlacementError, ClusterUnreachable, CheckpointError, StorageError) as e:
        raise _UserError(str(e)) from None
    except TrainingFailed as e:
        print(f"rayzero: training failed: {e}", file=sys.stderr)
        return 1, None


class _Terminated(KeyboardInterrupt):
    """SIGTERM before training began (`ray job stop`, a pod stopped during the checks)."""


def _on_sigterm():
    """SIGTERM raises _Terminated, as Ctrl-C raises KeyboardInterrupt; the previous handler
    (None off the main thread, where none can be set)."""
    import threading

    if threading.current_thread() is not threading.main_thread():
        return None

    def terminated(signum, frame):
        raise _Terminated

    return signal.signal(signal.SIGTERM, terminated)


def _print_plan(p: dict) -> None:
    from rayzero.jobs.pipeline_plan import pipeline_lines

    elastic = f" (down to {p['world_sizes'][-1]} if the cluster shrinks)" if len(p["world_sizes"]) > 1 else ""
    bundle = ", ".join(f"{v:g} {k}" for k, v in p["bundle"].items())
    hybrid = f", {p['dp_outer']} replicas" if p["dp_outer"] > 1 else ""
    mem = p["memory"]
    ck = p["checkpoint"]
    print(
        f"plan (dry run: nothing started)\n"
        f"  {p['world_size']} ranks{elastic} of {bundle} each, on {p['cluster']}\n"
        f"  strategy {p['strategy']}{hybrid}; params {p['param_dtype']}, grads {p['grad_dtype']}\n"
        + ("".join(f"  {line}\n" for line in p["mesh"]) if p["tp"] > 1 or p.get("cp", 1) > 1 or p.get("ep", 1) > 1
           or p.get("pipeline") else "")
        + (f"  {_experts_line(p)}\n" if p.get("experts") else "")
        + (f"  context parallel {p['cp']} ({p['cp_mode']}): each rank holds 1/{p['cp']} of every sequence's tokens "
           f"(chunks i and {2 * p['cp'] - 1}-i of {2 * p['cp']}), attention across them; gradients reduced over "
           f"data-parallel x cp\n" if p.get("cp", 1) > 1 else "")
        + ("".join(f"  {line}\n" for line in pipeline_lines(p["pipeline"])) if p.get("pipeline") else "")
        + ("  sequence parallel: norms and residuals on 1/tp of the sequence\n" if p["sequence_parallel"] else "")
        + ("  vocabulary parallel: embedding, head and logits split over the tp ranks, the loss on the shards\n"
           if p["tp"] > 1 and p["vocab_parallel"] else "")
        + (f"  note: {p['vocab_note']}\n" if p.get("vocab_note") else "")
        + f"  model {_model_line(p)}\n"
        + (f"  {p['model']['lora']}\n" if p["model"].get("lora") else "")
        + (f"  {_params_line(p['num_params'], p['trainable_params'])}"
           + (f" ({p['params_per_rank']:,} on each rank: its tensor-parallel share)" if p["tp"] > 1 else "")
           + "; model state per rank "
           f"{mem['bytes_per_param']:.2f} bytes/parameter = {mem['bytes_per_rank'] / 2**20:,.1f} MiB (Megatron's "
           f"formula, before padding and activations)\n" if p["num_params"] else
           f"  model state per rank {mem['bytes_per_param']:.2f} bytes/parameter (Megatron's formula)\n")
        + (f"  {_activations_line(mem)}\n" if mem.get("activations_bytes") is not None else "")
        + (f"  {_compile_line(p)}\n" if p.get("compile") else "")
        + (f"  {objective_line(p['objective'])}\n" if p.get("objective") else "")
        + (f"  {_buckets_line(p['buckets'])}\n" if p["buckets"]["numel"] else "")
        + f"  {p['global_batch_size']} sequences per step = {p['dp_size']} "
        + ("data-parallel ranks" if p["dp_size"] < p["world_size"] else "ranks") + f" x {p['grad_accum']} "
        f"micro-batches x {p['micro_batch_size']}; {p['tokens_per_step']:,} tokens per step, {p['steps']} steps\n"
        f"  {p['schedule']}\n"
        f"  data {p['data']}\n"
        + (f"  checkpoints every {ck['every_steps']} steps to {ck['dir']} (resume {ck['resume']})\n" if ck
           else "  checkpoints off\n")
        + (f"  {_start_line(ck['start'], ck['resume'])}\n" if ck and ck.get("start") else "")
        + f"  mlflow {p['tracking'] or 'off'}\n"
        f"  restarts up to {p['failure']['max_restarts']} (-1: unlimited), phase watchdog "
        f"{p['failure']['phase_timeout_s']:g} s"
        + (f", {_spares_words(p['failure'])}" if p["failure"].get("spares") else "")
    )


def _start_line(r: dict, mode: str) -> str:
    """Where the run starts, as the run itself will say it (`mode`: checkpoint.resume)."""
    if r.get("note"):
        return f"where it starts: {r['note']}"
    if r["from"] is None:
        return f"starts at step 0 of {r['of']}: " + ("checkpoint.resume=none" if mode == "none" else
                                                      "no checkpoint to resume yet")
    if r["nothing_to_train"]:
        return f"nothing to train: {r['from']} is at step {r['step']}, train.steps={r['of']}"
    return f"resuming from {r['from']} at step {r['step']} of {r['of']}"


def _spares_words(f: dict) -> str:
    """The warm spares asked for, and how many would be placed where that was measured."""
    n, room = f["spares"], f.get("spare_room") or {}
    asked = f"{n} warm spare{'s' if n > 1 else ''}"
    if room.get("fit") is None:
        return f"{asked}, room {room.get('on', 'not measured')}" if room else asked
    if room["fit"] >= n:
        return f"{asked}, room for {'them' if n > 1 else 'it'} on {room['on']}"
    fit = room["fit"]
    return (f"{asked} asked, but {'none' if not fit else f'only {fit}'} can be placed on {room['on']}: the run "
            f"would go on with{'out spares' if not fit else f' {fit}'}")


def _rewards_line(s: dict) -> str:
    """Preference tuning's last rewards, train and validation (nothing for other runs)."""
    out = ""
    for key, prefix, what in (("final_preferences", "", "rewards"), ("final_val_preferences", "val_", "validation")):
        r = s.get(key)
        if r:
            out += (f"; {what}: margin {r[prefix + 'rewards/margins']:.4f}, accuracy "
                    f"{r[prefix + 'rewards/accuracies']:.2f}")
    return out


def _activations_line(mem: dict) -> str:
    act = mem["activations_bytes"]
    total = (f"; model state + activations {(mem['bytes_per_rank'] + act) / 2**20:,.1f} MiB per rank"
             if mem["bytes_per_rank"] else "")
    return (f"activations {act / 2**20:,.1f} MiB a micro-batch (estimated from the model's shape; activation "
            f"checkpointing {mem['activation_checkpointing']}){total}")


def _compile_line(p: dict) -> str:
    """`train.compile`'s line: the backend, what stays eager, where inductor's caches go."""
    line = (f"each block compiled (torch.compile, {p['compile']}) at the first step; the embedding, head, loss "
            "and sharding hooks eager")
    if p["compile"] != "inductor":  # aot_eager generates no code to cache
        return line
    where = p.get("compile_cache") or "the run directory's compile_cache"
    return f"{line}; inductor's caches in {where}"


def _buckets_line(b: dict) -> str:
    n = b["numel"]
    if b["per_unit"]:
        rule = "one per FSDP unit"
    elif b["bucket_numel"] == "auto":
        rule = "bucket_numel auto"
    else:
        rule = f"bucket_numel {b['bucket_numel']:,}"
    return (f"{len(n)} communication bucket{'s' if len(n) > 1 else ''} ({rule}), {min(n):,} to {max(n):,} "
            f"elements, reduced in the order backward fills them")


def _model_line(p: dict) -> str:
    m = p["model"]
    if m["note"]:
        return f"{m['kind']} from {m['source']}: {m['note']}"
    from rayzero.models import spec_class

    return spec_class(m["kind"]).plan_line(m)


def _experts_line(p: dict) -> str:
    e = p["experts"]
    drop = (f"at most {e['capacity_factor']:g} x an even share of pairs an expert, the rest dropped"
            if e["capacity_factor"] else "dropless")
    return (f"expert parallel {p['ep']}: each rank holds {e['local']} of the {e['total']} experts of every MoE layer "
            f"({e['params_per_rank']:,} expert parameters, {e['bytes_per_param']:.2f} bytes each), their gradients "
            f"reduced over the {e['reduce_over']} rank(s) holding the same experts; tokens sent to their experts by "
            f"all-to-all, {drop}")


def _params_line(total: int, trainable: int) -> str:
    frozen = total - trainable
    return f"{total:,} parameters" + (f" ({frozen:,} frozen)" if frozen else "")


PARTS = ("torch_compile_s",)  # start-up timings inside a stage (the first step's), not stages of their own


def _startup_line(t: dict) -> str:
    """Where the wait for the first step went, stage by stage (the status lines' stages)."""
    stages = ", ".join(f"{k[:-2].replace('_', ' ')} {v:.1f}" for k, v in t.items() if k not in ("total_s", *PARTS))
    parts = "".join(f", of which {k[:-2].replace('_', ' ')} {t[k]:.1f} s" for k in PARTS if k in t)
    return f"first step done {t['total_s']:.1f} s after the start ({stages} s{parts})"


def _print_summary(s: dict) -> None:
    if s["steps"] == 0:
        why = (f"the run stopped early after step {s['stopped_early']['step']}: {s['stopped_early']['reason']}; "
               "train.early_stopping_patience=0 trains on" if s.get("stopped_early") else
               f"it is at step {s['start_step']} of train.steps={s['total_steps']}")
        print(f"\nnothing to train: {s['checkpoint']}: {why}")
        return
    phases = "  ".join(f"{k} {v:.1f}" for k, v in s["phase_ms"].items())
    mem = s["memory"]
    per_param = "  ".join(f"{k.replace('_', ' ')} {v:.2f}" for k, v in mem["bytes_per_param"].items()
                          if k != "frozen_params" or v)
    resumed = f" (resumed at step {s['start_step']})" if s["resumed_from"] else ""
    ranks = f"{s['world_size']} ranks" + ("" if s["world_size"] == s["num_workers"] else f" (of {s['num_workers']})")
    print(
        f"\ntrained {s['steps']} steps{resumed}: loss {s['first_loss']:.4f} -> {s['final_loss']:.4f}"
        + (f", validation loss {s['final_val_loss']:.4f}" if s.get("final_val_loss") is not None else "")
        + (f" (perplexity {math.exp(min(s['final_val_loss'], 700)):.2f})"
           if s.get("final_val_loss") is not None and "final_preferences" not in s else "")
        + _rewards_line(s)
        + (f"; router load-balancing loss {s['final_router_aux_loss']:.4f}"
           if s.get("final_router_aux_loss") is not None else "")
        + (f", z-loss {s['final_router_z_loss']:.4f}" if s.get("final_router_z_loss") is not None else "") + "\n"
        f"  {ranks}, strategy {s['strategy']}" + (f", tensor parallel {s['tp']}" if s.get("tp", 1) > 1 else "")
        + (f", pipeline {s['pp']} stages ({s.get('pp_schedule')})" if s.get("pp", 1) > 1 else "")
        + f", {_params_line(s['num_params'], s['trainable_params'])}, "
        f"{s['grad_accum']} micro-batches/step\n"
        f"  {s['tokens_per_s']:,.0f} tokens/s ({s['tokens_per_s_per_rank']:,.0f} per rank"
        + (f", MFU {s['mfu']:.1%} of the {s['device']}'s dense bf16 peak" if s.get("mfu") is not None else "")
        + f"), {s['step_ms']:.1f} ms/step ({phases} ms)\n"
        f"  memory per rank, bytes/parameter: {per_param}; transient peak "
        f"{mem['transient_bytes'] / 2**20:.1f} MiB; activations {mem['activations_peak_bytes'] / 2**20:.1f} MiB "
        f"a micro-batch at their peak"
        + (f"; reference model {mem['reference_bytes'] / 2**20:.1f} MiB" if mem.get("reference_bytes") else "") + "\n"
        + (f"  {s['skipped_steps']} steps skipped by loss scaling\n" if s["skipped_steps"] else "")
        + "".join(f"  {'replacement' if f['decision'] == 'replace' else 'restart'} {i}: {f['message']}; "
                  f"{f['decision']} at {f['world_size']} ranks, "
                  f"training again {f['timings'].get('total_s', 0):.1f}s later\n"
                  for i, f in enumerate(s["failures"], 1))
        + "".join(f"  grew from {r['from']} to {r['to']} ranks at step {r['step']}\n" for r in s["resizes"])
        + (f"  stopped early after step {s['stopped_early']['step']}: {s['stopped_early']['reason']}\n"
           if s.get("stopped_early") else "")
        + (f"  {_startup_line(s['startup'])}\n" if s.get("startup") else "")
        + (f"  checkpoint {s['checkpoint']}\n" if s["checkpoint"] else "")
        + (f"  best checkpoint {s['best_checkpoint']} (validation loss {s['best_val_loss']:.4f})\n"
           if s.get("best_checkpoint") else "")
        + f"  run dir {s['run_dir']}\n"
        + (f"  mlflow run {s['mlflow_run_id']} at {s['mlflow_tracking_uri']}" if s["mlflow_run_id"]
           else f"  mlflow at {s['mlflow_tracking_uri']} did not answer" if s["mlflow_tracking_uri"] else "  mlflow off")
        + (f"; unsent metrics in {s['mlflow_unsent']}" if s["mlflow_unsent"] else "")
        + (f"\n  weights {s['final_weights']}" if s["final_weights"] else "")
    )


def _deploy(args) -> int:
    from rayzero.jobs.deploy import DeployError, Note, check_manifest, crds_folder

    try:
        crds = crds_folder(args.crds)
        results = [(f, check_manifest(f, crds, workdir=args.workdir)) for f in args.files]
    except DeployError as e:
        raise _UserError(str(e)) from None
    if crds is None:
        print("rayzero: note: no KubeRay CRDs (--crds or $RAYZERO_KUBERAY_CRDS): the schema is not checked",
              file=sys.stderr)
    failed = False
    for f, problems in results:
        errors = [p for p in problems if not isinstance(p, Note)]
        for problem in problems:
            print(f"rayzero: {'note' if isinstance(problem, Note) else 'error'}: {f}: {problem}", file=sys.stderr)
        if not errors:
            print(f"{f}: ok" + ("" if crds else " (schema not checked)"))
        failed = failed or bool(errors)
    return 2 if failed else 0


def _prepare(args) -> int:
    """`data prepare`; with `--ray`, on a Ray it joins (or starts), and leaves as it found it: a
    Ray this call started is shut down when it ends, as `train` does. Ranks kept by an earlier
    run of this process (`cluster.keep_ranks`) are released first."""
    storage = load_config(None, args.overrides).checkpoint.storage  # before Ray: a typo fails at once
    logging.basicConfig(format="rayzero: warning: %(message)s", level=logging.WARNING)
    if not args.ray:
        return _tokenize(args, storage)
    import ray

    from rayzero.cluster.worker_group import release_ranks
    from rayzero.cluster.local_ray import quiet_logs, shutdown_ray
    from rayzero.jobs.train import _check_reachable

    quiet_logs()
    release_ranks()  # ranks an earlier `train` of this process kept would hold the CPUs its tasks need
    if ray.is_initialized():
        return _tokenize(args, storage)
    try:
        _check_reachable(args.address)
        ray.init(address=args.address or None, logging_level="WARNING", log_to_driver=False)
    except ConnectionError as e:
        raise _UserError(f"--address: cannot connect to a Ray cluster at {args.address!r}: {e}") from None
    try:
        return _tokenize(args, storage)
    finally:
        shutdown_ray()


def _tokenize(args, storage) -> int:
    from rayzero.data.sources import Fields
    from rayzero.data.tokens import prepare

    tokenizer = args.tokenizer
    if "://" in tokenizer and not tokenizer.startswith("file://"):  # a model directory in storage
        from rayzero.models.hf import model_tokenizer
        from rayzero.storage import StorageError

        try:
            tokenizer = model_tokenizer(tokenizer, storage)
        except StorageError as e:
            raise _UserError(f"--tokenizer: cannot read {args.tokenizer}: {e}") from None
        if tokenizer is None:
            raise _UserError(f"--tokenizer: {args.tokenizer} holds no tokenizer files")
    how = prepare
    if args.ray:
        from functools import partial

        from rayzero.jobs.ray_prepare import prepare_on_ray

        how = partial(prepare_on_ray, workers=args.workers)
    meta = how(args.src, args.out, pattern=args.glob, shard_tokens=args.shard_tokens, tokenizer=tokenizer,
               fields=Fields(args.text_field, args.text_column), strict_utf8=args.strict_utf8,
               progress=not args.no_progress, instructions=args.instructions, preferences=args.preferences,
               storage_cfg=storage)
    tok = meta["tokenizer"]
    what = "examples" if args.instructions else "documents"
    made = (f"{meta['num_pairs']:,} pairs ({meta['num_documents']:,} sequences)" if args.preferences
            else f"{meta['num_documents']:,} {what}")
    print(f"wrote {meta['num_tokens']:,} tokens ({meta['dtype']}) from {made} "
          f"in {len(meta['shards'])} shard(s) to {args.out}; tokenizer {tok.get('name', tok['kind'])} "
          f"({tok['vocab_size']:,} ids, {tok['sha256']})"
          + (f"; skipped {meta['num_skipped']} not UTF-8" if meta["num_skipped"] else ""))
    return 0


def _generate(args) -> int:
    from rayzero.checkpoint.manifest import CheckpointError
    from rayzero.storage import StorageError
    from rayzero.jobs.generate import load_generator
    from rayzero.models import ModelError

    try:
        gen = load_generator(args.weights, load_config(args.config, args.overrides), args.tokenizer)
    except (CheckpointError, StorageError, ModelError) as e:
        raise _UserError(str(e)) from None
    chat = True if args.chat else False if args.raw else None
    text = gen(args.prompt, args.max_new_tokens, args.temperature, args.top_k, args.seed, system=args.system,
               chat=chat)
    print(text if gen.chats(chat, args.system is not None) else args.prompt + text)
    return 0


class _UserError(Exception):
    pass


def _tracking(args) -> int:
    """`tracking send`: what a run left unsent, into its MLflow run."""
    from rayzero.cluster.tracking import UNSENT, send_unsent

    path = Path(args.run_dir)
    path = path / UNSENT if path.is_dir() else path
    if not path.is_file():
        raise _UserError(f"{args.run_dir}: nothing left unsent ({path} does not exist)")
    try:
        done = send_unsent(str(path), args.uri, args.timeout)
    except ValueError as e:
        raise _UserError(str(e)) from None
    if not done["sent"]:
        raise _UserError(f"MLflow did not take everything within {args.timeout:g} s; what is left stays in {path}")
    print(f"sent {path} to MLflow run {done['run_id']}")
    return 0


def main(argv: list[str] | None = None, own_process: bool = False) -> int:
    """`rayzero ARGV…`; `own_process`: called as the program (`command`), not from Python."""
    args = parse_args(argv)
    with ExitStack() as after:  # what a command leaves to do once its outcome is said
        return _command(args, after, own_process)


def _command(args, after: ExitStack, own_process: bool) -> int:
    try:
        if args.command == "train":
            return _train(args, after, own_process)
        if args.command == "ckpt":
            return _ckpt(args)
        if args.command == "generate":
            return _generate(args)
        if args.command == "deploy":
            return _deploy(args)
        if args.command == "tracking":
            return _tracking(args)
        return _prepare(args)
    except (ConfigError, DataError, _UserError) as e:
        print(f"rayzero: error: {e}", file=sys.stderr)
        return 2


def command() -> int:
    """The `rayzero` program: `main` in a process of its own. A local Ray still starting when
    the command ends (a refusal, a Ctrl-C during the checks) ends with the process, at once:
    nothing of the interpreter's own shutdown (atexit, imports) waits on that start."""
    code = main(own_process=True)
    from rayzero.cluster.local_ray import LocalRay

    if LocalRay.abandoned:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


if __name__ == "__main__":
    sys.exit(command())
