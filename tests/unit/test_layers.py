"""The package's layers import downward only, and every module imports alone (pip-tools'
test_circular_imports): a cycle or a layer crossed fails here rather than for a user.

From the bottom up:
- errors: DistsetupError, which every layer raises;
- formats: the DeepSpeed file, the FSDP file, the run config (read, build, check, write);
- scripts (launch plan, sbatch, templates) and planning (memory planner, GPUs), side by side;
- training (they import torch), itself in layers: its base modules (world, user_code, run_lock, run_length,
  preemption, metrics, run_record, memory) and distsetup.preflight; model/ and optim; data/; loss/ and checkpoint/,
  side by side; backends/; the trainer (with the loop state, model set-up and resume it makes) and distsetup.train;
- cli: the Click group, its commands, and the option, writer and launch-option modules they share.

A module imports only from its own layer and those below; groups side by side not from each other; nothing
but the cli imports Click; a command imports no other command (what two share has a module).
"""

import ast
import os
import subprocess
import sys

import pytest
from repo import REPO

PACKAGE = REPO / "distsetup"
LAYERS = (  # bottom first; a layer's groups may not import each other; a module is in its longest prefix's group
    (("distsetup.errors", "distsetup.__init__"),),
    (("distsetup.formats",),),
    (("distsetup.scripts",), ("distsetup.planning",)),
    (("distsetup.training", "distsetup.preflight"), ("distsetup.jobs",)),
    (("distsetup.training.model", "distsetup.training.optim"),),
    (("distsetup.training.data",),),
    (("distsetup.training.loss",), ("distsetup.training.checkpoint",)),
    (("distsetup.training.backends",),),
    (
        (
            "distsetup.training.trainer",
            "distsetup.training.loop",
            "distsetup.training.model_setup",
            "distsetup.training.resuming",
            "distsetup.train",
        ),
    ),
    (("distsetup.cli", "distsetup.cli.commands", "distsetup.__main__"),),
)


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


def in_group(name: str, group: tuple[str, ...]) -> bool:
    return any(name == prefix or name.startswith(prefix + ".") for prefix in group)


def place_of(name: str) -> tuple[int, int]:
    """(layer, group) of a module of the package: the group of its longest matching prefix (distsetup.training's
    sub-packages sit above its base modules); the package itself (its version) is the bottom."""
    if name == "distsetup":
        return (0, 0)
    matches = [
        (len(prefix), layer, group)
        for layer, groups in enumerate(LAYERS)
        for group, prefixes in enumerate(groups)
        for prefix in prefixes
        if in_group(name, (prefix,))
    ]
    if not matches:
        raise AssertionError(f"{name} is in no layer: add it to LAYERS")
    _, layer, group = max(matches)
    return (layer, group)


def crossings(name: str) -> list[str]:
    """The imports of module `name` that break the layer rules."""
    modules = set(module_names()) | {"distsetup"}
    ours = {i for i in imports_of(name) if i in modules}
    (layer, group), bad = place_of(name), []
    for imported in ours:
        other_layer, other_group = place_of(imported)
        if other_layer > layer or (other_layer == layer and other_group != group):
            bad.append(imported)
    if layer < len(LAYERS) - 1:
        bad += [i for i in imports_of(name) if i == "click" or i.startswith("click.")]
    if name.startswith("distsetup.cli.commands."):
        bad += [i for i in ours if i.startswith("distsetup.cli.commands.")]
    return sorted(bad)


def test_layers_import_downward_only():
    assert len(module_names()) > 30
    violations = {name: crossings(name) for name in module_names() if crossings(name)}
    assert violations == {}


def test_the_rules_catch_a_crossing():
    """The check above sees lazy imports, and what it forbids is forbidden."""
    assert "distsetup.training.model.build" in imports_of("distsetup.cli.plan_model")  # imported inside a function
    assert place_of("distsetup.formats.validate") < place_of("distsetup.scripts.sbatch")
    assert place_of("distsetup.scripts.sbatch")[0] == place_of("distsetup.planning.gpus")[0]
    assert place_of("distsetup.training.world") < place_of("distsetup.train") < place_of("distsetup.cli.output")
    assert place_of("distsetup.training.model.gpt") < place_of("distsetup.training.data.loader")
    assert place_of("distsetup.training.loss.sliced")[0] == place_of("distsetup.training.checkpoint.files")[0]
    assert place_of("distsetup.training.checkpoint") < place_of("distsetup.training.backends.fsdp")
    assert place_of("distsetup.cli.commands.plan") == place_of("distsetup.cli.launch_options")


