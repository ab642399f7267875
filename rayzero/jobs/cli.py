"""The `rayzero` command: `rayzero train …`, `rayzero data prepare SRC OUT`, `rayzero ckpt …`,
`rayzero deploy check FILE…`."""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
from pathlib import Path

from rayzero.config import ConfigError, load_config
from rayzero.data.errors import DataError


STORAGE_OPTIONS = ("S3 settings as overrides, the keys `rayzero train` takes: checkpoint.s3_endpoint=http://host:8333 "
                   "checkpoint.s3_access_key_id=… checkpoint.s3_secret_access_key=… checkpoint.s3_region=…; "
                   "those left out come from the AWS_* variables.")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="rayzero", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    t = sub.add_parser("train", help="run a training job", description=(
        "Train a model (the built-in GPT, a Hugging Face causal LM, or your own nn.Module) over Ray actors. "
        "Overrides are dotted key=value pairs, "
        "e.g. train.steps=50 sharding.strategy=no_shard cluster.num_workers=4."),
        epilog=_keys_epilog(), formatter_class=argparse.RawDescriptionHelpFormatter)
    t.add_argument("--config", help="YAML config file (defaults apply to what it leaves out)")
    t.add_argument("--summary-json", help="also write the final summary as JSON here")
    t.add_argument("--no-progress", action="store_true", help="no progress bar")
    t.add_argument("--dry-run", action="store_true",
                   help="validate the config and print the plan (world size, strategy, accumulation, "
                        "memory per rank) without starting Ray; --summary-json gets the plan")
    t.add_argument("overrides", nargs="*", metavar="key=value")
    d = sub.add_parser("data", help="dataset tools")
    dsub = d.add_subparsers(dest="data_command", required=True)
    prep = dsub.add_parser("prepare", help="tokenize text, JSON lines or Parquet into token shards", description=(
        "Tokenize documents into Parquet token shards training reads (data.path). SRC: a file, a folder or a "
        "glob, local or s3://. .jsonl/.json: a document per record (--text-field); .parquet: per row "
        "(--text-column); any other file is one document. " + STORAGE_OPTIONS))
    prep.add_argument("src", help="a file, a folder, or a glob such as 'docs/**.jsonl' (quote it)")
    prep.add_argument("out", help="output folder (local path or URI)")
    prep.add_argument("overrides", nargs="*", metavar="key=value", help="storage settings (checkpoint.s3_*)")
    prep.add_argument("--tokenizer", default="byte", help="`byte` (default), or a local directory with a Hugging "
                      "Face tokenizer (tokenizer.json, or what AutoTokenizer loads: e.g. the model's directory)")
    prep.add_argument("--glob", default="*", help="which files under a SRC folder, by name (default: all)")
    prep.add_argument("--text-field", default="text", help="JSON lines: the field holding the text (default: text)")
    prep.add_argument("--text-column", default="text", help="Parquet: the column holding the text (default: text)")
    prep.add_argument("--instructions", action="store_true",
                      help="JSON lines of instruction examples: {prompt, response} or {messages} (rendered with the "
                      "tokenizer's chat template); the loss is on the responses only")
    prep.add_argument("--strict-utf8", action="store_true",
                      help="refuse input that is not UTF-8 (default: skip it, naming each file or line)")
    prep.add_argument("--shard-tokens", type=int, default=1 << 24, help="tokens per shard file")
    prep.add_argument("--no-progress", action="store_true", help="no progress bar")
    prep.add_argument("--ray", action="store_true",
                      help="tokenize with Ray Data across a Ray cluster (same output); SRC must be readable from "
                      "every node (s3://, or a shared filesystem)")
    prep.add_argument("--address", default="", help="with --ray: the cluster (`auto`, host:port); empty = a local Ray")
    prep.add_argument("--workers", type=int, default=None, help="with --ray: tokenizing workers (default: the "
                      "cluster's CPUs)")
    g = sub.add_parser("generate", help="text from a prompt with trained weights", description=(
        "Continue a prompt, or answer it as a chat, with a checkpoint (its newest commit, or one step-... prefix), "
        "a Hugging Face directory (an hf export), a PEFT adapter directory (a peft export, or PEFT's own: its "
        "LoRA adapters merged onto the base model it names, or onto model.path=BASE_DIR, which must be the model "
        "it was trained on) or a safetensors export (with the model's config: --config or model.* overrides). "
        "The tokenizer: --tokenizer, else the adapter's or model directory's own, else the training data's, else "
        "bytes. With a chat template the prompt is the user's message and only the answer is printed; generation "
        "stops at the end-of-turn and end-of-sequence tokens. A checkpoint or safetensors file may be in s3://. "
        + STORAGE_OPTIONS))
    g.add_argument("weights", help="a checkpoint, an HF model directory, a PEFT adapter directory, or a "
                                   ".safetensors file")
    g.add_argument("--prompt", required=True, help="the text to continue, or (chat) the user's message")
    g.add_argument("--system", default=None, help="chat: a system prompt before the message")
    mode = g.add_mutually_exclusive_group()
    mode.add_argument("--chat", action="store_true", help="render the prompt with the tokenizer's chat template "
                      "(the default when it has one; an error when it has none)")
    mode.add_argument("--raw", action="store_true", help="continue the prompt as plain text, template or not")
    g.add_argument("--max-new-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-k", type=int, default=0, help="sample from the k likeliest tokens only (0 = all)")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--tokenizer", default=None, help="`byte` or a tokenizer directory")
    g.add_argument("--config", default=None, help="the training job's YAML (a safetensors export's model)")
    g.add_argument("overrides", nargs="*", metavar="key=value")
    c = sub.add_parser("ckpt", help="checkpoint tools", description=(
        "Inspect committed checkpoints. URI is a checkpoint directory (ls; the others take its "
        "newest commit) or one step-… prefix. " + STORAGE_OPTIONS))
    csub = c.add_subparsers(dest="ckpt_command", required=True)
    for name, text in (("ls", "committed checkpoints: step, size, world size, strategy"),
                       ("verify", "read every shard and check its checksums"),
                       ("export", "consolidated weights: one safetensors file, or a Hugging Face directory")):
        cmd = csub.add_parser(name, help=text)
        cmd.add_argument("uri")
        if name == "export":
            cmd.add_argument("out", help="output .safetensors file, or directory with --format hf or peft (local "
                                         "path or s3://…)")
            cmd.add_argument("--format", choices=("safetensors", "hf", "peft"), default="safetensors",
                             help="safetensors: one file by state_dict() names (default); hf: a directory "
                                  "AutoModelForCausalLM.from_pretrained loads (model.kind=hf); with LoRA both merge "
                                  "the adapters into the base weights; peft: the LoRA adapters alone, a directory "
                                  "peft.PeftModel.from_pretrained loads onto the base model")
            cmd.add_argument("--max-shard-size", default="5GB",
                             help="hf: the largest safetensors file, e.g. 5GB, 500MB (default 5GB)")
            cmd.add_argument("--dtype", choices=("auto", "float32", "bfloat16", "float16"), default="auto",
                             help="dtype of the weights written; auto: hf = the pretrained weights' dtype (else "
                                  "the config's), safetensors = float32")
        cmd.add_argument("overrides", nargs="*", metavar="key=value")
    k = sub.add_parser("deploy", help="KubeRay deployment tools")
    ksub = k.add_subparsers(dest="deploy_command", required=True)
    chk = ksub.add_parser("check", help="validate RayJob/RayCluster manifests before kubectl apply", description=(
        "Check KubeRay manifests: strictly against the CRDs' schema (a misspelt field is an error), "
        "an image for every container, and a RayJob's entrypoint as `rayzero train --dry-run` checks it."))
    chk.add_argument("files", nargs="+", metavar="FILE", help="manifest YAML (RayJob or RayCluster, ray.io/v1)")
    chk.add_argument("--crds", help="folder with KubeRay's ray.io_rayjobs.yaml and ray.io_rayclusters.yaml "
                                    "(default: $RAYZERO_KUBERAY_CRDS; without either the schema is not checked)")
    chk.add_argument("--workdir", default=".", help="where an entrypoint's --config resolves: the repository "
                                                    "root, which the image has at /app (default: here)")
    return p


