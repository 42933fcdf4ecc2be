"""Pods of a `distsetup job` manifest, run on this machine as the engine would run them: each pod's environment as
the engine's controller makes it, its files mounted where the pod has them, and the container's own command as its
first process.

Each pod runs in PID, mount and UTS namespaces of its own (`unshare`, as root): the container's command is its PID 1,
its host name is the pod's, the ConfigMap's files are bound at their mount path, the shared volume (one folder for
every pod) at its own, /tmp is the pod's own, and an /etc/hosts of the pod's own maps the engine's DNS names to
127.0.0.1. Nothing of the host is changed but the empty mount points, made if missing and removed after.

The variables, from the engines' code:
- Kubernetes' Indexed Job: JOB_COMPLETION_INDEX, the pod's index (pkg/controller/job/indexed_job_utils.go,
  addCompletionIndexEnvVariable).
- JobSet: pods named <jobset>-<replicated job>-<job index>-<pod index>, in the headless service <jobset>
  (pkg/controllers/jobset_controller.go); the rest is the spec's own env.
- Kubeflow Trainer v2.3.0's torch plugin (pkg/runtime/framework/plugins/torch/torch.go, 145-166): PET_NNODES,
  PET_NPROC_PER_NODE, PET_NODE_RANK (the completion index, by a fieldRef to the pod's annotation),
  PET_MASTER_ADDR=<trainjob>-node-0-0.<trainjob>, PET_MASTER_PORT=29500 (pkg/constants/constants.go), into the
  container named "node" only.
- SkyPilot 0.14 (sky/skylet/constants.py; sky/backends/task_codegen.py): SKYPILOT_NODE_IPS (one per line, the
  head first), SKYPILOT_NODE_RANK, SKYPILOT_NUM_NODES, SKYPILOT_NUM_GPUS_PER_NODE; `run` runs in the workdir's copy.
- training-operator v1.9.4 (pkg/controller.v1/pytorch/envvar.go, 43-127; master.go): PYTHONUNBUFFERED=1, MASTER_ADDR
  and PET_MASTER_ADDR <job>-master-0, MASTER_PORT and PET_MASTER_PORT (the Master's port, 23456 by default),
  WORLD_SIZE = replicas x nprocPerNode, RANK and PET_NODE_RANK (the Master 0, Worker i i + 1), PET_NPROC_PER_NODE
  (nprocPerNode), PET_NNODES (the replicas).

The master port is a free one here rather than the engines' fixed ones (the entry point reads whichever it is given).
"""

import os
import shlex
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import yaml
from process_tree import process_tree

from distsetup.jobs.engines import jobset_master_address, jobset_pod_host, pytorchjob_master_address


@dataclass
class Pod:
    host: str
    environment: dict[str, str]
    command: list[str]


def read_manifest(path: Path) -> list[dict]:
    return list(yaml.safe_load_all(path.read_text()))


def _one(objects: list[dict], kind: str) -> dict:
    (found,) = [o for o in objects if o["kind"] == kind]
    return found


def _container_env(container: dict) -> dict[str, str]:
    return {variable["name"]: variable["value"] for variable in container.get("env", [])}


