"""The rules across the Kubernetes objects of one file (as `kubectl apply -f` submits them together): a TrainJob
names the runtime the file defines, and each pod running distsetup's entry point has a grace period long enough for a
checkpoint and for the shutdown timeout the entry point gives torchrun."""

import re

from distsetup.formats.problems import Problem
from distsetup.jobs.engines import is_skypilot_task
from distsetup.jobs.spec import EXIT_MARGIN_SECONDS, grace_problem
from distsetup.jobs.walk import place, pod_templates, runs_entry_point

CHECKPOINT_ANNOTATION = "distsetup.dev/checkpoint-seconds"
_SHUTDOWN_TIMEOUT = re.compile(r"^export TORCH_ELASTIC_SHUTDOWN_TIMEOUT=(\d+)", re.MULTILINE)


def file_rules(documents: list) -> list[Problem]:
    """Rules across the file's Kubernetes objects: a TrainJob names the runtime the file defines, the grace period
    fits a checkpoint, and the shutdown timeout the entry point (in the file's ConfigMap) gives torchrun fits the
    grace period."""
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
        named = place(document, index)
        if document["kind"] == "TrainJob":
            problems += _runtime_ref_problems(named, document["spec"]["runtimeRef"], runtimes)
        checkpoint = document["metadata"].get("annotations", {}).get(CHECKPOINT_ANNOTATION)
        for path, template in pod_templates(document):
            if not runs_entry_point(template["spec"]):
                continue
            grace = template["spec"].get("terminationGracePeriodSeconds", 30)  # Kubernetes' default
            where = f"{named}.{path}.spec.terminationGracePeriodSeconds"
            found = grace_problem(grace, int(checkpoint)) if checkpoint is not None and checkpoint.isdigit() else None
            if found:
                said = found[0].replace("(--checkpoint_seconds)", f"({CHECKPOINT_ANNOTATION})")
                problems.append(Problem(where, said, found[1]))
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


def _runtime_ref_problems(named: str, ref: dict, runtimes: set[str]) -> list[Problem]:
    """A TrainJob's runtimeRef against the namespaced runtimes of its file (its kind defaults to the cluster's)."""
    if not runtimes:
        return []
    kind = ref.get("kind")
    if kind is None and ref["name"] in runtimes:
        return [
            Problem(
                f"{named}.spec.runtimeRef.kind",
                f"left out, it is ClusterTrainingRuntime, and {ref['name']!r} is this file's TrainingRuntime.",
                "write kind: TrainingRuntime.",
            )
        ]
    if kind == "TrainingRuntime" and ref["name"] not in runtimes:
        return [
            Problem(
                f"{named}.spec.runtimeRef.name",
                f"{ref['name']!r} is none of this file's TrainingRuntimes ({', '.join(sorted(runtimes))}).",
                "name the runtime this file defines.",
            )
        ]
    return []