def _keys_epilog() -> str:
    """Every config key, section by section (what `--config` and the overrides take), and where
    each is described."""
    import textwrap

    from rayzero.config import RootConfig

    lines = ["config keys (defaults and meanings: docs/configuration.md, or `python -m rayzero.config_reference`):"]
    for section, field in RootConfig.model_fields.items():
        keys = ", ".join(f.alias or name for name, f in field.annotation.model_fields.items())
        lines += textwrap.wrap(f"{section}: {keys}", width=100, initial_indent="  ", subsequent_indent="    ")
    return "\n".join(lines)


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
                print(f"{r['uri']}  step {r['step']}  {r['bytes'] / 2**20:.1f} MiB  "
                      f"world {r['world_size']}  {r['strategy']}  {r['created']}")
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


def _train(args) -> int:
    cfg = load_config(args.config, args.overrides)  # before torch and Ray are imported: a typo fails at once
    if args.dry_run:
        from rayzero.jobs.train import plan

        p = plan(cfg)
        _print_plan(p)
        if args.summary_json:
            Path(args.summary_json).write_text(json.dumps(p, indent=2))
        return 0
    from rayzero.cluster.startup import CHECKS, Startup

    startup = Startup()
    startup.stage("checks", CHECKS)  # said before the imports below: torch and Ray take seconds
    from rayzero.checkpoint.manifest import CheckpointError
    from rayzero.storage import StorageError
    from rayzero.cluster.failure import Stopped, TrainingFailed
    from rayzero.cluster.worker_group import PlacementError
    from rayzero.jobs.train import ClusterUnreachable, run_train

    try:
        summary = run_train(cfg, progress=not args.no_progress, startup=startup)
    except (PlacementError, ClusterUnreachable, CheckpointError, StorageError) as e:
        raise _UserError(str(e)) from None
    except TrainingFailed as e:
        print(f"rayzero: training failed: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt as e:  # Ctrl-C: one line, the shell's code for SIGINT, no traceback
        print(f"\nrayzero: {e if isinstance(e, Stopped) else 'stopped before training began'}", file=sys.stderr)
        return 130
    _print_summary(summary)
    if args.summary_json:
        Path(args.summary_json).write_text(json.dumps(summary, indent=2))
    return 0


def _print_plan(p: dict) -> None:
    elastic = f" (down to {p['world_sizes'][-1]} if the cluster shrinks)" if len(p["world_sizes"]) > 1 else ""
    bundle = ", ".join(f"{v:g} {k}" for k, v in p["bundle"].items())
    hybrid = f", {p['dp_outer']} replicas" if p["dp_outer"] > 1 else ""
    mem = p["memory"]
    ck = p["checkpoint"]
    print(
        f"plan (dry run: nothing started)\n"
        f"  {p['world_size']} ranks{elastic} of {bundle} each, on {p['cluster']}\n"
        f"  strategy {p['strategy']}{hybrid}; params {p['param_dtype']}, grads {p['grad_dtype']}\n"
        + ("".join(f"  {line}\n" for line in p["mesh"]) if p["tp"] > 1 else "")
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
        + (f"  {_buckets_line(p['buckets'])}\n" if p["buckets"]["numel"] else "")
        + f"  {p['global_batch_size']} sequences per step = {p['world_size'] // p['tp']} "
        + ("data-parallel ranks" if p["tp"] > 1 else "ranks") + f" x {p['grad_accum']} "
        f"micro-batches x {p['micro_batch_size']}; {p['tokens_per_step']:,} tokens per step, {p['steps']} steps\n"
        f"  {p['schedule']}\n"
        f"  data {p['data']}\n"
        + (f"  checkpoints every {ck['every_steps']} steps to {ck['dir']} (resume {ck['resume']})\n" if ck
           else "  checkpoints off\n")
        + f"  mlflow {p['tracking'] or 'off'}\n"
        f"  restarts up to {p['failure']['max_restarts']} (-1: unlimited), phase watchdog "
        f"{p['failure']['phase_timeout_s']:g} s"
    )


def _activations_line(mem: dict) -> str:
    act = mem["activations_bytes"]
    total = (f"; model state + activations {(mem['bytes_per_rank'] + act) / 2**20:,.1f} MiB per rank"
             if mem["bytes_per_rank"] else "")
    return (f"activations {act / 2**20:,.1f} MiB a micro-batch (estimated from the model's shape; activation "
            f"checkpointing {mem['activation_checkpointing']}){total}")


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
    if m["kind"] == "gpt":
        return "the built-in GPT" + (f", from {m['source']}" if m["source"] else "")
    what = m["architecture"] or m["kind"]
    source = f" from {m['source']}" if m["source"] else ""
    return f"{what}{source} ({'pretrained weights' if m['init'] == 'pretrained' else 'random init'})"


def _params_line(total: int, trainable: int) -> str:
    frozen = total - trainable
    return f"{total:,} parameters" + (f" ({frozen:,} frozen)" if frozen else "")


def _startup_line(t: dict) -> str:
    """Where the wait for the first step went, stage by stage (the status lines' stages)."""
    stages = ", ".join(f"{k[:-2].replace('_', ' ')} {v:.1f}" for k, v in t.items() if k != "total_s")
    return f"first step done {t['total_s']:.1f} s after the start ({stages} s)"


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
        + (f", validation loss {s['final_val_loss']:.4f} (perplexity {math.exp(min(s['final_val_loss'], 700)):.2f})"
           if s.get("final_val_loss") is not None else "")
        + (f"; router load-balancing loss {s['final_router_aux_loss']:.4f}"
           if s.get("final_router_aux_loss") is not None else "") + "\n"
        f"  {ranks}, strategy {s['strategy']}" + (f", tensor parallel {s['tp']}" if s.get("tp", 1) > 1 else "")
        + f", {_params_line(s['num_params'], s['trainable_params'])}, "
        f"{s['grad_accum']} micro-batches/step\n"
        f"  {s['tokens_per_s']:,.0f} tokens/s ({s['tokens_per_s_per_rank']:,.0f} per rank"
        + (f", MFU {s['mfu']:.1%} of the {s['device']}'s dense bf16 peak" if s.get("mfu") is not None else "")
        + f"), {s['step_ms']:.1f} ms/step ({phases} ms)\n"
        f"  memory per rank, bytes/parameter: {per_param}; transient peak "
        f"{mem['transient_bytes'] / 2**20:.1f} MiB; activations {mem['activations_peak_bytes'] / 2**20:.1f} MiB "
        f"a micro-batch at their peak\n"
        + (f"  {s['skipped_steps']} steps skipped by loss scaling\n" if s["skipped_steps"] else "")
        + "".join(f"  restart {i}: {f['message']}; {f['decision']} at {f['world_size']} ranks, "
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
    from rayzero.data.sources import Fields
    from rayzero.data.tokens import prepare

    storage = load_config(None, args.overrides).checkpoint.storage  # before Ray: a typo fails at once
    logging.basicConfig(format="rayzero: warning: %(message)s", level=logging.WARNING)
    if args.ray:
        import ray

        from rayzero.jobs.preflight import quiet_logs
        from rayzero.jobs.train import _check_reachable

        quiet_logs()
        if not ray.is_initialized():
            try:
                _check_reachable(args.address)
                ray.init(address=args.address or None, logging_level="WARNING", log_to_driver=False)
            except ConnectionError as e:
                raise _UserError(f"--address: cannot connect to a Ray cluster at {args.address!r}: {e}") from None
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
               progress=not args.no_progress, instructions=args.instructions, storage_cfg=storage)
    tok = meta["tokenizer"]
    what = "examples" if args.instructions else "documents"
    print(f"wrote {meta['num_tokens']:,} tokens ({meta['dtype']}) from {meta['num_documents']:,} {what} "
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


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, with `key=value` overrides allowed before and after the options
    (`rayzero train a=1 --no-progress b=2`): argparse alone stops the overrides at the first
    option and rejects the rest."""
    parser = _parser()
    args, extra = parser.parse_known_args(argv)
    stray = [a for a in extra if a.startswith("-") or "=" not in a or not hasattr(args, "overrides")]
    if stray:
        parser.error(f"unrecognized arguments: {' '.join(stray)}")
    if extra:
        args.overrides = [*args.overrides, *extra]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        if args.command == "train":
            return _train(args)
        if args.command == "ckpt":
            return _ckpt(args)
        if args.command == "generate":
            return _generate(args)
        if args.command == "deploy":
            return _deploy(args)
        return _prepare(args)
    except (ConfigError, DataError, _UserError) as e:
        print(f"rayzero: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
