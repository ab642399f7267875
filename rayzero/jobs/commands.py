"""The `rayzero` command: `rayzero train …`, `rayzero data prepare SRC OUT`, `rayzero ckpt …`,
`rayzero deploy check FILE…`, `rayzero tracking send RUN_DIR`."""

from __future__ import annotations

import argparse

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
    t.add_argument("overrides", nargs="*", metavar="key=value",
                   help="dotted config keys, over the --config file's values (the keys: below)")
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
    records = prep.add_mutually_exclusive_group()
    records.add_argument("--instructions", action="store_true",
                         help="JSON lines of instruction examples: {prompt, response} or {messages} (rendered with the "
                         "tokenizer's chat template); the loss is on the responses only")
    records.add_argument("--preferences", action="store_true",
                         help="JSON lines or Parquet of preference pairs for train.objective=dpo, in TRL's formats: "
                         "{prompt, chosen, rejected} as strings or as lists of messages (rendered with the chat "
                         "template), or {chosen, rejected} with the prompt implicit in both; tokenized as TRL's "
                         "DPOTrainer does")
    records.add_argument("--prompts", action="store_true",
                         help="JSON lines or Parquet of prompts for online RL, in TRL's prompt-only formats: "
                         "{prompt} as a string or as a list of messages (rendered with the chat template and the "
                         "generation prompt); every other field is kept for the reward functions")
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
        "stops at the end-of-turn and end-of-sequence tokens. A checkpoint, a safetensors file, an HF directory "
        "or a PEFT adapter directory may be in s3://. "
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
    g.add_argument("overrides", nargs="*", metavar="key=value", help="storage settings (checkpoint.s3_*)")
    c = sub.add_parser("ckpt", help="checkpoint tools", description=(
        "Inspect committed checkpoints. URI is a checkpoint directory (ls; the others take its "
        "newest commit) or one step-… prefix. " + STORAGE_OPTIONS))
    csub = c.add_subparsers(dest="ckpt_command", required=True)
    for name, text in (("ls", "committed checkpoints: step, size, world size, strategy"),
                       ("verify", "read every shard and check its checksums"),
                       ("export", "consolidated weights: one safetensors file, a Hugging Face directory or a PEFT "
                                  "adapter directory")):
        cmd = csub.add_parser(name, help=text, description=(
            f"{text[0].upper()}{text[1:]}. URI is a checkpoint directory ({'its commits' if name == 'ls' else 'its newest commit'}) "
            "or one step-… prefix. " + STORAGE_OPTIONS))
        cmd.add_argument("uri", help="a checkpoint directory or one step-… prefix: a local path, file:// or s3://")
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
        cmd.add_argument("overrides", nargs="*", metavar="key=value", help="storage settings (checkpoint.s3_*)")
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
    m = sub.add_parser("tracking", help="MLflow tools")
    msub = m.add_subparsers(dest="tracking_command", required=True)
    send = msub.add_parser("send", help="send what a run could not send to MLflow", description=(
        "Send what a run left in its run directory's mlflow-unsent.json when its MLflow server did not answer "
        "(its params, tags and config where the server never had the run, its metrics, its end) into the MLflow "
        "run it was for, made where the server never had it; the file goes once all of it is in. The next run "
        "or resume of the same run directory does this by itself."))
    send.add_argument("run_dir", metavar="RUN_DIR", help="the run directory (or the mlflow-unsent.json in it)")
    send.add_argument("--uri", help="the tracking URI to send to (default: the one the run used)")
    send.add_argument("--timeout", type=float, default=60.0, help="seconds to wait for the server (default 60)")
    return p


def _keys_epilog() -> str:
    """Every config key, section by section (what `--config` and the overrides take), and where
    each is described."""
    import textwrap

    from rayzero.config import RootConfig

    lines = ["config keys (defaults and meanings: docs/reference/configuration.md, or `python -m rayzero.config_reference`):"]
    for section, field in RootConfig.model_fields.items():
        keys = ", ".join(f.alias or name for name, f in field.annotation.model_fields.items())
        lines += textwrap.wrap(f"{section}: {keys}", width=100, initial_indent="  ", subsequent_indent="    ")
    return "\n".join(lines)


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
