"""The SkyPilot task of a job (skypilot 0.14): `num_nodes` nodes of `--num_gpus_per_node` GPUs of one type, the folder
distsetup ran in as the workdir every node gets, the checkpoint bucket mounted on each, the run's software from
`--image` (a Docker image, `resources.image_id`) or `--setup`, and the entry point as the `run` every node runs.
Launched as a managed job (`sky jobs launch`), it is recovered after a preemption, and also when the entry point
exits RESTART_STATUS (`job_recovery.recover_on_exit_codes`, SkyPilot 0.11 and later). Also the task's schema and
what `distsetup validate` checks in a task beyond it (task_problems)."""

import re

from distsetup.formats.problems import Problem
from distsetup.jobs.schema import ANY, BOOLEAN, COUNT, POSITIVE, STRING, array_schema, object_schema
from distsetup.jobs.spec import BUCKET_MOUNT, RESTART_STATUS, JobSpec


def task(spec: JobSpec, entry: str) -> dict:
    """The task YAML's data; `entry`: the entry point's text, run on every node."""
    launch = spec.launch
    resources: dict = {}
    if spec.accelerator:
        resources["accelerators"] = f"{spec.accelerator}:{launch.nproc_per_node}"
    if spec.use_spot:
        resources["use_spot"] = True
    if spec.image:
        resources["image_id"] = f"docker:{spec.image}"  # setup and run then run in this container
    resources["job_recovery"] = {
        "strategy": "EAGER_NEXT_REGION",
        "max_restarts_on_errors": spec.restart_limit,
        "recover_on_exit_codes": [RESTART_STATUS],
    }
    return {
        "name": spec.name,
        "num_nodes": launch.num_nodes,
        "resources": resources,
        "workdir": ".",
        # cached: written locally, then uploaded; the checkpoints' renames (a file written whole, then put in place)
        # work there, and not on a plain MOUNT (goofys, gcsfuse)
        "file_mounts": {BUCKET_MOUNT: {"source": spec.checkpoint_bucket, "mode": "MOUNT_CACHED"}},
        **({"setup": spec.setup} if spec.setup else {}),
        "run": entry,
    }


# A SkyPilot task (skypilot 0.14: sky/utils/schemas.py, get_task_schema and the resources and storage schemas)
SKYPILOT_STORE = object_schema(
    {
        "name": STRING,
        "source": {"type": ["string", "array"]},
        "store": STRING,
        "persistent": BOOLEAN,
        "mode": {  # SkyPilot's case_insensitive_enum
            "type": "string",
            "pattern": "(?i)^(MOUNT|COPY|MOUNT_CACHED)\\Z",  # Python's $ takes a trailing newline too
            "description": "MOUNT, COPY or MOUNT_CACHED (in any case)",
            "examples": ["MOUNT_CACHED"],
        },
        "type": STRING,
        "config": ANY,
    }
)
SKYPILOT_RESOURCES = object_schema(
    {
        "accelerators": {"type": ["string", "object", "array"]},
        "use_spot": BOOLEAN,
        "job_recovery": {
            "anyOf": [
                STRING,
                object_schema(
                    {
                        "strategy": {"enum": ["EAGER_NEXT_REGION", "FAILOVER", None]},
                        "max_restarts_on_errors": COUNT,
                        "recover_on_exit_codes": {
                            "anyOf": [
                                {"type": "integer", "minimum": 0, "maximum": 255},
                                array_schema({"type": "integer", "minimum": 0, "maximum": 255}),
                            ]
                        },
                    }
                ),
            ]
        },
        **{
            key: ANY
            for key in (
                "cloud region zone infra cpus memory instance_type volumes disk_size ephemeral_storage disk_tier "
                "network_tier local_disk max_hourly_cost ports labels accelerator_args image_id priority any_of "
                "ordered autostop"
            ).split()
        },
    }
)
SKYPILOT_TASK = object_schema(
    {
        "name": STRING,
        "workdir": {"type": ["string", "object"]},
        "num_nodes": POSITIVE,
        "resources": SKYPILOT_RESOURCES,
        "file_mounts": {"type": "object", "additionalProperties": {"anyOf": [STRING, SKYPILOT_STORE]}},
        "setup": STRING,
        "run": STRING,
        "envs": {"type": "object", "additionalProperties": {"type": ["string", "null"]}},
        **{key: ANY for key in "event_callback service pool secrets volumes config inputs outputs".split()},
    },
    required=("run",),
)


