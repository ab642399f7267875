"""`rayzero deploy check`: the KubeRay manifests that run rayzero, checked before `kubectl apply`.

    problems = check_manifest("deploy/kuberay/rayjob.yaml", "path/to/kuberay/crds")

Two kinds of check, so that a mistake surfaces here and not as a pod that never starts or a
job that fails after the GPUs were scheduled:

- the schema: the manifest against the `openAPIV3Schema` of KubeRay's own CRDs, strictly. The
  API server prunes a field it does not know (a misspelt `imagee:` disappears without a word),
  so every object that declares its properties is closed here, and such a field is an error.
- the meaning: `ray.io/v1` and a kind this checker knows, an image for every container, and for
  a RayJob an entrypoint that is a `rayzero train ...` command passing `rayzero train --dry-run`.

Problems are one line each, naming the field's path (`spec.rayClusterSpec...containers[0].image`).
"""

from __future__ import annotations

import contextlib
import difflib
import functools
import io
import os
import re
import shlex
from pathlib import Path
from typing import Any, Iterator

import yaml

API_VERSION = "ray.io/v1"
CRD_FILES = {"RayJob": "ray.io_rayjobs.yaml", "RayCluster": "ray.io_rayclusters.yaml"}
CRDS_ENV = "RAYZERO_KUBERAY_CRDS"  # the CRD folder when --crds is not given
GPU = "nvidia.com/gpu"
_DNS1035 = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")
_KUBE_VAR = re.compile(r"\$(\$|\(([A-Za-z_][A-Za-z0-9_]*)\))")  # $(NAME), and $$ for a literal $
_ENV_ASSIGNMENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*=")
_SHELL_OPERATORS = set("();<>|&")
_KUBERAY_SUBMITTER_ENV = ("PYTHONUNBUFFERED", "RAY_DASHBOARD_ADDRESS", "RAY_JOB_SUBMISSION_ID")


class DeployError(ValueError):
    """The check itself cannot run (a CRD folder that is missing or holds no CRD); a manifest's
    own mistakes are problems, returned as a list, so that every file gets checked."""


def crds_folder(crds_dir: str | Path | None = None) -> Path | None:
    """The CRD folder to validate against: `crds_dir`, else $RAYZERO_KUBERAY_CRDS, else None
    (schema not checked). A folder that was named but does not exist is an error, never a
    silent skip."""
    chosen = crds_dir or os.environ.get(CRDS_ENV)
    if not chosen:
        return None
    folder = Path(chosen).expanduser()
    if not folder.is_dir():
        source = "--crds" if crds_dir else f"${CRDS_ENV}"
        raise DeployError(f"{source} {chosen}: no such folder (it holds KubeRay's "
                          f"{' and '.join(CRD_FILES.values())})")
    return folder


def check_manifest(path: str | Path, crds_dir: str | Path | None = None,
                   workdir: str | Path = ".") -> list[str]:
    """Every problem of the manifest at `path`, one message each; [] = fine. `crds_dir` as in
    `crds_folder`; `workdir` is what the image has at /app (the repository root): an
    entrypoint's relative `--config` resolves against it."""
    crds = crds_folder(crds_dir)
    try:
        docs = [d for d in yaml.safe_load_all(Path(path).read_text()) if d is not None]
    except OSError as e:
        return [f"cannot be read: {e.strerror or e}"]
    except yaml.YAMLError as e:
        return [f"not valid YAML: {' '.join(str(e).split())}"]
    if not docs:
        return ["holds no manifest"]
    problems = []
    for i, doc in enumerate(docs, 1):
        prefix = f"document {i}: " if len(docs) > 1 else ""
        problems += [type(p)(prefix + p) for p in check_document(doc, crds, Path(workdir))]
    return problems


def check_document(doc: Any, crds: Path | None, workdir: Path) -> list[str]:
    """The problems of one parsed manifest: its kind first (nothing else means anything for
    an unknown kind), then the schema, then what the schema cannot say."""
    if not isinstance(doc, dict):
        return [f"expected a Kubernetes object (a mapping), got {_json_type(doc)}"]
    kind, api = doc.get("kind"), doc.get("apiVersion")
    if not isinstance(kind, str) or kind not in CRD_FILES:
        return [f"kind: {kind!r} is not one this check knows; expected {' or '.join(CRD_FILES)}"]
    if api != API_VERSION:
        return [f"apiVersion: {api!r}; expected {API_VERSION} (KubeRay's current API, the one checked here)"]
    problems = schema_problems(doc, crds / CRD_FILES[kind]) if crds else []
    problems += _name_problems(doc)
    problems += _cluster_problems(doc)
    problems += _image_problems(doc)
    if kind == "RayJob":
        problems += _entrypoint_problems(doc, workdir)
    return list(dict.fromkeys(problems))


