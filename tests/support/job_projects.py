"""A project folder as `distsetup job`'s tests use it (a run config of a tiny model), the job written for a target,
and where its objects hold the pod."""

import yaml

TARGETS = ("trainjob", "jobset", "pytorchjob")
CONFIG = {
    "model": {"n_layer": 2, "n_head": 2, "n_embd": 32, "block_size": 32},
    "training": {"micro_batch_size": 2, "output_dir": "runs/demo"},
    "distributed": {"backend": "ddp"},
}


SKYPILOT = (
    "--accelerator",
    "H100",
    "--checkpoint_bucket",
    "s3://my-bucket/runs",
    "--setup",
    "pip install -r requirements.txt",
)


def job_project(tmp_path, monkeypatch):
    """`tmp_path` with config.yaml, made the working folder."""
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(CONFIG))
    monkeypatch.chdir(tmp_path)
    return tmp_path


def write(run_cli, target: str, *extra, nodes: int = 4):
    """`distsetup job` for `target`, 4 nodes of 8 GPUs unless told; the name and image given."""
    args = ["job", "--target", target, "--config", "config.yaml", "--num_nodes", nodes, "--num_gpus_per_node", 8]
    return run_cli(*args, "--image", "ghcr.io/me/train:1", "--name", "llm-run", *extra)


def objects(project, target: str) -> list[dict]:
    return list(yaml.safe_load_all((project / "k8s" / f"{target}.yaml").read_text()))


def engine_object(documents: list[dict]) -> dict:
    return next(d for d in documents if d["kind"] in ("JobSet", "TrainingRuntime", "PyTorchJob"))


def pod_spec(documents: list[dict]) -> dict:
    found = engine_object(documents)
    if found["kind"] == "PyTorchJob":
        return found["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]
    jobset = found["spec"]["template"]["spec"] if found["kind"] == "TrainingRuntime" else found["spec"]
    return jobset["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
