"""A real two-node SLURM cluster on this machine, for tests: munged, slurmctld and two slurmd (n1, n2).

Both nodes listen on 127.0.0.1 with their own ports; `/etc/hosts` gets `127.0.0.1 n1 n2` for the
cluster's lifetime. Every file (slurm.conf, gres.conf, munge key and socket, state, spool, logs) lives in
one temporary folder, named by absolute path. Each node has two fake GPUs (character devices made
with mknod) so `--gres=gpu:N` jobs schedule and get CUDA_VISIBLE_DEVICES. Needs root, as in CI.

    cluster = LocalSlurm(tmp_dir); cluster.start(); ...; cluster.stop()
"""

import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

NODES = ("n1", "n2")
HOSTS_FILE = Path("/etc/hosts")
HOSTS_MARK = "# distsetup test cluster"


def slurm_available() -> bool:
    return all(shutil.which(tool) for tool in ("slurmctld", "slurmd", "munged", "sbatch", "scontrol"))


def free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


class LocalSlurm:
    def __init__(self, root: Path):
        self.root = Path(root)
        self.conf = self.root / "etc" / "slurm.conf"
        self.munge_socket = self.root / "munge" / "munge.socket"
        self.procs: list[subprocess.Popen] = []
        self.hosts_added = False

    @property
    def env(self) -> dict:
        """The environment for sbatch, squeue, scontrol (and the jobs, which inherit it)."""
        return {**os.environ, "SLURM_CONF": str(self.conf)}

    def start(self, timeout: float = 60) -> None:
        try:
            self._write_files()
            self._add_hosts()
            self._start_munge()
            self._spawn("slurmctld", ["slurmctld", "-D", "-c", "-f", str(self.conf)])
            for node in NODES:
                self._spawn(f"slurmd-{node}", ["slurmd", "-D", "-N", node, "-f", str(self.conf)])
            self._wait_idle(timeout)
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        self._cancel_jobs()
        for proc in reversed(self.procs):
            if proc.poll() is None:
                proc.terminate()
        for proc in reversed(self.procs):
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.procs.clear()
        self._restore_hosts()

    # --- set-up ---------------------------------------------------------------------------------

    def _write_files(self) -> None:
        for sub in ("etc", "munge", "state", "log", "dev", *(f"spool-{n}" for n in NODES)):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        for i in range(2):
            device = self.root / "dev" / f"gpu{i}"
            if not device.exists():
                subprocess.run(["mknod", str(device), "c", "1", "3"], check=True)
        ctld_port, *node_ports = free_ports(1 + len(NODES))
        host = socket.gethostname().split(".")[0]
        r = self.root
        nodes = "\n".join(
            f"NodeName={n} NodeAddr=127.0.0.1 NodeHostname={host} Port={p} CPUs=2 "
            "RealMemory=2000 Gres=gpu:2 State=UNKNOWN"
            for n, p in zip(NODES, node_ports, strict=True)
        )
        # sched_interval: SLURM holds a requeued job until its credential expires (cred_expire + 1 s), and nothing
        # wakes the scheduler then: its main loop runs every 60 s by default, backfill every 30, which kept the
        # requeue test's second run waiting 19 s; every 2 s, it starts 6 s after the requeue
        self.conf.write_text(f"""\
ClusterName=distsetup-test
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={self.munge_socket},cred_expire=5
StateSaveLocation={r}/state
SlurmdSpoolDir={r}/spool-%n
SlurmctldPidFile={r}/slurmctld.pid
SlurmdPidFile={r}/slurmd-%n.pid
SlurmctldLogFile={r}/log/slurmctld.log
SlurmdLogFile={r}/log/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/pgid
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=2
SlurmdParameters=config_overrides
ReturnToService=2
MpiDefault=none
GresTypes=gpu
JobRequeue=1
KillWait=30
MinJobAge=600
SlurmdTimeout=60
MessageTimeout=20
{nodes}
PartitionName=debug Nodes={",".join(NODES)} Default=YES MaxTime=INFINITE State=UP
""")
        (self.conf.parent / "gres.conf").write_text(f"NodeName=n[1-2] Name=gpu File={r}/dev/gpu[0-1]\n")

    def _add_hosts(self) -> None:
        text = HOSTS_FILE.read_text()
        if all(
            any(n in line.split()[1:] for line in text.splitlines() if line and not line.startswith("#")) for n in NODES
        ):
            return
        # in place (no rename): /etc/hosts may be a bind mount
        HOSTS_FILE.write_text(text.rstrip("\n") + f"\n127.0.0.1 {' '.join(NODES)}  {HOSTS_MARK}\n")
        self.hosts_added = True

    def _restore_hosts(self) -> None:
        """Remove the line we added, and only that line."""
        if self.hosts_added:
            lines = HOSTS_FILE.read_text().splitlines(keepends=True)
            HOSTS_FILE.write_text("".join(line for line in lines if HOSTS_MARK not in line))
            self.hosts_added = False

    def _start_munge(self) -> None:
        key = self.root / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        self.root.joinpath("munge").chmod(0o700)
        self._spawn(
            "munged",
            [
                "munged",
                "--foreground",
                "--force",
                f"--key-file={key}",
                f"--socket={self.munge_socket}",
                f"--pid-file={self.root}/munge/munged.pid",
                f"--log-file={self.root}/log/munged.log",
                f"--seed-file={self.root}/munge/seed",
            ],
        )
        self._wait(lambda: self.munge_socket.exists(), 20, "munged did not create its socket")

    def _spawn(self, name: str, argv: list[str]) -> None:
        log = open(self.root / "log" / f"{name}.stdout", "w")
        self.procs.append(
            subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=self.env, start_new_session=True)
        )

    def _wait_idle(self, timeout: float) -> None:
        def idle():
            out = self.run("sinfo", "-h", "-N", "-o", "%N %t", check=False).stdout
            states = dict(line.split() for line in out.splitlines() if line.strip())
            return all(states.get(n, "").startswith("idle") for n in NODES)

        self._wait(idle, timeout, "the SLURM nodes did not become idle")

    def _wait(self, condition, timeout: float, message: str) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if condition():
                return
            dead = [p.args[0] for p in self.procs if p.poll() is not None]
            if dead:
                raise RuntimeError(f"{message}: {', '.join(dead)} exited; logs in {self.root / 'log'}\n" + self.logs())
            time.sleep(0.5)
        raise RuntimeError(f"{message} within {timeout:.0f}s; logs in {self.root / 'log'}\n" + self.logs())

    def _cancel_jobs(self) -> None:
        """Cancel this cluster's jobs and let their slurmstepd processes end before the daemons stop."""
        if not any(p.args[0] == "slurmctld" and p.poll() is None for p in self.procs):
            return
        self.run("scancel", "--user", "root", check=False)
        deadline = time.monotonic() + 40
        while time.monotonic() < deadline:
            if not self.run("squeue", "-h", check=False).stdout.strip():
                return
            time.sleep(1)

    # --- use ------------------------------------------------------------------------------------

    def run(self, *argv: str, check: bool = True, cwd=None) -> subprocess.CompletedProcess:
        return subprocess.run(
            list(argv), capture_output=True, text=True, env=self.env, check=check, cwd=cwd, timeout=60
        )

    def job_state(self, job_id: str) -> dict:
        """Fields of `scontrol show job` (JobState, RestartCnt, NodeList, ExitCode, ...)."""
        out = self.run("scontrol", "show", "job", "-o", job_id, check=False).stdout
        return dict(field.split("=", 1) for field in out.split() if "=" in field)

    def wait_job(
        self,
        job_id: str,
        timeout: float,
        until=("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL"),
    ) -> dict:
        deadline = time.monotonic() + timeout
        state = {}
        while time.monotonic() < deadline:
            state = self.job_state(job_id)
            if state.get("JobState") in until:
                return state
            time.sleep(1)
        raise TimeoutError(f"job {job_id} still {state.get('JobState')} after {timeout}s\n" + self.logs())

    def logs(self, tail: int = 30) -> str:
        parts = []
        for path in sorted((self.root / "log").glob("*")):
            lines = path.read_text(errors="replace").splitlines()[-tail:]
            parts.append(f"--- {path.name}\n" + "\n".join(lines))
        return "\n".join(parts)