# --- the schema ---------------------------------------------------------------------------


def schema_problems(doc: dict, crd_path: Path) -> list[str]:
    """`doc` against the CRD's v1 schema, strictly; one message per error, with its path."""
    validator = _validator(str(crd_path))
    errors = sorted(validator.iter_errors(doc), key=lambda e: [str(p) for p in e.absolute_path])
    return [message for e in errors for message in _explain(e)]


@functools.lru_cache(maxsize=None)
def _validator(crd_path: str):
    """A validator for one CRD file (parsing a 1 MB CRD takes a while: once per process)."""
    import jsonschema

    try:
        text = Path(crd_path).read_text()
    except OSError:
        raise DeployError(f"{crd_path}: missing; the CRD folder needs {' and '.join(CRD_FILES.values())}") from None
    crd = _d(yaml.load(text, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader)))
    versions = [_d(v) for v in _l(_d(crd.get("spec")).get("versions"))]
    schema = next((_d(v.get("schema")).get("openAPIV3Schema") for v in versions
                   if v.get("name") == API_VERSION.split("/")[1]), None)
    if schema is None:
        raise DeployError(f"{crd_path}: not a CRD with a {API_VERSION} schema")
    # OpenAPI v3.0's schema objects are JSON Schema draft 4's, less some keywords.
    return jsonschema.Draft4Validator(strict_schema(schema))


def strict_schema(schema: dict) -> dict:
    """The CRD schema made checkable by jsonschema, and strict. `x-kubernetes-*` keys are
    dropped (jsonschema does not know them; the CEL rules in x-kubernetes-validations go
    unchecked) after reading the three that change what is valid:
    - int-or-string (resource quantities, ports): an integer or a string, whatever `type` says;
    - preserve-unknown-fields: the object stays open;
    - every other object that lists its properties is closed, so a misspelt field is an error
      (the API server would prune it without a word).
    `nullable: true` (OpenAPI's, not JSON Schema's) becomes an explicit null type. Walked by
    structure, never by key name, so a field called `type` or `properties` stays a field."""
    out = {k: v for k, v in schema.items() if not k.startswith("x-kubernetes-") and k != "nullable"}
    if "properties" in out:
        out["properties"] = {name: strict_schema(s) for name, s in out["properties"].items()}
        if not schema.get("x-kubernetes-preserve-unknown-fields") and "additionalProperties" not in out:
            out["additionalProperties"] = False
    for key in ("items", "additionalProperties", "not"):
        if isinstance(out.get(key), dict):
            out[key] = strict_schema(out[key])
    for key in ("anyOf", "allOf", "oneOf"):
        if key in out:
            out[key] = [strict_schema(s) for s in out[key]]
    if schema.get("x-kubernetes-int-or-string"):
        out.pop("type", None)
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    if schema.get("nullable") and isinstance(out.get("type"), str):
        out["type"] = [out["type"], "null"]
    return out


def _explain(error) -> list[str]:
    """jsonschema's error as what to fix, at the field's path."""
    where, kind, instance, expected = list(error.absolute_path), error.validator, error.instance, error.validator_value
    if kind == "additionalProperties" and isinstance(instance, dict):
        known = list(error.schema.get("properties", {}))
        return [f"{_path(where + [k])}: unknown field{_did_you_mean(k, known)}"
                for k in instance if k not in known]
    if kind == "required" and isinstance(instance, dict):
        return [f"{_path(where + [k])}: required field missing" for k in expected if k not in instance]
    if kind == "type":
        types = " or ".join([expected] if isinstance(expected, str) else expected)
        hint = " (quote it)" if "string" in types and isinstance(instance, (int, float, bool)) else ""
        return [f"{_path(where)}: expected {types}, got {_json_type(instance)}{hint}"]
    if kind == "anyOf" and all("type" in s for s in expected):
        types = " or ".join(s["type"] for s in expected)
        return [f"{_path(where)}: expected {types}, got {_json_type(instance)}"]
    if kind == "enum":
        return [f"{_path(where)}: {instance!r} is not one of {', '.join(map(str, expected))}"]
    if kind == "pattern":
        return [f"{_path(where)}: {instance!r} does not match {expected}"]
    return [f"{_path(where)}: {error.message}"]