# Each module imported in a child forked from one interpreter that has imported the libraries the package builds
# on (the slow part: torch, and the file formats' jsonschema, yaml, jinja2; Click) and nothing of distsetup: every
# child starts with no module of ours loaded, as a fresh interpreter would. Two children at a time, one per core.
IMPORT_EACH_ALONE = """
import os, sys, traceback
import click, jinja2, jsonschema, torch, yaml  # noqa: F401
importing = {}
def reap():
    pid, status = os.wait()
    print(importing.pop(pid), os.waitstatus_to_exitcode(status), flush=True)
for name in sys.argv[1:]:
    if len(importing) == 2:
        reap()
    pid = os.fork()
    if pid == 0:
        try:
            __import__(name)
        except BaseException:
            traceback.print_exc()
            os._exit(1)
        os._exit(0)
    importing[pid] = name
while importing:
    reap()
"""
MODULES = [n for n in module_names() if n != "distsetup.__main__"]


@pytest.fixture(scope="module")
def import_results() -> tuple[dict[str, int], str]:
    result = subprocess.run(
        [sys.executable, "-c", IMPORT_EACH_ALONE, *MODULES], capture_output=True, text=True, timeout=300
    )
    statuses = dict(line.rsplit(" ", 1) for line in result.stdout.splitlines())
    return {name: int(status) for name, status in statuses.items()}, result.stderr


@pytest.mark.parametrize("name", MODULES)
def test_each_module_imports_alone(name, import_results):
    statuses, stderr = import_results
    assert statuses[name] == 0, stderr[-2000:]


def test_a_module_that_cannot_import_alone_is_caught(tmp_path):
    """The forked import sees what a fresh interpreter sees: a circular import fails there."""
    (tmp_path / "cycle_a.py").write_text("from cycle_b import B\nA = 1\n")
    (tmp_path / "cycle_b.py").write_text("from cycle_a import A\nB = 2\n")
    result = subprocess.run(
        [sys.executable, "-c", IMPORT_EACH_ALONE, "cycle_a", "json"],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(tmp_path)},
    )
    assert sorted(result.stdout.splitlines()) == ["cycle_a 1", "json 0"]  # in the order the children end
    assert "ImportError" in result.stderr


def test_every_package_is_named_in_the_layers():
    """A new sub-package is placed in LAYERS on purpose, not by the prefix of the package around it."""
    named = {prefix for layer in LAYERS for group in layer for prefix in group}
    packages = {  # folders of code (distsetup/formats/schemas holds data)
        ".".join(path.parent.relative_to(REPO).parts)
        for path in PACKAGE.rglob("__init__.py")
        if any(module.name != "__init__.py" for module in path.parent.glob("*.py"))
    }
    assert packages - {"distsetup"} <= named, sorted(packages - named - {"distsetup"})
    assert {"distsetup.training.backends", "distsetup.training.checkpoint", "distsetup.training.data"} <= named


BACKEND_NAMES = {"single", "ddp", "fsdp", "deepspeed"}


def backend_facts_compared(source: str) -> list[str]:
    """The comparisons in `source` with a backend's name or a ZeRO stage (`x.zero_stage == 3`, `name in ("ddp",
    ...)`): what only a backend may know of itself."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Compare):
            continue
        for operand in [node.left, *node.comparators]:
            values = operand.elts if isinstance(operand, (ast.Tuple, ast.List, ast.Set)) else [operand]
            names = {v.value for v in values if isinstance(v, ast.Constant) and isinstance(v.value, str)}
            stage = isinstance(operand, (ast.Attribute, ast.Name)) and "zero_stage" in ast.unparse(operand)
            if names & BACKEND_NAMES or stage:
                found.append(ast.unparse(node))
    return found


def test_no_module_of_training_outside_backends_compares_backend_names_or_zero_stages():
    """The trainer, checkpoint, data, loss and model code ask a backend (backends/base.py) what they need to know of
    it: whether the run joins a process group, what could make it hang, the layout it writes."""
    training = PACKAGE / "training"
    compared = {
        str(path.relative_to(PACKAGE)): found
        for path in sorted(training.rglob("*.py"))
        if "backends" not in path.relative_to(training).parts and (found := backend_facts_compared(path.read_text()))
    }
    assert compared == {}, compared
    # the rule sees what it forbids: the comparisons world.py and the trainer made before
    assert backend_facts_compared('if backend == "single":\n    pass') and backend_facts_compared(
        "if self.backend.zero_stage == 3 and not conditional:\n    pass"
    )
