"""Launching src/train.py for the tests: tiny configs, real processes, runs shared between test modules.

Each named run happens at most once per pytest process (`shared_run`), so the parity, memory and resume
tests read the same DDP / FSDP / ZeRO runs instead of paying for them again on a 2-core machine.
"""

import atexit
import functools
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
TRAIN = REPO / "src" / "train.py"
BIN = Path(sys.executable).parent
SHARED = Path(tempfile.mkdtemp(prefix="distsetup-train-"))
atexit.register(shutil.rmtree, SHARED, ignore_errors=True)

STEPS, INTERVAL, GLOBAL_BATCH = 30, 10, 16
MODEL = {"n_layer": 2, "n_head": 2, "n_embd": 32, "block_size": 32}
TRAINING = {"seed": 7, "max_steps": STEPS, "warmup_steps": 3, "lr": 3e-3, "grad_clip": 1.0,
            "checkpoint_interval": INTERVAL, "log_interval": 1, "precision": "fp32"}

# name -> (processes, backend, backend file or None); every 2-process run splits the same global batch.
FSDP_FILES = {name: {"fsdp_version": 2, "fsdp_sharding_strategy": strategy,
                     "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP", "fsdp_transformer_layer_cls_to_wrap": "Block",
                     "fsdp_state_dict_type": "SHARDED_STATE_DICT", "mixed_precision": "no"}
              for name, strategy in (("fsdp_full", "FULL_SHARD"), ("fsdp_grad_op", "SHARD_GRAD_OP"),
                                     ("fsdp_no_shard", "NO_SHARD"))}


def ds_file(stage: int, offload: bool = False) -> dict:
    """No optimizer block: the script passes torch's AdamW (or DeepSpeedCPUAdam when offloading)."""
    zero = {"stage": stage, "stage3_param_persistence_threshold": 0} if stage == 3 else {"stage": stage}
    if offload:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": False}
    return {"train_micro_batch_size_per_gpu": GLOBAL_BATCH // 2, "gradient_accumulation_steps": 1,
            "train_batch_size": GLOBAL_BATCH, "gradient_clipping": TRAINING["grad_clip"],
            "bf16": {"enabled": False}, "fp16": {"enabled": False}, "zero_optimization": zero}


DS_FILES = {"zero1": ds_file(1), "zero2": ds_file(2), "zero3": ds_file(3), "zero2_offload": ds_file(2, offload=True)}
RUNS = {"single": (1, "single", None), "ddp": (2, "ddp", None),
        **{name: (2, "fsdp", cfg) for name, cfg in FSDP_FILES.items()},
        **{name: (2, "deepspeed", cfg) for name, cfg in DS_FILES.items()}}


def write_run_config(folder: Path, name: str, **training) -> Path:
    """config.yaml (and the backend file) for run `name` in `folder`."""
    nproc, backend, backend_file = RUNS[name]
    folder.mkdir(parents=True, exist_ok=True)
    dist = {"backend": backend, "timeout_minutes": 2}
    if backend_file is not None:
        key = "fsdp_config" if backend == "fsdp" else "deepspeed_config"
        (folder / f"{name}.json").write_text(json.dumps(backend_file))
        dist[key] = str(folder / f"{name}.json")
    config = {"model": MODEL, "data": {"num_samples": 2048},
              "training": {**TRAINING, "micro_batch_size": GLOBAL_BATCH // nproc,
                           "output_dir": str(folder / "out"), **training},
              "distributed": dist}
    path = folder / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def command(config: Path, nproc: int, *args) -> list[str]:
    if nproc == 1:
        return [sys.executable, str(TRAIN), "--config", str(config), *map(str, args)]
    return [str(BIN / "torchrun"), "--standalone", "--nproc_per_node", str(nproc), str(TRAIN),
            "--config", str(config), *map(str, args)]


def environment() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE",
                                                          "MASTER_ADDR", "MASTER_PORT")}
    env.setdefault("TORCH_EXTENSIONS_DIR", str(REPO / ".torch_extensions"))
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    return env


def train(config: Path, nproc: int = 1, *args, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run(command(config, nproc, *args), capture_output=True, text=True, timeout=timeout,
                          env=environment(), cwd=REPO)


def start(config: Path, nproc: int, *args) -> subprocess.Popen:
    """Start a run in the background; its output goes to run.log next to the config (a pipe could fill)."""
    log = open(config.parent / "run.log", "w")
    proc = subprocess.Popen(command(config, nproc, *args), stdout=log, stderr=subprocess.STDOUT, text=True,
                            env=environment(), cwd=REPO)
    proc.log = config.parent / "run.log"
    return proc


@functools.cache
def shared_run(name: str) -> Path:
    """Run `name` once (30 steps, checkpoints every 10); returns its output_dir. Fails loudly if it fails."""
    config = write_run_config(SHARED / name, name)
    result = train(config, RUNS[name][0])
    assert result.returncode == 0, f"{name} failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return SHARED / name / "out"


def losses(output_dir: Path) -> list[float]:
    """The last logged loss of each step (a resumed run logs some steps twice)."""
    by_step = {}
    for line in (output_dir / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        by_step[row["step"]] = row["loss"]
    return [by_step[s] for s in sorted(by_step)]


def final_weights(output_dir: Path) -> dict:
    from distsetup.training.checkpoint import latest_complete
    from distsetup.training.export import consolidated_state_dict
    return consolidated_state_dict(latest_complete(output_dir / "checkpoints"))


def worker_pids(launcher_pid: int) -> list[int]:
    """The training processes torchrun started (its children), in start order."""
    children = Path(f"/proc/{launcher_pid}/task/{launcher_pid}/children")
    return [int(p) for p in children.read_text().split()] if children.exists() else []


def wait_for(path: Path, proc: subprocess.Popen, timeout: float = 240) -> None:
    """Poll until `path` exists; fail if the run ends or times out first."""
    deadline = time.time() + timeout
    while not path.exists():
        if proc.poll() is not None:
            raise AssertionError(f"run ended (status {proc.returncode}) before {path} appeared:\n"
                                 f"{proc.log.read_text()[-3000:]}")
        if time.time() > deadline:
            proc.kill()
            raise AssertionError(f"{path} did not appear within {timeout}s")
        time.sleep(0.005)
