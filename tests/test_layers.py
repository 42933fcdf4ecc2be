"""The package's layers import downward only, and every module imports alone (pip-tools'
test_circular_imports): a cycle or a layer crossed fails here rather than for a user.

- cli: the Click group and its commands, and the option, writer and launch-option modules they share;
- training: distsetup.train and distsetup.training (imports torch);
- core: everything else, the file formats, scripts and planning, which the other two build on.

Core imports neither of the others; training imports nothing of the cli (nor Click); a command imports no
other command (what two commands share lives in a module of its own).
"""

import ast
import subprocess
import sys

import pytest

from tests.conftest import REPO

PACKAGE = REPO / "distsetup"
CLI = (
    "distsetup.cli",
    "distsetup.__main__",
    "distsetup.commands",
    "distsetup.options",
    "distsetup.output",
    "distsetup.launch_options",
)
TRAINING = ("distsetup.train", "distsetup.training")


def module_names() -> list[str]:
    names = []
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(REPO).with_suffix("").parts
        names.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return names


def imports_of(name: str) -> set[str]:
    """Every module `name` imports, at its top or inside a function (lazy imports count too)."""
    path = REPO / (name.replace(".", "/") + ".py")
    if not path.exists():
        path = REPO / name.replace(".", "/") / "__init__.py"
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def in_layer(name: str, layer: tuple[str, ...]) -> bool:
    return any(name == prefix or name.startswith(prefix + ".") for prefix in layer)


def layer_of(name: str) -> str:
    return "cli" if in_layer(name, CLI) else "training" if in_layer(name, TRAINING) else "core"


def crossings(name: str) -> list[str]:
    """The imports of module `name` that break the layer rules."""
    ours = {i for i in imports_of(name) if i.startswith("distsetup.") and i in set(module_names())}
    layer, bad = layer_of(name), []
    if layer == "core":
        bad += [i for i in ours if layer_of(i) != "core"]
    if layer == "training":
        bad += [i for i in ours if layer_of(i) == "cli"]
        bad += [i for i in imports_of(name) if i == "click" or i.startswith("click.")]
    if name.startswith("distsetup.commands."):
        bad += [i for i in ours if i.startswith("distsetup.commands.")]
    return sorted(bad)


def test_layers_import_downward_only():
    assert len(module_names()) > 30
    violations = {name: crossings(name) for name in module_names() if crossings(name)}
    assert violations == {}


def test_the_rules_catch_a_crossing():
    """The check above sees lazy imports, and what it forbids is forbidden."""
    assert "distsetup.training.model" in imports_of("distsetup.commands.plan")  # imported inside a function
    assert layer_of("distsetup.validate") == "core" and layer_of("distsetup.launch_options") == "cli"
    assert layer_of("distsetup.training.world") == layer_of("distsetup.train") == "training"


@pytest.mark.parametrize("name", [n for n in module_names() if n != "distsetup.__main__"])
def test_each_module_imports_alone(name):
    result = subprocess.run([sys.executable, "-c", f"import {name}"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
