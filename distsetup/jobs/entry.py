"""The entry point every node of a job runs (templates/pod_entry.sh.j2): the engine's variables read into the
launch's, torchrun started for this node, SIGTERM forwarded to it, and the engine's restart status once the world has
checkpointed for preemption. The files it names are where each node sees them (node_launch)."""

import json
import os
from dataclasses import replace
from pathlib import Path, PurePosixPath

import yaml

from distsetup.errors import DistsetupError
from distsetup.formats.reading import parse_yaml, read_yaml
from distsetup.formats.runconfig import TrainingConfig
from distsetup.jobs.spec import (
    BUCKET_MOUNT,
    DNS_WAIT_SECONDS,
    EXIT_MARGIN_SECONDS,
    FILES_MOUNT,
    RESTART_STATUS,
    WORK_MOUNT,
    JobSpec,
)
from distsetup.scripts.launch_plan import (
    DEFAULT_MASTER_PORT,
    LaunchSpec,
    check_launch,
    launch_context,
    literal_dollars,
)
from distsetup.scripts.templating import render

ENTRY_NAME = "entry.sh"
# The names the files take in the ConfigMap (and in the pod, under FILES_MOUNT)
SHIPPED_NAMES = {"config": "config.yaml", "deepspeed_config": "ds_config.json", "fsdp_config": "fsdp_config.json"}


def shipped_files(launch: LaunchSpec) -> dict[str, str]:
    """{name in the ConfigMap: the user's path} of the files the launch reads."""
    return {SHIPPED_NAMES[key]: getattr(launch, key) for key in SHIPPED_NAMES if getattr(launch, key)}


def node_launch(spec: JobSpec) -> LaunchSpec:
    """The launch as a node runs it, on static rendezvous at node 0 (never torchrun's --standalone, also on one node).
    In a pod: the run config and backend file where the ConfigMap puts them; distsetup's trainer in the folder the pod
    starts in (the image's, which holds the user's code and the run config's relative data paths), its output on the
    shared volume (output_override); a program of the user's in the shared volume, where what it writes outlives the
    pod. On a SkyPilot node: in the workdir SkyPilot synced from the folder distsetup ran in, the files where they are
    in it."""
    launch = spec.launch
    on_skypilot = spec.target == "skypilot"

    def seen_by_node(key: str) -> str | None:
        path = getattr(launch, key)
        if path is None:
            return None
        return _in_workdir(path, launch.workdir) if on_skypilot else f"{FILES_MOUNT}/{SHIPPED_NAMES[key]}"

    return replace(
        launch,
        config=seen_by_node("config"),
        deepspeed_config=seen_by_node("deepspeed_config"),
        fsdp_config=seen_by_node("fsdp_config"),
        workdir=None if on_skypilot or launch.runs_default_trainer else WORK_MOUNT,
        rdzv_backend="static",
        node_rank=None,
        master_addr=None,
        master_port=launch.master_port or DEFAULT_MASTER_PORT,
        # a pod's run config is the ConfigMap's copy, whose backend file is shipped beside it under another name:
        # passed to the trainer as the pod sees it
        backend_from_run_config=launch.backend_from_run_config and on_skypilot,
    )


def _in_workdir(path: str, workdir: str | None) -> str:
    """A file's path in SkyPilot's copy of the folder distsetup ran in (`workdir`), relative to it."""
    where = PurePosixPath(os.path.normpath(os.path.join(workdir or os.getcwd(), path)))
    if workdir and where.is_relative_to(workdir):
        return str(where.relative_to(workdir))
    raise DistsetupError(
        f"{path} is outside {workdir}, the folder SkyPilot copies to every node (its workdir).",
        "move the file into this folder, or run distsetup job from a folder that holds it.",
    )


def folder_of(spec: JobSpec, key: str, default: str | None) -> str | None:
    """The run's folder at run-config key `key` ("training.output_dir"): the last one given after `--` (normalised:
    `a/../../x` is `../x`), else the run config's, else `default`."""
    given = [arg.partition("=")[2] for arg in spec.program_args if arg.startswith(f"{key}=")]
    if given:
        try:
            value = parse_yaml(given[-1])
        except (yaml.YAMLError, ValueError):
            raise DistsetupError(
                f"{key}={given[-1]} after --: the value is not valid YAML.", f"quote it as a path: {key}=runs/exp2."
            ) from None
        if not isinstance(value, str) or not value:
            raise DistsetupError(f"{key}={given[-1]} after --: not a folder.", f"give one: {key}=runs/exp2.")
        return os.path.normpath(value)
    section, name = key.split(".")
    config = read_yaml(Path(spec.launch.config)) if spec.launch.config else {}
    value = (config.get(section) or {}).get(name)
    return os.path.normpath(str(value)) if value else default


