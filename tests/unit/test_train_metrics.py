"""Rank 0's metrics (JSONL, TensorBoard when installed) and the timer behind tokens_per_s."""

import importlib.util
import json
import time

import pytest
import torch

from distsetup.errors import DistsetupError
from distsetup.training.metrics import MetricsLog, StepTimer, as_json, reporters
from distsetup.training.world import StepAgreement


def test_jsonl_always_and_no_tensorboard_folder_without_tensorboard(tmp_path, monkeypatch):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name: None if name == "tensorboard" else real_find_spec(name)
    )
    assert reporters(None) == []  # unset: TensorBoard only where it is installed
    with pytest.raises(DistsetupError, match="training.report_to names tensorboard, which is not installed"):
        reporters(["tensorboard"])
    log = MetricsLog(tmp_path, enabled=True, report_to=reporters(None))
    log.write(1, loss=2.5, lr=1e-3)
    log.write(2, loss=2.0, lr=2e-3)
    log.close()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows == [{"step": 1, "loss": 2.5, "lr": 1e-3}, {"step": 2, "loss": 2.0, "lr": 2e-3}]
    assert not (tmp_path / "tensorboard").exists()


def strict_json(text: str):
    """JSON as any reader but Python's reads it: no NaN, no Infinity."""

    def refused(constant):
        raise ValueError(f"{constant} is not JSON")

    return json.loads(text, parse_constant=refused)


