"""What `distsetup job` writes, as plain data: the world (a LaunchSpec, launched by torchrun on every node), the
engine and its image or GPU type, where checkpoints live, and the preemption contract (the grace period a node has
after SIGTERM, the time a checkpoint takes). Checked here, each problem one line naming the flag."""

from dataclasses import dataclass

from distsetup.errors import DistsetupError
from distsetup.jobs import forms
from distsetup.jobs.engines import name_problem
from distsetup.scripts.launch_plan import LaunchSpec

TARGETS = ("trainjob", "jobset", "pytorchjob", "skypilot")
DEFAULT_MAX_RESTARTS = 3
# The status every node's entry point exits with once the world stopped for preemption (or was stopped before it
# could checkpoint): the job is to be started again, and resumes. 128 and over, because the training-operator's
# ExitCode policy restarts only those (1-127 are permanent there); each engine's spec restarts on it.
RESTART_STATUS = 143
# Seconds the entry point keeps for itself after torchrun's processes stop (TORCH_ELASTIC_SHUTDOWN_TIMEOUT is the
# grace period less this), and the least that a step in flight and the stop agreement need before the checkpoint.
EXIT_MARGIN_SECONDS = 10
STOP_MARGIN_SECONDS = 20
DNS_WAIT_SECONDS = 300
# In each pod: the run config and backend file (from the ConfigMap), and the shared volume the run works in
FILES_MOUNT = "/etc/distsetup"
WORK_MOUNT = "/workspace"
# On each SkyPilot node: the bucket the run's output and checkpoints go to
BUCKET_MOUNT = "/distsetup-work"
BUCKET_SCHEMES = ("s3://", "gs://", "r2://", "cos://", "oci://", "https://")  # SkyPilot's stores (Azure: https)
# A SkyPilot accelerator's name, as its catalogs write them (H100, A100-80GB, tpu-v5e-8)
ACCELERATOR = forms.Form(
    r"[A-Za-z0-9][-A-Za-z0-9_.]*",
    64,
    "a GPU type (letters, digits, '-', '_' and '.')",
    "H100 (the count is --num_gpus_per_node)",
)
# What only one kind of engine reads (JobSpec's fields, the flags of the same names)
KUBERNETES_ONLY = ("namespace", "gpu_resource", "checkpoint_claim", "checkpoint_storage", "storage_class", "shm_size")
SKYPILOT_ONLY = ("accelerator", "checkpoint_bucket", "use_spot", "setup")


@dataclass(frozen=True)
class JobSpec:
    """One training world on an engine. `launch` holds the paths as the user gave them (the files travel in a
    ConfigMap, or in SkyPilot's workdir); the builders turn them into the paths each node sees."""

    target: str
    name: str
    launch: LaunchSpec
    image: str | None = None  # the container image, with Python, torch and distsetup in it (SkyPilot: or `setup`)
    namespace: str | None = None
    gpu_resource: str = "nvidia.com/gpu"  # the resource a pod asks GPUs of; "" for CPU pods
    checkpoint_claim: str | None = None  # an existing ReadWriteMany PersistentVolumeClaim; None: one is written
    checkpoint_storage: str = "100Gi"  # the size of the claim written
    storage_class: str | None = None
    shm_size: str = "16Gi"  # /dev/shm, memory-backed (a pod's own is 64 MB)
    grace_seconds: int = 300  # after SIGTERM, before SIGKILL
    checkpoint_seconds: int = 60  # the longest a checkpoint takes (measured: summary.json's checkpoint_seconds)
    max_restarts: int | None = None  # restarts after failures (preemptions do not count); None: 3, PyTorchJob none
    accelerator: str | None = None  # SkyPilot: the GPU type, e.g. H100; "" for CPU nodes
    checkpoint_bucket: str | None = None  # SkyPilot: the bucket the run works in (mounted at BUCKET_MOUNT)
    use_spot: bool = False  # SkyPilot: spot (preemptible) instances
    setup: str | None = None  # SkyPilot: the commands that install Python, torch and distsetup on each node
    program_args: tuple[str, ...] = ()  # after `--`: the program's arguments on every node

    @property
    def restart_limit(self) -> int:
        """How many times a failed world is started again (preemptions are not counted)."""
        return DEFAULT_MAX_RESTARTS if self.max_restarts is None else self.max_restarts

    @property
    def shutdown_timeout(self) -> int:
        """TORCH_ELASTIC_SHUTDOWN_TIMEOUT: how long torchrun waits for its processes after SIGTERM."""
        return self.grace_seconds - EXIT_MARGIN_SECONDS


def check_job(spec: JobSpec) -> None:
    """Every rule of a job spec that spans flags; the engines' own limits (names, replicas) are object_rules.py's."""
    if spec.target not in TARGETS:
        raise DistsetupError(
            f"--target {spec.target!r} is not an engine distsetup writes.", f"use {'|'.join(TARGETS)}."
        )
    launch = spec.launch
    if launch.launch_method != "torchrun":
        raise DistsetupError(
            f"--launch_method {launch.launch_method}: every node of a {spec.target} job runs torchrun, which reads "
            "the engine's variables and forwards SIGTERM.",
            "drop --launch_method (DeepSpeed and FSDP runs train under torchrun too).",
        )
    if spec.target in ("trainjob", "pytorchjob") and launch.master_port is not None:
        raise DistsetupError(
            f"--master_port: {spec.target} sets the port itself (TrainJob 29500, PyTorchJob 23456).",
            "drop --master_port (jobset and skypilot take it).",
        )
    if spec.target == "pytorchjob" and spec.max_restarts is not None:
        raise DistsetupError(
            "--max_restarts: the training-operator recreates a PyTorchJob's pod on every exit of 128-255 and fails the "
            "job on 1-127; no limit counts those restarts.",
            "drop --max_restarts, or use --target trainjob or jobset (the world restarts as one, up to the limit).",
        )
    if launch.nproc_per_node is None:
        raise DistsetupError(
            "distsetup job needs a number for --num_gpus_per_node (not auto, and not left out).",
            "e.g. --num_gpus_per_node 8 (torchrun's auto starts one process on a node without visible GPUs).",
        )
    if spec.target == "skypilot":
        _check_skypilot(spec)
    else:
        _check_kubernetes(spec)
    found = name_problem(spec.target, spec.name, launch.num_nodes)
    if found:
        raise DistsetupError(f"--name {found[0]}", found[1])
    found = grace_problem(spec.grace_seconds, spec.checkpoint_seconds)
    if found:
        raise DistsetupError(f"--grace_seconds {found[0]}", found[1].replace("give it", "give --grace_seconds"))


