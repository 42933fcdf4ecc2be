"""`make gpu-check OUT=folder` (or `python3 gpu/check.py folder`): everything a lent GPU machine should settle, in
about 8 minutes, written to one folder: gpu_check.json (versions, each stage's outcome, every test, what each test
measured, the throughput table) and gpu_check.log (every command's output).

Stages, each with its share of the time:
  kit         the wheels of `make gpu-kit` (.whl/) into a --target folder (that machine reaches no registry)
  versions    GPU, driver, CUDA, torch, DeepSpeed, Python
  tests       the GPU tier, tests/gpu/ (in parallel over pytest-xdist where the image has it)
  throughput  benchmarks/gpu_throughput.py at a size that fits: tokens/s, MFU, peak memory beside `distsetup plan`

GPU_CHECK_DRY=1 runs the same stages on the CPU (CUDA hidden, gloo for NCCL, a small model), which proves the plumbing
every day in CI (gpu/dry_run.py builds the environment). Until the kit is installed this file uses only the standard
library: the image's python3 runs it.
"""

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ElementTree
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BUDGET_SECONDS = 470  # of the 8 minutes; the rest is the machine's start and the copies
# Reserved for the throughput stage out of what the stages before it may take.
THROUGHPUT_SECONDS = {"gpu": 170, "dry": 150}
# The benchmark's model: the ~1B GPT of its goal on a GPU (fewer steps than its default), a small one on the CPU.
THROUGHPUT_ARGS = {
    # the reference first: the runs measured against it come after, and time may run out before the last
    "gpu": ["--steps", "12", "--runs", "reference loop", "train.py single", "train.py fsdp", "reference zero3"]
    + ["train.py zero3"],
    "dry": ["--n_layer", "2", "--n_head", "2", "--n_embd", "64", "--block_size", "32", "--micro_batch_size", "2"]
    + ["--steps", "6", "--precision", "fp32", "--peak_tflops", "0.5", "--runs", "train.py zero3", "reference zero3"],
}
PROBE = """
import json, platform, subprocess, torch
found = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda}
found["device"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
try:
    found["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                     capture_output=True, text=True, timeout=30).stdout.strip() or None
except OSError:
    found["driver"] = None
import deepspeed, jsonschema
found["deepspeed"] = deepspeed.__version__
found["deepspeed_from"] = deepspeed.__file__
found["jsonschema_from"] = jsonschema.__file__
print(json.dumps(found))
"""