def task_problems(task: dict) -> list[Problem]:
    """distsetup's contract in a SkyPilot task that runs its entry point: its nodes get the run's software (a setup or
    an image), the GPUs asked for are the processes it starts per node, and the status it exits with after a
    preemption recovers the job."""
    run = task["run"]
    if "DISTSETUP_PREEMPTED_FILE" not in run:
        return []  # another program's task: SkyPilot's schema is all
    problems = []
    # a task written by hand or edited (distsetup job refuses the flags that would leave both out, naming them)
    if not task.get("setup") and "image_id" not in task.get("resources", {}):
        problems.append(
            Problem(
                "setup",
                "the task installs nothing: a node of SkyPilot's own image has no torch or distsetup, and the entry "
                "point stops at its first python3.",
                "add setup: (e.g. pip install -r requirements.txt), or resources.image_id: docker:IMAGE with them.",
            )
        )
    nproc = re.search(r"^NPROC_PER_NODE=(\d+)", run, re.MULTILINE)  # fixed (CPU nodes, or written by hand)
    accelerators = task.get("resources", {}).get("accelerators")
    count = _gpu_count(accelerators)
    if nproc and count is not None and count != int(nproc.group(1)):
        problems.append(
            Problem(
                "resources.accelerators",
                f"{accelerators!r} asks for {count:g} GPUs a node, and the run starts {nproc.group(1)} process(es).",
                "regenerate the task with distsetup job, or make them agree.",
            )
        )
    # the run's output is in the bucket, mounted so that it renames folders and writes back: MOUNT_CACHED only
    # (a plain MOUNT, goofys or gcsfuse, renames no folders; a COPY, or a string source, is never written back)
    bucket = (task.get("file_mounts") or {}).get(BUCKET_MOUNT)
    mode = str(bucket.get("mode", "MOUNT")).upper() if isinstance(bucket, dict) else None
    if mode != "MOUNT_CACHED":
        problems.append(
            Problem(
                f"file_mounts.{BUCKET_MOUNT}",
                f"the run's checkpoints go to {BUCKET_MOUNT}, and "
                + (
                    f"a bucket mounted with mode {mode} loses them"
                    if mode
                    else "no bucket is mounted there to keep them"
                )
                + " (a recovered job starts from step 0).",
                "mount the checkpoint bucket there with mode: MOUNT_CACHED, as distsetup job does.",
            )
        )
    recovery = task.get("resources", {}).get("job_recovery")
    codes = recovery.get("recover_on_exit_codes", []) if isinstance(recovery, dict) else []
    if RESTART_STATUS not in ([codes] if isinstance(codes, int) else codes):
        problems.append(
            Problem(
                "resources.job_recovery.recover_on_exit_codes",
                f"the run exits {RESTART_STATUS} once the world has checkpointed for preemption, and this task is not "
                "recovered on it.",
                f"add {RESTART_STATUS}.",
            )
        )
    return problems


def _gpu_count(accelerators) -> float | None:
    """The GPUs a node of `resources.accelerators` "TYPE:COUNT" asks for, as SkyPilot reads the count (a number, 8.0
    or 08 alike); None where it is given otherwise."""
    if not isinstance(accelerators, str) or ":" not in accelerators:
        return None
    try:
        return float(accelerators.rsplit(":", 1)[1])
    except ValueError:
        return None
