"""The rules of one schema-valid Kubernetes object that its schema cannot say: those its API server, CEL expressions
and webhooks apply (name lengths, the variables an engine sets itself, a podFailurePolicy's restart policy, one
Master, one replica of Kubeflow Trainer's trainer Job, one ML policy), and distsetup's contract for the pods that
run its entry point (every node a pod of one world: an Indexed Job of `nodes` pods, node 0's address, the processes
per node the GPUs asked for; restarted after a preemption: restart_rules.py)."""

from distsetup.formats.problems import Problem
from distsetup.jobs.engines import CONTAINER, jobset_master_address, name_problem, subdomain_problem
from distsetup.jobs.restart_rules import restart_problems
from distsetup.jobs.walk import is_trainer_job, plain_env, pod_templates, replicated_jobs, runs_entry_point

CONFIGMAP_MAX_BYTES = 1 << 20  # the API server's limit on a ConfigMap's data
# Variables each engine sets in the training container itself: a value the spec sets would be overwritten, or
# refused (kubeflow/trainer's torch plugin, torch.go; the training-operator's pytorch envvar.go and master.go)
INJECTED = {
    "TrainJob": ("PET_NNODES", "PET_NPROC_PER_NODE", "PET_NODE_RANK", "PET_MASTER_ADDR", "PET_MASTER_PORT"),
    "PyTorchJob": (
        *("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK"),
        *("PET_MASTER_ADDR", "PET_MASTER_PORT", "PET_NNODES", "PET_NPROC_PER_NODE", "PET_NODE_RANK"),
    ),
}
ML_POLICIES = ("torch", "mpi", "jax", "xgboost", "flux")


def object_rules(document: dict) -> list[Problem]:
    """The rules of one schema-valid Kubernetes object."""
    kind = document["kind"]
    problems = _name_problems(document)
    if not isinstance(document["metadata"].get("name"), str):  # the rules below name what it makes after it
        return problems
    if kind == "ConfigMap":
        size = sum(len(value.encode()) for value in document.get("data", {}).values())
        if size > CONFIGMAP_MAX_BYTES:
            too_large = f"holds {size} bytes; a ConfigMap holds at most 1 MiB."
            problems.append(Problem("data", too_large, "put the large files in the image."))
    for path, job, replicated in replicated_jobs(document):
        problems += _job_problems(document, path, job, replicated)
    for path, template in pod_templates(document):
        problems += _pod_problems(document, path, template)
    if kind == "PyTorchJob":
        problems += _pytorchjob_problems(document)
    if kind == "TrainJob":
        for e, variable in enumerate(document["spec"].get("trainer", {}).get("env", [])):
            if variable["name"] in INJECTED["TrainJob"]:
                problems.append(_injected(f"spec.trainer.env[{e}].name", kind, variable["name"]))
            elif sets_the_completion_index(variable):
                problems.append(_completion_index(f"spec.trainer.env[{e}].name"))
    problems += restart_problems(document)
    if kind in ("TrainingRuntime", "ClusterTrainingRuntime"):
        policies = [key for key in ML_POLICIES if key in document["spec"].get("mlPolicy", {})]
        if len(policies) > 1:
            problems.append(
                Problem("spec.mlPolicy", f"sets {' and '.join(policies)}: a runtime has one.", "keep one of them.")
            )
    return problems


def _name_problems(document: dict) -> list[Problem]:
    """metadata.name: for an engine's object, a DNS label short enough for the names it makes (engines.py); for
    another object, a DNS subdomain."""
    name, kind = document["metadata"].get("name"), document["kind"]
    if not isinstance(name, str):
        return [Problem("metadata.name", "the object has no name.", "give it one, e.g. llm-run-1.")]
    if kind == "JobSet":
        found = [
            name_problem("jobset", name, job.get("completions") or 1, rjob["name"], rjob.get("replicas", 1))
            for _, job, rjob in replicated_jobs(document)
        ]
        found = [f for f in found if f] or [name_problem("jobset", name, 1)]
    elif kind == "TrainJob":
        found = [name_problem("trainjob", name, document["spec"].get("trainer", {}).get("numNodes") or 1)]
    elif kind == "PyTorchJob":
        replicas = document["spec"]["pytorchReplicaSpecs"]
        found = [name_problem("pytorchjob", name, sum(r.get("replicas", 1) for r in replicas.values()))]
    else:
        found = [subdomain_problem(name)]
    return [Problem("metadata.name", *f) for f in found if f][:1]


