"""A cluster's own CustomResourceDefinitions as schemas (`distsetup validate FILE --crd CRD.yaml`): each served
version's `openAPIV3Schema`, made strict about unknown fields where it lists its fields, as the API server's strict
field validation is (`kubectl apply --validate=strict`). A CRD file is what `kubectl get crd NAME -o yaml` prints,
or an engine's release manifests: every CustomResourceDefinition in it is read, the other objects are left."""

from pathlib import Path

import yaml

from distsetup.errors import DistsetupError
from distsetup.formats.reading import yaml_problem

MAX_CRD_BYTES = 64 << 20  # an engine's CRDs run to megabytes (the whole pod schema, embedded in each)


def crd_schemas(paths: tuple[Path, ...]) -> dict[tuple[str, str], dict]:
    """{(apiVersion, kind): the strict schema} of every CRD version in the files."""
    found: dict[tuple[str, str], dict] = {}
    for path in paths:
        for document in _documents(path):
            listed = isinstance(document, dict) and document.get("kind") == "List"
            items = document.get("items", []) if listed else [document]
            for crd in items:
                if isinstance(crd, dict) and crd.get("kind") == "CustomResourceDefinition":
                    found |= _versions(crd)
        if not found:
            raise DistsetupError(
                f"--crd {path} holds no CustomResourceDefinition.",
                "give the output of `kubectl get crd NAME -o yaml`, or the engine's CRD file.",
            )
    return found


def _documents(path: Path) -> list:
    """The YAML documents of a CRD file: larger than any config, and a file the user names (no config limits)."""
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_CRD_BYTES + 1)
    except OSError as e:
        raise DistsetupError(f"cannot read --crd {path}: {e.strerror}.", "check the path.")
    if len(data) > MAX_CRD_BYTES:
        raise DistsetupError(f"--crd {path} is larger than {MAX_CRD_BYTES >> 20} MiB.", "give one CRD's file.")
    try:
        return list(yaml.load_all(data, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader)))
    except yaml.YAMLError as e:
        raise DistsetupError(f"--crd {path} is not valid YAML: {yaml_problem(e)}.", "give the CRD's YAML.")


def _versions(crd: dict) -> dict[tuple[str, str], dict]:
    spec = crd.get("spec", {})
    group, kind = spec.get("group"), spec.get("names", {}).get("kind")
    return {
        (f"{group}/{version['name']}", kind): strict(version["schema"]["openAPIV3Schema"])
        for version in spec.get("versions", [])
        if version.get("served", True) and "openAPIV3Schema" in version.get("schema", {})
    }


def strict(schema):
    """The OpenAPI schema as a JSON Schema that refuses unknown fields: `additionalProperties: false` beside every
    `properties` list that does not keep unknown fields (x-kubernetes-preserve-unknown-fields), and `nullable` as
    the null type."""
    if isinstance(schema, list):
        return [strict(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    result: dict = {}
    for key, value in schema.items():
        if key in ("properties", "patternProperties"):  # field names -> their schemas
            result[key] = {name: strict(field) for name, field in value.items()}
        elif key in ("enum", "default", "example", "x-kubernetes-validations"):  # values, not schemas
            result[key] = value
        else:
            result[key] = strict(value)
    if "properties" in result and "additionalProperties" not in result:
        if not result.get("x-kubernetes-preserve-unknown-fields"):
            result["additionalProperties"] = False
    if result.pop("nullable", False) and isinstance(result.get("type"), str):
        result["type"] = [result["type"], "null"]
    return result
