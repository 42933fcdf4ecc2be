"""Preflight of a lone rank: a wrong master port or address fails in seconds, naming the rank and host. (Real ranks
under torchrun: tests/processes/test_preflight_runs.py.)"""

import os
import socket
import subprocess
import sys
import time

import pytest
from repo import REPO, free_port

pytest.importorskip("torch")
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def _lone_rank(master_addr: str, port: int, timeout: float = 3):
    env = {
        **ENV,
        "RANK": "1",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "2",
        "MASTER_ADDR": master_addr,
        "MASTER_PORT": str(port),
    }
    env.pop("TORCHELASTIC_USE_AGENT_STORE", None)
    start = time.monotonic()
    out = subprocess.run(
        [sys.executable, "-m", "distsetup.preflight", "--timeout", str(timeout)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    return out, time.monotonic() - start


def test_wrong_master_port_fails_fast_naming_rank_and_host():
    port = free_port()  # nobody listens there
    out, seconds = _lone_rank("127.0.0.1", port)
    assert out.returncode == 1
    assert seconds < 20
    message = out.stderr.strip().splitlines()[-1]
    assert message.startswith("preflight FAILED: rank 1/2")
    assert socket.gethostname() in message and f"127.0.0.1:{port}" in message
    assert "Traceback" not in out.stderr


def test_unresolvable_master_address_fails_at_once():
    out, seconds = _lone_rank("no-such-host.invalid", free_port())
    assert out.returncode == 1 and seconds < 20
    assert "resolving the master address" in out.stderr and "no-such-host.invalid" in out.stderr