def test_a_loss_that_is_not_a_number_is_null_in_metrics_jsonl_and_the_summary(tmp_path):
    """A diverged loss (NaN, inf) in metrics.jsonl, and no loss at all in summary.json (the trainer's final_loss
    before any step): null, valid JSON, never a bare NaN."""
    log = MetricsLog(tmp_path, enabled=True)
    log.write(1, loss=float("nan"), lr=1e-3, grad_norm=float("inf"))
    log.write(2, "eval", val_loss=2.0)
    log.close()
    rows = [strict_json(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows == [{"step": 1, "loss": None, "lr": 1e-3, "grad_norm": None}, {"step": 2, "val_loss": 2.0}]
    summary = {"final_loss": float("nan"), "evals": [{"step": 2, "val_perplexity": float("inf")}], "steps": 2}
    assert strict_json(as_json(summary, indent=2)) == {
        "final_loss": None,
        "evals": [{"step": 2, "val_perplexity": None}],
        "steps": 2,
    }


def tensorboard_scalars(folder) -> dict[str, list[tuple[int, float]]]:
    """Each tag's (step, value) pairs as TensorBoard itself reads them from `folder`."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(folder))
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def test_scalars_go_to_tensorboard_under_their_section(tmp_path):
    log = MetricsLog(tmp_path, enabled=True, report_to=["tensorboard"])
    log.write(3, loss=1.5, lr=0.25, mfu=None)  # an unknown figure is left out
    log.write(3, "eval", val_loss=2.5)
    log.close()
    scalars = tensorboard_scalars(tmp_path / "tensorboard")
    assert scalars == {"train/loss": [(3, 1.5)], "train/lr": [(3, 0.25)], "eval/val_loss": [(3, 2.5)]}


def test_other_ranks_write_nothing(tmp_path):
    log = MetricsLog(tmp_path, enabled=False)
    log.write(1, loss=1.0)
    log.close()
    assert list(tmp_path.iterdir()) == []


def test_timer_leaves_checkpoint_time_out():
    begin = time.perf_counter()
    timer = StepTimer(window=2)
    for seconds in (0.05, 0.02, 0.03):  # the first step also writes a checkpoint
        time.sleep(seconds)
        timer.step_done()
        if seconds == 0.05:
            with timer.checkpointing():
                time.sleep(0.2)
    wall = time.perf_counter() - begin
    assert timer.checkpoint_seconds >= 0.2
    assert timer.train_seconds + timer.checkpoint_seconds == pytest.approx(wall, abs=0.02)
    second, third = timer.recent_steps  # the window keeps the latest two
    assert 0.02 <= second < 0.2 and 0.03 <= third < 0.2  # the checkpoint's 0.2 s is in neither
    assert timer.median_step_seconds == (second + third) / 2


def test_ranks_settle_often_enough_for_a_signal_but_not_every_short_step():
    agreement = StepAgreement(world_size=1, device=torch.device("cpu"), every_seconds=1.0)
    assert agreement.due(1)
    terms = {"loss": torch.tensor(3.0), "aux_loss": torch.tensor(0.5, dtype=torch.bfloat16)}
    settled = agreement.agree(1, terms, False, 0.05, False)
    assert settled == ({"loss": 3.0, "aux_loss": 0.5}, False, True)
    assert not agreement.due(20) and agreement.due(21)  # 1 s of 50 ms steps
    assert agreement.agree(21, {"loss": torch.tensor(1.0)}, True, 3.0, True) == ({"loss": 1.0}, True, False)
    assert agreement.due(22)  # steps longer than the period: every step


@pytest.mark.parametrize("tied", [False, True])
def test_flops_per_token_counts_a_hugging_face_model_without_its_embedding_lookups(tmp_path, tied):
    pytest.importorskip("transformers")
    from text_data import write_llama
    from transformers import AutoConfig, AutoModelForCausalLM

    from distsetup.training.model.throughput import flops_per_token, mfu

    config = AutoConfig.from_pretrained(write_llama(tmp_path, vocab_size=300))
    config.tie_word_embeddings = tied
    hf = AutoModelForCausalLM.from_config(config)
    head = 300 * 32  # the output head multiplies, tied to the embedding lookup or not
    multiplied = sum(p.numel() for p in hf.model.parameters()) - hf.model.embed_tokens.weight.numel() + head
    assert (hf.lm_head.weight is hf.model.embed_tokens.weight) == tied
    assert flops_per_token(hf, 64) == 6 * multiplied + 12 * 2 * 32 * 64
    assert mfu(1000.0, 2e9, 2, 1.0) == pytest.approx(1.0) and mfu(1000.0, 2e9, 2, None) is None


def test_wandb_without_a_login_is_one_line_saying_the_two_ways_on(tmp_path, monkeypatch):
    pytest.importorskip("wandb")  # installed in CI (requirements); a user without it gets report_to's own line
    from distsetup.training.metrics import wandb_run

    for variable in ("WANDB_API_KEY", "WANDB_MODE", "WANDB_DISABLED"):
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc: no login
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))
    with pytest.raises(DistsetupError, match=r"^training.report_to wandb: .*API key.* HINT: run `wandb login`"):
        wandb_run(tmp_path, {"project": "p"})


def test_a_resumed_run_continues_the_record_from_its_step_once_per_step(tmp_path):
    """A run that crashed at step 5, past its step-3 checkpoint, mid-line: resumed at 3, metrics.jsonl and
    TensorBoard (read by TensorBoard's own reader) hold each step once, steps 4 and 5 with the resumed run's values."""
    crashed = MetricsLog(tmp_path, enabled=True, report_to=["tensorboard"])
    for step in range(1, 6):
        crashed.write(step, loss=10.0 + step)
    crashed.close()
    with open(tmp_path / "metrics.jsonl", "a") as cut_short:
        cut_short.write('{"step": 6, "lo')
    resumed = MetricsLog(tmp_path, enabled=True, report_to=["tensorboard"], start_step=3)
    assert resumed.repeated_lines == 3
    for step in (4, 5):
        resumed.write(step, loss=float(step))
    resumed.close()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(row["step"], row["loss"]) for row in rows] == [(1, 11.0), (2, 12.0), (3, 13.0), (4, 4.0), (5, 5.0)]
    assert tensorboard_scalars(tmp_path / "tensorboard")["train/loss"] == [(1, 11), (2, 12), (3, 13), (4, 4), (5, 5)]


def test_a_fresh_start_sets_the_previous_runs_record_aside_whole(tmp_path):
    from distsetup.training import run_record

    assert run_record.set_aside(tmp_path) is None  # nothing to set aside: no folder made
    (tmp_path / "metrics.jsonl").write_text("")  # a start that failed before its first line: a folder a try, before
    assert run_record.set_aside(tmp_path) is None and list(tmp_path.iterdir()) == []
    (tmp_path / "checkpoints" / "step_0000002").mkdir(parents=True)
    (tmp_path / "metrics.jsonl").write_text('{"step": 2}\n')
    (tmp_path / "summary.json").write_text("{}")
    (tmp_path / "wandb_run_id").write_text("abc")  # not the record: a fresh start starts its own W&B run anyway
    first = run_record.set_aside(tmp_path)
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n')
    second = run_record.set_aside(tmp_path)  # within the same second: a folder of its own
    assert first != second and first.parent == second.parent == tmp_path and first.name.startswith("previous-")
    assert sorted(p.name for p in first.iterdir()) == ["checkpoints", "metrics.jsonl", "summary.json"]
    assert (second / "metrics.jsonl").read_text() == '{"step": 1}\n'
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([first.name, second.name, "wandb_run_id"])


def test_only_the_run_that_started_afresh_resumes_on_its_restarts(tmp_path, monkeypatch):
    """--no_resume on a requeue: the job that set the previous record aside resumes what it wrote since; another job
    (one that inherited SLURM_RESTART_COUNT), or a first start stopped before it set the record aside, does not."""
    from distsetup.training import run_record
    from distsetup.training.launch_env import run_identity

    for name in ("SLURM_JOB_ID", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(name, raising=False)
    assert run_identity() is None
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "distsetup")
    assert run_identity() == "torchrun run distsetup"
    monkeypatch.setenv("SLURM_JOB_ID", "42")  # under SLURM the job, which a requeue keeps, whatever torchrun's id
    assert run_identity() == "SLURM job 42"
    out = tmp_path / "out"
    assert not run_record.started_afresh_here(out, "SLURM job 42")  # stopped before it set anything aside
    run_record.note_fresh_start(out, "SLURM job 42")
    assert run_record.started_afresh_here(out, "SLURM job 42")
    assert not run_record.started_afresh_here(out, "SLURM job 43") and not run_record.started_afresh_here(out, None)
    run_record.note_fresh_start(out, None)  # a fresh start that nothing restarts: no older note stands
    assert not (out / run_record.FRESH_START).exists()
