"""What the engines' schemas cannot say, coded: the rules their API servers, CEL expressions and webhooks apply (name
lengths, reserved variables, the podFailurePolicy's restart policy, one Master), and distsetup's own contract
(every node a pod of one world, the grace period long enough for a checkpoint). `manifest_problems` checks the
objects of one file, as `kubectl apply -f` would submit them together."""

import re

from distsetup.formats.problems import Problem, schema_problems_in
from distsetup.jobs.engines import ANCESTOR_LABEL, CONTAINER, label_problem, name_problem
from distsetup.jobs.schema import SKYPILOT_TASK, schemas
from distsetup.jobs.spec import EXIT_MARGIN_SECONDS, RESTART_STATUS, grace_problem

CHECKPOINT_ANNOTATION = "distsetup.dev/checkpoint-seconds"
CONFIGMAP_MAX_BYTES = 1 << 20  # the API server's limit on a ConfigMap's data
# Variables each engine sets in the training container itself: a value the spec sets would be overwritten, or
# refused (kubeflow/trainer's torch plugin; the training-operator's pytorch envvar.go)
INJECTED = {
    "TrainJob": ("PET_NNODES", "PET_NPROC_PER_NODE", "PET_NODE_RANK", "PET_MASTER_ADDR", "PET_MASTER_PORT"),
    "PyTorchJob": ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "PET_NNODES", "PET_NODE_RANK"),
}
_SHUTDOWN_TIMEOUT = re.compile(r"^export TORCH_ELASTIC_SHUTDOWN_TIMEOUT=(\d+)", re.MULTILINE)


def manifest_problems(documents: list, crds: dict[tuple[str, str], dict] | None = None) -> list[Problem]:
    """Every problem of the objects of one file: each against its schema (and against the cluster's CRD for its
    kind, among `crds`: crd.py), then the rules, each problem's path starting with the object's kind/name (or its
    place in the file: [0], [1], ...)."""
    problems = []
    for index, document in enumerate(documents):
        where = _place(document, index)
        if is_skypilot_task(document):
            found = schema_problems_in(document, SKYPILOT_TASK) or _task_problems(document)
            problems += [Problem(f"{where}.{p.path}" if p.path else where, p.message, p.fix) for p in found]
            continue
        if not isinstance(document, dict) or (document.get("apiVersion"), document.get("kind")) not in schemas():
            known = ", ".join(f"{kind} ({api})" for api, kind in schemas())
            what = (
                f"{document.get('kind')} ({document.get('apiVersion')})"
                if isinstance(document, dict)
                else "not an object"
            )
            problems.append(Problem(where, f"{what} is not an object distsetup checks.", f"distsetup checks {known}."))
            continue
        found = schema_problems_in(document, schemas()[document["apiVersion"], document["kind"]])
        crd = (crds or {}).get((document["apiVersion"], document["kind"]))
        if crd is not None:
            said = {(p.path, p.message) for p in found}
            found += [
                Problem(p.path, f"{p.message.rstrip('.')} (by the cluster's CRD).", p.fix)
                for p in schema_problems_in(document, crd)
                if (p.path, p.message) not in said
            ]
        found = found or _object_rules(document)
        problems += [Problem(f"{where}.{p.path}" if p.path else where, p.message, p.fix) for p in found]
    if not problems:
        problems += _file_rules(documents)
    return problems


def is_skypilot_task(document) -> bool:
    """A SkyPilot task: what a node runs, and no Kubernetes object's apiVersion."""
    return isinstance(document, dict) and "apiVersion" not in document and "run" in document


