"""Every problem of the objects of one file: each object against its schema (and the cluster's CRD), then what the
schemas cannot say, coded: one object's rules (object_rules.py; a SkyPilot task's in skypilot.py) and the rules
across the file (file_rules.py)."""

from distsetup.formats.problems import Problem, schema_problems_in
from distsetup.jobs.engines import is_skypilot_task
from distsetup.jobs.file_rules import file_rules
from distsetup.jobs.object_rules import object_rules
from distsetup.jobs.schema import schemas
from distsetup.jobs.skypilot import SKYPILOT_TASK, task_problems
from distsetup.jobs.walk import place


def manifest_problems(documents: list, crds: dict[tuple[str, str], dict] | None = None) -> list[Problem]:
    """Every problem of the objects of one file: each against its schema (and against the cluster's CRD for its
    kind, among `crds`: crd.py), then the rules, each problem's path starting with the object's kind/name (or its
    place in the file: [0], [1], ...). Objects of other kinds are left to the cluster (manifest_notes)."""
    problems = []
    for index, document in enumerate(documents):
        found = _object_problems(document, crds or {})
        where = place(document, index)
        problems += [Problem(f"{where}.{p.path}" if p.path else where, p.message, p.fix) for p in found]
    if not problems:
        problems += file_rules([d for d in documents if _schema_of(d) is not None])
    return problems


def manifest_notes(documents: list) -> list[str]:
    """What the file holds that distsetup does not check."""
    known = ", ".join(kind for _, kind in schemas())
    return [
        f"{place(document, index)}: not checked (distsetup checks {known} and SkyPilot tasks)."
        for index, document in enumerate(documents)
        if _schema_of(document) is None
    ]


def _schema_of(document) -> dict | None:
    if is_skypilot_task(document):
        return SKYPILOT_TASK
    if not isinstance(document, dict):
        return None
    return schemas().get((str(document.get("apiVersion")), str(document.get("kind"))))


def _object_problems(document, crds: dict) -> list[Problem]:
    schema = _schema_of(document)
    if schema is None:
        return []
    found = schema_problems_in(document, schema)
    crd = crds.get((document.get("apiVersion"), document.get("kind")))
    if crd is not None:
        said = {(p.path, p.message) for p in found}
        found += [
            Problem(p.path, f"{p.message.rstrip('.')} (by the cluster's CRD).", p.fix)
            for p in schema_problems_in(document, crd)
            if (p.path, p.message) not in said
        ]
    if found:
        return found
    return task_problems(document) if schema is SKYPILOT_TASK else object_rules(document)
