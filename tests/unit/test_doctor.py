"""`distsetup doctor`: a real run on this machine, and the checks across the run config, its files and the world."""

import json
import platform

import pytest
from hostile_input import one_line_error
from repo import REPO, run_subprocess_cli

from distsetup.cli.commands.doctor import FAIL, slurm_findings


def test_real_run_reports_versions_and_gpus():
    out = run_subprocess_cli("doctor", "--json", cwd=REPO)
    assert out.returncode == 0, out.stderr
    findings = {f["topic"]: f for f in json.loads(out.stdout)}
    assert platform.python_version() in findings["python"]["message"]
    torch = pytest.importorskip("torch")
    assert torch.__version__ in findings["torch"]["message"]
    if not torch.cuda.is_available():
        assert "no GPU visible to torch" in findings["gpus (torch)"]["message"]
        assert "CUDA none" in findings["torch"]["message"] or "NCCL n/a" in findings["torch"]["message"]
    from importlib import metadata

    assert findings["deepspeed"]["message"] == metadata.version("deepspeed")
    assert "Traceback" not in out.stderr


def _write(tmp_path, ds=None, fsdp=None, backend="deepspeed", precision="fp32", micro=4, accumulation=2):
    dist = {"backend": backend}
    if ds is not None:
        (tmp_path / "ds.json").write_text(json.dumps(ds))
        dist["deepspeed_config"] = "ds.json"
    if fsdp is not None:
        (tmp_path / "fsdp.json").write_text(json.dumps(fsdp))
        dist["fsdp_config"] = "fsdp.json"
    cfg = tmp_path / "config.yaml"
    cfg.write_text(
        json.dumps(
            {
                "training": {
                    "micro_batch_size": micro,
                    "gradient_accumulation_steps": accumulation,
                    "precision": precision,
                },
                "distributed": dist,
            }
        )
    )
    return cfg


def _ds(stage=2, train=32, micro=4, accumulation=2, **zero):
    return {
        "train_batch_size": train,
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": accumulation,
        "fp16": {"enabled": False},
        "bf16": {"enabled": False},
        "zero_optimization": {"stage": stage, **zero},
    }


def _doctor(run_cli, *args):
    result = run_cli("doctor", "--json", *args)
    findings = json.loads(result.stdout)
    return result.exit_code, [f for f in findings if f["level"] == FAIL], findings


def test_consistent_files_pass(run_cli, tmp_path):
    cfg = _write(tmp_path, ds=_ds())
    code, problems, findings = _doctor(run_cli, "--config", cfg, "--num_nodes", "2", "--num_gpus_per_node", "2")
    assert code == 0 and problems == []
    (said,) = [f["message"] for f in findings if f["topic"] == "configs"]
    assert said.endswith(" agree for world size 4.") and "ds.json" in said, said
    # a run config alone "agree"d
    code, problems, findings = _doctor(run_cli, "--config", _write(tmp_path, backend="ddp"))
    (said,) = [f["message"] for f in findings if f["topic"] == "configs"]
    assert code == 0 and " is consistent (give --num_nodes/--num_gpus_per_node" in said and "agree" not in said, said


def test_batch_identity_against_nodes_times_gpus(run_cli, tmp_path):
    cfg = _write(tmp_path, ds=_ds(train=32))  # 32 = 4 x 2 x 4 GPUs, not 8
    code, problems, _ = _doctor(run_cli, "--config", cfg, "--num_nodes", "2", "--num_gpus_per_node", "4")
    assert code == 1
    assert any("train_batch_size" in p["message"] and "world size 8" in p["message"] for p in problems)


def test_backend_against_files(run_cli, tmp_path):
    """A file the run config names beside another backend is left unread (a warning, as the trainer's note); a file
    given to doctor names its backend, as the launcher's flag does: its own --help example reported a PROBLEM that
    the launcher's script would not have."""
    cfg = _write(tmp_path, ds=_ds(), backend="ddp")
    code, problems, findings = _doctor(run_cli, "--config", cfg)
    assert code == 0 and problems == []
    assert any(f["level"] == "warning" and "file is left unread: backend is ddp" in f["message"] for f in findings)
    ds = tmp_path / "ds.json"
    code, problems, findings = _doctor(run_cli, "--config", cfg, "--deepspeed_config", ds, "--world_size", 4)
    assert code == 0 and not any("left unread" in f["message"] for f in findings), findings
    settled = "global batch 32 = micro 4 x accumulation 2 x world size 4"  # the pair settled as the ZeRO run's
    assert any(settled in f["message"] for f in findings), findings
    # the run config read with the flag's backend and file, as the launcher reads it: no file of its own needed
    training = {"micro_batch_size": 4, "gradient_accumulation_steps": 2, "precision": "fp32"}
    (tmp_path / "alone.yaml").write_text(json.dumps({"distributed": {"backend": "deepspeed"}, "training": training}))
    code, problems, _ = _doctor(run_cli, "--config", tmp_path / "alone.yaml", "--deepspeed_config", ds)
    assert code == 0 and problems == [], problems
    both = run_cli("doctor", "--config", cfg, "--deepspeed_config", tmp_path / "ds.json", "--fsdp_config", cfg)
    one_line_error(both, "--deepspeed_config and --fsdp_config name two backends")


def test_zero_stage_against_keys(run_cli, tmp_path):
    ds = _ds(stage=2, offload_param={"device": "cpu", "pin_memory": True})
    code, problems, _ = _doctor(run_cli, "--config", _write(tmp_path, ds=ds), "--world_size", "4")
    assert code == 1 and any("offload_param" in p["message"] and "stage 2" in p["message"] for p in problems)
    # a DeepSpeed file given alone is checked the same way
    code, problems, _ = _doctor(run_cli, "--deepspeed_config", tmp_path / "ds.json")
    assert code == 1 and problems


def test_a_batch_both_files_write_differently_is_a_problem_and_a_file_precision_a_warning(run_cli, tmp_path):
    ds = _ds(micro=2, accumulation=4, train=32)
    ds["bf16"]["enabled"] = True
    code, problems, _ = _doctor(run_cli, "--config", _write(tmp_path, ds=ds), "--world_size", "4")
    assert code == 1
    assert any(
        "training.micro_batch_size is 4" in p["message"] and "train_micro_batch_size_per_gpu is 2" in p["message"]
        for p in problems
    ), problems
    agreeing = _write(tmp_path, ds=ds, micro=2, accumulation=4)
    code, problems, findings = _doctor(run_cli, "--config", agreeing, "--world_size", "4")
    warnings = [f["message"] for f in findings if f["level"] == "warning" and f["topic"] == "consistency"]
    assert code == 0 and not problems
    assert any("precision bf16 from" in w and "training.precision says fp32" in w for w in warnings), warnings


def test_slurm_allocation_against_the_plan():
    env = {"SLURM_JOB_ID": "42", "SLURM_NNODES": "2", "SLURM_GPUS_ON_NODE": "4"}
    ok = slurm_findings(env, 2, 4)
    assert [f.level for f in ok] == ["ok"] and "torchrun --nnodes 2" in ok[0].message
    bad = slurm_findings(env, 4, 8)
    assert [f.level for f in bad].count(FAIL) == 2
    assert slurm_findings({}, 2, 4)[0].message == "not inside a SLURM allocation."
