"""What a module's source says of a function the run config names, read without running it (validate runs none of
the user's code, nor torch): whether the module defines it, and where it is a plain function, whether it takes the
run config's keyword arguments. Only what the source says for certain is a problem: a module that makes names as it
runs (a module __getattr__, `import *`, globals()) or a decorated function is left to the run's import."""

import ast
from pathlib import Path

from distsetup.formats.problems import Problem, closest


def problems(source: Path, module: str, function: str, where: str, args: dict | None) -> list[Problem]:
    try:
        tree = ast.parse(source.read_text(encoding="utf-8"), filename=str(source))
    except (OSError, SyntaxError, UnicodeDecodeError, ValueError):  # the run's import says it
        return []
    if _makes_names_as_it_runs(tree):
        return []
    defined = _top_level(tree)
    if function not in defined:
        near = closest(function, [name for name in defined if not name.startswith("_")])
        return [
            Problem(
                where,
                f"{module} has no {function}.",
                f"did you mean {module}:{near}?" if near else f"define {function} in {module}, or fix {where}.",
            )
        ]
    node = defined[function]
    if args is None or not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) or node.decorator_list:
        return []
    if node.args.kwarg is not None:  # **kwargs: it takes any
        return []
    parameters = [a.arg for a in (*node.args.args, *node.args.kwonlyargs)]
    section = where.split(".")[0]
    return [
        Problem(
            f"{section}.args",
            f"{module}:{function} takes no argument {name!r} (its parameters: {', '.join(parameters) or 'none'}).",
            (f"did you mean {near!r}? " if (near := closest(name, parameters)) else "")
            + f"make {section}.args match its parameters.",
        )
        for name in args
        if name not in parameters
    ]


def _top_level(tree: ast.Module) -> dict[str, ast.AST]:
    """The names the module's body defines (in its if and try blocks too), each with its node."""
    names: dict[str, ast.AST] = {}
    statements = list(tree.body)
    while statements:
        node = statements.pop(0)
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names[node.name] = node
        elif isinstance(node, ast.Assign | ast.AnnAssign | ast.AugAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update({t.id: node for target in targets for t in ast.walk(target) if isinstance(t, ast.Name)})
        elif isinstance(node, ast.Import | ast.ImportFrom):
            names.update({(a.asname or a.name).split(".")[0]: node for a in node.names})
        elif isinstance(node, ast.If | ast.Try | ast.With | ast.For | ast.While):
            for block in ("body", "orelse", "finalbody", "handlers"):
                statements += getattr(node, block, [])
        elif isinstance(node, ast.ExceptHandler):
            statements += node.body
    return names


def _makes_names_as_it_runs(tree: ast.Module) -> bool:
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and any(a.name == "*" for a in node.names):
            return True
        if isinstance(node, ast.FunctionDef) and node.name == "__getattr__" and node in tree.body:
            return True
        if isinstance(node, ast.Name) and node.id in ("globals", "exec", "setattr", "vars"):
            return True
    return False
