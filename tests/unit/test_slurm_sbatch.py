"""`distsetup slurm`'s #SBATCH lines: the mapping from flags, the pairs --sbatch may add, the torchrun grace period
under --requeue, SLURM's time limits, and the values SLURM would refuse."""

import pytest
from slurm_scripts import GRACE, build, spec

from distsetup.errors import DistsetupError
from distsetup.scripts.sbatch import (
    MANAGED_SBATCH_KEYS,
    parse_sbatch_pairs,
    sbatch_directives,
    sbatch_quote,
    shutdown_grace_seconds,
    time_limit_seconds,
)

# --- the #SBATCH mapping -------------------------------------------------------------------------


def test_directives_are_sorted_and_complete():
    d = sbatch_directives(
        spec(
            cpus_per_task=32,
            mem="256G",
            time_limit="48:00:00",
            partition="gpu",
            account="ml",
            qos="high",
            constraint="a100&ib",
            exclusive=True,
            log_error="%x-%j.err",
            mail_user="me@example.org",
            mail_type="END,FAIL",
        )
    )
    assert list(d) == sorted(d)
    assert d == {
        "account": "ml",
        "constraint": "a100&ib",
        "cpus-per-task": "32",
        "error": "%x-%j.err",
        "exclusive": None,
        "gres": "gpu:4",
        "job-name": "distsetup",
        "mail-type": "END,FAIL",
        "mail-user": "me@example.org",
        "mem": "256G",
        "nodes": "2",
        "ntasks-per-node": "1",
        "output": "%x-%j.out",
        "partition": "gpu",
        "qos": "high",
        "time": "48:00:00",
    }


def test_gpu_request_styles():
    assert sbatch_directives(spec(gpu_type="a100"))["gres"] == "gpu:a100:4"
    d = sbatch_directives(spec(gpu_request="gpus-per-node"))
    assert d["gpus-per-node"] == "4" and "gres" not in d
    assert not {"gres", "gpus-per-node"} & set(sbatch_directives(spec(gpu_request="none")))


def test_extra_sbatch_pairs_and_flags():
    pairs = parse_sbatch_pairs(["reservation=big", "--nice=10", "overcommit"])
    d = sbatch_directives(spec(extra_sbatch=pairs))
    assert d["reservation"] == "big" and d["nice"] == "10" and d["overcommit"] is None
    with pytest.raises(DistsetupError, match="not KEY=VALUE"):
        parse_sbatch_pairs(["Bad Key=1"])


@pytest.mark.parametrize(
    "item, flag",
    [
        ("nodes=3", "--num_nodes"),
        ("ntasks-per-node=8", "--num_gpus_per_node"),
        ("gres=gpu:2", "--num_gpus_per_node"),
        ("gpus-per-node=2", "--gpu_request"),
        ("signal=B:USR1@60", "--signal_seconds"),
        ("time=10", "--time_limit"),
        ("requeue", "--requeue"),
        ("job-name=x", "--job_name"),
    ],
)
def test_sbatch_pairs_cannot_override_what_distsetup_writes(item, flag):
    """Bug: --num_nodes 2 --sbatch nodes=3 wrote --nodes=3 silently (one world of 2 nodes on 3)."""
    with pytest.raises(DistsetupError, match=f"distsetup writes #SBATCH --{item.split('=')[0]} itself.*{flag}"):
        build(extra_sbatch=parse_sbatch_pairs([item]))
    assert set(MANAGED_SBATCH_KEYS) >= {
        k for k in sbatch_directives(spec(requeue=True, exclusive=True, mem="1G")) if k != "open-mode"
    }


def test_requeue_lines():
    d = sbatch_directives(spec(requeue=True, signal_seconds=300))
    assert d["requeue"] is None and d["signal"] == "B:USR1@300" and d["open-mode"] == "append"