class Check:
    """The stages' shared state: the environment they run in, the log, and the report they fill."""

    def __init__(self, out: Path, kit: Path, dry: bool):
        self.out, self.kit, self.dry = out, kit, dry
        self.began = time.monotonic()
        # where the wheels are installed (PYTHONPATH): outside `out`, whose files the device tool brings back
        self.target = Path(tempfile.mkdtemp(prefix="gpu-check-kit-"))
        self.record = out / "measured.jsonl"
        self.log = open(out / "gpu_check.log", "w")
        self.report: dict = {"dry": dry, "kit_target": str(self.target), "stages": {}, "versions": None}
        self.report.update(tests=[], measured=[])
        self.env = dict(os.environ)
        paths = [str(self.target), str(REPO), self.env.get("PYTHONPATH", "")]
        self.env["PYTHONPATH"] = os.pathsep.join(path for path in paths if path)
        self.env["GPU_CHECK_RECORD"] = str(self.record)
        self.env["PYTHONUNBUFFERED"] = "1"
        self.env.setdefault("TORCH_EXTENSIONS_DIR", str(REPO / ".torch_extensions"))  # DeepSpeed's compiled ops
        self.env["DISTSETUP_BENCH_RESULTS"] = str(out / "RESULTS.md")
        if dry:
            self.env.update(GPU_CHECK_DRY="1", CUDA_VISIBLE_DEVICES="")

    def seconds_left(self) -> float:
        return BUDGET_SECONDS - (time.monotonic() - self.began)

    def stage(self, name: str, argv: list[str], timeout: float) -> str | None:
        """Run one stage's command (its output to the log); its stdout, or None when it failed or ran out of time."""
        self.log.write(f"\n===== {name}: {' '.join(argv)}\n")
        self.log.flush()
        began = time.monotonic()
        # a session of its own: at the time limit the whole tree goes (torchrun's workers, pytest's runs), not only
        # the stage's first process, which would leave them on the GPU through the next stage
        process = subprocess.Popen(
            argv,
            cwd=REPO,
            env=self.env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        try:
            stdout, stderr = process.communicate(timeout=max(timeout, 1))
            status = "passed" if process.returncode == 0 else f"failed (exit {process.returncode})"
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            stdout, stderr = process.communicate()
            status = f"timed out after {timeout:.0f} s"
        self.log.write(stdout + stderr)
        self.log.flush()
        self.report["stages"][name] = {"status": status, "seconds": round(time.monotonic() - began, 1)}
        print(f"{name}: {status} ({self.report['stages'][name]['seconds']} s)", flush=True)
        return stdout if status == "passed" else None


def install_kit(check: Check) -> None:
    wheels = sorted(str(wheel) for wheel in check.kit.glob("*.whl"))
    if not wheels:
        check.report["stages"]["kit"] = {"status": f"failed (no wheels in {check.kit}: run make gpu-kit)"}
        print(check.report["stages"]["kit"]["status"], flush=True)
        return
    pip = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile", "--no-cache-dir"]
    check.stage("kit", [*pip, "--upgrade", "--target", str(check.target), *wheels], timeout=120)


def read_versions(check: Check) -> None:
    stdout = check.stage("versions", [sys.executable, "-c", PROBE], timeout=90)
    if stdout:
        check.report["versions"] = json.loads(stdout.strip().splitlines()[-1])


def run_tests(check: Check) -> None:
    junit = check.out / "gpu_tests.xml"
    argv = [sys.executable, "-m", "pytest", "tests/gpu", "-q", "-rA", "-p", "no:cacheprovider", f"--junitxml={junit}"]
    if not check.dry and _has_module(check, "xdist"):
        argv += ["-n", "4"]  # runs of tiny models: the GPU has room for four at once
    mode = "dry" if check.dry else "gpu"
    check.stage("tests", argv, timeout=check.seconds_left() - THROUGHPUT_SECONDS[mode])
    if junit.exists():
        check.report["tests"] = junit_outcomes(junit)
    if check.record.exists():
        check.report["measured"] = [json.loads(line) for line in check.record.read_text().splitlines()]


def _has_module(check: Check, name: str) -> bool:
    probe = [sys.executable, "-c", f"import importlib.util, sys; sys.exit(importlib.util.find_spec({name!r}) is None)"]
    return subprocess.run(probe, env=check.env, capture_output=True).returncode == 0


def junit_outcomes(junit: Path) -> list[dict]:
    """Each test case of a JUnit XML file: its name, outcome, seconds and, if it did not pass, the first line why."""
    outcomes = []
    for case in ElementTree.parse(junit).getroot().iter("testcase"):
        problem = next((child for child in case if child.tag in ("failure", "error", "skipped")), None)
        outcomes.append(
            {
                "test": f"{case.get('classname')}::{case.get('name')}",
                "outcome": "passed" if problem is None else problem.tag,
                "seconds": float(case.get("time") or 0),
                "why": (problem.get("message") or "").splitlines()[0][:300] if problem is not None else None,
            }
        )
    return outcomes


def measure_throughput(check: Check) -> None:
    figures = check.out / "throughput.json"
    mode = "dry" if check.dry else "gpu"
    argv = [sys.executable, "benchmarks/gpu_throughput.py", *THROUGHPUT_ARGS[mode], "--json", str(figures)]
    if Path("/dev/shm").is_dir() and not check.dry:
        argv += ["--work_dir", "/dev/shm"]  # the runs' final checkpoints (16 GB for 1B parameters) go to memory
    check.stage("throughput", argv, timeout=check.seconds_left())
    if figures.exists():
        check.report["throughput"] = json.loads(figures.read_text())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path, help="the folder for gpu_check.json, gpu_check.log and the rest")
    parser.add_argument("--kit", type=Path, default=REPO / ".whl", help="the wheels to install first (make gpu-kit)")
    a = parser.parse_args(argv)
    a.out.mkdir(parents=True, exist_ok=True)
    check = Check(a.out.resolve(), a.kit.resolve(), os.environ.get("GPU_CHECK_DRY") == "1")
    install_kit(check)
    read_versions(check)
    run_tests(check)
    measure_throughput(check)
    shutil.rmtree(check.target, ignore_errors=True)
    check.report["seconds"] = round(time.monotonic() - check.began, 1)
    (a.out / "gpu_check.json").write_text(json.dumps(check.report, indent=2))
    failed = [name for name, stage in check.report["stages"].items() if stage["status"] != "passed"]
    failed_tests = [t["test"] for t in check.report["tests"] if t["outcome"] != "passed"]
    print(f"gpu check {'(dry) ' if check.dry else ''}in {check.report['seconds']} s: {a.out / 'gpu_check.json'}")
    for test in failed_tests:
        print(f"  {test}: not passed")
    if "throughput" in check.report:
        print(check.report["throughput"].get("table", ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