def pods(objects: list[dict], port: int) -> list[Pod]:
    """Every pod of the manifest's engine object (or node of a SkyPilot task), with the variables its engine gives
    it. `port`: the master port (the engines' fixed ports may be taken on a shared machine; the entry point reads
    whichever the engine sets)."""
    if "run" in objects[0]:
        task = objects[0]
        nodes = task["num_nodes"]
        env = {
            # an address of this machine without a name (127.0.0.1 has one in /etc/hosts), as a cloud VM's
            # private address may be: it needs no resolving (getent looked it up in reverse, and waited 300 s)
            "SKYPILOT_NODE_IPS": "\n".join(["127.0.0.2"] * nodes),
            "SKYPILOT_NUM_NODES": str(nodes),
            "SKYPILOT_NUM_GPUS_PER_NODE": task["resources"].get("accelerators", ":0").rsplit(":", 1)[1],
        }
        # SkyPilot runs the task's setup on each node, then its run
        command = ["bash", "-c", "bash setup.sh && exec bash run.sh"] if "setup" in task else ["bash", "run.sh"]
        return [Pod(f"node{i}", env | {"SKYPILOT_NODE_RANK": str(i)}, command) for i in range(nodes)]
    if any(o["kind"] == "JobSet" for o in objects):
        jobset = _one(objects, "JobSet")
        name, job = jobset["metadata"]["name"], jobset["spec"]["replicatedJobs"][0]
        container = job["template"]["spec"]["template"]["spec"]["containers"][0]
        env = _container_env(container) | {"MASTER_PORT": str(port)}
        return [
            Pod(jobset_pod_host(name, i), env | {"JOB_COMPLETION_INDEX": str(i)}, container["command"])
            for i in range(job["template"]["spec"]["parallelism"])
        ]
    if any(o["kind"] == "TrainJob" for o in objects):
        trainjob, runtime = _one(objects, "TrainJob"), _one(objects, "TrainingRuntime")
        name, trainer = trainjob["metadata"]["name"], trainjob["spec"]["trainer"]
        job = runtime["spec"]["template"]["spec"]["replicatedJobs"][0]
        container = job["template"]["spec"]["template"]["spec"]["containers"][0]
        nodes = trainer["numNodes"]
        env = _container_env(container) | {
            "PET_NNODES": str(nodes),
            "PET_NPROC_PER_NODE": str(trainer["numProcPerNode"]),
            "PET_MASTER_ADDR": jobset_master_address(name),
            "PET_MASTER_PORT": str(port),
        }
        return [
            Pod(
                jobset_pod_host(name, i),
                env | {"JOB_COMPLETION_INDEX": str(i), "PET_NODE_RANK": str(i)},
                container["command"],
            )
            for i in range(nodes)
        ]
    job = _one(objects, "PyTorchJob")
    name, spec = job["metadata"]["name"], job["spec"]
    replicas = spec["pytorchReplicaSpecs"]
    roles = [("master", 0)] + [("worker", i) for i in range(replicas.get("Worker", {}).get("replicas", 0))]
    nodes = len(roles)
    found = []
    for rank, (role, index) in enumerate(roles):
        container = replicas[role.capitalize()]["template"]["spec"]["containers"][0]
        env = _container_env(container) | {
            "PYTHONUNBUFFERED": "1",
            "MASTER_ADDR": pytorchjob_master_address(name),
            "PET_MASTER_ADDR": pytorchjob_master_address(name),
            "MASTER_PORT": str(port),
            "PET_MASTER_PORT": str(port),
            "WORLD_SIZE": str(nodes * int(spec["nprocPerNode"])),
            "RANK": str(rank),
            "PET_NODE_RANK": str(rank),
            "PET_NPROC_PER_NODE": spec["nprocPerNode"],
            "PET_NNODES": str(nodes),
        }
        found.append(Pod(f"{name}-{role}-{index}", env, container["command"]))
    return found


def pod_mounts(objects: list[dict]) -> dict[str, str]:
    """{mount path: volume name} of the pods' container (the same in every pod distsetup writes)."""
    pod = _first_pod_spec(objects)
    return {mount["mountPath"]: mount["name"] for mount in pod["containers"][0]["volumeMounts"]}