@pytest.mark.parametrize("signal_seconds, grace", [(300, 270), (120, 90), (60, 30), (20, 10)])
def test_requeue_gives_torchrun_a_grace_period_from_signal_seconds(signal_seconds, grace):
    """Bug: torchrun SIGKILLs its workers 30 s after SIGTERM by default, mid-way through a big checkpoint."""
    assert shutdown_grace_seconds(signal_seconds) == grace
    for method in ("torchrun", "accelerate"):
        text = build(requeue=True, signal_seconds=signal_seconds, launch={"launch_method": method})
        assert [int(v) for v in GRACE.findall(text)] == [grace]
    assert not GRACE.search(build())


def test_deepspeed_launcher_header_says_its_limits():
    text = build(
        requeue=True, launch={"launch_method": "deepspeed", "backend": "deepspeed", "deepspeed_config": "ds.json"}
    )
    assert "SIGKILLs the training processes 30 s after SIGTERM" in text and not GRACE.search(text)
    assert "uses local GPU ids 0..N-1" in text and "uses local GPU ids" not in build()


def test_sbatch_quote():
    assert sbatch_quote("%x-%j.out") == "%x-%j.out"
    assert sbatch_quote('my "job" \\ x') == '"my \\"job\\" \\\\ x"'


@pytest.mark.parametrize(
    "text, seconds",
    [
        ("90", 5400),
        ("05:30", 330),
        ("48:00:00", 172800),
        ("2-12", 216000),
        ("1-02:30", 95400),
        ("1-00:00:01", 86401),
        ("UNLIMITED", None),
        ("infinite", None),
        # as sbatch reads them (they were refused): 0 is no limit, and a field past its range counts on
        ("0", None),
        ("00:00:00", None),
        ("2-25", 262800),
        ("10:75", 675),
        ("25:61:00", 93660),
    ],
)
def test_time_limits_slurm_accepts(text, seconds):
    assert time_limit_seconds(text) == seconds


@pytest.mark.parametrize("text", ["", "1:2:3:4", "1h", "1-2:3:4:5", "-5", "1.5", "3 days"])
def test_time_limits_slurm_rejects(text):
    with pytest.raises(DistsetupError, match="not one SLURM accepts"):
        time_limit_seconds(text)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"nodes": 0}, "--num_nodes 0 must be at least 1"),
        ({"gpus": 0}, "--num_gpus_per_node 0 must be at least 1"),
        ({"time_limit": "48h"}, "not one SLURM accepts"),
        ({"partition": "gpu queue"}, "not a SLURM partition name"),
        ({"partition": "gpu;rm"}, "not a SLURM partition name"),
        ({"account": "my account"}, "--account 'my account' is not a SLURM account name"),  # sbatch refuses it
        ({"mem": "lots"}, "not a SLURM memory size"),
        ({"mem": "²"}, "not a SLURM memory size"),  # a digit to str.isdigit, none to int(): it raised ValueError
        ({"mem": "256"}, "--mem 256: SLURM reads a number without a unit as megabytes"),  # meant 256G, most likely
        ({"mem_per_gpu": "80"}, "--mem_per_gpu 80: SLURM reads a number without a unit as megabytes"),
        ({"mem": "1G", "mem_per_gpu": "1G"}, "mutually exclusive"),
        ({"conda_env": "a", "venv": "b"}, "mutually exclusive"),
        ({"modules": ("cuda 12",)}, "not an environment-module name"),
        ({"mail_type": "SOMETIMES"}, "not a SLURM mail type"),
        ({"requeue": True, "time_limit": "1", "signal_seconds": 120}, "is not longer than the preemption warning"),
        ({"job_name": "a\nb"}, "control character"),
    ],
)
def test_bad_input(kwargs, message):
    with pytest.raises(DistsetupError, match=message):
        build(**kwargs)


def test_unlimited_time_with_requeue():
    assert "#SBATCH --time=UNLIMITED" in build(time_limit="UNLIMITED", requeue=True)


def test_megabytes_written_as_slurm_reads_them_stay_valid():
    """--mem 256000 is 256 GB in megabytes, as SLURM users write it (a number under a GB is refused above); 0 is all
    the node's memory."""
    assert "#SBATCH --mem=256000" in build(mem="256000") and "#SBATCH --mem=0" in build(mem="0")