def _did_you_mean(name: str, known: list[str]) -> str:
    close = difflib.get_close_matches(name, known, n=1)
    return f"; did you mean {close[0]!r}?" if close else ""


def _path(parts: list) -> str:
    out = ""
    for p in parts:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out or "the document"


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    return {bool: "boolean", int: "integer", float: "number", str: "string", list: "array",
            dict: "object"}.get(type(value), type(value).__name__)


# --- what the schema cannot say -----------------------------------------------------------


def _d(value: Any) -> dict:
    """`value` if it is a mapping, else {}: without the schema, a manifest's shape is not
    guaranteed, and a wrong one is the schema's to report, not a crash here."""
    return value if isinstance(value, dict) else {}


def _l(value: Any) -> list:
    return value if isinstance(value, list) else []


def _name_problems(doc: dict) -> list[str]:
    """KubeRay names the head Service and the pods after the object: a DNS-1035 label."""
    name = _d(doc.get("metadata")).get("name")
    if not isinstance(name, str) or not name:
        return ["metadata.name: missing; every object needs a name"]
    if not _DNS1035.fullmatch(name) or len(name) > 63:
        return [f"metadata.name: {name!r} is not a DNS-1035 label (lower-case letters, digits and '-', "
                f"starting with a letter, at most 63 characters)"]
    return []


def _cluster_spec(doc: dict) -> tuple[str, dict | None]:
    """(path, the RayClusterSpec) of a RayCluster, or of a RayJob that makes its own cluster
    (None for one that runs on an existing cluster through spec.clusterSelector)."""
    spec = _d(doc.get("spec"))
    if doc["kind"] == "RayCluster":
        return "spec", spec
    return "spec.rayClusterSpec", (_d(spec["rayClusterSpec"]) if "rayClusterSpec" in spec else None)


def _cluster_problems(doc: dict) -> list[str]:
    where, cluster = _cluster_spec(doc)
    if cluster is None:
        if _d(_d(doc.get("spec")).get("clusterSelector")):
            return []
        return ["spec.rayClusterSpec: missing; a RayJob needs the cluster to make (rayClusterSpec) "
                "or one to run on (clusterSelector)"]
    if "headGroupSpec" not in cluster:
        return [f"{where}.headGroupSpec: missing; a Ray cluster needs a head group"]
    return []


def _pod_templates(doc: dict) -> Iterator[tuple[str, dict]]:
    """(path, pod template) of every pod the manifest makes: a RayJob's submitter, the head,
    each worker group."""
    spec = _d(doc.get("spec"))
    if doc["kind"] == "RayJob" and "submitterPodTemplate" in spec:
        yield "spec.submitterPodTemplate", _d(spec["submitterPodTemplate"])
    where, cluster = _cluster_spec(doc)
    if cluster is None:
        return
    if "headGroupSpec" in cluster:
        yield f"{where}.headGroupSpec.template", _d(_d(cluster["headGroupSpec"]).get("template"))
    for i, group in enumerate(_l(cluster.get("workerGroupSpecs"))):
        yield f"{where}.workerGroupSpecs[{i}].template", _d(_d(group).get("template"))


def _image_problems(doc: dict) -> list[str]:
    """Every container needs an image: the pod schema leaves `image` optional (for tools that
    fill it in later), but KubeRay's pods without one never start, long after the apply."""
    problems = []
    for where, template in _pod_templates(doc):
        pod = _d(template.get("spec"))
        if not _l(pod.get("containers")):
            problems.append(f"{where}.spec.containers: none; the pod needs a container running the rayzero image")
        for field in ("initContainers", "containers"):
            for i, c in enumerate(_l(pod.get(field))):
                c = _d(c)
                if not isinstance(c.get("image"), str) or not c["image"].strip():
                    problems.append(f"{where}.spec.{field}[{i}].image: container {c.get('name', '(unnamed)')!r} "
                                    f"has no image; set it to the rayzero image (built from deploy/docker/Dockerfile)")
    return problems


# --- a RayJob's entrypoint ----------------------------------------------------------------


