"""The GPU tier's device and its record: `make gpu-check` runs it on a lent GPU, its dry run (GPU_CHECK_DRY=1) on the
CPU, where every test runs the same plumbing with the device forced to the CPU and gloo in place of NCCL.

Each test adds what it measured to the file GPU_CHECK_RECORD names (one JSON line each), which gpu/check.py puts
into its report; without it (a plain `pytest tests/gpu`), nothing is recorded.
"""

import json
import os

import pytest

DRY = os.environ.get("GPU_CHECK_DRY") == "1"
DEVICE = "cpu" if DRY else "cuda"


@pytest.fixture
def record(request):
    """record(**figures): one line of this test's measurements in the GPU check's report."""

    def write(**figures):
        path = os.environ.get("GPU_CHECK_RECORD")
        if path:
            with open(path, "a") as f:
                f.write(json.dumps({"test": request.node.name, **figures}) + "\n")

    return write


def pytest_collection_modifyitems(config, items):
    """The dry run keeps the first case of each parametrized test: the plumbing, not every backend again (the CPU
    tiers train each backend already)."""
    if not DRY:
        return
    seen, kept, dropped = set(), [], []
    for item in items:
        function = item.nodeid.split("[", 1)[0]
        (dropped if function in seen else kept).append(item)
        seen.add(function)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept
