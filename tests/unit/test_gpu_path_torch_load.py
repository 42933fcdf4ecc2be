"""Every torch.load in distsetup says where the tensors go: without map_location a file written on a GPU loads
back onto that GPU (rank 0 would put a whole DeepSpeed module on cuda:0 beside its live engine), and a CPU-only
machine cannot read it at all."""

import ast

from repo import REPO


def torch_loads_without_map_location(source: str) -> list[int]:
    """The lines of the `torch.load(...)` calls in `source` that give no map_location (keyword or second argument)."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "load"):
            continue
        if isinstance(node.func.value, ast.Name) and node.func.value.id == "torch":
            given = len(node.args) > 1 or any(k.arg == "map_location" or k.arg is None for k in node.keywords)
            if not given:
                lines.append(node.lineno)
    return lines


def test_the_check_finds_a_load_without_map_location():
    assert torch_loads_without_map_location("import torch\ntorch.load(f)\ntorch.load(f, mmap=True)") == [2, 3]
    assert torch_loads_without_map_location("torch.load(f, map_location='cpu')\ntorch.load(f, 'cpu')") == []


def test_every_torch_load_says_where_the_tensors_go():
    found = [
        f"{path.relative_to(REPO)}:{line}"
        for path in sorted((REPO / "distsetup").rglob("*.py"))
        for line in torch_loads_without_map_location(path.read_text())
    ]
    assert not found, "torch.load without map_location at " + ", ".join(found)
