"""torch.compile's work at decoration put off to the first call, while DeepSpeed sets up its engine.

DeepSpeed 0.19's ZeRO optimizers import its Muon optimizer whatever the run's optimizer is (to test for it), and
that module decorates its update functions with torch.compile when it is imported. Building the inductor backend
for a decorator imports torch._inductor: about 3 s of every rank's start on a CPU (4 s where torch._dynamo is not
imported yet), for functions that only a Muon run calls. Inside `compile_deferred()`, torch.compile given a plain
function returns one that compiles it at its first call; anything else (a module, a bound method) is compiled at
once. torch.compile traces at the first call anyway, so a Muon run compiles the same functions with the same
options; what torch.compile itself would refuse at decoration is refused at that first call instead.
"""

import contextlib
import functools
import inspect
from collections.abc import Callable, Iterator
from typing import Any

import torch


@contextlib.contextmanager
def compile_deferred() -> Iterator[None]:
    compile_now = torch.compile

    def compile_at_first_call(model: Callable | None = None, **options: Any) -> Callable:
        if model is None:  # used as @torch.compile(**options)
            return functools.partial(compile_at_first_call, **options)
        if not inspect.isfunction(model):
            return compile_now(model, **options)
        return _at_first_call(lambda: compile_now(model, **options), model)

    torch.compile = compile_at_first_call
    try:
        yield
    finally:
        torch.compile = compile_now


def _at_first_call(compile_it: Callable[[], Callable], function: Callable) -> Callable:
    compiled: Callable | None = None

    @functools.wraps(function)
    def call(*args: Any, **kwargs: Any) -> Any:
        nonlocal compiled
        if torch.compiler.is_compiling():  # traced inside another compiled function, as torch.compile's own are
            return function(*args, **kwargs)
        if compiled is None:
            compiled = compile_it()
        return compiled(*args, **kwargs)

    return call