def _first_pod_spec(objects: list[dict]) -> dict:
    for o in objects:
        if o["kind"] == "JobSet":
            return o["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
        if o["kind"] == "TrainingRuntime":
            return o["spec"]["template"]["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
        if o["kind"] == "PyTorchJob":
            return o["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]
    raise AssertionError("no engine object")


class PodRunner:
    """Starts the pods of a manifest in `root`: files/ (the ConfigMap's data), work/ (the shared volume). The nodes
    of a SkyPilot task run in `workdir` (the folder the task was written in, as SkyPilot copies it), with work/ as
    the bucket."""

    def __init__(self, objects: list[dict], root: Path, port: int, path: str, workdir: Path | None = None):
        self.objects, self.root, self.port, self.path = objects, root, port, path
        self.files, self.work = root / "files", root / "work"
        self.files.mkdir(parents=True, exist_ok=True)
        self.work.mkdir(parents=True, exist_ok=True)
        self.cwd = workdir
        if "run" in objects[0]:
            (workdir / "run.sh").write_text(objects[0]["run"])
            if "setup" in objects[0]:
                (workdir / "setup.sh").write_text(objects[0]["setup"])
            ((bucket, _),) = objects[0]["file_mounts"].items()
            self.binds = [(str(self.work), bucket)]
        else:
            for name, text in _one(objects, "ConfigMap")["data"].items():
                (self.files / name).write_text(text)
            sources = {"distsetup-files": self.files, "work": self.work}
            mounts = pod_mounts(objects)
            self.binds = [(str(sources[volume]), path) for path, volume in mounts.items() if volume in sources]
        self.processes: list[subprocess.Popen] = []
        self.logs: list[Path] = []
        self.mount_points: list[Path] = []

    def start(self) -> None:
        every = list(pods(self.objects, self.port))
        hosts = self.root / "hosts"
        names = " ".join(sorted({p.host for p in every} | {_fqdn(p, self.objects) for p in every}))
        hosts.write_text(f"127.0.0.1 localhost {names}\n")
        binds = self.binds
        for path in (Path(path) for _, path in binds):
            if not path.exists():
                path.mkdir(parents=True)  # the mount point, empty on the host, removed again by kill()
                self.mount_points.append(path)
        script = "".join(f"mount --bind {shlex.quote(source)} {shlex.quote(target)} && " for source, target in binds)
        script += f'mount --bind {shlex.quote(str(hosts))} /etc/hosts && hostname "$HOSTNAME" && exec "$@"'
        for index, pod in enumerate(every):
            log = self.root / f"pod{index}.log"
            tmp = self.root / f"tmp{index}"
            tmp.mkdir(exist_ok=True)
            environment = {
                "TMPDIR": str(tmp),
                "PATH": self.path,
                "HOME": os.environ.get("HOME", "/root"),
                "HOSTNAME": pod.host,
                "OMP_NUM_THREADS": "1",
                **pod.environment,
            }
            command = [
                "unshare",
                "--pid",
                "--fork",
                "--mount-proc",
                "--mount",
                "--uts",
                "--propagation",
                "private",
                "bash",
                "-c",
                script,
                "pod",
                *pod.command,
            ]
            with open(log, "w") as out:
                self.processes.append(
                    subprocess.Popen(
                        command,
                        env=environment,
                        cwd=self.cwd,
                        stdout=out,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,
                    )
                )
            self.logs.append(log)

    def first_process(self, index: int) -> int:
        """The host's pid of pod `index`'s PID 1 (unshare's child): where the kubelet's SIGTERM goes."""
        unshare = self.processes[index].pid
        deadline = time.monotonic() + 30
        while not (children := Path(f"/proc/{unshare}/task/{unshare}/children").read_text().split()):
            assert time.monotonic() < deadline, "the pod's first process did not start"
            time.sleep(0.05)
        pid = int(children[0])
        status = Path(f"/proc/{pid}/status").read_text().splitlines()
        namespaced = next(line for line in status if line.startswith("NSpid"))
        assert namespaced.split()[-1] == "1", namespaced  # PID 1 of the pod's PID namespace
        return pid

    def wait(self, timeout: float) -> list[int]:
        try:
            return [p.wait(timeout=timeout) for p in self.processes]
        finally:
            self.kill()

    def kill(self) -> None:
        """Every process of every pod (torchrun starts each rank in a session of its own: by process tree)."""
        for process in self.processes:
            for pid in process_tree(process.pid):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for process in self.processes:
            process.wait()
        for path in self.mount_points:
            path.rmdir()
        self.mount_points.clear()

    def text(self) -> str:
        """Every pod's output, whole."""
        return "\n".join(log.read_text() for log in self.logs)

    def log(self) -> str:
        """Each pod's last output, for a failure's message."""
        return "\n".join(f"--- {log.name}\n{log.read_text()[-3000:]}" for log in self.logs)


def _fqdn(pod: Pod, objects: list[dict]) -> str:
    """The name node 0 is reached by: JobSet and TrainJob pods by <host>.<subdomain>; PyTorchJob by service."""
    if "run" in objects[0] or any(o["kind"] == "PyTorchJob" for o in objects):
        return pod.host
    name = next(o["metadata"]["name"] for o in objects if o["kind"] in ("JobSet", "TrainJob"))
    return f"{pod.host}.{name}"
