"""The `rayzero` command: each subcommand's work, on the arguments `commands` parses."""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
from contextlib import ExitStack
from pathlib import Path

from rayzero.config import ConfigError, load_config
from rayzero.data.errors import DataError
from rayzero.jobs.commands import parse_args
from rayzero.jobs.printed import print_plan, print_summary


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
    Ray's start begins before torch is imported (`RayStart`), and is stopped by `after` once the
    run's outcome is said (a refusal found while Ray was starting is said first; then Ray is
    shut down, or, still starting, its processes are killed); a caller's process (tests, Python
    calling `main`) has imported torch already, and starts Ray after the checks."""
    cfg = load_config(args.config, args.overrides)  # before torch and Ray are imported: a typo fails at once
    if args.dry_run:
        from rayzero.jobs.plan import plan

        p = plan(cfg)  # ConfigError: the refusal the run would give, the same exit code
        print_plan(p)
        if args.summary_json:
            Path(args.summary_json).write_text(json.dumps(p, indent=2))
        return 0
    from rayzero.cluster.startup import CHECKS, Startup

    startup = Startup()
    startup.stage("checks", CHECKS)  # said before the imports below: torch and Ray take seconds
    previous = _on_sigterm()  # before training; the controller takes SIGTERM over while it trains
    ray_start = None
    try:
        if own_process:
            from rayzero.cluster.local_ray import RayStart
            from rayzero.jobs.data_checks import check_data_paths

            check_data_paths(cfg)  # a mistyped path refused before anything starts
            ray_start = RayStart.begin(cfg, clock=startup.elapsed)  # None: this process has a Ray already
            if ray_start is not None:
                after.callback(ray_start.stop)
        code, summary = _run_train(args, cfg, startup, ray_start)
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
    print_summary(summary)
    if args.summary_json:
        Path(args.summary_json).write_text(json.dumps(summary, indent=2))
    return 0


def _run_train(args, cfg, startup, ray_start) -> tuple[int, dict | None]:
    """The run itself, its failures said in one line: (exit code, summary)."""
    from rayzero.checkpoint.manifest import CheckpointError
    from rayzero.storage import StorageError
    from rayzero.cluster.failure import TrainingFailed
    from rayzero.cluster.worker_group import PlacementError
    from rayzero.jobs.train import ClusterUnreachable, run_train

    try:
        return 0, run_train(cfg, progress=not args.no_progress, startup=startup, ray_start=ray_start)
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
    from rayzero.cluster.local_ray import check_reachable

    quiet_logs()
    release_ranks()  # ranks an earlier `train` of this process kept would hold the CPUs its tasks need
    if ray.is_initialized():
        return _tokenize(args, storage)
    try:
        check_reachable(args.address)
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
    if args.ray and args.prompts:
        raise _UserError("--prompts: prompts are prepared in this process; leave out --ray")
    if args.prompts:
        from functools import partial

        how = partial(prepare, prompts=True)
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
            else f"{meta['num_prompts']:,} prompts (their other fields: {', '.join(meta['columns']) or 'none'})"
            if args.prompts else f"{meta['num_documents']:,} {what}")
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
    from rayzero.jobs.tracking import UNSENT, send_unsent

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
    from rayzero.cluster.local_ray import RayStart

    if RayStart.abandoned:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


if __name__ == "__main__":
    sys.exit(command())