def check_flags_given(target: str, given: list[str]) -> None:
    """Of the flags `given` (JobSpec's field names), one the job would leave unused is refused (given at its default
    value too): one only the other kind of engine reads, and the claim's size or class beside a claim of the user's."""
    on_skypilot = target == "skypilot"
    other = [name for name in given if name in (KUBERNETES_ONLY if on_skypilot else SKYPILOT_ONLY)]
    if other:
        kind, own = ("a Kubernetes", SKYPILOT_ONLY) if on_skypilot else ("a SkyPilot", KUBERNETES_ONLY)
        raise DistsetupError(
            f"--{other[0]} is {kind} flag: --target {target} does not read it.",
            f"drop it (--target {target} takes {', '.join('--' + name for name in own)}).",
        )
    for name in ("checkpoint_storage", "storage_class"):
        if name in given and "checkpoint_claim" in given:
            raise DistsetupError(
                f"--{name} shapes the claim distsetup writes, and with --checkpoint_claim it writes none.",
                f"drop --{name} (your claim has its own), or drop --checkpoint_claim.",
            )


def _check_kubernetes(spec: JobSpec) -> None:
    if not spec.image:
        raise DistsetupError(
            f"--target {spec.target} needs --image.", "name an image with Python, torch and distsetup installed."
        )
    for flag, value, form in (
        ("--image", spec.image, forms.IMAGE),
        ("--namespace", spec.namespace, forms.DNS_LABEL),
        ("--checkpoint_claim", spec.checkpoint_claim, forms.DNS_SUBDOMAIN),
        ("--storage_class", spec.storage_class, forms.DNS_SUBDOMAIN),
        ("--checkpoint_storage", spec.checkpoint_storage, forms.SIZE),
        ("--shm_size", spec.shm_size, forms.SIZE),
        ("--gpu_resource", spec.gpu_resource or None, forms.GPU_RESOURCE),
    ):
        if found := form.problem(flag, value):
            raise DistsetupError(*found)


def _check_skypilot(spec: JobSpec) -> None:
    missing = [
        flags
        for flags, absent in (
            ("--accelerator", spec.accelerator is None),
            ("--checkpoint_bucket", not spec.checkpoint_bucket),
            ("--image or --setup", not spec.image and not spec.setup),
        )
        if absent
    ]
    if len(missing) > 1:  # said at once, not one run at a time (each is explained below where it is alone)
        raise DistsetupError(
            f"--target skypilot needs {', '.join(missing[:-1])} and {missing[-1]}.",
            "e.g. --accelerator H100 (none for CPU nodes) --checkpoint_bucket s3://my-bucket/runs --setup 'pip "
            "install -r requirements.txt' (or --image, a Docker image of yours with torch and distsetup).",
        )
    if spec.accelerator is None:
        raise DistsetupError(
            "--target skypilot needs --accelerator: the GPU type, counted by --num_gpus_per_node.",
            "e.g. --accelerator H100 (or none for CPU nodes).",
        )
    for flag, value, form in (
        ("--accelerator", spec.accelerator or None, ACCELERATOR),
        ("--image", spec.image, forms.IMAGE),
    ):
        if found := form.problem(flag, value):
            raise DistsetupError(*found)
    bucket = spec.checkpoint_bucket
    if not bucket or not bucket.startswith(BUCKET_SCHEMES) or any(c.isspace() for c in bucket):
        raise DistsetupError(
            f"--target skypilot needs --checkpoint_bucket, a bucket URL ({', '.join(BUCKET_SCHEMES)})"
            f"{f', not {bucket!r}' if bucket else ''}: a recovered job resumes from the checkpoints there.",
            "e.g. --checkpoint_bucket s3://my-bucket/runs.",
        )
    if not spec.image and not spec.setup:
        raise DistsetupError(
            "--target skypilot needs --image or --setup: a node of SkyPilot's own image has no torch or distsetup, "
            "and each start of the job would fail at once.",
            "give --image IMAGE (a Docker image with Python, torch and distsetup) or --setup COMMANDS "
            "(e.g. --setup 'pip install -r requirements.txt'), run on each node before the run.",
        )


def grace_problem(grace_seconds: int, checkpoint_seconds: int) -> tuple[str, str] | None:
    """(what is wrong, the fix) where a pod's grace period after SIGTERM cannot hold a checkpoint, or None."""
    least = checkpoint_seconds + STOP_MARGIN_SECONDS + EXIT_MARGIN_SECONDS
    if grace_seconds >= least:
        return None
    return (
        f"{grace_seconds} s is too short for a checkpoint of {checkpoint_seconds} s (--checkpoint_seconds) with the "
        f"step in flight ({STOP_MARGIN_SECONDS} s) and the exit ({EXIT_MARGIN_SECONDS} s).",
        f"give it {least} or more.",
    )
