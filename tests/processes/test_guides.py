"""The guides' flows, command by command, as a user pastes them, on 2 processes: the run trains with what the
blocks say, read from the run's own backend line and metrics.jsonl. (What settle() makes of them, in one process:
tests/unit/test_settle.py.)"""

import json
import math

import pytest
from guide_configs import FREE_TRANSFORMER, llm_guide
from train_runs import SHARED, deepspeed_supports, losses, train


def backend_line(stdout: str) -> str:
    (line,) = [line for line in stdout.splitlines() if line.startswith("backend ")]
    return line


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
