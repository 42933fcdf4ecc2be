"""Where distsetup's rules look in a schema-valid Kubernetes object: its name in messages, the replicated Jobs of a
JobSet or a runtime's JobSet template, the pods it makes, and whether a pod runs distsetup's entry point."""

from distsetup.jobs.engines import ANCESTOR_LABEL, TRAINER_ANCESTOR, is_skypilot_task
from distsetup.jobs.entry import ENTRY_NAME


def place(document, index: int) -> str:
    """An object as kubectl names it (kind/name), a SkyPilot task as Task/name, or by its place in the file."""
    if is_skypilot_task(document) and isinstance(document.get("name"), str):
        return f"Task/{document['name']}"
    if isinstance(document, dict) and isinstance(document.get("metadata"), dict):
        name = document["metadata"].get("name")
        if isinstance(name, str) and isinstance(document.get("kind"), str):
            return f"{document['kind']}/{name}"
    return f"[{index}]"


def jobset_spec(document: dict) -> tuple[str, dict]:
    """(path, spec) of a JobSet's spec or a runtime's JobSet template's; ("", {}) for other kinds."""
    if document["kind"] == "JobSet":
        return "spec", document["spec"]
    if document["kind"] in ("TrainingRuntime", "ClusterTrainingRuntime"):
        return "spec.template.spec", document["spec"]["template"]["spec"]
    return "", {}


def replicated_jobs(document: dict):
    """(path, Job spec, replicated Job) of each replicated Job of a JobSet or a runtime's JobSet template."""
    path, jobset = jobset_spec(document)
    for index, replicated in enumerate(jobset.get("replicatedJobs", [])):
        if "spec" in replicated["template"]:
            yield f"{path}.replicatedJobs[{index}]", replicated["template"]["spec"], replicated


def pod_templates(document: dict):
    """(path, pod template) of every pod the object makes."""
    for path, job, _ in replicated_jobs(document):
        yield f"{path}.template.spec.template", job["template"]
    if document["kind"] == "PyTorchJob":
        for role, replica in document["spec"]["pytorchReplicaSpecs"].items():
            if "template" in replica:
                yield f"spec.pytorchReplicaSpecs.{role}.template", replica["template"]


def runs_entry_point(pod: dict) -> bool:
    """Whether a pod's first container runs distsetup's entry point (which distsetup's contract is about)."""
    container = pod["containers"][0]
    return any(word.endswith(f"/{ENTRY_NAME}") for word in container.get("command", []) + container.get("args", []))


def is_trainer_job(replicated: dict) -> bool:
    return replicated["template"].get("metadata", {}).get("labels", {}).get(ANCESTOR_LABEL) == TRAINER_ANCESTOR


def plain_env(container: dict) -> dict[str, str]:
    return {variable["name"]: variable["value"] for variable in container.get("env", []) if "value" in variable}
