"""Rank 0's metrics (JSONL, TensorBoard when installed) and the timer behind tokens_per_s."""

import importlib.util
import json
import sys
import time
import types

import pytest
import torch

from distsetup.errors import DistsetupError
from distsetup.training.metrics import MetricsLog, StepTimer, reporters
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


def test_scalars_go_to_tensorboard_when_it_imports(tmp_path, monkeypatch):
    calls = []

    class SummaryWriter:
        def __init__(self, log_dir):
            calls.append(("dir", log_dir))

        def add_scalar(self, tag, value, step):
            calls.append((tag, value, step))

        def flush(self):
            pass

        def close(self):
            calls.append(("closed",))

    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", types.SimpleNamespace(SummaryWriter=SummaryWriter))
    log = MetricsLog(tmp_path, enabled=True, report_to=["tensorboard"])
    log.write(3, loss=1.5, lr=4e-4, mfu=None)  # an unknown figure is left out
    log.close()
    assert calls == [("dir", str(tmp_path / "tensorboard")), ("train/loss", 1.5, 3), ("train/lr", 4e-4, 3), ("closed",)]


def test_other_ranks_write_nothing(tmp_path):
    log = MetricsLog(tmp_path, enabled=False)
    log.write(1, loss=1.0)
    log.close()
    assert list(tmp_path.iterdir()) == []


@pytest.mark.skipif(importlib.util.find_spec("tensorboard") is None, reason="tensorboard not installed")
def test_real_tensorboard_writes_event_files(tmp_path):
    log = MetricsLog(tmp_path, enabled=True, report_to=["tensorboard"])
    log.write(1, loss=1.0)
    log.close()
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))


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
    settled = agreement.settle(1, terms, False, 0.05, False)
    assert settled == ({"loss": 3.0, "aux_loss": 0.5}, False, True)
    assert not agreement.due(20) and agreement.due(21)  # 1 s of 50 ms steps
    assert agreement.settle(21, {"loss": torch.tensor(1.0)}, True, 3.0, True) == ({"loss": 1.0}, True, False)
    assert agreement.due(22)  # steps longer than the period: every step


def wandb_history(run_folder) -> tuple[object, list[dict]]:
    """The run record and the history rows of a W&B offline run folder, read from its .wandb file: W&B's
    header, then LevelDB's log format (32 KiB blocks of records with a 7-byte header: crc, length, type)."""
    from wandb.proto import wandb_internal_pb2 as pb

    (path,) = run_folder.glob("run-*.wandb")
    data, position, pending, run, rows = path.read_bytes(), 7, b"", None, []
    assert data[:4] == b":W&B"
    while position + 7 <= len(data):
        if (left := 32768 - position % 32768) < 7:  # a block's tail too short for a header is padding
            position += left
            continue
        length, kind = int.from_bytes(data[position + 4 : position + 6], "little"), data[position + 6]
        pending += data[position + 7 : position + 7 + length]
        position += 7 + length
        if kind in (1, 4):  # a whole record, or the last piece of one
            record = pb.Record()
            record.ParseFromString(pending)
            pending = b""
            if record.WhichOneof("record_type") == "run":
                run = record.run
            elif record.WhichOneof("record_type") == "history":
                rows.append(
                    {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
                )
    return run, rows


@pytest.mark.slow
def test_wandb_offline_run_holds_the_metrics_and_a_resumed_run_continues_it(tmp_path, monkeypatch):
    from train_runs import train, write_config

    monkeypatch.setenv("WANDB_MODE", "offline")
    training = {"max_steps": 6, "log_interval": 2, "checkpoint_interval": 6, "eval_interval": 3, "micro_batch_size": 4}
    training |= {"report_to": ["wandb"], "run_name": "tiny", "wandb_project": "distsetup-tests", "wandb_tags": ["ci"]}
    config = write_config(tmp_path, "single", "single", None, training, data={"num_samples": 256, "val_fraction": 0.1})
    assert train(config, 1).returncode == 0
    assert train(config, 1, "training.max_steps=10").returncode == 0  # resumes at step 6
    metrics = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    first, resumed = sorted((tmp_path / "out" / "wandb").glob("offline-run-*"))
    run_id = (tmp_path / "out" / "wandb_run_id").read_text()
    logged = {}
    for folder in (first, resumed):
        run, rows = wandb_history(folder)
        assert (run.run_id, run.display_name, run.project, list(run.tags)) == (
            run_id,
            "tiny",
            "distsetup-tests",
            ["ci"],
        )
        logged.update({row["_step"]: row for row in rows})
    for line in metrics:
        section = "train" if "loss" in line else "eval"
        for key, value in line.items():
            if key != "step":
                assert logged[line["step"]][f"{section}/{key}"] == pytest.approx(value, rel=1e-12), (line, key)
    assert sorted(logged) == [2, 3, 4, 6, 8, 9, 10] and "train/tokens_per_s" in logged[10]
    assert train(config, 1, "--no_resume", "training.max_steps=2").returncode == 0  # a new run: a new W&B run
    assert (tmp_path / "out" / "wandb_run_id").read_text() != run_id


@pytest.mark.parametrize("tied", [False, True])
def test_flops_per_token_counts_a_hugging_face_model_without_its_embedding_lookups(tmp_path, tied):
    pytest.importorskip("transformers")
    from text_data import write_llama
    from transformers import AutoConfig, AutoModelForCausalLM

    from distsetup.training.throughput import flops_per_token, mfu

    config = AutoConfig.from_pretrained(write_llama(tmp_path, vocab_size=300))
    config.tie_word_embeddings = tied
    hf = AutoModelForCausalLM.from_config(config)
    head = 300 * 32  # the output head multiplies, tied to the embedding lookup or not
    multiplied = sum(p.numel() for p in hf.model.parameters()) - hf.model.embed_tokens.weight.numel() + head
    assert (hf.lm_head.weight is hf.model.embed_tokens.weight) == tied
    assert flops_per_token(hf, 64) == 6 * multiplied + 12 * 2 * 32 * 64
    assert mfu(1000.0, 2e9, 2, 1.0) == pytest.approx(1.0) and mfu(1000.0, 2e9, 2, None) is None