def _submitter_env(spec: dict) -> dict[str, str | None] | None:
    """The variables Kubernetes can expand as $(NAME) in the entrypoint: KubeRay puts it in
    the submitter container's args, and the kubelet expands them from that container's env:
    the user's (submitterPodTemplate, submissionMode K8sJobMode, the default) and the few
    KubeRay adds. Literal values by name, None for one from a Secret or ConfigMap; None in all
    when the container takes whole sources (envFrom). In the HTTP and interactive modes the
    entrypoint is sent as it is: nothing expands it."""
    mode = spec.get("submissionMode", "K8sJobMode")
    if mode not in ("K8sJobMode", "SidecarMode"):
        return {}
    env: dict[str, str | None] = dict.fromkeys(_KUBERAY_SUBMITTER_ENV)
    containers = _l(_d(_d(spec.get("submitterPodTemplate")).get("spec")).get("containers"))
    submitter = _d(containers[0]) if containers and mode == "K8sJobMode" else {}
    if _l(submitter.get("envFrom")):
        return None
    for var in _l(submitter.get("env")):
        var = _d(var)
        if isinstance(var.get("name"), str):
            env[var["name"]] = var["value"] if isinstance(var.get("value"), str) else None
    return env


def expand_kube_vars(text: str, env: dict[str, str | None] | None = None) -> tuple[str, list[str]]:
    """`text` with Kubernetes' $(NAME) expansions done as far as a manifest tells: a literal
    value where `env` has one, else the placeholder `NAME` (a string that passes for the
    value, which only the cluster knows); `$$` is a literal `$`. Also the names `env` does
    not define (`env` None: every name may be defined)."""
    undefined: list[str] = []

    def one(m: re.Match) -> str:
        if m.group(1) == "$":
            return "$"
        name = m.group(2)
        if env is not None and name not in env:
            undefined.append(name)
        value = env.get(name) if env else None
        return name if value is None else value

    return _KUBE_VAR.sub(one, text), list(dict.fromkeys(undefined))


