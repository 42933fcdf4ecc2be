"""GPU selection with fake NVML data, and `distsetup status` on a machine without an NVIDIA driver."""

import json
from types import SimpleNamespace

import pytest
from repo import REPO, run_subprocess_cli

from distsetup.cli.commands.status import refit_batch
from distsetup.errors import DistsetupError
from distsetup.planning.gpus import GIB, NoGpuError, choose_gpus, judge_gpus, query_gpus


class FakeNvml:
    """The slice of pynvml that query_gpus calls, over a list of (name, total GiB, used GiB, util %, pids)."""

    class NVMLError(Exception):
        pass

    def __init__(self, devices, init_error=None):
        self.devices, self.init_error, self.shut_down = devices, init_error, False

    def nvmlInit(self):
        if self.init_error:
            raise self.NVMLError(self.init_error)

    def nvmlShutdown(self):
        self.shut_down = True

    def nvmlDeviceGetCount(self):
        return len(self.devices)

    def nvmlDeviceGetHandleByIndex(self, i):
        return self.devices[i]

    def nvmlDeviceGetName(self, d):
        return d[0].encode()  # older pynvml returns bytes

    def nvmlDeviceGetMemoryInfo(self, d):
        total, used = d[1] * GIB, d[2] * GIB
        return SimpleNamespace(total=total, used=used, free=total - used)

    def nvmlDeviceGetUtilizationRates(self, d):
        if d[3] is None:
            raise self.NVMLError("Not Supported")
        return SimpleNamespace(gpu=d[3], memory=0)

    def nvmlDeviceGetComputeRunningProcesses(self, d):
        return [SimpleNamespace(pid=pid, usedGpuMemory=GIB) for pid in d[4]]

    def nvmlSystemGetProcessName(self, pid):
        return f"python-{pid}"


EIGHT = [
    ("H100", 80, 70, 95, [11]),  # busy and nearly full
    ("H100", 80, 1, 0, []),
    ("H100", 80, 30, 50, [12, 13]),
    ("H100", 80, 70, 0, [14]),  # 10 GiB free: under 16
    ("H100", 80, 0, 0, []),
    ("H100", 80, 5, 92, [15]),  # free but busy
    ("H100", 80, 2, None, []),  # utilisation not supported (MIG): judged on memory only
    ("H100", 80, 40, 10, [16]),
]


def test_query_reads_every_field_and_shuts_nvml_down():
    nvml = FakeNvml(EIGHT)
    gpus = query_gpus(nvml)
    assert [g.index for g in gpus] == list(range(8))
    assert gpus[2].name == "H100" and gpus[2].memory_free == 50 * GIB and gpus[2].utilization == 50
    assert [(p.pid, p.name) for p in gpus[2].processes] == [(12, "python-12"), (13, "python-13")]
    assert gpus[6].utilization is None
    assert nvml.shut_down


def test_ranking_by_free_memory_and_the_thresholds():
    gpus = query_gpus(FakeNvml(EIGHT))
    verdicts = judge_gpus(gpus, min_free_gb=16, max_util=90)
    ok = [v.gpu.index for v in verdicts if v.ok]
    assert ok == [4, 1, 6, 2, 7]  # 80, 79, 78, 50, 40 GiB free
    rejected = {v.gpu.index: v.reason for v in verdicts if not v.ok}
    assert set(rejected) == {0, 3, 5}
    assert "utilisation 92%" in rejected[5] and "10.0 GiB free" in rejected[3]
    assert choose_gpus(gpus, 3) == [4, 1, 6]
    assert choose_gpus(gpus, 2, min_free_gb=60, max_util=5) == [4, 1]


def test_fewer_than_asked_is_an_error_unless_allowed():
    gpus = query_gpus(FakeNvml(EIGHT))
    with pytest.raises(DistsetupError, match="asked for 6 GPUs but only 5 of 8"):
        choose_gpus(gpus, 6)
    assert choose_gpus(gpus, 6, allow_fewer=True) == [4, 1, 6, 2, 7]
    with pytest.raises(DistsetupError):  # allow_fewer never returns no GPU at all
        choose_gpus(gpus, 2, min_free_gb=100, allow_fewer=True)


def test_no_driver_and_no_devices_are_no_gpu_errors():
    with pytest.raises(NoGpuError, match="no NVIDIA GPU found"):
        query_gpus(FakeNvml([], init_error="Driver Not Loaded"))
    with pytest.raises(NoGpuError, match="0 devices"):
        query_gpus(FakeNvml([]))


def test_fewer_gpus_redo_the_batch_arithmetic():
    kept = refit_batch(8, 4, 256, 4, 3e-4, None)
    assert kept["gradient_accumulation_steps"] * 4 * 4 == 256 and kept["lr"] == 3e-4
    changed = refit_batch(8, 3, 64, 4, 3e-4, "linear")
    assert changed["global_batch_size"] == 4 * changed["gradient_accumulation_steps"] * 3 != 64
    assert changed["lr"] == pytest.approx(3e-4 * changed["global_batch_size"] / 64)
    with pytest.raises(DistsetupError, match="scale_lr"):
        refit_batch(8, 3, 64, 4, 3e-4, None)


def test_status_without_driver_is_one_line_and_exit_0_unless_gpus_are_asked_for():
    out = run_subprocess_cli("status", cwd=REPO)
    try:
        query_gpus()
    except NoGpuError:
        pass
    else:
        pytest.skip("this machine has an NVIDIA GPU")
    assert out.returncode == 0, out.stderr
    assert "Traceback" not in out.stdout + out.stderr
    lines = out.stdout.strip().splitlines()
    assert len(lines) == 1 and "no NVIDIA GPU found" in lines[0]
    as_json = run_subprocess_cli("status", "--json", cwd=REPO)
    assert as_json.returncode == 0 and json.loads(as_json.stdout)["gpus"] == []
    # GPUs asked for: `status --count 2 && launch` must not launch (it went on, exit 0)
    counted = run_subprocess_cli("status", "--count", "2", cwd=REPO)
    assert counted.returncode == 1 and "no NVIDIA GPU found" in counted.stderr
    assert "Traceback" not in counted.stderr and len(counted.stderr.strip().splitlines()) == 1


def test_select_gpus_keeps_the_launchers_signature():
    import inspect

    from distsetup.planning.gpus import select_gpus

    params = inspect.signature(select_gpus).parameters
    assert [(n, p.default) for n, p in params.items()] == [
        ("count", inspect.Parameter.empty),
        ("min_free_gb", 16),
        ("max_util", 90),
        ("allow_fewer", False),
    ]
