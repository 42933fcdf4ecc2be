"""distsetup's restart contract, held in the files it did not write too: the pods that run its entry point exit
RESTART_STATUS (143) once the world has checkpointed for a preemption, and the engine starts the world again for
that without counting it as a failure, while a failure of the program (exit 1-127) stops the job, or is retried a
counted number of times. Each rule is the engine's own way of choosing, read from its code:
- a Job (Kubernetes' pod_failure_policy.go): the first podFailurePolicy rule whose exit codes match decides; without
  one, a pod's exit is a failure counted against backoffLimit;
- a JobSet (jobset's failure_policy.go): without a failurePolicy the JobSet fails at its first failed Job; with one,
  the first rule that matches the failed Job's reason, message and replicated Job decides, and RestartJobSet (the
  default where none matches) counts against maxRestarts;
- a PyTorchJob (training-operator v1): restartPolicy ExitCode recreates a pod that exits 128-255 and fails the job on
  1-127; left out, it is OnFailure, whose restarts runPolicy.backoffLimit counts, preemptions' too."""

import re

from distsetup.formats.problems import Problem
from distsetup.jobs.spec import RESTART_STATUS
from distsetup.jobs.walk import jobset_spec, pod_templates, replicated_jobs, runs_entry_point

# What a Job fails with when a FailJob exit-code rule matched (Kubernetes' pod_failure_policy.go), which a JobSet
# rule's onJobFailureMessagePatterns are matched against
FAIL_JOB_MESSAGE = (
    "Container {container} for pod {namespace}/{pod} failed with exit code {code} "
    "matching FailJob rule at index {index}"
)
JOB_FAILURE_REASON = "PodFailurePolicy"  # the Job's reason then
UNCOUNTED_RESTARTS = ("RestartJobSetAndIgnoreMaxRestarts", "RestartJobAndIgnoreMaxRestarts")
FIX_FROM_DISTSETUP = "regenerate the file with distsetup job."


def restart_problems(document: dict) -> list[Problem]:
    """Where a preemption of an object's entry-point pods would fail the job, or count against its restarts."""
    if document["kind"] == "PyTorchJob":
        return _pytorchjob_problems(document)
    problems = []
    for path, job, replicated in replicated_jobs(document):
        pod = job["template"]["spec"]
        if not runs_entry_point(pod):
            continue
        fail_job_rule, problem = _pod_failure_rule(f"{path}.template.spec", job, pod["containers"][0]["name"])
        if problem:
            problems.append(problem)
        elif fail_job_rule is not None:
            problems += _jobset_problems(document, replicated["name"], pod["containers"][0]["name"], fail_job_rule)
    return problems


def _pod_failure_rule(path: str, job: dict, container: str) -> tuple[int | None, Problem | None]:
    """(the index of the FailJob rule that takes a pod's RESTART_STATUS, None where an Ignore rule does), or the
    problem where neither does."""
    rules = job.get("podFailurePolicy", {}).get("rules", [])
    for index, rule in enumerate(rules):
        codes = rule.get("onExitCodes")
        if codes is None or codes.get("containerName", container) != container:
            continue
        if (RESTART_STATUS in codes["values"]) != (codes["operator"] == "In"):
            continue
        if rule["action"] == "FailJob":
            return index, None
        if rule["action"] == "Ignore":  # the Job recreates the pod uncounted; no restart of the JobSet needed
            return None, None
        return None, Problem(
            f"{path}.podFailurePolicy.rules[{index}].action",
            f"{rule['action']}: the entry point's exit {RESTART_STATUS} after a preemption is taken as a failure (of "
            "the Job or its index), not as a preemption to restart the world for.",
            f"write FailJob (and a JobSet failurePolicy rule that restarts the world for it), or {FIX_FROM_DISTSETUP}",
        )
    return None, Problem(
        f"{path}.podFailurePolicy",
        f"no rule takes the entry point's exit {RESTART_STATUS} after a preemption: it is counted as a failure "
        f"(against backoffLimit {job.get('backoffLimit', 6)}), then fails the Job.",
        f"add a rule FailJob onExitCodes In [{RESTART_STATUS}] for container {container}, or {FIX_FROM_DISTSETUP}",
    )


