"""deploy/kuberay/: the manifests pass `rayzero deploy check`, strictly against KubeRay's CRDs,
and the check names what to fix in a broken one."""

from pathlib import Path

import jsonschema
import pytest
import yaml

from rayzero.config import ConfigError, load_config
from rayzero.jobs.deploy import CRDS_ENV, DeployError, check_manifest, crds_folder, strict_schema, train_argv
from tests.conftest import cli_in_process

ROOT = Path(__file__).resolve().parents[2]
CRDS = ROOT.parent / "shared/kuberay/crds"
MANIFESTS = sorted((ROOT / "deploy/kuberay").glob("*.yaml"))

needs_crds = pytest.mark.skipif(
    not CRDS.is_dir(), reason=f"{CRDS} is absent: the KubeRay CRDs sit beside the project, at ../shared/kuberay/crds")


def load(name: str) -> dict:
    return yaml.safe_load((ROOT / "deploy/kuberay" / name).read_text())


def write(tmp_path, doc: dict) -> Path:
    path = tmp_path / "manifest.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def head_container(job: dict) -> dict:
    return job["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]["containers"][0]


def worker_group(job: dict) -> dict:
    return job["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]


@pytest.fixture(autouse=True)
def no_crds_from_env(monkeypatch):
    """Each test says which CRDs it validates against; none come from the caller's env."""
    monkeypatch.delenv(CRDS_ENV, raising=False)


def test_the_project_has_both_manifests():
    assert [p.name for p in MANIFESTS] == ["raycluster.yaml", "rayjob.yaml"]
    assert {yaml.safe_load(p.read_text())["kind"] for p in MANIFESTS} == {"RayCluster", "RayJob"}


@needs_crds
@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_each_manifest_passes_the_strict_check(path):
    assert check_manifest(path, CRDS, workdir=ROOT) == []


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_each_manifest_passes_without_crds_too(path):
    assert check_manifest(path, None, workdir=ROOT) == []


def test_the_rayjob_is_what_the_deployment_needs():
    job = load("rayjob.yaml")
    spec = job["spec"]
    assert spec["shutdownAfterJobFinishes"] is True and spec["ttlSecondsAfterFinished"] > 0
    head, gpu = head_container(job), worker_group(job)
    assert "nvidia.com/gpu" not in head["resources"].get("limits", {})
    assert gpu["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert gpu["replicas"] == 2
    secret_keys = {v["name"]: v["valueFrom"]["secretKeyRef"] for v in head["env"]}
    for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_ENDPOINT_URL", "MLFLOW_TRACKING_URI"):
        assert secret_keys[key] == {"name": "rayzero-secrets", "key": key}


@needs_crds
def test_a_misspelt_field_fails_naming_its_path(tmp_path):
    job = load("rayjob.yaml")
    head_container(job)["imagee"] = head_container(job)["image"]
    problems = check_manifest(write(tmp_path, job), CRDS, workdir=ROOT)
    assert ("spec.rayClusterSpec.headGroupSpec.template.spec.containers[0].imagee: unknown field; "
            "did you mean 'image'?") in problems


@needs_crds
def test_quantities_take_integers_and_strings_but_ray_start_params_only_strings(tmp_path):
    job = load("rayjob.yaml")
    head_container(job)["resources"]["limits"].update(cpu=2, memory="8Gi")
    worker_group(job)["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] = "1"
    assert check_manifest(write(tmp_path, job), CRDS, workdir=ROOT) == []
    job["spec"]["rayClusterSpec"]["headGroupSpec"]["rayStartParams"]["num-cpus"] = 0
    assert check_manifest(write(tmp_path, job), CRDS, workdir=ROOT) == [
        "spec.rayClusterSpec.headGroupSpec.rayStartParams.num-cpus: expected string, got integer (quote it)"]


@needs_crds
def test_a_missing_required_field_is_named(tmp_path):
    cluster = load("raycluster.yaml")
    del cluster["spec"]["workerGroupSpecs"][0]["groupName"]
    assert check_manifest(write(tmp_path, cluster), CRDS, workdir=ROOT) == [
        "spec.workerGroupSpecs[0].groupName: required field missing"]


def test_a_missing_image_names_the_container(tmp_path):
    job = load("rayjob.yaml")
    del worker_group(job)["template"]["spec"]["containers"][0]["image"]
    [problem] = check_manifest(write(tmp_path, job), None, workdir=ROOT)
    assert problem.startswith("spec.rayClusterSpec.workerGroupSpecs[0].template.spec.containers[0].image: "
                              "container 'ray-worker' has no image")


def test_a_missing_entrypoint_fails(tmp_path):
    job = load("rayjob.yaml")
    del job["spec"]["entrypoint"]
    [problem] = check_manifest(write(tmp_path, job), None, workdir=ROOT)
    assert problem.startswith("spec.entrypoint: missing")


def test_a_fine_tuning_entrypoint_passes_with_its_model_where_the_cluster_has_it(tmp_path):
    """An HF model on the cluster's S3 (or a volume): checked as far as this machine can see,
    with a note for the model itself; a model directory in the image is read and checked."""
    from rayzero.jobs.deploy import Note

    job = load("rayjob.yaml")
    base = ("rayzero train --config examples/configs/finetune_llama.yaml cluster.address=auto "
            "cluster.use_gpu=true checkpoint.s3_endpoint=$(AWS_ENDPOINT_URL) checkpoint.retries=0 ")
    job["spec"]["entrypoint"] = base + "model.path=s3://models/Llama-3.2-1B"
    problems = check_manifest(write(tmp_path, job), None, workdir=ROOT)
    assert len(problems) == 1 and isinstance(problems[0], Note), problems
    assert problems[0].startswith("spec.entrypoint: the model is not checked: not read from here: model.path: "
                                  "cannot read s3://models/Llama-3.2-1B")
    job["spec"]["entrypoint"] = base + "model.path=/mnt/models/llama"
    assert check_manifest(write(tmp_path, job), None, workdir=ROOT) == [
        "spec.entrypoint: the model is not checked: not read from here: model.path /mnt/models/llama is on the "
        "cluster's machines"]
    from tests.models import save_hf_model

    save_hf_model("llama", tmp_path / "image" / "models" / "tiny")
    (tmp_path / "image" / "examples").symlink_to(ROOT / "examples")
    job["spec"]["entrypoint"] = base + "model.path=models/tiny"  # relative: under /app, the workdir
    assert check_manifest(write(tmp_path, job), None, workdir=tmp_path / "image") == []
    job["spec"]["entrypoint"] = base + "model.path=models/tiny sharding.fsdp_units=Block"
    assert check_manifest(write(tmp_path, job), None, workdir=tmp_path / "image") == [
        "spec.entrypoint: sharding.fsdp_units: no module of LlamaForCausalLM has class Block; its module classes "
        "are Embedding, Linear, LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP, LlamaModel, "
        "LlamaRMSNorm, LlamaRotaryEmbedding, ModuleList, SiLUActivation"]


def test_a_bad_override_fails_with_rayzeros_own_config_message(tmp_path):
    job = load("rayjob.yaml")
    job["spec"]["entrypoint"] += " sharding.strategy=zero9"
    with pytest.raises(ConfigError) as own:
        load_config(None, ["sharding.strategy=zero9"])
    expected = next(line.strip() for line in str(own.value).splitlines() if "sharding.strategy" in line)
    assert check_manifest(write(tmp_path, job), None, workdir=ROOT) == [f"spec.entrypoint: {expected}"]


def test_an_entrypoint_that_is_not_rayzero_train_fails(tmp_path):
    job = load("rayjob.yaml")
    for entrypoint, says in (("python train.py", "expected a `rayzero train ...` command"),
                             ("cd /app && rayzero train", "holds shell operators"),
                             ("rayzero train --epochs 3", "`rayzero train` rejects it: unrecognized arguments"),
                             ("rayzero train --config missing.yaml", "--config missing.yaml: no such file under")):
        job["spec"]["entrypoint"] = entrypoint
        [problem] = check_manifest(write(tmp_path, job), None, workdir=ROOT)
        assert problem.startswith("spec.entrypoint: ") and says in problem, problem


def test_a_kubernetes_variable_the_submitter_lacks_fails(tmp_path):
    job = load("rayjob.yaml")
    job["spec"]["entrypoint"] += " tracking.run_name=$(RUN_NAME)"
    [problem] = check_manifest(write(tmp_path, job), None, workdir=ROOT)
    assert problem.startswith("spec.entrypoint: $(RUN_NAME) is not in the submitter's env")
    del job["spec"]["submitterPodTemplate"]  # the default submitter defines none
    assert any("$(AWS_ENDPOINT_URL)" in p for p in check_manifest(write(tmp_path, job), None, workdir=ROOT))


def test_more_ranks_than_gpus_fails(tmp_path):
    job = load("rayjob.yaml")
    worker_group(job).update(replicas=1, minReplicas=1, maxReplicas=1)
    [problem] = check_manifest(write(tmp_path, job), None, workdir=ROOT)
    assert "needs 2 GPUs, but spec.rayClusterSpec offers at most 1" in problem


def test_wrong_kind_or_api_version_fails(tmp_path):
    job = load("rayjob.yaml")
    assert check_manifest(write(tmp_path, {**job, "apiVersion": "ray.io/v1alpha1"}), None, ROOT) == [
        "apiVersion: 'ray.io/v1alpha1'; expected ray.io/v1 (KubeRay's current API, the one checked here)"]
    assert check_manifest(write(tmp_path, {**job, "kind": "RayService"}), None, ROOT)[0].startswith(
        "kind: 'RayService' is not one this check knows")


def test_the_strict_schema_closes_objects_keeps_open_ones_and_takes_int_or_string():
    schema = strict_schema({"type": "object", "properties": {
        "quantity": {"anyOf": [{"type": "integer"}, {"type": "string"}], "x-kubernetes-int-or-string": True},
        "free": {"type": "object", "x-kubernetes-preserve-unknown-fields": True, "properties": {"a": {"type": "string"}}},
        "labels": {"type": "object", "additionalProperties": {"type": "string"}},
    }})
    valid = jsonschema.Draft4Validator(schema).is_valid
    assert valid({"quantity": 2}) and valid({"quantity": "500m"}) and not valid({"quantity": 0.5})
    assert valid({"free": {"a": "x", "anything": 1}}) and valid({"labels": {"any": "x"}})
    assert not valid({"quantiy": 2})
    assert "x-kubernetes-int-or-string" not in str(schema)


def test_crds_come_from_the_option_then_the_env_and_a_named_folder_must_exist(tmp_path, monkeypatch):
    assert crds_folder(None) is None
    monkeypatch.setenv(CRDS_ENV, str(tmp_path))
    assert crds_folder(None) == tmp_path
    with pytest.raises(DeployError, match="--crds .*: no such folder"):
        crds_folder(tmp_path / "absent")
    with pytest.raises(DeployError, match="ray.io_rayjobs.yaml"):  # a folder without the CRDs
        check_manifest(ROOT / "deploy/kuberay/rayjob.yaml", tmp_path, workdir=ROOT)


def rayzero(capsys, monkeypatch, *argv: str) -> tuple[int, str, str]:
    """`rayzero ARGV…` by its `main`, in this process, from the repository root."""
    return cli_in_process(capsys, monkeypatch, ROOT, *argv)


@needs_crds
def test_the_cli_checks_the_project_manifests(capsys, monkeypatch):
    code, out, err = rayzero(capsys, monkeypatch, "deploy", "check",
                             *[str(p.relative_to(ROOT)) for p in MANIFESTS], "--crds", str(CRDS))
    assert code == 0, err
    assert out.splitlines() == [f"{p.relative_to(ROOT)}: ok" for p in MANIFESTS]


@needs_crds
def test_the_cli_reports_each_problem_and_exits_2(tmp_path, capsys, monkeypatch):
    """The exit code and stderr a shell sees (the entry point's own exit code and stderr:
    tests/e2e/test_bad_input.py::test_the_entry_point_exits_2_with_the_message_on_stderr)."""
    job = load("rayjob.yaml")
    head_container(job)["imagee"] = head_container(job).pop("image")
    path = write(tmp_path, job)
    code, out, err = rayzero(capsys, monkeypatch, "deploy", "check", str(path), "--crds", str(CRDS))
    assert code == 2 and out == ""
    lines = err.splitlines()
    assert len(lines) == 2 and all(line.startswith(f"rayzero: error: {path}: spec.rayClusterSpec.") for line in lines)
    assert "containers[0].imagee: unknown field" in lines[0] and "has no image" in lines[1]


def test_the_cli_says_when_the_schema_is_not_checked(capsys, monkeypatch):
    monkeypatch.delenv(CRDS_ENV, raising=False)
    code, out, err = rayzero(capsys, monkeypatch, "deploy", "check", "deploy/kuberay/raycluster.yaml")
    assert code == 0
    assert out == "deploy/kuberay/raycluster.yaml: ok (schema not checked)\n"
    assert "the schema is not checked" in err


@pytest.mark.parametrize("path", [p for p in MANIFESTS if "entrypoint" in yaml.safe_load(p.read_text())["spec"]],
                         ids=lambda p: p.name)
def test_each_entrypoint_passes_rayzero_train_dry_run(path, capsys, monkeypatch):
    """The entrypoint as the job would run it, from the repository root (the image's /app),
    with --dry-run: $(VARS) from the Secret stand in as their names."""
    argv = train_argv(yaml.safe_load(path.read_text())["spec"]["entrypoint"])
    code, out, err = rayzero(capsys, monkeypatch, *argv, "--dry-run")
    assert code == 0, err
    assert out.startswith("plan (dry run: nothing started)")
    assert "2 ranks of 4 CPU, 1 GPU each, on auto" in out
