"""`distsetup validate` of the files `distsetup job` writes, wherever they came from: which kind a YAML file is (a
Kubernetes manifest, a SkyPilot task) and its problems (rules.py), also against the cluster's CRDs (crd.py)."""

import re
from pathlib import Path

from distsetup.formats.reading import read_config_text, read_yaml_documents
from distsetup.formats.validate import YAML_SUFFIXES, Validated
from distsetup.jobs.engines import is_skypilot_task

JOB_KINDS = ("kubernetes", "skypilot")
# A Kubernetes manifest: an object's apiVersion and kind at the top level (no other kind of file has them)
_MANIFEST = re.compile(r"^apiVersion:.*^kind:|^kind:.*^apiVersion:", re.MULTILINE | re.DOTALL)


def job_file_kind(path: Path) -> str | None:
    """ "kubernetes" or "skypilot" for a YAML file of those kinds, else None (another config: formats/validate.py)."""
    if path.suffix not in YAML_SUFFIXES:
        return None
    text = read_config_text(path, "file")
    if _MANIFEST.search(text):
        return "kubernetes"
    if re.search(r"^run:", text, re.MULTILINE):
        documents = read_yaml_documents(path)
        if documents and is_skypilot_task(documents[0]):
            return "skypilot"
    return None


def validate_job_file(path: Path, kind: str, crds: tuple[Path, ...] = ()) -> Validated:
    """The problems of a manifest or task (its documents under "documents"), a manifest also against the
    CustomResourceDefinitions in `crds`; the objects distsetup does not check are named in the notes."""
    from distsetup.jobs.crd import crd_schemas  # the rules and schemas only for such a file
    from distsetup.jobs.rules import manifest_notes, manifest_problems

    documents = read_yaml_documents(path)
    problems = manifest_problems(documents, crd_schemas(crds))
    return Validated(kind, problems, {"documents": documents}, manifest_notes(documents))