def _jobset_problems(document: dict, replicated_job: str, container: str, rule_index: int) -> list[Problem]:
    """The JobSet's failurePolicy for a Job its podFailurePolicy failed on RESTART_STATUS: restarted, uncounted."""
    path, spec = jobset_spec(document)
    policy = spec.get("failurePolicy")
    if policy is None:
        return [
            Problem(
                f"{path}.failurePolicy",
                "left out: the JobSet fails at the first preemption (its Job fails on the entry point's "
                f"exit {RESTART_STATUS}, and nothing restarts it).",
                f"add a failurePolicy whose rule RestartJobSetAndIgnoreMaxRestarts takes onJobFailureReasons "
                f"[{JOB_FAILURE_REASON}], or {FIX_FROM_DISTSETUP}",
            )
        ]
    namespace, name = document["metadata"].get("namespace", "default"), document["metadata"]["name"]
    pod = f"{name}-{replicated_job}-0-0"  # the first node's pod, but for the suffix the Job controller adds
    message = FAIL_JOB_MESSAGE.format(
        container=container, namespace=namespace, pod=pod, code=RESTART_STATUS, index=rule_index
    )
    for index, rule in enumerate(policy.get("rules", [])):
        if _applies(rule, replicated_job, message):
            action, where = rule["action"], f"{path}.failurePolicy.rules[{index}].action"
            break
    else:
        action, where = "RestartJobSet", f"{path}.failurePolicy.rules"  # the JobSet's default
    if action in UNCOUNTED_RESTARTS:
        return []
    outcome = (
        "the JobSet fails at the first preemption"
        if action == "FailJobSet"
        else f"each preemption uses one of maxRestarts ({policy.get('maxRestarts', 0)}), then the JobSet fails"
    )
    return [
        Problem(
            where,
            f"{action} for a Job failed on the entry point's exit {RESTART_STATUS} (a preemption, checkpointed): "
            f"{outcome}.",
            f"put first a rule RestartJobSetAndIgnoreMaxRestarts with onJobFailureReasons [{JOB_FAILURE_REASON}], "
            f"or {FIX_FROM_DISTSETUP}",
        )
    ]


def _applies(rule: dict, replicated_job: str, message: str) -> bool:
    """Whether a JobSet failurePolicy rule matches the Job its podFailurePolicy failed (jobset's ruleIsApplicable)."""
    reasons, targets = rule.get("onJobFailureReasons", []), rule.get("targetReplicatedJobs", [])
    patterns = rule.get("onJobFailureMessagePatterns", [])
    return (
        (not reasons or JOB_FAILURE_REASON in reasons)
        and (not targets or replicated_job in targets)
        and (not patterns or any(_matches(pattern, message) for pattern in patterns))
    )


def _matches(pattern: str, message: str) -> bool:
    try:
        return re.search(pattern, message) is not None
    except re.error:  # Go's RE2 takes a few forms Python's re does not: a pattern not read is taken as matching
        return True


def _pytorchjob_problems(document: dict) -> list[Problem]:
    """Each replica of entry-point pods is recreated on RESTART_STATUS and fails on a program's error (ExitCode)."""
    problems = []
    bounded = "backoffLimit" in document["spec"].get("runPolicy", {})
    replicas = document["spec"]["pytorchReplicaSpecs"]
    for path, template in pod_templates(document):
        role = path.split(".")[2]
        if not runs_entry_point(template["spec"]):
            continue
        policy = replicas[role].get("restartPolicy", "OnFailure")  # the operator's default
        if policy == "Never":
            outcome = f"a preempted pod's exit {RESTART_STATUS} fails the job"
        elif policy == "Always":
            outcome = "the pod restarts after the run has finished too (exit 0), and trains it again without end"
        elif policy == "OnFailure" and bounded:
            outcome = (
                f"each preemption's exit {RESTART_STATUS} is a restart runPolicy.backoffLimit counts: preemptions "
                "fail the job"
            )
        elif policy == "OnFailure":
            outcome = "a program's error (exit 1-127) restarts the pod without end (runPolicy sets no backoffLimit)"
        else:
            continue
        problems.append(
            Problem(
                f"spec.pytorchReplicaSpecs.{role}.restartPolicy",
                f"{policy}{' (left out)' if 'restartPolicy' not in replicas[role] else ''}: {outcome}.",
                f"write ExitCode (recreated on 128-255, failed on 1-127), or {FIX_FROM_DISTSETUP}",
            )
        )
    return problems
