"""Mixtures of experts trained on 2 processes. examples/switch_moe with a routing that differs per rank by
construction (tests/support/moe_per_rank.py routes rank r's tokens to experts 2r and 2r + 1) trains to the same
numbers under DDP, FSDP2, ZeRO-2 and ZeRO-3: without what each backend is told, DDP stops, FSDP2 and ZeRO-2 silently
train other numbers and ZeRO-3 hangs. examples/hf_moe reports transformers' own loss."""

import functools
import json

import pytest
import torch
from repo import REPO, SUPPORT
from train_runs import SHARED, ds_file, final_weights, losses, train

SWITCH = REPO / "examples" / "switch_moe"

HF_MOE = REPO / "examples" / "hf_moe"

STEPS = 10


def deepspeed_overrides(folder, stage: int) -> list[str]:
    batch = {"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 1, "train_batch_size": 16}
    (folder / "ds.json").write_text(json.dumps({**ds_file(stage), **batch}))
    return ["distributed.backend=deepspeed", f"distributed.deepspeed_config={folder / 'ds.json'}"]


@functools.cache
def per_rank_run(backend: str):
    folder = SHARED / f"moe_{backend}"
    folder.mkdir(parents=True, exist_ok=True)
    chosen = (
        deepspeed_overrides(folder, int(backend[-1]))
        if backend.startswith("zero")
        else [f"distributed.backend={backend}"]
    )
    result = train(
        SWITCH / "config.yaml",
        2,
        "model.builder=moe_per_rank:build_model",
        f"training.max_steps={STEPS}",
        "training.log_interval=1",
        f"training.checkpoint_interval={STEPS}",
        "training.eval_interval=null",
        f"training.output_dir={folder / 'out'}",
        *chosen,
        env={"PYTHONPATH": f"{SUPPORT}:{SWITCH}"},
        timeout=240,
    )
    assert result.returncode == 0, f"{backend}:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return folder / "out", result.stdout


HOW = {
    "ddp": "DDP looks for unused parameters",
    "fsdp": "FSDP2 reduce-scatters zeros for the experts a rank did not run",
    "zero2": "every expert gets a zero gradient on every rank",
    "zero3": "ZeRO-3 gathers each whole (a leaf module)",
}


@pytest.mark.parametrize("backend", ["fsdp", "zero2", "zero3"])
def test_experts_routed_differently_per_rank_train_alike_on_every_backend(backend):
    reference, ddp_stdout = per_rank_run("ddp")
    out, stdout = per_rank_run(backend)
    assert f"SwitchFFN (x2) may run other experts on each rank: {HOW['ddp']}" in ddp_stdout
    assert f"(x2) may run other experts on each rank: {HOW[backend]}" in stdout
    curve = losses(out)
    assert len(curve) == STEPS and curve[-1] < curve[0] - 0.5
    torch.testing.assert_close(torch.tensor(curve), torch.tensor(losses(reference)), rtol=1e-4, atol=0)
    theirs, ours = final_weights(reference), final_weights(out)
    for key, value in ours.items():  # the attention's key bias has no true gradient: Adam steps its rounding noise
        torch.testing.assert_close(value, theirs[key], rtol=1e-4, atol=3e-5, msg=key)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    trained = [row for row in rows if "loss" in row]  # not the evaluation's
    assert len(trained) == STEPS and all(
        row["loss"] == pytest.approx(row["ce_loss"] + row["aux_loss"]) for row in trained
    )


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
    rows = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    coefficient = 0.02  # examples/hf_moe/model/config.json's router_aux_loss_coef
    assert all(row["loss"] == pytest.approx(row["ce_loss"] + coefficient * row["aux_loss"]) for row in rows[:3])

    cfg = load_run_config(HF_MOE / "config.yaml", args[1:])
    cfg.model.hf_path = cfg.model.tokenizer = str(HF_MOE / "model")
    cfg.data.paths, cfg.data.val_paths = (
        [str(HF_MOE / "data" / "chat.jsonl")],
        [str(HF_MOE / "data" / "chat_val.jsonl")],
    )
    data = build_datasets(cfg, eval_batch=16)  # the cache the run built
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
