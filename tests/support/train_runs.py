"""Launching src/train.py for the tests: tiny configs, real processes, runs shared between test modules.

Each named run happens at most once per test session (`shared_run`, `feature_attempt`), whichever pytest-xdist worker
asks first, so the parity, memory and resume tests read the same DDP / FSDP / ZeRO runs instead of paying for them
again on a 2-core machine.
"""

import atexit
import contextlib
import fcntl
import functools
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml
from process_tree import process_tree
from repo import REPO, SHARED_RUNS_VARIABLE, free_port
from text_data import write_llama

from distsetup.train import STACKS_AFTER

TRAIN = REPO / "src" / "train.py"
BIN = Path(sys.executable).parent
if shared := os.environ.get(SHARED_RUNS_VARIABLE):  # tests/conftest.py's, one for every worker of the session
    SHARED = Path(shared)
else:
    SHARED = Path(tempfile.mkdtemp(prefix="distsetup-train-"))
    atexit.register(shutil.rmtree, SHARED, ignore_errors=True)

STEPS, INTERVAL, GLOBAL_BATCH = 30, 10, 24
STACKS_AFTER_S = 240  # below train()'s timeout of 300 s
MODEL = {"n_layer": 2, "n_head": 2, "n_embd": 32, "block_size": 32}
TRAINING = {
    "seed": 7,
    "max_steps": STEPS,
    "warmup_steps": 3,
    "lr": 3e-3,
    "grad_clip": 1.0,
    "checkpoint_interval": INTERVAL,
    "log_interval": 1,
    "precision": "fp32",
}

# name -> (processes, backend, backend file or None); every 2-process run splits the same global batch.
FSDP_FILES = {
    name: {
        "fsdp_version": 2,
        "fsdp_sharding_strategy": strategy,
        "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
        "fsdp_transformer_layer_cls_to_wrap": "Block",
        "fsdp_state_dict_type": "SHARDED_STATE_DICT",
        "mixed_precision": "no",
    }
    for name, strategy in (
        ("fsdp_full", "FULL_SHARD"),
        ("fsdp_grad_op", "SHARD_GRAD_OP"),
        ("fsdp_no_shard", "NO_SHARD"),
    )
}


def ds_file(stage: int, offload: bool = False) -> dict:
    """No optimizer block: the script passes torch's AdamW (or DeepSpeedCPUAdam when offloading)."""
    zero = {"stage": stage, "stage3_param_persistence_threshold": 0} if stage == 3 else {"stage": stage}
    if offload:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": False}
    return {
        "train_micro_batch_size_per_gpu": GLOBAL_BATCH // 2,
        "gradient_accumulation_steps": 1,
        "train_batch_size": GLOBAL_BATCH,
        "gradient_clipping": TRAINING["grad_clip"],
        "bf16": {"enabled": False},
        "fp16": {"enabled": False},
        "zero_optimization": zero,
    }


DS_FILES = {"zero1": ds_file(1), "zero2": ds_file(2), "zero3": ds_file(3), "zero2_offload": ds_file(2, offload=True)}


def ds_split(name: str, processes: int, micro: int) -> dict:
    """Run `name`'s DeepSpeed file with the same global batch split over `processes` in micro-batches of `micro`."""
    accumulation = GLOBAL_BATCH // (processes * micro)
    assert micro * accumulation * processes == GLOBAL_BATCH
    return {
        **DS_FILES[name],
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": accumulation,
    }


RUNS = {
    "single": (1, "single", None),
    "ddp": (2, "ddp", None),
    **{name: (2, "fsdp", cfg) for name, cfg in FSDP_FILES.items()},
    **{name: (2, "deepspeed", cfg) for name, cfg in DS_FILES.items()},
}


