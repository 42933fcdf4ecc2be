"""Your own model, data and loss (examples/pairwise_scorer: model.type python, data.type python, training.loss) under
every backend: the same fp32 curve on 2 ranks as on one process (the same global batch), a DDP checkpoint resumed
under FSDP2 on 1 rank and ZeRO-3 on 2 continuing it, samples loaded by DataLoader workers (the example's
data.num_workers: 2) at the exact position, and the weights exported under the model's own names; no rank warns that
the model's output (a view) may get wrong gradients."""

import functools
import json
import shutil
import subprocess

import pytest
import torch
from repo import REPO
from train_runs import SHARED, command, ds_file, environment, final_weights, losses, train

EXAMPLE = REPO / "examples" / "pairwise_scorer"
STEPS, GLOBAL = 8, 16
SMALL = (
    "model.args={channels: 8, depth: 2}",
    "data.args={pairs: 256, image_size: 8}",
    f"training.max_steps={STEPS}",
    "training.checkpoint_interval=4",
    "training.log_interval=1",
    "training.warmup_steps=2",
)


def deepspeed_file(folder, stage: int, ranks: int):
    batch = {"train_micro_batch_size_per_gpu": GLOBAL // ranks, "gradient_accumulation_steps": 1}
    path = folder / f"zero{stage}.json"
    path.write_text(json.dumps({**ds_file(stage), **batch, "train_batch_size": GLOBAL}))
    return [f"distributed.deepspeed_config={path}"]


# name -> (processes, backend, more overrides); 2-process runs split the global batch of 16 pairs in micro-batches of
# 8; activation checkpointing recomputes the blocks of model.layer_classes (ConvBlock) without changing a number
RUNS = {
    "single": (1, "single", ["training.peak_tflops=0.5"]),  # a peak: MFU from the FLOPs counted on the meta device
    "ddp": (2, "ddp", []),
    "fsdp": (2, "fsdp", ["training.activation_checkpointing=full"]),
    "zero2": (2, "zero2", []),
    "zero3": (2, "zero3", ["training.activation_checkpointing=selective"]),
}


def overrides(folder, ranks: int, backend: str) -> list[str]:
    if backend.startswith("zero"):
        chosen = ["distributed.backend=deepspeed", *deepspeed_file(folder, int(backend[-1]), ranks)]
    else:
        chosen = [f"distributed.backend={backend}"]
    return [
        *SMALL,
        *chosen,
        f"training.micro_batch_size={GLOBAL // ranks}",
        f"training.output_dir={folder / 'out'}",
    ]


@functools.cache
def scorer_run(name: str):
    ranks, backend, more = RUNS[name]
    folder = SHARED / f"scorer_{name}"
    folder.mkdir(parents=True, exist_ok=True)
    result = train(EXAMPLE / "config.yaml", ranks, *overrides(folder, ranks, backend), *more)
    assert result.returncode == 0, f"{name} failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return folder / "out", result.stdout + result.stderr


def metrics(out) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("name", ["ddp", "fsdp", "zero2", "zero3"])
def test_the_scorer_trains_on_two_ranks_as_on_one_process(name):
    single, _ = scorer_run("single")
    out, output = scorer_run(name)
    # the scorer returns a view (squeeze(-1)): FSDP2's root output is made no view, so no rank warns of it
    assert "returned a view tensor" not in output
    reference, curve = losses(single), losses(out)
    assert len(curve) == STEPS
    torch.testing.assert_close(torch.tensor(curve), torch.tensor(reference), rtol=1e-4, atol=0)
    theirs, ours = final_weights(single), final_weights(out)
    assert theirs.keys() == ours.keys()
    for key, value in ours.items():  # 8 steps of lr 3e-3 move each weight by about 2e-2: a wrong step shows
        torch.testing.assert_close(value, theirs[key], rtol=1e-4, atol=1e-6, msg=key)
    evals = [row for row in metrics(out) if "val_loss" in row]
    reference_eval = [row for row in metrics(single) if "val_loss" in row]
    assert len(evals) == 1 and "val_perplexity" not in evals[0]  # the mean loss over the whole validation split
    assert evals[0]["val_loss"] == pytest.approx(reference_eval[0]["val_loss"], rel=1e-4)
    # the loss's other term too, over the whole split: 32 pairs, so a multiple of 1/32, alike however split
    assert evals[0]["val_accuracy"] == reference_eval[0]["val_accuracy"] and (32 * evals[0]["val_accuracy"]) % 1 == 0
    assert "accuracy" in metrics(out)[0]  # logged beside the training loss as well
    trained = [row for row in metrics(out) if "loss" in row]
    assert all(row["samples_per_s"] > 0 and "tokens_per_s" not in row for row in trained)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["samples_per_s"] > 0 and summary["mfu"] is None  # a CPU without training.peak_tflops
    assert summary["val_accuracy"] == evals[0]["val_accuracy"]  # the last evaluation's terms, as its loss
    without = json.loads((scorer_run("ddp")[0] / "summary.json").read_text())["peak_activation_bytes"]
    recomputed = "activation_checkpointing" in " ".join(RUNS[name][2])  # its blocks' activations are not kept
    assert recomputed == (summary["peak_activation_bytes"] < without / 2)


def test_mfu_of_your_own_model_counts_its_flops_with_pytorchs_counter(monkeypatch):
    from torch.utils.flop_counter import FlopCounterMode

    single, _ = scorer_run("single")
    monkeypatch.syspath_prepend(str(EXAMPLE))
    from scorer import build_dataset, build_model, pairwise_loss

    dataset = build_dataset("train", pairs=256, image_size=8)
    batch = torch.utils.data.default_collate([dataset[i] for i in range(GLOBAL)])
    with FlopCounterMode(display=False) as counter:
        pairwise_loss(build_model(channels=8, depth=2), batch)["loss"].backward()
    summary = json.loads((single / "summary.json").read_text())
    assert summary["flops_per_sample"] == counter.get_total_flops() / GLOBAL > 0
    logged = [row for row in metrics(single) if "loss" in row]
    for row in logged:
        assert row["mfu"] == pytest.approx(row["samples_per_s"] * summary["flops_per_sample"] / 0.5e12)


# The scorer with BatchNorm in its blocks (the last one's an InstanceNorm that keeps running statistics too, whose
# output is a view), and a loss of probabilities against the batch's fp32 judgements (as the
# walker's Crowd-BT scorer) from two forwards (a siamese pair), noting in evaluation each rank's running statistics
# after them (their sums, and the batches they counted) in $BATCHNORM_PROBE/rank<N>.txt
BATCHNORM_SCORER = """
import os
import torch
import torch.nn as nn
import torch.nn.functional as F
import scorer

def build(**args):
    model = scorer.build_model(**args)
    for block in model.blocks:
        block.norm = nn.BatchNorm2d(block.conv.out_channels)
    last = model.blocks[-1]
    last.norm = nn.InstanceNorm2d(last.conv.out_channels, affine=True, track_running_stats=True)
    return model

def loss(model, batch):
    first, second = model(batch["first"]), model(batch["second"])  # two forwards before one backward
    terms = F.binary_cross_entropy(torch.sigmoid(first - second), batch["first_better"])
    if not model.training:
        stats = [b for name, b in model.named_buffers() if name.endswith(("running_mean", "num_batches_tracked"))]
        with open(os.path.join(os.environ["BATCHNORM_PROBE"], f"rank{os.environ['RANK']}.txt"), "a") as noted:
            noted.write(" ".join(f"{float(b.sum()):.9g}" for b in stats) + "\\n")
    return terms
"""


@pytest.mark.parametrize("backend", ["fsdp", "zero3"])
def test_every_rank_evaluates_with_rank_0s_batchnorm_statistics_and_recomputing_counts_each_step_once(
    run_cli, tmp_path, backend
):
    """Bugs: under FSDP2 and DeepSpeed each rank kept its own running statistics (DDP broadcasts rank 0's at each
    step), so evaluation averaged the ranks' own while checkpoints and exports held rank 0's; activation
    checkpointing's recompute updated them a second time each step; DeepSpeed's engine said it was training in
    evaluation (model.training); and FSDP2 in bf16 stopped at the first step, in BatchNorm (16-bit weights beside its
    fp32 statistics) and in the loss (its 16-bit outputs beside the batch's fp32 targets). An InstanceNorm keeping
    statistics is an fp32 unit of FSDP2's as well, whose view output FSDP2 warned of on every rank. And ZeRO's
    checkpoints of a model with activation checkpointing lost the buffers inside its blocks in the export (and in a
    resume under another backend or world size): DeepSpeed names them with the checkpoint wrapper's prefix."""
    shutil.copy(EXAMPLE / "scorer.py", tmp_path / "scorer.py")
    (tmp_path / "batchnorm_scorer.py").write_text(BATCHNORM_SCORER)
    shutil.copy(EXAMPLE / "config.yaml", tmp_path / "config.yaml")
    probes = tmp_path / "probes"
    probes.mkdir()
    # full recompute: FSDP2's fp32 BatchNorm units in bf16 are refused under selective (test_own_model_bad_input), and
    # ZeRO-3 with selective recompute and two forwards a step fails in DeepSpeed's gathers (a GroupNorm model too)
    recompute, precision = ("full", "bf16") if backend == "fsdp" else ("full", "fp32")
    result = train(
        tmp_path / "config.yaml",
        2,
        *overrides(tmp_path, 2, backend),
        "model.builder=batchnorm_scorer:build",
        "training.loss=batchnorm_scorer:loss",
        f"training.activation_checkpointing={recompute}",
        f"training.precision={precision}",
        env={"BATCHNORM_PROBE": str(probes)},
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rank0, rank1 = ((probes / f"rank{rank}.txt").read_text().splitlines() for rank in (0, 1))
    assert rank0 == rank1 and len(rank0) >= 2  # every validation batch of one evaluation, alike on both ranks
    counted = [float(value) for value in rank0[0].split()[1::2]]  # each norm's num_batches_tracked
    assert counted == [2 * STEPS, 0]  # one update a forward, none by the recompute (an InstanceNorm counts none)
    assert "returned a view tensor" not in result.stdout + result.stderr
    exported = run_cli("checkpoint", "export", tmp_path / "out", "-o", tmp_path / "exported")
    assert exported.exit_code == 0, exported.output
    from safetensors.torch import load_file

    weights = load_file(tmp_path / "exported" / "model.safetensors")
    statistics = {f"blocks.{b}.norm.{name}" for b in (0, 1) for name in ("running_mean", "running_var")}
    assert statistics <= weights.keys()
    assert float(weights["blocks.0.norm.num_batches_tracked"]) == 2 * STEPS  # the last step's, as the ranks had it


@pytest.mark.parametrize("ranks, backend", [(1, "fsdp"), (2, "zero3")])
def test_a_ddp_checkpoint_of_the_scorer_resumes_under_another_backend_and_world_size(tmp_path, ranks, backend):
    ddp, _ = scorer_run("ddp")
    uninterrupted = losses(scorer_run("single")[0])
    shutil.copytree(ddp / "checkpoints" / "step_0000004", tmp_path / "out" / "checkpoints" / "step_0000004")
    result = train(EXAMPLE / "config.yaml", ranks, *overrides(tmp_path, ranks, backend))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "converted for this run" in result.stdout and "resumed from" in result.stdout
    resumed = losses(tmp_path / "out")
    assert len(resumed) == STEPS - 4  # steps 5-8 only: the run went on from the checkpoint
    torch.testing.assert_close(torch.tensor(resumed), torch.tensor(uninterrupted[4:]), rtol=1e-4, atol=0)


def test_the_scorer_is_exported_under_its_own_parameter_names(run_cli, tmp_path, monkeypatch):
    out, _ = scorer_run("zero3")
    result = run_cli("checkpoint", "export", out, "-o", tmp_path / "exported")
    assert result.exit_code == 0, result.output
    from safetensors.torch import load_file

    monkeypatch.syspath_prepend(str(EXAMPLE))
    from scorer import build_model

    model = build_model(channels=8, depth=2)
    weights = load_file(tmp_path / "exported" / "model.safetensors")
    model.load_state_dict(weights, strict=True)  # the model's own names: no wrapper prefix
    described = json.loads((tmp_path / "exported" / "model.json").read_text())
    assert described["builder"] == "scorer:build_model" and "n_layer" not in described  # not the GPT's defaults
    refused = run_cli("checkpoint", "export", out, "-o", tmp_path / "hf", "--format", "hf")
    assert refused.exit_code == 1 and "model.builder scorer:build_model's model" in refused.output


def test_checkpoint_convert_builds_your_model_from_the_folder_it_trained_from(run_cli, tmp_path):
    """convert names the optimizer's state by parameter, for which it builds the model (on the meta device) with
    model.builder, found where the training found it: this test runs in another folder."""
    ddp, _ = scorer_run("ddp")
    result = run_cli("checkpoint", "convert", ddp, "--to", "fsdp", "-o", tmp_path / "converted")
    assert result.exit_code == 0, result.output
    converted = tmp_path / "converted" / "checkpoints" / "step_0000008"
    assert (converted / "model").is_dir() and (converted / "optim").is_dir()
    for key, value in final_weights(tmp_path / "converted").items():
        torch.testing.assert_close(value, final_weights(ddp)[key], rtol=0, atol=0)


def test_checkpoint_convert_finds_your_model_in_the_folder_the_training_ran_in(run_cli, tmp_path):
    """The layout `distsetup init` writes (config/config.yaml), the model's module in the project's folder, which the
    training runs in and imports from after the run config's folder: convert, run from another folder, imports it
    from there too. The module's name is this test's own: no earlier import of it in this process can stand in."""
    project = tmp_path / "project"
    (project / "config").mkdir(parents=True)
    shutil.copy(EXAMPLE / "scorer.py", project / "scorer_in_project.py")
    shutil.copy(EXAMPLE / "config.yaml", project / "config" / "config.yaml")
    functions = ("model.builder=scorer_in_project:build_model", "data.builder=scorer_in_project:build_dataset")
    run = subprocess.run(
        command(
            project / "config" / "config.yaml", 1, *SMALL, *functions, "training.loss=scorer_in_project:pairwise_loss",
            "training.max_steps=2", "training.checkpoint_interval=2", "data.num_workers=0",
            "distributed.backend=single", f"training.output_dir={project / 'out'}",
        ),
        cwd=project, env=environment(), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    result = run_cli("checkpoint", "convert", project / "out", "--to", "fsdp", "-o", tmp_path / "converted")
    assert result.exit_code == 0, result.output
    assert (tmp_path / "converted" / "checkpoints" / "step_0000002" / "optim").is_dir()


def test_your_own_model_takes_float_inputs_under_a_bf16_deepspeed_engine(tmp_path):
    """The engine holds bf16 weights and casts no input: the pairs' images (float32 from the dataset) are cast to
    bf16 for it, as the HF Trainer casts them (without, the first convolution refuses float32 input)."""
    from deepspeed.accelerator import get_accelerator

    config = {**ds_file(2), "train_micro_batch_size_per_gpu": GLOBAL, "gradient_accumulation_steps": 1}
    config.update(train_batch_size=GLOBAL, bf16={"enabled": True})
    (tmp_path / "bf16.json").write_text(json.dumps(config))
    chosen = ["distributed.backend=deepspeed", f"distributed.deepspeed_config={tmp_path / 'bf16.json'}"]
    chosen.append(f"training.micro_batch_size={GLOBAL}")  # the example's own 32 would contradict the file
    result = train(
        EXAMPLE / "config.yaml", 1, *SMALL, *chosen, "training.max_steps=3", f"training.output_dir={tmp_path}"
    )
    if not get_accelerator().is_bf16_supported():  # this CPU: refused in one line, before any process group
        assert result.returncode == 1 and "enables bf16, which DeepSpeed does not support" in result.stderr
        return
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["precision"] == "bf16" and 0.5 < summary["final_loss"] < 0.9  # about ln 2 at the start


# The scorer with a calibration it applies on every other training step only: a layer run on some micro-batches
SKIPPING_SCORER = """
import torch.nn as nn
import scorer

class Skipping(nn.Module):
    def __init__(self, **args):
        super().__init__()
        self.scorer, self.calibration, self.calls = scorer.build_model(**args), nn.Linear(1, 1), 0
    def forward(self, images):
        self.calls += self.training
        score = self.scorer(images)
        return self.calibration(score[:, None])[:, 0] if self.calls % 2 else score

def build(**args):
    return Skipping(**args)
"""


def test_ddp_trains_a_layer_run_on_some_steps_only_once_told_to_look_for_unused_parameters(tmp_path):
    """DDP waits for every parameter's gradient: a layer the model runs on some steps only stopped the run at the
    third with torch's traceback on every rank. It is one line naming distributed.find_unused_parameters (the HF
    Trainer's ddp_find_unused_parameters), with which DDP trains it as one process does."""
    shutil.copy(EXAMPLE / "scorer.py", tmp_path / "scorer.py")
    (tmp_path / "skipping_scorer.py").write_text(SKIPPING_SCORER)
    config = tmp_path / "config.yaml"
    shutil.copy(EXAMPLE / "config.yaml", config)
    mine = ["model.builder=skipping_scorer:build", "training.max_steps=4", "data.num_workers=0"]
    stopped = train(config, 2, *overrides(tmp_path / "stopped", 2, "ddp"), *mine)
    said = [line for line in stopped.stderr.splitlines() if line.startswith("error:")]
    assert stopped.returncode != 0 and len(said) == 1, stopped.stderr[-3000:]
    assert "got no gradient" in said[0] and "set distributed.find_unused_parameters: true" in said[0]
    told = train(config, 2, *overrides(tmp_path / "told", 2, "ddp"), *mine, "training.ddp_find_unused_parameters=true")
    alone = train(config, 1, *overrides(tmp_path / "alone", 1, "single"), *mine)
    assert told.returncode == alone.returncode == 0, told.stderr[-3000:] + alone.stderr[-3000:]
    expected = losses(tmp_path / "alone" / "out")
    torch.testing.assert_close(
        torch.tensor(losses(tmp_path / "told" / "out")), torch.tensor(expected), rtol=1e-4, atol=0
    )


# The scorer with a calibration sized from a parameter's shape, which reads as empty inside deepspeed.zero.Init
SIZED_FROM_A_WEIGHT = """
import torch.nn as nn
import scorer

def build(**args):
    model = scorer.build_model(**args)
    model.calibration = nn.Linear(model.head.weight.shape[1], 1)
    return model
"""


def test_a_builder_that_reads_a_parameters_size_trains_under_zero3_each_rank_building_it_whole(tmp_path):
    """ZeRO-3 builds the model inside deepspeed.zero.Init, where a parameter reads as empty: a builder that sizes a
    layer from one stopped with an IndexError, or built another model than rank 0's and failed in a copy. It falls
    back to every rank building the model whole (DeepSpeed partitions it at its start), said in a note, and trains
    as one process does."""
    shutil.copy(EXAMPLE / "scorer.py", tmp_path / "scorer.py")
    (tmp_path / "sized.py").write_text(SIZED_FROM_A_WEIGHT)
    config = tmp_path / "config.yaml"
    shutil.copy(EXAMPLE / "config.yaml", config)
    mine = ["model.builder=sized:build", "training.max_steps=4", "data.num_workers=0"]
    (tmp_path / "zero3").mkdir()
    zero3 = train(config, 2, *overrides(tmp_path / "zero3", 2, "zero3"), *mine)
    alone = train(config, 1, *overrides(tmp_path / "alone", 1, "single"), *mine)
    assert zero3.returncode == alone.returncode == 0, zero3.stderr[-3000:] + alone.stderr[-3000:]
    assert "note: model.builder sized:build cannot be built inside deepspeed.zero.Init" in zero3.stdout
    assert "every rank holds it whole instead" in zero3.stdout
    expected = losses(tmp_path / "alone" / "out")
    torch.testing.assert_close(
        torch.tensor(losses(tmp_path / "zero3" / "out")), torch.tensor(expected), rtol=1e-4, atol=0
    )
