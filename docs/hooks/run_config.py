"""MkDocs hook: the run config's reference, one table per section, rendered at build time from the dataclasses
in distsetup/formats/runconfig.py through the JSON Schema they yield (the schema `make schemas` ships), so a
field's type, default, range and meaning are written once, beside the field.

A page holds `<!-- run-config-reference -->` where the tables go; a build in which no page holds it fails.
"""

import dataclasses
import json

from mkdocs.exceptions import PluginError

from distsetup.formats.runconfig import SECTIONS, run_config_schema

MARKER = "<!-- run-config-reference -->"
TYPES = {"integer": "integer", "number": "number", "string": "string", "boolean": "boolean", "object": "mapping"}
_found: list[str] = []


def on_pre_build(config) -> None:
    _found.clear()


def on_page_markdown(markdown: str, page, config, files) -> str:
    if MARKER not in markdown:
        return markdown
    _found.append(page.file.src_uri)
    return markdown.replace(MARKER, reference())


def on_post_build(config) -> None:
    if not _found:
        raise PluginError(f"docs/hooks/run_config.py: no page holds {MARKER}; the run config reference is lost")


def reference() -> str:
    """Markdown: a heading, the section's docstring and a table of its keys, for each section in file order
    (the heading names the section: `training` and `max_steps` are `training.max_steps` on a command line)."""
    schema = run_config_schema()["properties"]
    parts = []
    for name, cls in SECTIONS.items():
        rows = ["| key | type | default | meaning |", "| --- | --- | --- | --- |"]
        for f in dataclasses.fields(cls):
            prop = schema[name]["properties"][f.name]
            rows.append(
                f"| `{f.name}` | {type_text(prop)} | {default_text(f)} | "
                f"{escape(prop['description'])}{limits_text(prop)} |"
            )
        parts.append(f"### `{name}`\n\n{escape(schema[name]['description'])}\n\n" + "\n".join(rows))
    return "\n\n".join(parts) + "\n"


def type_text(prop: dict) -> str:
    kinds = prop["type"] if isinstance(prop["type"], list) else [prop["type"]]
    words = []
    for kind in kinds:
        if kind == "array":
            items = prop["items"]
            words.append(f"list of {TYPES[items['type']]}" + (f" ({one_of(items['enum'])})" if "enum" in items else ""))
        elif kind != "null":
            words.append(one_of(prop["enum"]) if "enum" in prop else TYPES[kind])
    return " or ".join(words) + (" or null" if "null" in kinds else "")


def one_of(values: list) -> str:
    return ", ".join(f"`{v}`" for v in values)


def default_text(f: dataclasses.Field) -> str:
    value = f.default_factory() if callable(f.default_factory) else f.default
    return f"`{value if isinstance(value, str) else json.dumps(value)}`"  # as YAML writes it: null, true, [0.9, 0.95]


def limits_text(prop: dict) -> str:
    """The schema's numeric and length constraints, as a reader checks a value against them."""
    said = []
    if "minimum" in prop and "maximum" in prop:
        said.append(f"{prop['minimum']} to {prop['maximum']}")
    elif "minimum" in prop:
        said.append(f"at least {prop['minimum']}")
    elif "maximum" in prop:
        said.append(f"at most {prop['maximum']}")
    if "exclusiveMinimum" in prop:
        said.append(f"above {prop['exclusiveMinimum']}")
    if "minItems" in prop and prop.get("minItems") == prop.get("maxItems"):
        said.append(f"exactly {prop['minItems']} items")
    return f" ({'; '.join(said)})" if said else ""


def escape(text: str) -> str:
    """Plain text in a Markdown table cell: a pipe would end the cell, * _ ` [ would start markup, & < HTML."""
    for char in "\\|*_`[":
        text = text.replace(char, "\\" + char)
    return text.replace("&", "&amp;").replace("<", "&lt;")