def train_argv(entrypoint: str, env: dict[str, str | None] | None = None) -> list[str]:
    """The arguments of the `rayzero train ...` command in `entrypoint`, starting with
    "train", as `rayzero` would get them (leading VAR=value assignments skipped, $(NAME)
    expanded as in `expand_kube_vars`). DeployError where it is not one such command."""
    text, _ = expand_kube_vars(entrypoint, env)
    lexer = shlex.shlex(text, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    try:
        words = list(lexer)
    except ValueError as e:  # an unclosed quote
        raise DeployError(f"cannot be split into words: {e}") from None
    if any(w and set(w) <= _SHELL_OPERATORS for w in words):
        raise DeployError("holds shell operators (;, &&, |, ...): the check takes one `rayzero train ...` "
                          "command; put what else the job needs into the image")
    while words and _ENV_ASSIGNMENT.match(words[0]):
        words = words[1:]
    if len(words) < 2 or Path(words[0]).name != "rayzero" or words[1] != "train":
        raise DeployError(f"expected a `rayzero train ...` command, got {entrypoint.strip()[:60]!r}")
    return words[1:]


def _entrypoint_problems(doc: dict, workdir: Path) -> list[str]:
    spec = _d(doc.get("spec"))
    entrypoint = spec.get("entrypoint")
    if not isinstance(entrypoint, str) or not entrypoint.strip():
        return ["spec.entrypoint: missing; set it to the training command, e.g. "
                "`rayzero train --config examples/configs/gpu.yaml cluster.address=auto`"]
    env = _submitter_env(spec)
    _, undefined = expand_kube_vars(entrypoint, env)
    problems = [f"spec.entrypoint: $({name}) is not in the submitter's env: Kubernetes leaves it as it is "
                f"and the submitter's shell runs it as a command; define {name} in "
                f"spec.submitterPodTemplate.spec.containers[0].env (submissionMode K8sJobMode)"
                for name in undefined]
    try:
        args = _parse_train(train_argv(entrypoint, env))
        if args.dry_run:
            return problems + ["spec.entrypoint: has --dry-run: the job would print the plan and train nothing"]
        cfg, p = dry_run(args.config, args.overrides, workdir)
    except DeployError as e:
        return problems + [f"spec.entrypoint: {line}" for line in str(e).splitlines()]
    if p["model"]["note"]:
        problems.append(Note(f"spec.entrypoint: the model is not checked: {p['model']['note']}"))
    where, cluster = _cluster_spec(doc)
    return problems + ([] if cluster is None else _gpu_problems(cfg, where, cluster))


class Note(str):
    """Something the check could not look at: said, but not a problem."""


def _parse_train(argv: list[str]):
    """`argv` parsed by the `rayzero` command's own parser, so that the check and the job
    agree on what an option means; its usage error becomes a DeployError."""
    from rayzero.jobs.commands import parse_args

    out = io.StringIO()
    try:
        with contextlib.redirect_stderr(out), contextlib.redirect_stdout(out):
            return parse_args(argv)
    except SystemExit:
        last = (out.getvalue().strip().splitlines() or ["not a valid command"])[-1]
        raise DeployError(f"`rayzero train` rejects it: {last.removeprefix('rayzero: error: ')}") from None


def dry_run(config: str | None, overrides: list[str], workdir: str | Path = "."):
    """What `rayzero train --dry-run` does with these arguments, in-process: (config, plan).
    A relative `config` resolves against `workdir`. DeployError with rayzero's own message,
    one problem per line of it."""
    from rayzero.config import ConfigError, load_config
    from rayzero.jobs.plan import plan

    path = None
    if config:
        path = Path(config) if Path(config).is_absolute() else Path(workdir) / config
        if not path.is_file():
            raise DeployError(f"--config {config}: no such file under {Path(workdir).resolve()} (the "
                              f"image has the repository root at /app: check from there, or pass --workdir)")
    try:
        cfg = load_config(path, overrides)
        model_path, read_model = cfg.model.path, True
        if model_path and "://" not in model_path:  # a path in the image: resolve it as the job will
            local = Path(model_path) if Path(model_path).is_absolute() else Path(workdir) / model_path
            read_model = local.exists()  # else on a volume of the cluster's, say
            cfg = cfg.override(f"model.path={local}") if read_model else cfg
        return cfg, plan(cfg, read_model=read_model, local=False, job=True)  # a job runs on its cluster
    except ConfigError as e:
        header, *items = [line.strip() for line in str(e).splitlines()]
        items = [i for i in items if i != header]  # "invalid config:" heads the list of keys
        raise DeployError("\n".join(items) if items else header) from None


def _gpu_problems(cfg, where: str, cluster: dict) -> list[str]:
    """A GPU run needs a GPU per rank (down to cluster.min_workers if elastic), or it waits
    for placement and fails after cluster.placement_timeout_s, with the GPUs it did get idle."""
    have = gpu_capacity(cluster)
    need = cfg.cluster.min_workers or cfg.cluster.num_workers
    if not cfg.cluster.use_gpu or have is None or have >= need:
        return []
    return [f"spec.entrypoint: cluster.use_gpu with {need} ranks needs {need} GPUs, but {where} offers at most "
            f"{have} ({GPU} limits x replicas); raise the GPU worker group's replicas or lower "
            f"cluster.num_workers"]


def gpu_capacity(cluster: dict) -> int | None:
    """GPUs Ray sees at most in this cluster: per group, rayStartParams num-gpus or else the
    Ray container's `nvidia.com/gpu` limit, times its pods (maxReplicas when autoscaling,
    else replicas) and hosts. None where a count is not a plain number."""
    autoscaling = cluster.get("enableInTreeAutoscaling") is True
    head = _d(cluster.get("headGroupSpec"))
    groups = [(head, 1)] + [(_d(g), _pods(_d(g), autoscaling)) for g in _l(cluster.get("workerGroupSpecs"))]
    total = 0
    for group, pods in groups:
        containers = _l(_d(_d(group.get("template")).get("spec")).get("containers"))
        limit = _d(_d(_d(containers[0] if containers else {}).get("resources")).get("limits")).get(GPU, 0)
        per_pod = _d(group.get("rayStartParams")).get("num-gpus", limit)
        if pods is None or not str(per_pod).isdigit():
            return None
        total += int(per_pod) * pods
    return total


def _pods(group: dict, autoscaling: bool) -> int | None:
    count = group.get("maxReplicas") if autoscaling else group.get("replicas", group.get("minReplicas", 0))
    hosts = group.get("numOfHosts", 1)
    return count * hosts if isinstance(count, int) and isinstance(hosts, int) else None
