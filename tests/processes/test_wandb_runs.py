"""Weights & Biases offline: a run's .wandb file holds every metric metrics.jsonl holds, a resumed run continues
the same W&B run, and --no_resume starts another."""

import json

import pytest


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
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())  # the resumed run's lists the first's too
    assert [evaluation["step"] for evaluation in summary["evals"]] == [3, 6, 9, 10]
    assert summary["evals"] == [line for line in metrics if "val_loss" in line]
    assert train(config, 1, "--no_resume", "training.max_steps=2").returncode == 0  # a new run: a new W&B run
    assert (tmp_path / "out" / "wandb_run_id").read_text() != run_id
    (previous,) = (tmp_path / "out").glob("previous-*")  # the first run's record, whole, beside the new one's
    assert [json.loads(line) for line in (previous / "metrics.jsonl").read_text().splitlines()] == metrics
    assert sorted(p.name for p in (previous / "checkpoints").iterdir()) == ["step_0000006", "step_0000010"]
    new_lines = (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in new_lines] == [2, 2]  # the new run's training and evaluation lines