def _task_problems(task: dict) -> list[Problem]:
    """distsetup's contract in a SkyPilot task that runs its entry point: the GPUs asked for are the processes it
    starts per node, and the status it exits with after a preemption recovers the job."""
    run = task["run"]
    if "DISTSETUP_PREEMPTED_FILE" not in run:
        return []  # another program's task: SkyPilot's schema is all
    problems = []
    nproc = re.search(r"^NPROC_PER_NODE=(\d+)", run, re.MULTILINE)
    accelerators = task.get("resources", {}).get("accelerators")
    count = accelerators.rsplit(":", 1)[1] if isinstance(accelerators, str) and ":" in accelerators else None
    if nproc and count is not None and count != nproc.group(1):
        problems.append(
            Problem(
                "resources.accelerators",
                f"{accelerators!r} asks for {count} GPUs a node, and the run starts {nproc.group(1)} processes.",
                "regenerate the task with distsetup job, or make them agree.",
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


def _place(document, index: int) -> str:
    """An object as kubectl names it (kind/name), a SkyPilot task as Task/name, or by its place in the file."""
    if is_skypilot_task(document) and isinstance(document.get("name"), str):
        return f"Task/{document['name']}"
    if isinstance(document, dict) and isinstance(document.get("metadata"), dict):
        name = document["metadata"].get("name")
        if isinstance(name, str) and isinstance(document.get("kind"), str):
            return f"{document['kind']}/{name}"
    return f"[{index}]"


def _object_rules(document: dict) -> list[Problem]:
    """The rules of one schema-valid object."""
    kind = document["kind"]
    problems = _name_problems(document)
    if kind == "ConfigMap":
        size = sum(len(value.encode()) for value in document.get("data", {}).values())
        if size > CONFIGMAP_MAX_BYTES:
            problems.append(
                Problem(
                    "data", f"holds {size} bytes; a ConfigMap holds at most 1 MiB.", "ship large files in the image."
                )
            )
    for path, pod in _pod_templates(document):
        problems += _pod_problems(path, pod, kind)
    for path, job in _jobs(document):
        problems += _job_problems(path, job)
    if kind == "PyTorchJob":
        replicas = document["spec"]["pytorchReplicaSpecs"]
        if replicas.get("Master", {}).get("replicas", 1) != 1:
            problems.append(
                Problem(
                    "spec.pytorchReplicaSpecs.Master.replicas", "a PyTorchJob has one Master.", "write replicas: 1."
                )
            )
        if replicas.get("Worker", {}).get("replicas", 1) < 1:
            problems.append(
                Problem(
                    "spec.pytorchReplicaSpecs.Worker.replicas",
                    "the operator refuses Workers with 0 replicas.",
                    "leave Worker out for one node.",
                )
            )
        nproc = document["spec"].get("nprocPerNode")
        if nproc is not None and not nproc.isdigit():
            problems.append(
                Problem(
                    "spec.nprocPerNode",
                    f"{nproc!r}: torchrun's auto starts one process on a node without visible GPUs.",
                    "write the GPUs per node as a string, e.g. '8'.",
                )
            )
    if kind == "TrainJob":
        for e, variable in enumerate(document["spec"].get("trainer", {}).get("env", [])):
            if variable["name"] in INJECTED["TrainJob"]:
                problems.append(_injected(f"spec.trainer.env[{e}].name", kind, variable["name"]))
    for index, replicated in enumerate(_replicated_jobs(document) if kind == "TrainingRuntime" else []):
        labels = replicated["template"].get("metadata", {}).get("labels", {})
        if ANCESTOR_LABEL in labels and replicated.get("replicas", 1) != 1:
            problems.append(
                Problem(
                    f"spec.template.spec.replicatedJobs[{index}].replicas",
                    "Kubeflow Trainer's webhook takes 1 replica of a replicated Job it runs (the nodes are its pods).",
                    "write replicas: 1 and the node count in numNodes.",
                )
            )
    return problems


def _injected(path: str, kind: str, name: str) -> Problem:
    return Problem(path, f"{kind} sets {name} itself.", "leave it out: the engine's value is the world's.")


def _name_problems(document: dict) -> list[Problem]:
    """metadata.name: a DNS label; for an engine's object, short enough for the pods it makes (engines.py)."""
    name, kind = document["metadata"].get("name"), document["kind"]
    target = {"JobSet": "jobset", "TrainJob": "trainjob", "PyTorchJob": "pytorchjob"}.get(kind, "")
    if not isinstance(name, str):
        return [Problem("metadata.name", "the object has no name.", "give it one, e.g. llm-run-1.")]
    found = name_problem(target, name, _node_count(document)) if target else label_problem(name)
    return [Problem("metadata.name", *found)] if found else []


def _node_count(document: dict) -> int:
    spec = document["spec"]
    if document["kind"] == "TrainJob":
        return spec.get("trainer", {}).get("numNodes", 1)
    if document["kind"] == "PyTorchJob":
        return sum(replica.get("replicas", 1) for replica in spec["pytorchReplicaSpecs"].values())
    return max((job["template"].get("spec", {}).get("parallelism", 1) for job in spec["replicatedJobs"]), default=1)


def _jobset_spec(document: dict) -> tuple[str, dict] | None:
    if document["kind"] == "JobSet":
        return "spec", document["spec"]
    if document["kind"] == "TrainingRuntime":
        return "spec.template.spec", document["spec"]["template"]["spec"]
    return None


def _replicated_jobs(document: dict) -> list[dict]:
    found = _jobset_spec(document)
    return [] if found is None else found[1].get("replicatedJobs", [])


def _jobs(document: dict):
    """(path, Job spec) of each replicated Job of a JobSet or a TrainingRuntime's JobSet template."""
    found = _jobset_spec(document)
    for index, replicated in enumerate(_replicated_jobs(document)):
        if found is not None and "spec" in replicated["template"]:
            yield f"{found[0]}.replicatedJobs[{index}].template.spec", replicated["template"]["spec"]


def _pod_templates(document: dict):
    """(path, pod template) of every pod the object makes."""
    for path, job in _jobs(document):
        yield f"{path}.template", job["template"]
    if document["kind"] == "PyTorchJob":
        for role, replica in document["spec"]["pytorchReplicaSpecs"].items():
            if "template" in replica:
                yield f"spec.pytorchReplicaSpecs.{role}.template", replica["template"]


def _job_problems(path: str, job: dict) -> list[Problem]:
    """Kubernetes' own Job rules that its schema does not hold, and one pod per node, indexed."""
    problems = []
    restart = job["template"].get("spec", {}).get("restartPolicy")
    if "podFailurePolicy" in job and restart != "Never":
        problems.append(
            Problem(
                f"{path}.template.spec.restartPolicy",
                f"{restart!r}: a Job with a podFailurePolicy needs restartPolicy Never (the API server refuses it).",
                "write restartPolicy: Never.",
            )
        )
    if job.get("completionMode") != "Indexed":
        problems.append(
            Problem(
                f"{path}.completionMode",
                "the node rank is the Job's completion index, which only an Indexed Job has.",
                "write completionMode: Indexed.",
            )
        )
    if job.get("parallelism", 1) != job.get("completions", 1):
        problems.append(
            Problem(
                f"{path}.parallelism",
                "every node of the world runs at once: parallelism and completions must be equal.",
                "write the node count in both.",
            )
        )
    return problems


def _pod_problems(path: str, template: dict, kind: str) -> list[Problem]:
    """The container the engine looks for, the variables it sets itself, volumes mounted that exist."""
    problems = []
    pod = template["spec"]
    names = [container["name"] for container in pod["containers"]]
    wanted = {"PyTorchJob": CONTAINER["pytorchjob"], "TrainingRuntime": CONTAINER["trainjob"]}.get(kind)
    if wanted and wanted not in names:
        problems.append(
            Problem(
                f"{path}.spec.containers",
                f"no container is named {wanted!r}, the one {kind} sets the training variables in.",
                f"name the training container {wanted}.",
            )
        )
    volumes = {volume["name"] for volume in pod.get("volumes", [])}
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
            if variable["name"] in INJECTED.get("TrainJob" if kind == "TrainingRuntime" else kind, ()):
                problems.append(_injected(f"{path}.spec.containers[{c}].env[{e}].name", kind, variable["name"]))
    return problems


def _file_rules(documents: list) -> list[Problem]:
    """Rules across the file's objects: a TrainJob's runtime is the file's, the grace period fits a checkpoint,
    and torchrun's shutdown timeout (in the entry point the ConfigMap carries) fits the grace period."""
    problems = []
    documents = [d for d in documents if not is_skypilot_task(d)]
    runtimes = {d["metadata"]["name"] for d in documents if d["kind"] == "TrainingRuntime"}
    entry_timeouts = [
        int(match.group(1))
        for d in documents
        if d["kind"] == "ConfigMap"
        for text in d.get("data", {}).values()
        for match in [_SHUTDOWN_TIMEOUT.search(text)]
        if match
    ]
    for index, document in enumerate(documents):
        if document["kind"] == "TrainJob" and runtimes:
            ref = document["spec"]["runtimeRef"]
            if ref.get("kind", "ClusterTrainingRuntime") == "TrainingRuntime" and ref["name"] not in runtimes:
                problems.append(
                    Problem(
                        f"{_place(document, index)}.spec.runtimeRef.name",
                        f"{ref['name']!r} is none of this file's TrainingRuntimes ({', '.join(sorted(runtimes))}).",
                        "name the runtime this file defines.",
                    )
                )
        checkpoint = document["metadata"].get("annotations", {}).get(CHECKPOINT_ANNOTATION)
        for path, template in _pod_templates(document):
            grace = template["spec"].get("terminationGracePeriodSeconds", 30)  # Kubernetes' default
            where = f"{_place(document, index)}.{path}.spec.terminationGracePeriodSeconds"
            found = grace_problem(grace, int(checkpoint)) if checkpoint is not None and checkpoint.isdigit() else None
            if found:
                problems.append(
                    Problem(where, found[0].replace("(--checkpoint_seconds)", f"({CHECKPOINT_ANNOTATION})"), found[1])
                )
            for timeout in entry_timeouts:
                if timeout > grace - EXIT_MARGIN_SECONDS:
                    problems.append(
                        Problem(
                            where,
                            f"{grace} s: the entry point lets torchrun wait {timeout} s for its processes, and the pod "
                            "is killed before it can exit with the restart status.",
                            f"give it {timeout + EXIT_MARGIN_SECONDS} or more, or regenerate the files.",
                        )
                    )
    return problems
