"""Mixtures of experts trained on 2 processes. examples/switch_moe with a routing that differs per rank by
construction (tests/support/moe_per_rank.py routes rank r's tokens to experts 2r and 2r + 1) trains to the same
numbers under DDP, FSDP2, ZeRO-2 and ZeRO-3: without what each backend is told, DDP stops, FSDP2 and ZeRO-2 silently
train other numbers and ZeRO-3 hangs. So does transformers' own Switch Transformer (model.type python, its own
.loss, rank r's tokens routed to expert r), whose ZeRO-3 leaf is its SwitchTransformersExperts: its router jitters its
input in place, which a leaf around it refuses. Under FSDP2 and ZeRO-2 each model's experts are named among its blocks
(model.layer_classes), as a user wrapping or checkpointing each expert does: they are still experts (a hang or a
crash before). examples/hf_moe reports transformers' own loss."""

import functools
import json
import math
import re

import pytest
import torch
import yaml
from repo import REPO, SUPPORT
from train_runs import SHARED, ds_file, final_weights, losses, train

SWITCH = REPO / "examples" / "switch_moe"

HF_MOE = REPO / "examples" / "hf_moe"

STEPS = 10


def deepspeed_overrides(folder, stage: int) -> list[str]:
    batch = {"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 1, "train_batch_size": 16}
    (folder / "ds.json").write_text(json.dumps({**ds_file(stage), **batch}))
    return ["distributed.backend=deepspeed", f"distributed.deepspeed_config={folder / 'ds.json'}"]


# transformers' SwitchTransformersForConditionalGeneration (d_model 16, 2 experts, one sparse layer each side) as a
# user brings it: model.type python, samples {input_ids, labels}, the model's own .loss, its blocks sharded by FSDP2
HF_SWITCH = {
    "model": {
        "type": "python",
        "builder": "moe_per_rank:build_hf_switch",
        "layer_classes": ["SwitchTransformersBlock"],
    },
    "data": {"type": "python", "builder": "moe_per_rank:build_copy_data"},
    "training": {"lr": 1.0e-2, "warmup_steps": 1, "micro_batch_size": 8},
}
HF_STEPS = 6


@functools.cache
def per_rank_run(backend: str, model: str = "switch"):
    """`model` (switch: examples/switch_moe's, hf_switch: transformers' Switch Transformer) routed per rank, trained
    on 2 processes under `backend`: its output folder, and what it printed."""
    folder = SHARED / f"moe_{model}_{backend}"
    folder.mkdir(parents=True, exist_ok=True)
    chosen = (
        deepspeed_overrides(folder, int(backend[-1]))
        if backend.startswith("zero")
        else [f"distributed.backend={backend}"]
    )
    config, steps = SWITCH / "config.yaml", STEPS
    if model == "hf_switch":
        config, steps = folder / "config.yaml", HF_STEPS
        config.write_text(yaml.safe_dump(HF_SWITCH))
    more = ["model.builder=moe_per_rank:build_model"] if model == "switch" else []
    if backend in ("fsdp", "zero2"):  # the experts named among the blocks, as a user wrapping or compiling each does
        more.append(f"model.layer_classes={EXPERTS_NAMED[model]}")
    result = train(
        config,
        2,
        *more,
        f"training.max_steps={steps}",
        "training.log_interval=1",
        f"training.checkpoint_interval={steps}",
        "training.eval_interval=null",
        f"training.output_dir={folder / 'out'}",
        *chosen,
        env={"PYTHONPATH": f"{SUPPORT}:{SWITCH}"},
        timeout=240,
    )
    assert result.returncode == 0, f"{model} {backend}:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return folder / "out", result.stdout + result.stderr


EXPERTS_NAMED = {"switch": "[Block,Expert]", "hf_switch": "[SwitchTransformersBlock,SwitchTransformersDenseActDense]"}

HOW = {
    "ddp": "DDP looks for unused parameters",
    "fsdp": "FSDP2 reduce-scatters zeros for the experts a rank did not run",
    "zero2": "every expert gets a zero gradient on every rank",
    "zero3": "ZeRO-3 gathers each whole (a leaf module, or within its block)",
}


@pytest.mark.parametrize("backend", ["fsdp", "zero2", "zero3"])
def test_experts_routed_differently_per_rank_train_alike_on_every_backend(backend):
    reference, ddp_stdout = per_rank_run("ddp")
    out, stdout = per_rank_run(backend)
    assert f"SwitchFFN (x2) may run other experts on each rank: {HOW['ddp']}" in ddp_stdout
    assert f"(x2) may run other experts on each rank: {HOW[backend]}" in stdout
    if backend == "fsdp":  # named among the blocks, the experts are no units of their own (a hang before)
        assert "16 FSDP units inside PerRankSwitchFFN (x2) left to the unit around them" in stdout
    curve = losses(out)
    assert len(curve) == STEPS and curve[-1] < curve[0] - 0.5
    torch.testing.assert_close(torch.tensor(curve), torch.tensor(losses(reference)), rtol=1e-4, atol=0)
    theirs, ours = final_weights(reference), final_weights(out)
    for key, value in ours.items():  # the attention's key bias has no true gradient: Adam steps its rounding noise
        torch.testing.assert_close(value, theirs[key], rtol=1e-4, atol=3e-5, msg=key)
    # experts 4-7 run on no rank: AdamW steps them with a zero gradient (their weight decay) under every backend,
    # DDP too (it passed over them, having no gradient for them: 1.6e-4 of each weight apart after these steps)
    unrouted = [key for key in ours if re.search(r"\.experts\.[4-7]\.", key)]
    assert len(unrouted) == 2 * 4 * 4, unrouted  # 2 layers x 4 experts x up and down, weight and bias
    for key in unrouted:
        torch.testing.assert_close(ours[key], theirs[key], rtol=2e-6, atol=0, msg=key)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    trained = [row for row in rows if "loss" in row]  # not the evaluation's
    assert len(trained) == STEPS and all(
        row["loss"] == pytest.approx(row["ce_loss"] + row["aux_loss"]) for row in trained
    )


@pytest.mark.parametrize("backend", ["ddp", "fsdp", "zero2", "zero3"])
def test_transformers_switch_transformer_routed_differently_per_rank_trains_on_every_backend(backend):
    """Without its experts container as the leaf, ZeRO-3 failed on the first batch, blaming the data."""
    reference, _ = per_rank_run("ddp", "hf_switch")
    out, output = per_rank_run(backend, "hf_switch")
    assert f"SwitchTransformersExperts (x2) may run other experts on each rank: {HOW[backend]}" in output
    assert "returned a view tensor" not in output  # FSDP2 warned of each block's output on every rank
    curve = losses(out)
    assert len(curve) == HF_STEPS and all(math.isfinite(loss) for loss in curve) and curve[-1] < curve[0] - 0.2
    # ZeRO-3's hooks on the layer around the leaf hand its router a detached tensor sharing the layer's input: the
    # router's in-place jitter reaches the experts' input but not its gradient (measured: with router_jitter_noise 0,
    # ZeRO-3's losses were DDP's within 1e-7; with 0.01, up to 2.2e-4 apart; FSDP2's and ZeRO-2's equal DDP's)
    tolerance = 1e-3 if backend == "zero3" else 1e-4
    torch.testing.assert_close(torch.tensor(curve), torch.tensor(losses(reference)), rtol=tolerance, atol=0)


def test_the_hf_moe_example_reports_transformers_loss_on_two_ranks(tmp_path):
    """Step 1's loss is the mean over the step's counted tokens of the cross-entropy, plus the coefficient times
    each rank's load-balancing loss averaged over ranks: computed here with transformers itself, on the batches the
    sampler gave each rank."""
    pytest.importorskip("transformers")
    from distsetup.formats.runconfig_load import load_run_config
    from distsetup.training.data.datasets import IGNORE, ShardedSampler, build_datasets
    from distsetup.training.model import build as models

    args = ["training.max_steps=3", "training.log_interval=1", f"training.output_dir={tmp_path / 'out'}"]
    result = train(HF_MOE / "config.yaml", 2, *args)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "eos_token_id" not in result.stdout  # its config stops generating at its tokenizer's EOS
    rows = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    coefficient = 0.02  # examples/hf_moe/model/config.json's router_aux_loss_coef
    assert all(row["loss"] == pytest.approx(row["ce_loss"] + coefficient * row["aux_loss"]) for row in rows[:3])

    cfg = load_run_config(HF_MOE / "config.yaml", args[1:])
    cfg.model.hf_path = cfg.model.tokenizer = str(HF_MOE / "model")
    cfg.data.paths, cfg.data.val_paths = (
        [str(HF_MOE / "data" / "chat.jsonl")],
        [str(HF_MOE / "data" / "chat_val.jsonl")],
    )
    data = build_datasets(cfg, ranks=16)  # the cache the run built
    torch.manual_seed(cfg.training.seed)
    mixtral = models.build(cfg.model)
    first_batches = [
        data.train.batch(ShardedSampler(len(data.train), 8, 1, 2, rank, cfg.training.seed).next_step()[0].tolist())
        for rank in range(2)
    ]
    x, y = (torch.cat([batch[i] for batch in first_batches]) for i in range(2))
    ce = mixtral(input_ids=x, labels=y, shift_labels=y).loss  # over every counted token of the step
    aux = [mixtral(input_ids=x[r * 8 : (r + 1) * 8], output_router_logits=True).aux_loss for r in range(2)]
    assert (y == IGNORE).any()
    expected = ce + coefficient * torch.stack(aux).mean()
    assert rows[0]["step"] == 1 and rows[0]["loss"] == pytest.approx(expected.item(), rel=1e-5)
