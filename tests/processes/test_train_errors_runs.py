"""Errors a run meets after others ran: a checkpoint another backend wrote, resumed by DeepSpeed runs that cannot
take it, and a checkpoint of a model of another shape, each one clear line; and a plain one-process DeepSpeed run,
which needs a process group, takes a free port rather than torch's default 29500."""

import json
import socket

from train_runs import GLOBAL_BATCH, assert_clean_error, copied_run, ds_file, train, write_run_config


def test_checkpoint_another_backend_wrote_into_deepspeed_runs_that_cannot_take_it(tmp_path):
    """Conversions load DeepSpeed's universal format, which a run offloading its optimizer to NVMe cannot; a
    DeepSpeed file's own scheduler cannot continue distsetup's schedule."""
    config = copied_run("single", tmp_path)
    metrics = (tmp_path / "out" / "metrics.jsonl").read_text()
    one_rank = {**ds_file(2), "train_micro_batch_size_per_gpu": GLOBAL_BATCH}
    one_rank["zero_optimization"]["offload_optimizer"] = {"device": "nvme", "nvme_path": str(tmp_path)}
    (tmp_path / "ds.json").write_text(json.dumps(one_rank))
    result = train(config, 1, "--deepspeed", tmp_path / "ds.json")
    assert_clean_error(result, "(single, 1 rank); a run that offloads its optimizer to NVMe", "offload to cpu")
    one_rank["zero_optimization"].pop("offload_optimizer")
    one_rank["scheduler"] = {"type": "WarmupLR", "params": {"warmup_num_steps": 2}}
    (tmp_path / "ds.json").write_text(json.dumps(one_rank))
    result = train(config, 1, "--deepspeed", tmp_path / "ds.json")
    assert_clean_error(result, "the scheduler block of DeepSpeed file", "remove the scheduler block")
    assert (tmp_path / "out" / "metrics.jsonl").read_text() == metrics  # nothing trained


def test_checkpoint_of_a_model_of_another_shape(tmp_path):
    config = copied_run("single", tmp_path)
    metrics = (tmp_path / "out" / "metrics.jsonl").read_text()
    result = train(config, 1, "model.n_layer=3")
    assert_clean_error(result, "holds a model with model.n_layer 2; this run config says 3", "trained with")
    assert (tmp_path / "out" / "metrics.jsonl").read_text() == metrics  # nothing trained


def test_a_plain_one_process_deepspeed_run_takes_a_free_port_not_29500(tmp_path):
    """DeepSpeed needs a process group for one process too; another job holding torch's default port 29500 on
    this machine does not stop a plain `python -m distsetup.train` run."""
    one_process = {**ds_file(2), "train_micro_batch_size_per_gpu": GLOBAL_BATCH}
    (tmp_path / "ds.json").write_text(json.dumps(one_process))
    config = write_run_config(tmp_path, "single", max_steps=2, checkpoint_interval=2, warmup_steps=0)
    with socket.socket() as other_job:
        try:
            other_job.bind(("127.0.0.1", 29500))
            other_job.listen()
        except OSError:  # something on this machine holds it already: as good
            pass
        result = train(config, 1, "--deepspeed", tmp_path / "ds.json")
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert (tmp_path / "out" / "metrics.jsonl").exists()
