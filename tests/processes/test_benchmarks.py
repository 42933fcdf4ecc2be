"""benchmarks/gpu_throughput.py end to end on the CPU with a small model: every run trains for real, and
the MFU column is the arithmetic the docstring states. (Its GPU figures come from a GPU, not from here.)"""

import os
import subprocess
import sys

import pytest
from repo import REPO

sys.path.insert(0, str(REPO / "benchmarks"))
from gpu_throughput import flops_per_token  # noqa: E402

SMALL = {"n_layer": 2, "n_head": 2, "n_embd": 64, "block_size": 32, "micro_batch_size": 2}


def test_gpu_throughput_runs_on_the_cpu(tmp_path):
    """The reference loop and train.py under ZeRO-3 (single and FSDP are measured by the same code; the
    full table is the GPU's)."""
    results = tmp_path / "RESULTS.md"
    flags = [f"--{key}={value}" for key, value in SMALL.items()]
    env = {**os.environ, "DISTSETUP_BENCH_RESULTS": str(results)}
    run = subprocess.run(
        [sys.executable, "gpu_throughput.py", *flags, "--steps", "6", "--precision", "fp32", "--peak_tflops", "0.5"]
        + ["--runs", "train.py zero3", "reference loop"],
        cwd=REPO / "benchmarks",
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    rows = [line.strip("|").split("|") for line in results.read_text().splitlines() if line.startswith("| ")]
    table = {cells[0].strip(): [c.strip() for c in cells[1:]] for cells in rows[1:]}
    assert sorted(table) == ["reference loop", "train.py zero3"]
    from types import SimpleNamespace

    flops = flops_per_token(SimpleNamespace(**SMALL))
    for tokens_per_s, mfu, _, _, planned, verdict in table.values():
        assert float(planned) > 0
        assert float(tokens_per_s) > 0
        assert float(mfu.rstrip("%")) == pytest.approx(100 * float(tokens_per_s) * flops / 0.5e12, rel=0.01, abs=0.06)
        assert verdict == ("met" if float(mfu.rstrip("%")) >= 40 else "NOT met")
    assert float(table["reference loop"][2]) == 1
    assert "peak 0.5 TFLOP/s fp32" in results.read_text()