def write_run_config(folder: Path, name: str, **training) -> Path:
    """config.yaml (and the backend file) for run `name` in `folder`. The 2-process runs compute the loss inside the
    output head (training.chunked_loss always), the single-process reference from the whole logits: their parity
    holds the sliced loss to the plain one under every backend."""
    nproc, backend, backend_file = RUNS[name]
    loss = {"chunked_loss": "always" if nproc > 1 else "never"}
    return write_config(
        folder, name, backend, backend_file, {**TRAINING, "micro_batch_size": GLOBAL_BATCH // nproc, **loss, **training}
    )


def write_config(
    folder: Path, name: str, backend: str, backend_file: dict | None, training: dict, data: dict | None = None
) -> Path:
    """config.yaml for `backend` (its file written next to it as name.json), output in folder/out."""
    folder.mkdir(parents=True, exist_ok=True)
    dist = {"backend": backend, "timeout_minutes": 2}
    if backend_file is not None:
        key = "fsdp_config" if backend == "fsdp" else "deepspeed_config"
        (folder / f"{name}.json").write_text(json.dumps(backend_file))
        dist[key] = str(folder / f"{name}.json")
    config = {
        "model": MODEL,
        "data": data or {"num_samples": 2048},
        "training": {**training, "output_dir": str(folder / "out")},
        "distributed": dist,
    }
    path = folder / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def command(config: Path, nproc: int, *args) -> list[str]:
    if nproc == 1:
        return [sys.executable, str(TRAIN), "--config", str(config), *map(str, args)]
    return [  # torchrun as a module: the GPU check's interpreter may have no torchrun script beside it
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        str(nproc),
        str(TRAIN),
        "--config",
        str(config),
        *map(str, args),
    ]


def environment() -> dict:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    }
    env.setdefault("TORCH_EXTENSIONS_DIR", str(REPO / ".torch_extensions"))
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.setdefault(STACKS_AFTER, str(STACKS_AFTER_S))  # a run that hangs prints its stacks before train() gives up
    return env


