"""`distsetup status` against the machine's real NVML: the GPUs torch sees, with their names and memory (the dry run:
a machine without NVIDIA GPUs, said in the JSON's message)."""

import json
import subprocess
import sys

from conftest import DEVICE
from repo import REPO


def test_status_reads_the_gpus_through_nvml(record):
    result = subprocess.run(
        [sys.executable, "-m", "distsetup", "status", "--json"], capture_output=True, text=True, cwd=REPO, timeout=60
    )
    assert result.returncode == 0, result.stderr[-2000:]
    report = json.loads(result.stdout)
    record(status=report)
    if DEVICE == "cpu":
        assert report["gpus"] == [] and report["message"], report
        return
    import torch

    assert [gpu["index"] for gpu in report["gpus"]] == list(range(torch.cuda.device_count())), report
    first = report["gpus"][0]
    properties = torch.cuda.get_device_properties(0)
    assert first["name"] == properties.name, (first["name"], properties.name)
    assert abs(first["memory_total"] - properties.total_memory) <= 0.02 * first["memory_total"], first
    assert report["selected"], report  # an idle lent GPU passes selection
