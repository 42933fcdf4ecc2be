"""The SkyPilot task of a job (skypilot 0.14): `num_nodes` nodes of `--num_gpus_per_node` GPUs of one type, the folder
distsetup ran in as the workdir every node gets, the checkpoint bucket mounted on each, and the entry point as the
`run` every node runs. Launched as a managed job (`sky jobs launch`), it is recovered after a preemption, and also
when the entry point exits RESTART_STATUS (`job_recovery.recover_on_exit_codes`, SkyPilot 0.11 and later)."""

from distsetup.jobs.spec import BUCKET_MOUNT, RESTART_STATUS, JobSpec


def task(spec: JobSpec, entry: str) -> dict:
    """The task YAML's data; `entry`: the entry point's text, run on every node."""
    launch = spec.launch
    resources: dict = {}
    if spec.accelerator:
        resources["accelerators"] = f"{spec.accelerator}:{launch.nproc_per_node}"
    if spec.use_spot:
        resources["use_spot"] = True
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
        "run": entry,
    }