def train(
    config: Path, nproc: int = 1, *args, timeout: int = 300, env: dict | None = None
) -> subprocess.CompletedProcess:
    """Run it to the end; `env` adds to the environment the tests give every run. A run still going after
    `timeout` seconds is killed, all its processes (torchrun's ranks run in sessions of their own), and fails the
    test with the end of its output, where a hung one printed its ranks' stacks."""
    with subprocess.Popen(
        command(config, nproc, *args),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**environment(), **(env or {})},
        cwd=REPO,
    ) as run:
        try:
            stdout, stderr = run.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for pid in process_tree(run.pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            said = "\n".join(run.communicate())[-12000:]
            raise AssertionError(f"the run took more than {timeout} s; the end of its output:\n{said}") from None
    return subprocess.CompletedProcess(run.args, run.returncode, stdout, stderr)


def start(config: Path, nproc: int, *args) -> subprocess.Popen:
    """Start a run in the background; its output goes to run.log next to the config (a pipe could fill)."""
    log = open(config.parent / "run.log", "w")
    proc = subprocess.Popen(
        command(config, nproc, *args), stdout=log, stderr=subprocess.STDOUT, text=True, env=environment(), cwd=REPO
    )
    proc.log = config.parent / "run.log"
    return proc


@contextlib.contextmanager
def one_worker_at_a_time(name: str):
    """Held by one pytest process of the session at a time: the one making shared run `name`, or reading it."""
    with open(SHARED / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


@functools.cache
def shared_run(name: str) -> Path:
    """Run `name` once (30 steps, checkpoints every 10); returns its output_dir. Fails loudly if it fails."""
    passed = SHARED / name / "passed"
    with one_worker_at_a_time(name):
        if not passed.exists():
            config = write_run_config(SHARED / name, name)
            result = train(config, RUNS[name][0])
            assert result.returncode == 0, f"{name} failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
            passed.touch()
    return SHARED / name / "out"


def copied_run(name: str, folder: Path) -> Path:
    """Shared run `name`, finished, copied into folder/out (to damage, resume or refuse without touching it); its
    config, writing there."""
    shutil.copytree(shared_run(name), folder / "out")
    return write_run_config(folder, name)


def losses(output_dir: Path) -> list[float]:
    """The logged training loss of each step."""
    by_step = {}
    for line in (output_dir / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        if "loss" in row:  # not an evaluation's line
            by_step[row["step"]] = row["loss"]
    return [by_step[s] for s in sorted(by_step)]


def final_weights(output_dir: Path) -> dict:
    from distsetup.formats.checkpoint_folder import latest_complete
    from distsetup.training.checkpoint.export import consolidated_state_dict

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
            raise AssertionError(
                f"run ended (status {proc.returncode}) before {path} appeared:\n{proc.log.read_text()[-3000:]}"
            )
        if time.time() > deadline:
            proc.kill()
            raise AssertionError(f"{path} did not appear within {timeout}s")
        time.sleep(0.005)


# -- feature runs: global batch 16 = micro 4 x accumulation (4 / processes) x processes, 12 steps ------------
# Backend files come from the CLI (`distsetup fsdp|deepspeed ...`), as users get them.

FEATURE_STEPS, MICRO, FEATURE_BATCH = 12, 4, 16
DS_ACC = (
    "--world_size",
    "2",
    "--micro_batch_size",
    str(MICRO),
    "--gradient_accumulation_steps",
    "2",
    "--lr",
    str(TRAINING["lr"]),
    "--betas",
    "0.9",
    "0.95",
    "--weight_decay",
    "0.01",
)


def cli_file(command: str, *args: str) -> dict:
    """The JSON file `distsetup COMMAND ARGS --output FILE` writes."""
    from click.testing import CliRunner

    from distsetup.cli.main import cli

    out = Path(tempfile.mkdtemp(dir=SHARED)) / f"{command}.json"
    result = CliRunner().invoke(cli, [command, *args, "--output", str(out)])
    assert result.exit_code == 0, result.output
    return json.loads(out.read_text())


def text_files(folder: Path) -> dict:
    """A .txt and a .jsonl file of repetitive English (byte-level: the loss falls fast); the data section."""
    folder.mkdir(parents=True, exist_ok=True)
    line = "the quick brown fox jumps over the lazy dog while the cat sleeps. "
    (folder / "a.txt").write_text(line * 120)
    (folder / "b.jsonl").write_text("".join(json.dumps({"text": f"record {i}: {line}"}) + "\n" for i in range(60)))
    return {"type": "files", "paths": [str(folder / "a.txt"), str(folder / "b.jsonl")]}


# name -> (processes, backend, backend file (built lazily), training overrides, data, launched as 2 nodes)
FEATURE_RUNS = {
    "acc_single": lambda: (1, "single", None, {}, None, False),
    "acc_ddp_ckpt": lambda: (2, "ddp", None, {"activation_checkpointing": True}, None, False),
    "acc_fsdp_ckpt_full_sd": lambda: (
        2,
        "fsdp",
        cli_file(
            "fsdp",
            "--sharding_strategy",
            "FULL_SHARD",
            "--activation_checkpointing",
            "--state_dict_type",
            "FULL_STATE_DICT",
        ),
        {},
        None,
        False,
    ),
    "acc_zero2": lambda: (2, "deepspeed", cli_file("deepspeed", "--zero_stage", "2", *DS_ACC), {}, None, False),
    # one plain `python src/train.py --deepspeed`-style process: DeepSpeed without a launcher's LOCAL_RANK
    "acc_zero2_one_process": lambda: (
        1,
        "deepspeed",
        cli_file(
            "deepspeed",
            "--zero_stage",
            "2",
            "--world_size",
            "1",
            "--micro_batch_size",
            str(MICRO),
            "--gradient_accumulation_steps",
            "4",
            *DS_ACC[6:],
        ),
        {},
        None,
        False,
    ),
    "acc_zero3_offload": lambda: (
        2,
        "deepspeed",
        cli_file(
            "deepspeed",
            "--zero_stage",
            "3",
            "--offload_param",
            "--offload_optimizer",
            "--stage3_param_persistence_threshold",
            "0",
            *DS_ACC,
        ),
        {},
        None,
        False,
    ),
    "acc_fsdp_hybrid_size": lambda: (
        2,
        "fsdp",
        cli_file(
            "fsdp",
            "--sharding_strategy",
            "HYBRID_SHARD",
            "--auto_wrap_policy",
            "SIZE_BASED_WRAP",
            "--min_num_params",
            "5000",
            "--cpu_offload",  # ignored on the CPU, in a note (test_train_features)
        ),
        {},
        None,
        False,
    ),
    "acc_fsdp_hybrid_zero2_nodes": lambda: (
        2,
        "fsdp",
        cli_file("fsdp", "--sharding_strategy", "HYBRID_SHARD_ZERO2"),
        {},
        None,
        True,
    ),
    # low precision (no parity: loss falls and stays finite); a higher lr so 12 steps show it
    "bf16_ddp_files": lambda: (
        2,
        "ddp",
        None,
        {"precision": "bf16", "lr": 5e-3, "scale_lr": "linear", "base_batch_size": 8},
        text_files(SHARED / "text"),
        False,
    ),
    "bf16_fsdp": lambda: (2, "fsdp", cli_file("fsdp", "--mixed_precision", "BFLOAT16"), {"lr": 1e-2}, None, False),
    "fp16_zero2": lambda: (
        2,
        "deepspeed",
        cli_file("deepspeed", "--zero_stage", "2", "--fp16", *DS_ACC[:-7], "--lr", "1e-2", "--betas", "0.9", "0.95"),
        {},
        None,
        False,
    ),
}


def write_feature_config(folder: Path, name: str, **training) -> tuple[Path, int, bool]:
    """(config path, processes, as two nodes) for feature run `name`."""
    nproc, backend, backend_file, extra, data = FEATURE_RUNS[name]()[:5]
    accumulation = FEATURE_BATCH // (MICRO * nproc)
    settings = {
        **TRAINING,
        "max_steps": FEATURE_STEPS,
        "checkpoint_interval": FEATURE_STEPS,
        "micro_batch_size": MICRO,
        "gradient_accumulation_steps": accumulation,
        **extra,
        **training,
    }
    return write_config(folder, name, backend, backend_file, settings, data), nproc, FEATURE_RUNS[name]()[5]


@functools.cache
def feature_attempt(name: str) -> subprocess.CompletedProcess:
    """Run feature run `name` once per test session, whatever its outcome."""
    outcome = SHARED / name / "outcome.json"
    with one_worker_at_a_time(name):
        if not outcome.exists():
            config, nproc, nodes = write_feature_config(SHARED / name, name)
            result = train_nodes(config) if nodes else train(config, nproc)
            fields = {"args": result.args, "returncode": result.returncode}
            outcome.write_text(json.dumps({**fields, "stdout": result.stdout, "stderr": result.stderr}))
    return subprocess.CompletedProcess(**json.loads(outcome.read_text()))


def feature_run(name: str) -> Path:
    """Feature run `name`, which must succeed; returns its output_dir."""
    result = feature_attempt(name)
    assert result.returncode == 0, f"{name} failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return SHARED / name / "out"


def train_nodes(config: Path, *args, timeout: int = 300) -> subprocess.CompletedProcess:
    """Two torchrun "nodes" of one process each on this machine (LOCAL_WORLD_SIZE 1, WORLD_SIZE 2)."""
    port, procs, logs = free_port(), [], []
    for node in range(2):
        logs.append(config.parent / f"node{node}.log")
        cmd = [
            str(BIN / "torchrun"),
            "--nnodes",
            "2",
            "--nproc_per_node",
            "1",
            "--node_rank",
            str(node),
            "--master_addr",
            "127.0.0.1",
            "--master_port",
            str(port),
            str(TRAIN),
            "--config",
            str(config),
            *map(str, args),
        ]
        procs.append(
            subprocess.Popen(
                cmd, stdout=open(logs[-1], "w"), stderr=subprocess.STDOUT, text=True, env=environment(), cwd=REPO
            )
        )
    codes = [p.wait(timeout=timeout) for p in procs]
    text = "".join(log.read_text() for log in logs)
    return subprocess.CompletedProcess(procs[0].args, max(codes, key=abs), stdout=text, stderr=text)


def assert_clean_error(result, *words):
    assert result.returncode != 0
    lines = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    for word in words:
        assert word in lines[0], lines[0]
    return lines[0]


def deepspeed_supports(precision: str) -> bool:
    """What DeepSpeed's accelerator says of this machine (fp16 on a CPU needs oneDNN fp16: some have it)."""
    from deepspeed.accelerator import get_accelerator

    return bool({"fp16": get_accelerator().is_fp16_supported, "bf16": get_accelerator().is_bf16_supported}[precision]())


def write_llama_config(tmp_path, layer_cls: str, tie_word_embeddings=False):
    write_llama(tmp_path / "llama", tie_word_embeddings=tie_word_embeddings)
    fsdp = {**FSDP_FILES["fsdp_full"], "fsdp_transformer_layer_cls_to_wrap": layer_cls}
    (tmp_path / "fsdp.json").write_text(json.dumps(fsdp))
    config = {
        "model": {"type": "hf", "hf_path": str(tmp_path / "llama"), "block_size": 32},
        "data": {"num_samples": 1024},
        "training": {
            "micro_batch_size": 8,
            "max_steps": 30,
            "warmup_steps": 3,
            "lr": 3e-3,
            "log_interval": 1,
            "checkpoint_interval": 30,
            "output_dir": str(tmp_path / "out"),
        },
        "distributed": {"backend": "fsdp", "fsdp_config": str(tmp_path / "fsdp.json")},
    }
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(config))
    return tmp_path / "config.yaml"
