"""The Kubernetes objects of a job, as Python data: the ConfigMap that carries the run config, its backend file and
the entry point; the PersistentVolumeClaim the run works in; and the engine's object around one pod template:
- a JobSet (jobset.x-k8s.io/v1alpha2): one replicated Job of `nodes` indexed pods;
- a Kubeflow Trainer TrainJob (trainer.kubeflow.org/v1alpha1) with its own TrainingRuntime, whose JobSet template
  is that same JobSet's;
- a training-operator PyTorchJob (kubeflow.org/v1): a Master and nodes - 1 Workers.

Preemption, in each: SIGTERM reaches one pod (the node is taken), the world checkpoints at one step, and every
pod's entry point exits RESTART_STATUS. JobSet and TrainJob: the Job's podFailurePolicy fails the Job on that
status, and the JobSet's failurePolicy restarts the whole world for it without counting it against maxRestarts; any
other failure (backoffLimit 0) restarts it up to maxRestarts times. PyTorchJob: restartPolicy ExitCode recreates
each pod that exits 128-255, without limit, and fails the job on 1-127."""

from distsetup.jobs.engines import (
    ANCESTOR_LABEL,
    CONTAINER,
    JOBSET_API,
    PYTORCHJOB_API,
    REPLICATED_JOB,
    TRAINER_ANCESTOR,
    TRAINER_API,
    TRAINER_GROUP,
    jobset_master_address,
)
from distsetup.jobs.entry import ENTRY_NAME
from distsetup.jobs.spec import FILES_MOUNT, RESTART_STATUS, WORK_MOUNT, JobSpec
from distsetup.scripts.launch_plan import DEFAULT_MASTER_PORT

# The reason a Job fails with when a podFailurePolicy rule with action FailJob matched (batch/v1 JobFailed reasons)
POD_FAILURE_POLICY_REASON = "PodFailurePolicy"


def files_configmap(spec: JobSpec, texts: dict[str, str]) -> dict:
    """The ConfigMap the pods read their files from: {name: text}, the entry point among them."""
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _metadata(spec, f"{spec.name}-files"),
        "data": dict(sorted(texts.items())),
    }


def checkpoint_claim(spec: JobSpec) -> dict:
    """The volume every pod works in: the run's output and checkpoints, which a restarted world resumes from."""
    claim_spec: dict = {
        "accessModes": ["ReadWriteMany"],  # every node's rank writes its own part of a checkpoint
        "resources": {"requests": {"storage": spec.checkpoint_storage}},
    }
    if spec.storage_class:
        claim_spec["storageClassName"] = spec.storage_class
    return {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": _metadata(spec, claim_name(spec)),
        "spec": claim_spec,
    }


def claim_name(spec: JobSpec) -> str:
    return spec.checkpoint_claim or f"{spec.name}-work"


