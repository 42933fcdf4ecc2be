"""A rank that torchrun, accelerate or the deepspeed launcher started gets SIGTERM (a preemption: it checkpoints and
stops) when its launcher dies outright, where it went on training in a session of its own; and not while the
launcher lives, also where the launcher is the first process of a container (PID 1)."""

import subprocess
import sys

from repo import REPO

RANK = """
import os, signal, sys, time
from distsetup.training.launch_env import sigterm_when_the_launcher_dies
signal.signal(signal.SIGTERM, lambda *_: (open(sys.argv[1], "w").write("SIGTERM"), os._exit(0)))
sigterm_when_the_launcher_dies()
open(sys.argv[1] + ".armed", "w").close()
time.sleep(30)
"""

LAUNCHER = """
import os, subprocess, sys, time
env = {**os.environ, "TORCHELASTIC_RUN_ID": "test"}
rank = subprocess.Popen([sys.executable, "-c", sys.argv[3], sys.argv[1]], env=env, start_new_session=True)
while not os.path.exists(sys.argv[1] + ".armed"):
    time.sleep(0.02)
if sys.argv[2] == "dies":
    os._exit(0)  # as SIGKILL would: nothing of the launcher's own care runs
time.sleep(1)
print("pid", os.getpid(), "rank alive" if rank.poll() is None else "rank ended")
rank.kill()
"""


def launch(tmp_path, how: str, *prefix: str) -> subprocess.CompletedProcess:
    said = tmp_path / f"{how}.txt"
    command = [*prefix, sys.executable, "-c", LAUNCHER, str(said), how, RANK]
    return subprocess.run(command, capture_output=True, text=True, cwd=REPO, timeout=60)


def test_a_rank_whose_launcher_dies_gets_sigterm_and_one_whose_launcher_lives_does_not(tmp_path):
    import time

    assert launch(tmp_path, "dies").returncode == 0
    said = tmp_path / "dies.txt"
    deadline = time.monotonic() + 20
    while not said.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert said.read_text() == "SIGTERM"
    lives = launch(tmp_path, "lives")
    assert "rank alive" in lives.stdout, lives.stdout + lives.stderr
    # the launcher as a container's first process: the rank's parent is PID 1, alive
    container = launch(tmp_path, "lives", "unshare", "--pid", "--fork")
    assert "pid 1 rank alive" in container.stdout, container.stdout + container.stderr
