"""The one file `distsetup job` writes: for a Kubernetes engine every object the job needs, in the order
`kubectl apply -f` creates them; for SkyPilot the task. The command checks it by the rules `distsetup validate`
applies before it writes it."""

import shlex
from pathlib import Path

import yaml

from distsetup.formats.reading import read_config_text
from distsetup.jobs import kubernetes, skypilot
from distsetup.jobs.entry import ENTRY_NAME, entry_script, shipped_files
from distsetup.jobs.file_rules import CHECKPOINT_ANNOTATION
from distsetup.jobs.spec import JobSpec, check_job


def job_documents(spec: JobSpec, command_line: str) -> list[dict]:
    """The file's documents: the Kubernetes objects (job_objects), or the SkyPilot task."""
    check_job(spec)
    if spec.target == "skypilot":
        return [skypilot.task(spec, entry_script(spec, command_line))]
    return job_objects(spec, command_line)


def job_objects(spec: JobSpec, command_line: str) -> list[dict]:
    """The ConfigMap (run config, backend file, entry point), the working volume's claim unless an existing one is
    named, and the engine's objects, the checkpoint time stated beside the grace period it must fit."""
    texts = {name: read_config_text(Path(path), "file") for name, path in shipped_files(spec.launch).items()}
    texts[ENTRY_NAME] = entry_script(spec, command_line)
    objects = [kubernetes.files_configmap(spec, texts)]
    if spec.checkpoint_claim is None:
        objects.append(kubernetes.checkpoint_claim(spec))
    for engine_object in kubernetes.engine_objects(spec):
        if engine_object["kind"] != "TrainJob":  # the objects that hold the pod template
            engine_object["metadata"]["annotations"] = {CHECKPOINT_ANNOTATION: str(spec.checkpoint_seconds)}
        objects.append(engine_object)
    return objects


class _Dumper(yaml.SafeDumper):
    """Scripts and files as block text (`|`), readable in the manifest."""


_Dumper.add_representer(
    str,
    lambda dumper, text: dumper.represent_scalar("tag:yaml.org,2002:str", text, style="|" if "\n" in text else None),
)


def manifest_text(objects: list[dict], command_line: str, submit: str) -> str:
    """The objects as one multi-document YAML file, headed by how it was written and how it is submitted."""
    header = (
        "# Written by `distsetup job`; regenerate it rather than editing by hand:\n"
        f"#   {command_line}\n# Submit: {submit}\n"
    )
    # allow_unicode: text outside ASCII (an --env value, a comment in the run config) kept as it is, not escaped,
    # which also turned the whole script or file it is in into one quoted line
    documents = (yaml.dump(o, Dumper=_Dumper, sort_keys=False, width=120, allow_unicode=True) for o in objects)
    return header + "---\n".join(documents)


def default_output(target: str) -> str:
    return "sky/task.yaml" if target == "skypilot" else f"k8s/{target}.yaml"


def submit_command(spec: JobSpec, path: str) -> str:
    """The one command that submits the file: a managed SkyPilot job (recovered after preemptions), or kubectl."""
    if spec.target == "skypilot":
        return f"sky jobs launch {shlex.quote(path)}"
    return f"kubectl apply{f' -n {shlex.quote(spec.namespace)}' if spec.namespace else ''} -f {shlex.quote(path)}"