def output_dir_of(spec: JobSpec) -> str:
    """The run's training.output_dir (folder_of)."""
    return folder_of(spec, "training.output_dir", TrainingConfig.output_dir) or TrainingConfig.output_dir


# The folders distsetup's trainer writes that every node must see, and outlive them: its output (checkpoints) and a
# token cache of the run config's own (rank 0 writes it, every rank reads it; by default it is in the output): each
# key's default
KEPT_FOLDERS = {"training.output_dir": TrainingConfig.output_dir, "data.cache_dir": None}


def kept_overrides(spec: JobSpec) -> list[str]:
    """Where the node's own disk goes with it: distsetup's trainer writes its output (and checkpoints), and a token
    cache of the run config's, in the bucket (SkyPilot) or on the shared volume (a pod, which works in the image's
    folder), at their relative paths in the run config or in an override after `--` (these come after them). An
    absolute one is the user's choice, kept (output_note says where the output is not kept)."""
    if not spec.launch.runs_default_trainer:
        return []
    kept = BUCKET_MOUNT if spec.target == "skypilot" else WORK_MOUNT
    overrides = []
    for key, default in KEPT_FOLDERS.items():
        folder = folder_of(spec, key, default)
        if folder is None or PurePosixPath(folder).is_absolute() or folder.startswith(".."):
            continue  # a path outside: output_note says where the output goes
        overrides.append(f"{key}={json.dumps(f'{kept}/{folder}', ensure_ascii=False)}")  # as written, not escaped
    return overrides


def output_note(spec: JobSpec) -> str | None:
    """Where distsetup's trainer would write its checkpoints on the node's own disk (an absolute output_dir outside
    the bucket or the shared volume): a restarted job would start from step 0."""
    if not spec.launch.runs_default_trainer:
        return None
    kept = PurePosixPath(BUCKET_MOUNT if spec.target == "skypilot" else WORK_MOUNT)
    output_dir = PurePosixPath(output_dir_of(spec))  # a relative one is kept's (kept_overrides), but `../x`
    if (output_dir.is_absolute() and output_dir.is_relative_to(kept)) or not str(output_dir).startswith(("/", "..")):
        return None
    where, machine = ("the bucket", "node") if spec.target == "skypilot" else ("the shared volume", "pod")
    return (
        f"training.output_dir {output_dir} is outside {kept} ({where}): its checkpoints go with the {machine}, and a "
        "restarted job starts from step 0 (a relative output_dir is kept there)."
    )


def entry_script(spec: JobSpec, command_line: str) -> str:
    """The entry point's text for `spec`'s engine."""
    launch = node_launch(spec)
    check_launch(launch)
    context = launch_context(launch)
    context["workdir_why"] = "the shared volume: what the program writes there outlives the pod"
    context["workdir_missing"] = "(the shared volume): is its claim mounted there?"
    context["kept_overrides"] = kept_overrides(spec)
    context["program_args"] = spec.program_args
    if spec.target != "skypilot":  # the program is the image's
        context["script_missing"] = (
            "in the image: build it in (a relative --script is in the folder the pod starts in), or regenerate the "
            "job with --script naming its path there"
        )
    context["literal_dollars"] = literal_dollars(context)
    return render(
        "pod_entry.sh.j2",
        command_line=command_line,
        engine=spec.target,
        restart_status=RESTART_STATUS,
        grace_seconds=spec.grace_seconds,
        exit_margin_seconds=EXIT_MARGIN_SECONDS,
        shutdown_timeout=spec.shutdown_timeout,
        dns_wait_seconds=DNS_WAIT_SECONDS,
        gpu_nodes=bool(spec.accelerator),  # SkyPilot: nodes of GPUs, whose count `sky jobs launch --gpus` may change
        **context,
    )
