"""settle(): the batch, precision, clipping and lr a run trains with, from the run config and its backend file
together. The backend trains with settle()'s values and doctor reports them; a batch both files give differently
stops the trainer before its process group, and the launcher before it writes."""

import json
import subprocess
import sys

import pytest
import torch
import yaml
from guide_configs import TINY, llm_guide
from repo import REPO
from train_runs import environment

from distsetup.formats.reading import parse_yaml
from distsetup.formats.runconfig_load import load_run_config
from distsetup.formats.settle import settle
from distsetup.formats.validate import read_fsdp_settings
from distsetup.training.backends import make_backend
from distsetup.training.launch_env import World


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
    # training.scale_lr: the run config's lr scaled to the global batch, a file's lr used as written
    "scaled lr, file optimizer": (
        "deepspeed",
        {"optimizer": {"type": "AdamW", "params": {"lr": 5e-4}}},
        {"lr": 1e-3, "scale_lr": "linear", "base_batch_size": 4},
    ),
    "scaled lr, file optimizer without lr": (
        "deepspeed",
        {"optimizer": {"type": "AdamW", "params": {"weight_decay": 0.1}}},
        {"lr": 1e-3, "scale_lr": "linear", "base_batch_size": 4},
    ),
    "scaled lr, fsdp": ("fsdp", {"mixed_precision": "no"}, {"lr": 1e-3, "scale_lr": "sqrt", "base_batch_size": 2}),
}
SCALED = {"scaled lr, file optimizer": None, "scaled lr, file optimizer without lr": 1e-3 * 16 / 4}
SCALED["scaled lr, fsdp"] = 1e-3 * (16 / 2) ** 0.5  # the default batch: micro 8 x accumulation 1 x world 2


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
    if name in SCALED:  # decided in settle() alone: the backend, its DeepSpeed file and doctor all read it there
        assert settled.lr_scaled == (SCALED[name] is not None)
        assert settled.lr == pytest.approx(SCALED[name] or 5e-4)
        said = " ".join(backend.notes)
        assert backend.lr_scaled == settled.lr_scaled and ("not applied" in said) != settled.lr_scaled, said
        assert (" scaled " in ok) == settled.lr_scaled, ok  # doctor says it once, in its batch line
        if backend_name == "deepspeed":
            assert backend.ds_config["optimizer"]["params"]["lr"] == settled.lr


@pytest.mark.parametrize(
    "flag, mode, settled_mode",
    [(True, "none", "full"), (True, "selective", "selective"), (False, "full", "full"), (False, "none", "none")],
)
def test_activation_checkpointing_is_one_rule_for_the_trainer_and_doctor(
    run_cli, tmp_path, monkeypatch, flag, mode, settled_mode
):
    """The FSDP file's fsdp_activation_checkpointing turns it on (full) where the run config leaves it off, said in
    a note; the run config's mode decides otherwise (a file's False says nothing, as an fp32 file of precision)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "fsdp.json").write_text(
        json.dumps({"fsdp_version": 2, "fsdp_sharding_strategy": "FULL_SHARD", "fsdp_activation_checkpointing": flag})
    )
    training = {"activation_checkpointing": mode}
    run = {**TINY, "training": training, "distributed": {"backend": "fsdp", "fsdp_config": "fsdp.json"}}
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(run))
    cfg = load_run_config(tmp_path / "config.yaml")
    settled = settle(cfg, None, read_fsdp_settings(cfg), 2)
    backend = make_backend("fsdp", cfg, World(rank=0, local_rank=0, size=2, local_size=2), torch.device("cpu"))
    assert settled.activation_checkpointing == backend.checkpointing() == settled_mode
    doctor = run_cli("doctor", "--json", "--config", tmp_path / "config.yaml", "--world_size", "2")
    said = [f["message"] for f in json.loads(doctor.stdout) if f["message"].startswith("activation checkpointing")]
    overridden = settled_mode != mode
    assert len(said) == int(overridden) and all("fsdp_activation_checkpointing" in line for line in said), said


def test_a_files_optimizer_settings_that_differ_from_the_run_configs_are_said(tmp_path):
    """DeepSpeed builds the optimizer from the file's block: its betas and weight decay decide, and a note says so
    where the run config's differ (`distsetup deepspeed` writes DeepSpeed's betas, 0.999; the trainer's are 0.95)."""
    (tmp_path / "config.yaml").write_text(yaml.safe_dump({**TINY, "training": {"weight_decay": 0.1}}))
    cfg = load_run_config(tmp_path / "config.yaml")
    block = {"type": "AdamW", "params": {"lr": 1e-3, "betas": [0.9, 0.999], "weight_decay": 0.1}}
    notes = settle(cfg, {"optimizer": block}, None, 2).notes
    assert [n for n in notes if "betas" in n or "weight_decay" in n] == [
        "betas [0.9, 0.999] from the DeepSpeed file's optimizer AdamW (the run config's training.betas (default) "
        "says [0.9, 0.95])."
    ]


