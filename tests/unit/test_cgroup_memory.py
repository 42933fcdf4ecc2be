"""A container's memory limit is the memory a run has, not the node's /proc/meminfo: the trainer reads its memory
cgroup (v2 and v1, a parent's limit binding too, the page cache the kernel would drop counted as free) wherever it
plans host memory (check_model_fits' refusal, ZeRO's buffer sizes, FSDP2 on the CPU). Laid out here as a kernel
lays it out, in files under a folder standing for /sys/fs/cgroup."""

import pytest

from distsetup.training import cgroup_memory, memory

GIB = 2**30


@pytest.fixture
def cgroups(tmp_path, monkeypatch):
    """write(path, text) lays out files under the stand-in /sys/fs/cgroup; proc(text) is /proc/self/cgroup."""
    mount, proc = tmp_path / "cgroup", tmp_path / "proc_self_cgroup"
    monkeypatch.setattr(cgroup_memory, "CGROUP_MOUNT", mount)
    monkeypatch.setattr(cgroup_memory, "PROC_CGROUP", proc)

    def write(path: str, text: str) -> None:
        (mount / path).parent.mkdir(parents=True, exist_ok=True)
        (mount / path).write_text(text)

    return write, proc.write_text


def test_v2_the_tightest_limit_on_the_path_binds_and_the_page_cache_counts_as_free(cgroups):
    write, proc = cgroups
    proc("0::/kubepods/pod1/ctr\n")
    write("kubepods/pod1/ctr/memory.max", "max\n")  # the container: no limit of its own
    write("kubepods/pod1/memory.max", f"{8 * GIB}\n")  # the pod's resources.limits
    write("kubepods/pod1/memory.current", f"{3 * GIB}\n")
    write("kubepods/pod1/memory.stat", f"anon {2 * GIB}\ninactive_file {GIB}\nactive_file 0\n")
    write("kubepods/memory.max", f"{64 * GIB}\n")
    assert cgroup_memory.limiting_group() == cgroup_memory.GroupMemory(limit=8 * GIB, free=6 * GIB)
    # a container limited below its pod, whose other containers use most of the pod's: the pod's room binds
    write("kubepods/pod1/ctr/memory.max", f"{6 * GIB}\n")
    write("kubepods/pod1/ctr/memory.current", f"{GIB}\n")
    write("kubepods/pod1/memory.current", f"{8 * GIB}\n")
    assert cgroup_memory.limiting_group() == cgroup_memory.GroupMemory(limit=6 * GIB, free=GIB)


def test_v1_inside_a_namespace_reads_the_mount_s_root_as_its_group(cgroups):
    """/proc names the group as the host sees it, the container's mount shows that group as its root."""
    write, proc = cgroups
    proc("5:cpu,cpuacct:/docker/abc\n4:memory:/docker/abc\n0::/\n")
    write("memory/memory.limit_in_bytes", f"{2 * GIB}\n")
    write("memory/memory.usage_in_bytes", f"{GIB}\n")
    write("memory/memory.stat", f"cache 5\ntotal_inactive_file {GIB // 2}\n")
    assert cgroup_memory.limiting_group() == cgroup_memory.GroupMemory(limit=2 * GIB, free=3 * GIB // 2)


@pytest.mark.parametrize(
    "proc_line, path, unlimited",
    [
        ("0::/user.slice\n", "user.slice/memory.max", "max\n"),
        ("4:memory:/\n", "memory/memory.limit_in_bytes", "9223372036854771712\n"),
    ],
)
def test_no_limit_is_none(cgroups, proc_line, path, unlimited):
    write, proc = cgroups
    proc(proc_line)
    write(path, unlimited)
    assert cgroup_memory.limiting_group() is None


def test_without_proc_there_is_no_limit_and_an_odd_line_is_passed_over(cgroups):
    write, proc = cgroups
    assert cgroup_memory.limiting_group() is None  # /proc/self/cgroup never written: not Linux, or hidden
    proc("odd\n0::/pod:a\n")  # a path may hold ':'
    write("pod:a/memory.max", f"{GIB}\n")
    assert cgroup_memory.limiting_group() == cgroup_memory.GroupMemory(limit=GIB, free=GIB)


def test_the_trainer_plans_within_the_limit_where_it_is_below_the_node_s_memory(cgroups, tmp_path, monkeypatch):
    write, proc = cgroups
    meminfo = tmp_path / "meminfo"
    meminfo.write_text(f"MemTotal: {64 * 2**20} kB\nMemAvailable: {60 * 2**20} kB\n")  # a 64 GiB node
    monkeypatch.setattr(memory, "MEMINFO", meminfo)
    cpu = memory.torch.device("cpu")
    assert memory.device_memory_per_rank(cpu, 4) == 16 * GIB and memory.available_memory() == 60 * GIB
    proc("0::/pod\n")
    write("pod/memory.max", f"{16 * GIB}\n")
    write("pod/memory.current", f"{6 * GIB}\n")
    assert memory.device_memory_per_rank(cpu, 4) == 4 * GIB  # each of 4 processes: a quarter of the pod's 16
    assert memory.available_memory() == 10 * GIB
    write("pod/memory.max", f"{128 * GIB}\n")  # a limit above the node's memory changes nothing
    assert memory.device_memory_per_rank(cpu, 4) == 16 * GIB and memory.available_memory() == 60 * GIB
