"""fast_schema.conforms never calls a file valid that jsonschema calls invalid, and it does accept the
files distsetup writes and ships (else the fast path would never be taken)."""

import functools
import json

import jsonschema
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from repo import REPO

from distsetup.formats.fast_schema import conforms
from distsetup.formats.problems import load_schema, schema_problems
from distsetup.formats.reading import parse_yaml
from distsetup.jobs import forms

SCHEMAS = ["deepspeed", "fsdp", "run_config"]
ANY_JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-3, 10**20) | st.floats() | st.text(max_size=4),
    lambda inner: st.lists(inner, max_size=2) | st.dictionaries(st.text(max_size=3), inner, max_size=2),
    max_leaves=4,
)


def valid(schema: dict):
    """Values the schema accepts (for the keywords distsetup's schemas use)."""
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    if "properties" in schema:
        required = set(schema.get("required", []))
        props = {key: valid(sub) for key, sub in schema["properties"].items()}
        return st.fixed_dictionaries(
            {k: v for k, v in props.items() if k in required},
            optional={k: v for k, v in props.items() if k not in required},
        )
    types = schema.get("type", ["null", "boolean", "string"])
    return st.one_of([of_type(name, schema) for name in (types if isinstance(types, list) else [types])])


def of_type(name: str, schema: dict):
    if name == "array":
        return st.lists(
            valid(schema.get("items", {})), min_size=schema.get("minItems", 0), max_size=schema.get("maxItems", 3)
        )
    if name in ("integer", "number"):
        low, high = schema.get("minimum", schema.get("exclusiveMinimum", -1e6)), schema.get("maximum", 1e6)
        exclusive = "exclusiveMinimum" in schema
        if name == "number":
            return st.floats(low, high, exclude_min=exclusive)
        return st.integers(int(low) + 1 if exclusive or low != int(low) else int(low), int(high))
    return {
        "boolean": st.booleans(),
        "null": st.none(),
        "string": st.text(min_size=schema.get("minLength", 0)),
        "object": st.dictionaries(st.text(max_size=3), ANY_JSON, max_size=2),
    }[name]


def near_valid(schema: dict):
    """Valid values, values a little wrong (a bound crossed, a wrong type; in objects, keys missing or unknown
    and wrong values deeper down) and anything at all."""
    bounds = [schema[k] for k in ("minimum", "maximum", "exclusiveMinimum") if k in schema]
    wrong = [
        ANY_JSON,
        st.sampled_from([b + d for b in bounds or [0] for d in (-1, -0.5, 0, 0.5, 1)]),
        st.sampled_from([True, 1, 1.0, "x", "", None]),
    ]
    if "properties" in schema:
        wrong.append(
            st.fixed_dictionaries(
                {}, optional={**{k: near_valid(v) for k, v in schema["properties"].items()}, "unknown_key": ANY_JSON}
            )
        )
    return st.one_of([valid(schema)] * 3 + wrong)


@functools.cache
def near_valid_documents(name: str):
    """near_valid's strategy for one shipped schema, built once: building it walks the whole schema, which cost more
    than the draws and checks of all 250 examples."""
    return near_valid(load_schema(name))


def jsonschema_valid(data, schema) -> bool:
    return jsonschema.Draft202012Validator(schema).is_valid(data)


@pytest.mark.parametrize("name", SCHEMAS)
@settings(max_examples=250, deadline=None)
@given(data=st.data())
def test_conforms_only_what_jsonschema_accepts(name, data):
    schema = load_schema(name)
    document = data.draw(near_valid_documents(name))
    if conforms(document, schema):
        assert jsonschema_valid(document, schema), json.dumps(document, default=str)
    else:  # the slow path: problems exactly where jsonschema finds the file invalid
        assert bool(schema_problems(document, name)) != jsonschema_valid(document, schema)


def shipped_files():
    files = [
        (p.stem, "deepspeed", json.loads(p.read_text())) for p in sorted((REPO / "config" / "presets").glob("*.json"))
    ]
    return files + [("config.yaml", "run_config", parse_yaml((REPO / "config" / "config.yaml").read_text()))]


@pytest.mark.parametrize("label, name, document", shipped_files(), ids=lambda v: v if isinstance(v, str) else "")
def test_shipped_files_take_the_fast_path(label, name, document):
    assert conforms(document, load_schema(name)) and jsonschema_valid(document, load_schema(name))


@pytest.mark.parametrize(
    "document, schema",
    [
        (True, {"type": "integer"}),  # a bool is not a number to JSON Schema
        (1.0, {"type": "string"}),
        (True, {"enum": [1, 2]}),
        ([True], {"enum": [[1]]}),  # jsonschema compares inside lists strictly too
        (1, {"properties": {}, "not_a_keyword": False}),
        (1, False),  # a `false` schema accepts nothing
        (7, {"type": "integer", "exclusiveMinimum": 7}),
        (1, {"type": "number", "exclusiveMaximum": 1}),  # a beta of 1 (deepspeed_params.BETAS)
        ({"a": 1}, {"properties": {"b": {}}, "additionalProperties": False}),
        ({}, {"required": ["a"]}),
        ([1, 2, 3], {"maxItems": 2}),
        ("", {"minLength": 1}),
        ({"a": 1}, {"patternProperties": {"a": {}}}),  # a keyword it does not know: it leaves it to jsonschema
    ],
)
def test_says_no_where_it_must(document, schema):
    assert not conforms(document, schema)


@pytest.mark.parametrize(
    "document, schema, valid",
    [  # the forms of Kubernetes' names and sizes (jobs/forms.py): the fast path and jsonschema agree
        ("my ns", forms.DNS_LABEL.schema(), False),
        ("a" * 64, forms.DNS_LABEL.schema(), False),
        ("16 GB", forms.QUANTITY.schema(), False),
        ({"nvidia gpu": 1}, {"propertyNames": forms.RESOURCE_NAME.schema()}, False),
        ("team-a", forms.DNS_LABEL.schema(), True),
        ("runs.example.com", forms.DNS_SUBDOMAIN.schema(), True),
        ("16Gi", forms.QUANTITY.schema(), True),
        ("1.5e3", forms.QUANTITY.schema(), True),
        ({"nvidia.com/gpu": 8, "cpu": "500m"}, {"propertyNames": forms.RESOURCE_NAME.schema()}, True),
    ],
)
def test_the_forms_kubernetes_takes(document, schema, valid):
    assert conforms(document, schema) == valid == jsonschema_valid(document, schema)