@pytest.mark.parametrize("scale_lr, scaled", [("none", False), ("linear", True)])
def test_a_base_batch_size_without_scaling_is_said_to_be_unused(scale_lr, scaled):
    """A guide's base batch without training.scale_lr: the lr stays as written, and a note says why."""
    cfg = load_run_config(None, ["training.base_batch_size=4", f"training.scale_lr={scale_lr}", "training.lr=0.001"])
    settled = settle(cfg, None, None, 2)
    unused = [note for note in settled.notes if "base_batch_size 4 is unused" in note]
    assert (settled.lr != 0.001, len(unused)) == (scaled, 0 if scaled else 1)


def test_backend_single_is_one_process_for_validate_and_several_train_with_ddp_from_the_launcher(
    run_cli, tmp_path, monkeypatch
):
    """A run config of one process (init writes backend single for one): validate refuses it for a world of
    several, as the trainer does; the launcher asked for several processes trains them with DDP, and says so."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "c.yaml").write_text("distributed:\n  backend: single\n")
    refused = run_cli("validate", "c.yaml", "--world_size", 2)
    assert refused.exit_code == 1 and "distributed.backend: single trains one process" in refused.output
    assert run_cli("validate", "c.yaml", "--world_size", 1).exit_code == 0
    # the script's ddp over the run config's single; one process: the run config's own, read when it starts
    for processes, pinned in ((2, " distributed.backend=ddp"), (1, "")):
        written = run_cli("launcher", "--config", "c.yaml", "--num_gpus_per_node", processes, "-o", "run.sh")
        assert written.exit_code == 0, written.output
        assert f"TRAIN_ARGS=(--config c.yaml{pinned})" in (tmp_path / "run.sh").read_text()
        assert ("trains its 2 processes with ddp" in written.stderr) == (processes == 2)
    (tmp_path / "mine.py").write_text("")  # a program of the user's gets no backend from the script: nothing said
    own = run_cli("launcher", "--config", "c.yaml", "--script", "mine.py", "--num_gpus_per_node", 2, "-o", "own.sh")
    assert own.exit_code == 0 and "with ddp" not in own.stderr, own.output


def test_a_warmup_as_long_as_the_run_is_said_and_init_writes_a_shorter_one(run_cli, tmp_path, monkeypatch):
    """The default warmup (20 steps) in a run of 10: the learning rate rose the whole run, without a word."""
    short = settle(load_run_config(None, ["training.max_steps=10"]), None, None, 2).notes
    assert [note for note in short if "warmup_steps" in note] == [
        "training.warmup_steps 20 is not shorter than training.max_steps 10: the learning rate rises the whole run "
        "and never reaches its peak (set warmup_steps lower)"
    ]
    shorter = load_run_config(None, ["training.max_steps=10", "training.warmup_steps=2"])
    assert not [note for note in settle(shorter, None, None, 2).notes if "warmup_steps" in note]
    monkeypatch.chdir(tmp_path)
    assert run_cli("init", "--yes", "--max_steps", 20).exit_code == 0
    assert yaml.safe_load((tmp_path / "config" / "config.yaml").read_text())["training"]["warmup_steps"] == 2


def test_an_fp16_fsdp_file_is_refused_by_validate_and_the_launcher_as_the_ranks_refuse_it(run_cli, tmp_path):
    """The run config's training.precision fp16 beside FSDP was refused; the same from the FSDP file passed validate,
    doctor, --check and the launcher, and every rank stopped."""
    made = run_cli("fsdp", "--mixed_precision", "FLOAT16", "-o", tmp_path / "fsdp16.json")
    assert made.exit_code == 0, made.output
    (tmp_path / "c.yaml").write_text(f"distributed:\n  backend: fsdp\n  fsdp_config: {tmp_path / 'fsdp16.json'}\n")
    said = "fsdp16.json: mixed_precision: FSDP with fp16 needs loss scaling"
    refused = run_cli("validate", tmp_path / "c.yaml")
    assert refused.exit_code == 1 and said in refused.output
    (tmp_path / "plain.yaml").write_text("training:\n  max_steps: 2\n")
    launcher = run_cli(
        "launcher", "--config", tmp_path / "plain.yaml", "--use_fsdp", "--fsdp_config", tmp_path / "fsdp16.json",
        "--num_gpus_per_node", 2, "-o", tmp_path / "run.sh",
    )  # fmt: skip
    assert launcher.exit_code == 1 and said in launcher.output and not (tmp_path / "run.sh").exists()
    cfg = load_run_config(tmp_path / "c.yaml")
    problems = settle(cfg, None, read_fsdp_settings(cfg), 2).problems  # what the trainer and --check settle
    assert [str(problem).split(" Fix:")[0] for problem in problems] == [
        f"FSDP file {tmp_path / 'fsdp16.json'}: mixed_precision: FSDP with fp16 needs loss scaling, which distsetup's "
        "trainer does not do for FSDP."
    ]