def _job_problems(document: dict, path: str, job: dict, replicated: dict) -> list[Problem]:
    """Kubernetes' own Job rules that its schema does not hold, Kubeflow Trainer's for its trainer Job, and
    distsetup's for a Job of its entry point: one indexed pod per node, all at once, told node 0's address."""
    problems, spec = [], f"{path}.template.spec"
    restart = job["template"].get("spec", {}).get("restartPolicy")
    if "podFailurePolicy" in job and restart != "Never":
        problems.append(
            Problem(
                f"{spec}.template.spec.restartPolicy",
                f"{restart!r}: a Job with a podFailurePolicy needs restartPolicy Never (the API server refuses it).",
                "write restartPolicy: Never.",
            )
        )
    runtime = document["kind"] != "JobSet"
    if runtime and is_trainer_job(replicated) and replicated.get("replicas", 1) != 1:
        problems.append(
            Problem(
                f"{path}.replicas",
                "Kubeflow Trainer's webhook takes 1 replica of the trainer's Job (the nodes are its pods).",
                "write replicas: 1, and the node count in numNodes.",
            )
        )
    if not runs_entry_point(job["template"]["spec"]):
        return problems
    if job.get("completionMode", "Indexed") != "Indexed":  # JobSet's webhook makes it Indexed when left out
        problems.append(
            Problem(
                f"{spec}.completionMode",
                "the node rank is the Job's completion index, which only an Indexed Job has.",
                "write completionMode: Indexed.",
            )
        )
    if runtime:  # the TrainJob's numNodes sets both
        return problems
    nodes = job.get("completions")
    if job.get("parallelism", 1) != nodes:
        problems.append(
            Problem(
                f"{spec}.parallelism",
                "every node of the world runs at once: parallelism and completions must be equal.",
                "write the node count in both.",
            )
        )
    env = plain_env(job["template"]["spec"]["containers"][0])
    expected = {"NNODES": str(nodes), "MASTER_ADDR": jobset_master_address(document["metadata"]["name"])}
    for name, value in expected.items():
        if name in env and env[name] != value:
            problems.append(
                Problem(
                    f"{spec}.template.spec.containers[0].env",
                    f"{name} is {env[name]!r}, and this JobSet makes it {value!r} (renamed or resized since written?).",
                    f"write {value}, or regenerate the file with distsetup job.",
                )
            )
    return problems


def _pod_problems(document: dict, path: str, template: dict) -> list[Problem]:
    """The container the engine looks for, the variables it sets itself, volumes mounted that exist, and the GPUs
    asked for against the processes the entry point starts."""
    kind, problems, pod = document["kind"], [], template["spec"]
    trainer_pod = kind == "PyTorchJob" or any(
        is_trainer_job(rjob) and job["template"] is template for _, job, rjob in replicated_jobs(document)
    )
    target = "pytorchjob" if kind == "PyTorchJob" else "trainjob"
    wanted = CONTAINER[target] if kind != "JobSet" and trainer_pod else None
    names = [container["name"] for container in pod["containers"]]
    if wanted and wanted not in names:
        problems.append(
            Problem(
                f"{path}.spec.containers",
                f"no container is named {wanted!r}, the one {kind} sets the training variables in.",
                f"name the training container {wanted}.",
            )
        )
    volumes = {volume["name"] for volume in pod.get("volumes", [])}
    injected = INJECTED["TrainJob" if kind.endswith("TrainingRuntime") else kind] if wanted else ()
    for c, container in enumerate(pod["containers"]):
        for m, mount in enumerate(container.get("volumeMounts", [])):
            if mount["name"] not in volumes:
                problems.append(
                    Problem(
                        f"{path}.spec.containers[{c}].volumeMounts[{m}].name",
                        f"no volume is named {mount['name']!r}.",
                        "add it to the pod's volumes or fix the name.",
                    )
                )
        for e, variable in enumerate(container.get("env", [])):
            if variable["name"] in injected and (kind == "PyTorchJob" or container["name"] == wanted):
                problems.append(_injected(f"{path}.spec.containers[{c}].env[{e}].name", kind, variable["name"]))
            elif kind != "PyTorchJob" and sets_the_completion_index(variable):  # an indexed Job's pods
                problems.append(_completion_index(f"{path}.spec.containers[{c}].env[{e}].name"))
    if kind == "JobSet" and runs_entry_point(pod):
        nproc = plain_env(pod["containers"][0]).get("NPROC_PER_NODE")
        problems += _gpu_problems(f"{path}.spec.containers[0].resources", pod, nproc)
    return problems