def pod_spec(spec: JobSpec, env: list[dict]) -> dict:
    """The pod every node runs: the entry point as PID 1, never restarted in place (the engine restarts the world or
    recreates the pod), the files, the shared working volume and a memory-backed /dev/shm, GPUs asked for, and a
    grace period that fits a checkpoint."""
    gpus = spec.launch.nproc_per_node
    resources = {"limits": {spec.gpu_resource: gpus}} if spec.gpu_resource else {}
    container = {
        "name": CONTAINER[spec.target],
        "image": spec.image,
        "command": ["bash", f"{FILES_MOUNT}/{ENTRY_NAME}"],
        **({"env": env} if env else {}),
        **({"resources": resources} if resources else {}),
        "volumeMounts": [
            {"name": "distsetup-files", "mountPath": FILES_MOUNT, "readOnly": True},
            {"name": "work", "mountPath": WORK_MOUNT},
            {"name": "dshm", "mountPath": "/dev/shm"},
        ],
    }
    return {
        "restartPolicy": "Never",
        "terminationGracePeriodSeconds": spec.grace_seconds,
        "containers": [container],
        "volumes": [
            {"name": "distsetup-files", "configMap": {"name": f"{spec.name}-files"}},
            {"name": "work", "persistentVolumeClaim": {"claimName": claim_name(spec)}},
            {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": spec.shm_size}},
        ],
    }


def node_job(spec: JobSpec, env: list[dict], labels: dict[str, str] | None = None) -> dict:
    """A Job of one indexed pod per node (node rank = completion index), failed at once on a pod's failure, for
    the JobSet to restart the world."""
    nodes = spec.launch.num_nodes
    template: dict = {"spec": {}}
    if labels:
        template["metadata"] = {"labels": labels}
    template["spec"] = {
        "parallelism": nodes,
        "completions": nodes,
        "completionMode": "Indexed",
        "backoffLimit": 0,
        "podFailurePolicy": {
            "rules": [
                {
                    "action": "FailJob",
                    "onExitCodes": {
                        "containerName": CONTAINER[spec.target],
                        "operator": "In",
                        "values": [RESTART_STATUS],
                    },
                },
            ]
        },
        "template": {"spec": pod_spec(spec, env)},
    }
    return {"name": REPLICATED_JOB, "replicas": 1, "template": template}


def jobset_spec(spec: JobSpec, env: list[dict], labels: dict[str, str] | None = None) -> dict:
    """The JobSet spec: the node Job, DNS names for the pods, and the world restarted as one."""
    return {
        "network": {"enableDNSHostnames": True, "publishNotReadyAddresses": True},
        "failurePolicy": {
            "maxRestarts": spec.restart_limit,
            "restartStrategy": "Recreate",
            "rules": [
                {
                    "name": "preempted",
                    "action": "RestartJobSetAndIgnoreMaxRestarts",
                    "onJobFailureReasons": [POD_FAILURE_POLICY_REASON],
                    # the exit-code rule's message (Kubernetes' pod_failure_policy.go); any other failure is counted
                    "onJobFailureMessagePatterns": [f"exit code {RESTART_STATUS}"],
                }
            ],
        },
        "replicatedJobs": [node_job(spec, env, labels)],
    }


def jobset(spec: JobSpec) -> dict:
    nodes, nproc = spec.launch.num_nodes, spec.launch.nproc_per_node
    env = [
        {"name": "NNODES", "value": str(nodes)},
        {"name": "NPROC_PER_NODE", "value": str(nproc)},
        {"name": "MASTER_ADDR", "value": jobset_master_address(spec.name)},
        {"name": "MASTER_PORT", "value": str(spec.launch.master_port or DEFAULT_MASTER_PORT)},
    ]
    return {
        "apiVersion": JOBSET_API,
        "kind": "JobSet",
        "metadata": _metadata(spec, spec.name),
        "spec": jobset_spec(spec, env),
    }


def training_runtime(spec: JobSpec) -> dict:
    """A namespaced TrainingRuntime after Kubeflow's torch-distributed one, with distsetup's pod and failure
    policy: the TrainJob's torch plugin injects PET_NNODES, PET_NODE_RANK, PET_MASTER_ADDR and the rest."""
    return {
        "apiVersion": TRAINER_API,
        "kind": "TrainingRuntime",
        "metadata": _metadata(spec, f"{spec.name}-runtime", labels={"trainer.kubeflow.org/framework": "torch"}),
        "spec": {
            # the processes per node are the TrainJob's numProcPerNode (v2.3's torch policy has none)
            "mlPolicy": {"numNodes": spec.launch.num_nodes, "torch": {}},
            "template": {"spec": jobset_spec(spec, [], labels={ANCESTOR_LABEL: TRAINER_ANCESTOR})},
        },
    }


def trainjob(spec: JobSpec) -> dict:
    nodes, nproc = spec.launch.num_nodes, spec.launch.nproc_per_node
    return {
        "apiVersion": TRAINER_API,
        "kind": "TrainJob",
        "metadata": _metadata(spec, spec.name),
        "spec": {
            "runtimeRef": {
                "name": f"{spec.name}-runtime",
                "apiGroup": TRAINER_GROUP,
                "kind": "TrainingRuntime",
            },
            "trainer": {"numNodes": nodes, "numProcPerNode": nproc},
        },
    }


def pytorchjob(spec: JobSpec) -> dict:
    """Master (node 0) and Workers, each pod restarted on RESTART_STATUS (ExitCode) and the run resumed."""
    nodes = spec.launch.num_nodes

    def replica(count: int) -> dict:
        return {"replicas": count, "restartPolicy": "ExitCode", "template": {"spec": pod_spec(spec, [])}}

    replicas = {"Master": replica(1)}
    if nodes > 1:
        replicas["Worker"] = replica(nodes - 1)
    return {
        "apiVersion": PYTORCHJOB_API,
        "kind": "PyTorchJob",
        "metadata": _metadata(spec, spec.name),
        "spec": {
            "runPolicy": {"cleanPodPolicy": "None"},
            "nprocPerNode": str(spec.launch.nproc_per_node),
            "pytorchReplicaSpecs": replicas,
        },
    }


def engine_objects(spec: JobSpec) -> list[dict]:
    """The engine's objects, in the order kubectl applies them (the runtime before the TrainJob that names it)."""
    if spec.target == "jobset":
        return [jobset(spec)]
    if spec.target == "trainjob":
        return [training_runtime(spec), trainjob(spec)]
    return [pytorchjob(spec)]


def _metadata(spec: JobSpec, name: str, labels: dict[str, str] | None = None) -> dict:
    metadata: dict = {"name": name}
    if spec.namespace:
        metadata["namespace"] = spec.namespace
    metadata["labels"] = {"app.kubernetes.io/managed-by": "distsetup", **(labels or {})}
    return metadata
