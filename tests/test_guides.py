"""The guides' flows, command by command, as a user pastes them: the run trains with what the blocks say, read from
the run's own backend line and metrics.jsonl; a batch both files write differently stops the run before it starts
(and the launcher before it writes); settle() is what the backends train with and what doctor reports."""

import json
import math
import subprocess
import sys

import pytest
import torch
import yaml

from distsetup.formats.reading import parse_yaml
from distsetup.formats.runconfig import load_run_config
from distsetup.formats.settle import settle
from distsetup.training.backends import make_backend
from distsetup.training.fsdp import read_fsdp_settings
from distsetup.training.world import World
from tests.test_other_names import FREE_TRANSFORMER
from tests.test_train_features import deepspeed_supports
from tests.train_runs import REPO, SHARED, environment, losses, train

TINY = {"model": {"n_layer": 2, "n_head": 2, "n_embd": 32, "block_size": 32}, "data": {"num_samples": 512}}


def llm_guide(run_cli, folder, accumulation_in_file: int | None = None):
    """The LLM framework guide: `distsetup deepspeed --zero_stage 2 --offload_optimizer cpu --bf16`, then its
    distributed block (accumulation 16 beside use_deepspeed) in a run config of a tiny model."""
    folder.mkdir(parents=True, exist_ok=True)
    batch = ["--micro_batch_size", "1", "--gradient_accumulation_steps", str(accumulation_in_file)]
    written = run_cli(
        "deepspeed",
        *("--zero_stage", "2", "--offload_optimizer", "cpu", "--bf16"),
        *(batch if accumulation_in_file else []),
        *("--output", folder / "config" / "ds_config.json"),
    )
    assert written.exit_code == 0, written.output
    config = {
        **TINY,
        "training": {"micro_batch_size": 1, "max_steps": 3, "log_interval": 1, "output_dir": str(folder / "out")},
        "distributed": {
            "use_deepspeed": True,
            "deepspeed_config": "config/ds_config.json",
            "gradient_accumulation_steps": 16,
        },
    }
    (folder / "config.yaml").write_text(yaml.safe_dump(config))
    return folder / "config.yaml"


def backend_line(stdout: str) -> str:
    (line,) = [line for line in stdout.splitlines() if line.startswith("backend ")]
    return line


@pytest.mark.slow
def test_the_llm_guides_flow_trains_zero2_offload_bf16_with_its_accumulation(run_cli):
    config = llm_guide(run_cli, SHARED / "guide_llm")
    validated = run_cli("validate", config)
    assert validated.exit_code == 0 and "distributed.gradient_accumulation_steps" in validated.stdout
    result = train(config, 2)
    if not deepspeed_supports("bf16"):  # a CPU without bf16 in DeepSpeed: refused in one line naming it
        assert result.returncode != 0 and "enables bf16, which DeepSpeed does not support" in result.stderr
        return
    assert result.returncode == 0, result.stderr[-3000:]
    line = backend_line(result.stdout)
    assert line.startswith("backend deepspeed (ZeRO-2, optimizer offloaded to cpu) on 2 x cpu")
    assert "global batch 32 = micro 1 x accumulation 16 x world 2; bf16;" in line
    curve = losses(SHARED / "guide_llm" / "out")
    assert len(curve) == 3 and all(math.isfinite(x) for x in curve)
    summary = json.loads((SHARED / "guide_llm" / "out" / "summary.json").read_text())
    assert summary["precision"] == "bf16" and summary["zero_stage"] == 2 and summary["world_size"] == 2


@pytest.mark.slow
def test_the_free_transformer_guides_block_trains_fsdp_full_shard_bf16_checkpointed_and_clipped():
    folder = SHARED / "guide_free"
    folder.mkdir(parents=True, exist_ok=True)
    extra = f"  max_steps: 3\n  warmup_steps: 1\n  log_interval: 1\n  output_dir: {folder / 'out'}\n"
    config = folder / "config.yaml"
    config.write_text(FREE_TRANSFORMER.replace("distributed:\n", extra + "distributed:\n"))
    result = train(config, 2)
    assert result.returncode == 0, result.stderr[-3000:]
    line = backend_line(result.stdout)
    assert line.startswith("backend fsdp (FULL_SHARD) on 2 x cpu; global batch 8 = micro 4 x accumulation 1")
    assert line.endswith("; bf16; grad clip 1; peak lr 0.0002; activation checkpointing full")
    assert "note: distributed.fsdp_backward_prefetch is not used" in result.stdout
    rows = [json.loads(r) for r in (folder / "out" / "metrics.jsonl").read_text().splitlines() if '"loss"' in r]
    assert max(row["lr"] for row in rows) == pytest.approx(2e-4) and all(math.isfinite(r["loss"]) for r in rows)


