"""The engines' own names, as their controllers make them (kubeflow/trainer v2.3.0, jobset v0.12.0,
training-operator v1.9.4): the containers they look for, the pods' host names and the address of node 0, and the
rule their names follow."""

from distsetup.jobs.forms import DNS_1035_LABEL, DNS_SUBDOMAIN

# The engines' API versions
JOBSET_API = "jobset.x-k8s.io/v1alpha2"
TRAINER_GROUP = "trainer.kubeflow.org"
TRAINER_API = f"{TRAINER_GROUP}/v1alpha1"
PYTORCHJOB_API = "kubeflow.org/v1"
# The container each engine runs (TrainJob: the torch plugin fills PET_* into the container named "node";
# PyTorchJob: the operator sets its variables in the container named "pytorch")
CONTAINER = {"trainjob": "node", "jobset": "node", "pytorchjob": "pytorch"}
# The replicated Job of the JobSet (and of the TrainingRuntime's JobSet template) that runs the nodes
REPLICATED_JOB = "node"
# How Kubeflow Trainer finds the replicated Job its trainer settings apply to
ANCESTOR_LABEL, TRAINER_ANCESTOR = "trainer.kubeflow.org/trainjob-ancestor-step", "trainer"
DNS_LABEL_MAX = DNS_1035_LABEL.max_length


def jobset_job_name(jobset: str, replicated_job: str = REPLICATED_JOB, job_index: int = 0) -> str:
    """A JobSet's Job: <jobset>-<replicated job>-<job index> (distsetup's: one Job, index 0)."""
    return f"{jobset}-{replicated_job}-{job_index}"


def jobset_pod_host(jobset: str, node: int, replicated_job: str = REPLICATED_JOB, job_index: int = 0) -> str:
    """A JobSet pod's host name: its Job's name and its completion index (distsetup's: one pod per node)."""
    return f"{jobset_job_name(jobset, replicated_job, job_index)}-{node}"


def jobset_master_address(jobset: str) -> str:
    """Node 0's DNS name: its host name in the JobSet's headless service (the subdomain, named after the JobSet).
    A TrainJob's JobSet is named after the TrainJob, so its PET_MASTER_ADDR is the same name."""
    return f"{jobset_pod_host(jobset, 0)}.{jobset}"


def pytorchjob_master_address(job: str) -> str:
    """The Master's service name, which the training-operator puts in MASTER_ADDR."""
    return f"{job}-master-0"


# The Job controller's random suffix of an indexed pod's name, which JobSet's webhook counts
POD_SUFFIX = "-abcde"


def longest_names(target: str, name: str, nodes: int, replicated_job: str = REPLICATED_JOB, replicas: int = 1):
    """The longest names the engine makes of `name` for `nodes` pods, each of which must be a DNS label. JobSet's
    webhook (pkg/webhooks/jobset_webhook.go) checks its last Job, <jobset>-<replicated job>-<replicas - 1>, and that
    Job's last pod with the Job controller's suffix; the training-operator names pods and services
    <job>-<role>-<index>."""
    if target == "pytorchjob":
        return [f"{name}-worker-{nodes - 2}" if nodes > 1 else pytorchjob_master_address(name)]
    last_job = replicas - 1
    return [
        jobset_job_name(name, replicated_job, last_job),
        jobset_pod_host(name, nodes - 1, replicated_job, last_job) + POD_SUFFIX,
    ]


def subdomain_problem(name: str) -> tuple[str, str] | None:
    """(what is wrong, the fix) with the name of another object (ConfigMap, claim, runtime): a DNS subdomain."""
    if DNS_SUBDOMAIN.fits(name):
        return None
    return f"{name!r} is not {DNS_SUBDOMAIN.said}.", "e.g. llm-run-1-files."


def name_problem(
    target: str, name: str, nodes: int, replicated_job: str = REPLICATED_JOB, replicas: int = 1
) -> tuple[str, str] | None:
    """(what is wrong, the fix) with a job's name, or None: an RFC 1035 label (TrainJob's CEL rule, the operators'
    webhooks), short enough for the longest names the engine makes of it (a SkyPilot task's is its own)."""
    if not DNS_1035_LABEL.fits(name):
        return f"{name!r} is not {DNS_1035_LABEL.said}.", f"e.g. {DNS_1035_LABEL.example}."
    made = [] if target == "skypilot" else longest_names(target, name, nodes, replicated_job, replicas)
    too_long = [made_name for made_name in made if len(made_name) > DNS_LABEL_MAX]
    if too_long:
        longest = max(too_long, key=len)
        return (
            f"{name!r} makes names like {longest!r}, {len(longest)} characters; the engine refuses names over "
            f"{DNS_LABEL_MAX}.",
            f"use a name of at most {DNS_LABEL_MAX - (len(longest) - len(name))} characters.",
        )
    return None


def is_skypilot_task(document) -> bool:
    """A SkyPilot task: what its nodes run, and no Kubernetes object's apiVersion."""
    return isinstance(document, dict) and "apiVersion" not in document and isinstance(document.get("run"), str)
