"""What a module's source says of a function the run config names, read without running it (validate runs none of
the user's code, nor torch): whether the module binds the name at all, and where it is bound once, as a plain
top-level function, whether it takes the run config's keyword arguments. Only what the source says for certain is a
problem: a module that makes names as it runs (a module __getattr__, `global`, `import *`, globals(), sys.modules) is
left to the run's import, and so are a decorated function and a name bound twice or inside a block."""

import ast
from pathlib import Path

from distsetup.formats.problems import Problem, closest

# names whose use lets a module make module-level names the source does not bind
_DYNAMIC = {"globals", "exec", "setattr", "vars", "__getattr__", "__dict__", "modules"}


def problems(source: Path, module: str, function: str, where: str, args: dict | None) -> list[Problem]:
    try:
        tree = ast.parse(source.read_text(encoding="utf-8"), filename=str(source))
    except (OSError, SyntaxError, UnicodeDecodeError, ValueError):  # the run's import says it
        return []
    if _makes_names_as_it_runs(tree):
        return []
    bound = _module_level_bindings(tree)
    if function not in bound:
        near = closest(function, [name for name in bound if not name.startswith("_")])
        return [
            Problem(
                where,
                f"{module} has no {function}.",
                f"did you mean {module}:{near}?" if near else f"define {function} in {module}, or fix {where}.",
            )
        ]
    node = bound[function][0] if len(bound[function]) == 1 else None
    if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) or node not in tree.body or node.decorator_list:
        return []  # a class, a decorated function, one bound twice or inside a block: the import says
    if args is None or node.args.kwarg is not None:  # **kwargs: it takes any
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


def _module_level_bindings(tree: ast.Module) -> dict[str, list[ast.AST]]:
    """Each name the module binds at its level, in any block of its body (if, try, with, for, match...), with the
    nodes that bind it; not inside functions, classes, lambdas or comprehensions (their names are their own)."""
    bound: dict[str, list[ast.AST]] = {}

    def bind(name: str, node: ast.AST) -> None:
        bound.setdefault(name, []).append(node)

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                bind(child.name, child)
            elif isinstance(child, ast.Lambda | ast.ListComp | ast.SetComp | ast.DictComp | ast.GeneratorExp):
                continue
            elif isinstance(child, ast.Import | ast.ImportFrom):
                for alias in child.names:
                    bind((alias.asname or alias.name).split(".")[0], child)
            else:
                if isinstance(child, ast.Name) and isinstance(child.ctx, ast.Store):
                    bind(child.id, child)
                elif isinstance(child, ast.ExceptHandler | ast.MatchAs | ast.MatchStar) and child.name:
                    bind(child.name, child)
                elif isinstance(child, ast.MatchMapping) and child.rest:
                    bind(child.rest, child)
                visit(child)

    visit(tree)
    return bound


def _makes_names_as_it_runs(tree: ast.Module) -> bool:
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and any(a.name == "*" for a in node.names):
            return True
        if isinstance(node, ast.Global):
            return True
        if isinstance(node, ast.Name) and node.id in _DYNAMIC:
            return True
        if isinstance(node, ast.Attribute) and node.attr in _DYNAMIC:  # sys.modules[__name__] = ..., mod.__dict__
            return True
        if isinstance(node, ast.FunctionDef) and node.name == "__getattr__":
            return True
    return False
