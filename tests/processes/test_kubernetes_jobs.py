"""`distsetup job`'s manifests run as their engines run them, on this machine (no cluster is reachable): every pod of
2 "nodes" x 2 processes runs its container's own command under the engine's variables, with the engine's DNS names
mapped to 127.0.0.1 and SkyPilot's node addresses a name-less one, 127.0.0.2 (tests/support/engine_pods.py says
how, and cites the engines' code). The four form one world,
train and checkpoint; SIGTERM to one pod's first process, as the kubelet sends it, makes every pod checkpoint the same
step and exit with the status the engine restarts on; the job written again for one node resumes from it."""

import json
import os
import re
import signal
import time

import pytest
import yaml
from engine_pods import PodRunner, read_manifest
from repo import free_port
from train_runs import BIN, MODEL

from distsetup.jobs.spec import RESTART_STATUS

PATH = f"{BIN}:{os.environ['PATH']}"


def project(tmp_path, max_steps: int, checkpoint_interval: int):
    root = tmp_path / "project"
    root.mkdir()
    config = {
        "model": MODEL,
        "data": {"num_samples": 4096},
        "training": {
            "seed": 3,
            "micro_batch_size": 2,
            "max_steps": max_steps,
            "checkpoint_interval": checkpoint_interval,
            "warmup_steps": 1,
            "eval_interval": None,
            "output_dir": "runs/demo",  # relative: in the shared volume the pods work in
        },
        "distributed": {"backend": "ddp", "timeout_minutes": 2},
    }
    (root / "config.yaml").write_text(yaml.safe_dump(config))
    return root


SOFTWARE_CHECK = "python3 -c 'import torch, distsetup' && echo distsetup: setup done"
# CPU "nodes": Kubernetes pods that ask for no GPU, SkyPilot nodes of no accelerator
CPU_NODES = {  # and the setup a SkyPilot node runs first: here, what checks that the node has the run's software
    "skypilot": ("--accelerator", "none", "--checkpoint_bucket", "s3://bucket/runs", "--setup", SOFTWARE_CHECK)
}
KUBERNETES_CPU_PODS = ("--gpu_resource", "none", "--image", "distsetup-test:1")


def write_job(run_cli, root, target: str, nodes: int, monkeypatch, port: int | None = None) -> list[dict]:
    """The job's manifest; `port`: the master port written into a SkyPilot task (whose nodes here share this
    machine's network, where SkyPilot's default, 29500, may be another test's)."""
    monkeypatch.chdir(root)
    output = "sky/task.yaml" if target == "skypilot" else f"k8s/{target}.yaml"
    written_port = ("--master_port", port) if target == "skypilot" and port is not None else ()
    result = run_cli(
        "job",
        "--target",
        target,
        "--config",
        "config.yaml",
        "--num_nodes",
        nodes,
        "--num_gpus_per_node",
        2,
        *CPU_NODES.get(target, KUBERNETES_CPU_PODS),
        *written_port,
        "--name",
        "t1",
        "--grace_seconds",
        60,
        "--checkpoint_seconds",
        20,
        "-o",
        output,
    )
    assert result.exit_code == 0, result.output
    assert run_cli("validate", output).exit_code == 0
    return read_manifest(root / output)


@pytest.mark.parametrize("target", ["jobset", "pytorchjob", "skypilot"])
def test_each_pod_of_two_nodes_joins_one_world_that_trains_and_checkpoints(run_cli, tmp_path, monkeypatch, target):
    root = project(tmp_path, max_steps=3, checkpoint_interval=3)
    port = free_port()
    documents = write_job(run_cli, root, target, 2, monkeypatch, port)
    pods = PodRunner(documents, tmp_path / "pods", port, PATH, workdir=root)
    pods.start()
    assert pods.wait(timeout=240) == [0, 0], pods.log()
    summary = json.loads((pods.work / "runs" / "demo" / "summary.json").read_text())
    assert summary["world_size"] == 4 and summary["steps"] == 3, pods.log()
    assert (pods.work / "runs" / "demo" / "checkpoints" / "step_0000003" / "COMPLETE").exists()
    log = pods.text()
    assert "node_rank 0 of 2" in log and "node_rank 1 of 2" in log
    assert log.count("distsetup: setup done") == (2 if target == "skypilot" else 0)  # on each node, before its run


