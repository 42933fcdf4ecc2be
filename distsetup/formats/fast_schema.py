"""A quick yes/no for the part of JSON Schema that distsetup's own schemas use.

Importing jsonschema takes about a quarter of a generating command's time, and almost every file a
command checks is valid. `conforms` answers "valid" without it; every "no" (and any keyword it does
not know) goes on to jsonschema, which finds and explains the problems. So it may say "no" too often,
never "yes" too often: tests/unit/test_fast_schema.py holds it to that against jsonschema itself.
"""

import re

KNOWN_KEYWORDS = {
    "$schema",
    "title",
    "description",
    "examples",
    "type",
    "enum",
    "minimum",
    "maximum",
    "exclusiveMinimum",
    "exclusiveMaximum",
    "properties",
    "additionalProperties",
    "required",
    "items",
    "minItems",
    "maxItems",
    "minLength",
    "maxLength",
    "pattern",
    "propertyNames",
}
PYTHON_TYPES = {"array": list, "string": str, "boolean": bool, "null": type(None)}


def conforms(value, schema: dict) -> bool:
    """True only if `value` is valid under `schema`; False if it is not, or if unsure."""
    if isinstance(schema, bool):  # `true` accepts anything, `false` nothing
        return schema
    if not KNOWN_KEYWORDS.issuperset(schema):
        return False
    if "type" in schema and not _has_type(value, schema["type"]):
        return False
    if "enum" in schema and not any(_same_scalar(value, choice) for choice in schema["enum"]):
        return False
    if _is_number(value) and not _within_bounds(value, schema):
        return False
    if isinstance(value, str) and not _conforming_string(value, schema):
        return False
    if isinstance(value, list) and not _conforming_list(value, schema):
        return False
    if isinstance(value, dict) and not _conforming_object(value, schema):
        return False
    return True


def _same_scalar(value, choice) -> bool:
    """Equal and of one type (so True is not 1); lists and objects are left to jsonschema."""
    return type(value) is type(choice) and not isinstance(value, (list, dict)) and value == choice


def _has_type(value, expected) -> bool:
    names = expected if isinstance(expected, list) else [expected]
    return any(_is_type(value, name) for name in names)


def _is_type(value, name: str) -> bool:
    if name == "number":
        return _is_number(value)
    if name == "integer":
        return type(value) is int or (type(value) is float and value.is_integer())
    if name == "object":  # a dict subclass too, as jsonschema's is_object: read_json's objects note duplicate keys
        return isinstance(value, dict)
    return name in PYTHON_TYPES and type(value) is PYTHON_TYPES[name]


def _is_number(value) -> bool:
    return type(value) in (int, float)


def _within_bounds(value, schema: dict) -> bool:
    return (
        value >= schema.get("minimum", value)
        and value <= schema.get("maximum", value)
        and ("exclusiveMinimum" not in schema or value > schema["exclusiveMinimum"])
        and ("exclusiveMaximum" not in schema or value < schema["exclusiveMaximum"])
    )


def _conforming_string(value: str, schema: dict) -> bool:
    if not schema.get("minLength", 0) <= len(value) <= schema.get("maxLength", len(value)):
        return False
    return "pattern" not in schema or re.search(schema["pattern"], value) is not None


def _conforming_list(value: list, schema: dict) -> bool:
    if not schema.get("minItems", 0) <= len(value) <= schema.get("maxItems", len(value)):
        return False
    return all(conforms(item, schema.get("items", {})) for item in value)


def _conforming_object(value: dict, schema: dict) -> bool:
    properties, extra = schema.get("properties", {}), schema.get("additionalProperties", True)
    if not set(schema.get("required", [])) <= value.keys():
        return False
    if "propertyNames" in schema and not all(conforms(key, schema["propertyNames"]) for key in value):
        return False
    for key, item in value.items():
        if key in properties:
            if not conforms(item, properties[key]):
                return False
        elif extra is False or (isinstance(extra, dict) and not conforms(item, extra)):
            return False
    return True