def _pytorchjob_problems(document: dict) -> list[Problem]:
    spec = document["spec"]
    replicas, problems = spec["pytorchReplicaSpecs"], []
    if replicas.get("Master", {}).get("replicas", 1) != 1:
        problems.append(Problem("spec.pytorchReplicaSpecs.Master.replicas", "a PyTorchJob has 1 Master.", "write 1."))
    if replicas.get("Worker", {}).get("replicas", 1) < 1:
        problems.append(
            Problem(
                "spec.pytorchReplicaSpecs.Worker.replicas",
                "the operator refuses Workers with 0 replicas.",
                "leave Worker out for one node.",
            )
        )
    master = replicas.get("Master", {}).get("template", {}).get("spec")
    if master is None or not runs_entry_point(master):
        return problems
    nproc = spec.get("nprocPerNode")
    if nproc is not None and not nproc.isdigit():
        problems.append(
            Problem(
                "spec.nprocPerNode",
                f"{nproc!r}: torchrun's auto starts one process on a node without visible GPUs.",
                "write the GPUs per node as a string, e.g. '8'.",
            )
        )
    elif nproc is not None:
        where = "spec.pytorchReplicaSpecs.Master.template.spec.containers[0].resources"
        problems += _gpu_problems(where, master, nproc)
    return problems


def _gpu_problems(path: str, pod: dict, nproc: str | None) -> list[Problem]:
    """GPUs asked for (the first limit whose name ends in /gpu) that are not one a process (`nproc` per node)."""
    limits = pod["containers"][0].get("resources", {}).get("limits", {})
    gpus = [(name, value) for name, value in limits.items() if name.endswith("/gpu")]
    if nproc is None or not gpus:
        return []
    name, value = gpus[0]
    if str(value) == nproc:
        return []
    return [
        Problem(
            f"{path}.limits",
            f"asks for {value} {name} and starts {nproc} processes per node: one process a GPU.",
            "make them agree (regenerate the file with distsetup job).",
        )
    ]


def sets_the_completion_index(variable: dict) -> bool:
    """Whether an env entry sets JOB_COMPLETION_INDEX other than from the pod's own index (the annotation or label the
    Job controller writes, which Kubernetes' own examples read it from)."""
    if variable["name"] != "JOB_COMPLETION_INDEX":
        return False
    field = (variable.get("valueFrom") or {}).get("fieldRef", {}).get("fieldPath", "")
    return "batch.kubernetes.io/job-completion-index" not in field


def _completion_index(path: str) -> Problem:
    return Problem(
        path,
        "the Job controller sets JOB_COMPLETION_INDEX, each pod's index, but keeps a value written here: every pod "
        "would be node 0, and the world would never form.",
        "leave it out (or read it from the pod's batch.kubernetes.io/job-completion-index annotation).",
    )


def _injected(path: str, kind: str, name: str) -> Problem:
    return Problem(path, f"{kind} sets {name} itself.", "leave it out: the engine's value is the world's.")
