"""`make gpu-kit` and `make gpu-check`, proven on the CPU: the kit for the GPU machine (cp312, the image's torch) is
whole and within the device tool's limit, and the check's dry run (GPU_CHECK_DRY=1) installs a kit of the same pins
into a clean --target, in an interpreter that sees only the image's packages, and runs every stage: the GPU tier on
the CPU and the throughput benchmark, whose MFU column is the arithmetic its docstring states."""

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from repo import REPO

sys.path[:0] = [str(REPO / "gpu"), str(REPO / "benchmarks")]
import kit  # noqa: E402
from gpu_throughput import flops_per_token  # noqa: E402

DRY_MODEL = {"n_layer": 2, "n_head": 2, "n_embd": 64, "block_size": 32, "micro_batch_size": 2}  # gpu/check.py's


@pytest.fixture(scope="module")
def gpu_kit(tmp_path_factory):
    """The kit for the GPU machine (what `make gpu-kit` writes to .whl/)."""
    folder = tmp_path_factory.mktemp("kit")
    # the Makefile's own target, its venv taken as made (CI made it before the tests)
    result = subprocess.run(
        ["make", "-s", "-o", ".venv/.installed", "gpu-kit", f"KIT={folder}", f"PY={sys.executable}"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert "wheels for CPython 3.12" in result.stdout, result.stdout
    return sorted(folder.glob("*.whl"))


def test_the_kit_holds_what_the_image_lacks_for_cpython_312(gpu_kit):
    names = {kit.wheel_name(wheel): wheel.name for wheel in gpu_kit}
    for needed in ("deepspeed", "jsonschema", "pydantic-core", "rpds-py", "hjson", "ruamel-yaml"):
        assert needed in names, sorted(names)
    assert "torch" not in names and "transformers" not in names  # the image's own
    assert "cp312" in names["pydantic-core"] and "cp312" in names["rpds-py"]
    assert sum(wheel.stat().st_size for wheel in gpu_kit) < kit.LIMIT_BYTES


def test_a_kit_missing_a_dependency_is_refused_by_name(gpu_kit):
    without = [wheel for wheel in gpu_kit if kit.wheel_name(wheel) != "rpds-py"]
    with pytest.raises(
        kit.KitError, match=r"rpds-py.*needed by (jsonschema|referencing).*neither in the kit nor in image.txt"
    ):
        kit.check_kit(without, "3.12")


def test_the_image_torch_must_meet_every_requirement(gpu_kit, tmp_path, monkeypatch):
    """gpu/image.txt pins torch to the image's version: a torch too old for DeepSpeed or distsetup is refused."""
    image = tmp_path / "image.txt"
    image.write_text(kit.IMAGE.read_text().replace("torch==2.11.0", "torch==1.13.0"))
    monkeypatch.setattr(kit, "IMAGE", image)
    with pytest.raises(kit.KitError, match=r"torch>=.* is not met by torch 1.13.0"):
        kit.check_kit(gpu_kit, "3.12")


def test_wheels_for_another_python_are_refused(gpu_kit):
    with pytest.raises(kit.KitError, match="does not install on CPython 3.11"):
        kit.check_kit(gpu_kit, "3.11")


def test_the_dry_run_installs_the_kit_and_passes_every_stage(tmp_path):
    out = tmp_path / "check out"  # a space: every path is quoted
    result = subprocess.run(
        [sys.executable, str(REPO / "gpu" / "dry_run.py"), str(out)], capture_output=True, text=True, timeout=900
    )
    report = json.loads((out / "gpu_check.json").read_text())
    log = (out / "gpu_check.log").read_text()
    assert result.returncode == 0, result.stdout[-3000:] + log[-4000:]
    assert report["dry"] and set(report["stages"]) == {"kit", "versions", "tests", "throughput"}
    assert all(stage["status"] == "passed" for stage in report["stages"].values()), report["stages"]
    versions = report["versions"]
    # DeepSpeed and jsonschema came from the kit's --target, not from this environment
    kit_target = report["kit_target"]
    assert versions["deepspeed_from"].startswith(kit_target) and versions["device"] == "cpu", versions
    assert versions["jsonschema_from"].startswith(kit_target), versions
    tests = {t["test"].rsplit("::", 1)[1].split("[")[0]: t["outcome"] for t in report["tests"]}
    gpu_tier = {item.split("::", 1)[1].split("[")[0] for item in collected_gpu_tests()}
    assert set(tests) == gpu_tier and set(tests.values()) == {"passed"}, tests
    recorded = {line["test"].split("[")[0] for line in report["measured"]}
    assert recorded == gpu_tier, recorded
    throughput = report["throughput"]
    assert sorted(throughput["runs"]) == ["reference zero3", "train.py zero3"] and not throughput["failed"]
    flops = flops_per_token(SimpleNamespace(**DRY_MODEL))
    for figures in throughput["runs"].values():
        assert figures["tokens_per_s"] > 0 and figures["plan_gb"] > 0
        assert figures["mfu"] == pytest.approx(figures["tokens_per_s"] * flops / 0.5e12, rel=1e-9)
    # ZeRO-3's pace against DeepSpeed's own loop on the same file; that loop's against the plain one, not run here
    runs = throughput["runs"]
    assert (
        runs["train.py zero3"]["vs_reference"]
        == runs["train.py zero3"]["tokens_per_s"] / runs["reference zero3"]["tokens_per_s"]
    )
    assert runs["reference zero3"]["vs_reference"] is None
    assert "peak 0.5 TFLOP/s fp32" in (out / "RESULTS.md").read_text()
    assert not Path(kit_target).exists()  # the check cleans up after itself
    # the kit's DeepSpeed trained ZeRO-3 without compiling an op (its shared-memory all-reduce, which no step uses, is
    # left out), and had it compiled one, this environment's would not be built again: none here names the kit
    ops = Path(os.environ["TORCH_EXTENSIONS_DIR"])
    assert not any(kit_target in ninja.read_text() for ninja in ops.glob("**/build.ninja"))


def collected_gpu_tests() -> list[str]:
    """The GPU tier's tests as pytest collects them (the dry run keeps one case of each)."""
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "tests/gpu"],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**os.environ, "GPU_CHECK_DRY": "1"},
    )
    return [line for line in result.stdout.splitlines() if "::" in line]