def test_sigterm_to_one_trainjob_pod_checkpoints_the_world_and_one_node_resumes(run_cli, tmp_path, monkeypatch):
    root = project(tmp_path, max_steps=400, checkpoint_interval=200)
    pods = PodRunner(write_job(run_cli, root, "trainjob", 2, monkeypatch), tmp_path / "pods", free_port(), PATH)
    pods.start()
    metrics = pods.work / "runs" / "demo" / "metrics.jsonl"
    deadline = time.monotonic() + 180
    while not (metrics.exists() and metrics.read_text().count("\n") >= 2):  # training is under way
        assert time.monotonic() < deadline and all(p.poll() is None for p in pods.processes), pods.log()
        time.sleep(0.2)
    os.kill(pods.first_process(1), signal.SIGTERM)  # the kubelet signals the container's first process only
    assert pods.wait(timeout=120) == [RESTART_STATUS, RESTART_STATUS], pods.log()
    log = pods.text()
    preempted = re.findall(r"preempted: checkpoint at step (\d+)", log)  # after the progress bar's \r
    assert len(preempted) == 1, pods.log()  # said by rank 0, in node 0's pod
    step = int(preempted[0])
    checkpoints = pods.work / "runs" / "demo" / "checkpoints"
    assert 1 <= step < 400 and (checkpoints / f"step_{step:07d}" / "COMPLETE").exists(), pods.log()
    assert sorted(path.name for path in checkpoints.glob("step_*")) == [f"step_{step:07d}"]

    # The restarted job, on one node this time, in the same volume
    config = root / "config.yaml"
    config.write_text(config.read_text().replace("max_steps: 400", f"max_steps: {step + 2}"))
    again = PodRunner(write_job(run_cli, root, "trainjob", 1, monkeypatch), tmp_path / "pods", free_port(), PATH)
    again.start()
    assert again.wait(timeout=240) == [0], again.log()
    resumed = re.findall(r"resumed from (\S+) \(step (\d+)\)", again.text())
    assert resumed == [(f"/workspace/runs/demo/checkpoints/step_{step:07d}", str(step))], again.log()
    summary = json.loads((pods.work / "runs" / "demo" / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["steps"] == step + 2


def test_a_relative_script_is_found_in_the_image_and_runs_in_the_shared_volume(run_cli, tmp_path, monkeypatch):
    """--script train.py on Kubernetes: the file in the folder the pod starts in (the image's), run in the shared
    volume, where what it writes outlives the pod, with the arguments given after `--` to distsetup job."""
    root = project(tmp_path, max_steps=1, checkpoint_interval=1)
    (root / "train.py").write_text(
        "import os, pathlib, sys\n"
        "pathlib.Path(f\"ran-{os.environ['RANK']}\").write_text(os.getcwd() + ' ' + sys.argv[-1])\n"
    )
    monkeypatch.chdir(root)
    args = ["--config", "config.yaml", "--num_nodes", 1, "--num_gpus_per_node", 2, *KUBERNETES_CPU_PODS, "--name", "t1"]
    job = ["job", "--target", "jobset", *args, "--script", "train.py", "-o", "k8s/jobset.yaml"]
    result = run_cli(*job, "--", "--note", "a b$c")  # the program's own arguments
    assert result.exit_code == 0, result.output
    pods = PodRunner(read_manifest(root / "k8s" / "jobset.yaml"), tmp_path / "pods", free_port(), PATH, workdir=root)
    pods.start()
    assert pods.wait(timeout=120) == [0], pods.log()
    ran = {path.name: path.read_text() for path in pods.work.glob("ran-*")}
    assert ran == {"ran-0": "/workspace a b$c", "ran-1": "/workspace a b$c"}, pods.log()


def test_the_trainer_finds_the_images_code_and_data_and_writes_in_the_shared_volume(run_cli, tmp_path, monkeypatch):
    """A run config naming a model.builder module and data files by paths relative to the image's folder (where the
    pod starts, as `python -m distsetup.train` runs from a checkout): the trainer runs there, its output_dir on the
    shared volume (its checkpoints outlive the pod). It entered the volume first, and found neither."""
    root = project(tmp_path, max_steps=2, checkpoint_interval=2)
    (root / "mymodel.py").write_text(
        "from distsetup.training.model.gpt import GPT\n\ndef build():\n    return GPT(256, 32, 2, 2, 32, 0.0)\n"
    )
    (root / "data").mkdir()
    (root / "data" / "train.txt").write_text("the image holds the data. " * 400)
    config = yaml.safe_load((root / "config.yaml").read_text())
    config["model"] = {"type": "python", "builder": "mymodel:build", "block_size": 32}
    config["data"] = {"type": "files", "paths": ["data/train.txt"]}
    (root / "config.yaml").write_text(yaml.safe_dump(config))
    monkeypatch.chdir(root)
    args = ["--config", "config.yaml", "--num_nodes", 1, "--num_gpus_per_node", 2, *KUBERNETES_CPU_PODS, "--name", "t1"]
    result = run_cli("job", "--target", "jobset", *args, "-o", "k8s/jobset.yaml")
    assert result.exit_code == 0, result.output
    pods = PodRunner(read_manifest(root / "k8s" / "jobset.yaml"), tmp_path / "pods", free_port(), PATH, workdir=root)
    pods.start()
    assert pods.wait(timeout=120) == [0], pods.log()
    summary = json.loads((pods.work / "runs" / "demo" / "summary.json").read_text())
    assert summary["steps"] == 2 and summary["world_size"] == 2, pods.log()
    assert (pods.work / "runs" / "demo" / "checkpoints" / "step_0000002" / "COMPLETE").exists()
    assert not (root / "runs").exists()  # nothing of the run's in the image's folder