def test_a_batch_both_files_write_differently_stops_the_run_and_the_launcher(run_cli, tmp_path):
    config = llm_guide(run_cli, tmp_path, accumulation_in_file=1)  # the file says 1, the run config 16
    result = subprocess.run(
        [sys.executable, "src/train.py", "--config", str(config)],
        capture_output=True,
        text=True,
        env=environment(),
        cwd=REPO,
        timeout=120,
    )
    (error,) = result.stderr.strip().splitlines()
    assert result.returncode != 0 and "backend" not in result.stdout  # before the process group
    assert "distributed.gradient_accumulation_steps is 16" in error and "gradient_accumulation_steps is 1" in error
    assert "remove one of the two" in error
    launched = run_cli("launcher", "--config", config, "--num_gpus_per_node", "2", "--output", tmp_path / "run.sh")
    assert launched.exit_code == 1 and "gradient_accumulation_steps is 1" in launched.stderr
    assert not (tmp_path / "run.sh").exists()


PAIRINGS = {  # backend, its file (or inline FSDP settings) -> the run config's training section
    "no batch, no precision": (
        "deepspeed",
        {"zero_optimization": {"stage": 1}},
        {"micro_batch_size": 2, "precision": "bf16"},
    ),
    "file batch and precision": (
        "deepspeed",
        {"train_micro_batch_size_per_gpu": 3, "gradient_accumulation_steps": 2, "bf16": {"enabled": True}},
        {"lr": 1e-3},
    ),
    "file train batch only": ("deepspeed", {"train_batch_size": 16, "gradient_clipping": 0.5}, {"micro_batch_size": 4}),
    "file optimizer": ("deepspeed", {"optimizer": {"type": "AdamW", "params": {"lr": 5e-4}}}, {"learning_rate": 1e-3}),
    "fsdp file bf16, run config fp32": ("fsdp", {"mixed_precision": "bf16"}, {"precision": "fp32", "grad_clip": 0.5}),
    "fsdp file fp32, run config bf16": ("fsdp", {"mixed_precision": "no"}, {"bf16": True, "micro_batch_size": 3}),
    "fsdp inline bf16": ("fsdp inline", {"fsdp_mixed_precision": True, "fsdp_param_dtype": "bfloat16"}, {"lr": 2e-4}),
}


def pairing_config(folder, name: str):
    """The run config of a pairing, with its backend file beside it (or its FSDP settings inline)."""
    backend, file, training = PAIRINGS[name]
    distributed: dict = {"backend": backend.split()[0]}
    if backend == "deepspeed":
        (folder / "ds.json").write_text(json.dumps({"zero_optimization": {"stage": 2}, **file}))
        distributed["deepspeed_config"] = "ds.json"
    elif backend == "fsdp":
        (folder / "fsdp.json").write_text(
            json.dumps({"fsdp_version": 2, "fsdp_sharding_strategy": "FULL_SHARD", **file})
        )
        distributed["fsdp_config"] = "fsdp.json"
    else:
        distributed.update(file)
    (folder / "config.yaml").write_text(yaml.safe_dump({**TINY, "training": training, "distributed": distributed}))
    return folder / "config.yaml"


@pytest.mark.parametrize("name", sorted(PAIRINGS))
def test_settled_values_are_what_the_backend_trains_with_and_doctor_reports(run_cli, tmp_path, name, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the backend reads its file relative to the working directory
    cfg = load_run_config(pairing_config(tmp_path, name))
    backend_name = cfg.distributed.backend
    ds = parse_yaml((tmp_path / "ds.json").read_text()) if backend_name == "deepspeed" else None
    fsdp = read_fsdp_settings(cfg) if backend_name == "fsdp" else None
    settled = settle(cfg, ds, fsdp, 2)
    backend = make_backend(backend_name, cfg, World(rank=0, local_rank=0, size=2, local_size=2), torch.device("cpu"))
    assert (backend.micro_batch, backend.accumulation) == (settled.micro_batch, settled.accumulation)
    assert (backend.precision, backend.grad_clip, backend.lr) == (settled.precision, settled.grad_clip, settled.lr)
    line = backend.line()
    assert f"micro {settled.micro_batch} x accumulation {settled.accumulation} x world 2; {settled.precision};" in line
    doctor = run_cli("doctor", "--json", "--config", tmp_path / "config.yaml", "--world_size", "2")
    (ok,) = [f["message"] for f in json.loads(doctor.stdout) if f["message"].startswith("global batch")]
    assert ok.startswith(
        f"global batch {settled.train_batch} = micro {settled.micro_batch} x accumulation {settled.accumulation} "
        f"x world size 2; {settled.precision}; grad clip {settled.grad_clip:g}; lr {settled.lr:g}"
    )
