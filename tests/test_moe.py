"""Mixtures of experts. A Hugging Face MoE's reported loss is transformers' own (cross-entropy plus
router_aux_loss_coef x the load-balancing loss). A user's MoE whose experts run only when tokens reach them
(examples/switch_moe) is found by itself, and trains on DDP, FSDP2, ZeRO-2 and ZeRO-3 with a routing that differs per
rank to the same numbers on each: without what each backend is told, DDP stops, FSDP2 and ZeRO-2 silently train
other numbers and ZeRO-3 hangs (tests/moe_per_rank.py routes rank r's tokens to experts 2r and 2r + 1)."""

import copy
import functools
import json

import pytest
import torch
from train_runs import SHARED, ds_file, final_weights, losses, train

from distsetup.errors import DistsetupError
from distsetup.training import moe
from tests.conftest import REPO

SWITCH = REPO / "examples" / "switch_moe"
HF_MOE = REPO / "examples" / "hf_moe"


@pytest.fixture
def switch(monkeypatch):
    monkeypatch.syspath_prepend(str(SWITCH))
    import switch

    return switch


def test_layers_whose_experts_run_per_token_are_found_and_a_list_of_blocks_is_not(switch):
    from distsetup.training.gpt import GPT

    model = switch.build_model(layers=3)
    found = moe.conditional_layers(model, {"Block"}, [])
    assert found == [block.moe for block in model.blocks]
    assert moe.conditional_layers(GPT(64, 16, 2, 2, 16, 0.0), {"Block"}, []) == []
    assert moe.conditional_layers(model, {"Block"}, ["Block"]) == list(model.blocks)  # named: outermost only
    with pytest.raises(DistsetupError, match="model.zero3_leaf_classes: no module of class Nope"):
        moe.conditional_layers(model, {"Block"}, ["Nope"])


def test_heads_and_the_model_itself_are_no_experts(switch):
    class Heads(torch.nn.Module):  # a multi-task model: every head runs every step
        def __init__(self):
            super().__init__()
            self.trunk = torch.nn.Linear(8, 8)
            self.heads = torch.nn.ModuleList(torch.nn.Linear(8, 2) for _ in range(3))

    assert moe.conditional_layers(Heads(), set(), []) == []
    layer = switch.SwitchFFN(width=8, experts=4, capacity_factor=1.0)  # experts held by the root: no leaf to gather
    assert moe.conditional_layers(layer, set(), []) == []
    experts_of_layers = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU())
    wrapped = torch.nn.Module()
    wrapped.moe = torch.nn.Module()
    wrapped.moe.experts = torch.nn.ModuleList(copy.deepcopy(experts_of_layers) for _ in range(4))
    assert moe.conditional_layers(wrapped, set(), []) == [wrapped.moe]  # experts that are Sequentials of layers


def test_every_expert_gets_a_zero_gradient_where_it_did_not_run(switch):
    layer = switch.SwitchFFN(width=8, experts=4, capacity_factor=1.0)
    layer.routed_to = lambda expert, choice: torch.arange(len(choice)) if expert == 0 else torch.arange(0)
    x = torch.randn(2, 3, 8)
    layer(x).sum().backward()
    assert layer.experts[0].up.weight.grad is not None and layer.experts[1].up.weight.grad is None
    layer.zero_grad(set_to_none=True)
    moe.give_every_expert_a_gradient([layer])
    out = layer(x)
    out.sum().backward()
    for expert in layer.experts[1:]:
        assert all(p.grad is not None and not p.grad.any() for p in expert.parameters())
    assert layer.experts[0].up.weight.grad.any()


def test_a_tiny_mixtral_loss_is_transformers_own_with_the_router_loss():
    pytest.importorskip("transformers")
    from distsetup.formats.runconfig import load_run_config
    from distsetup.training import model as models
    from distsetup.training.objective import TokenObjective

    cfg = load_run_config(None, ["model.type=hf", f"model.hf_path={HF_MOE / 'model'}", "model.vocab_size=316"])
    torch.manual_seed(0)
    mixtral = models.build(cfg.model)
    x, y = torch.randint(0, 316, (2, 2, 16)).unbind(0)
    y[0, :5] = -100  # targets that carry no loss, as in chat data
    objective = TokenObjective(mixtral, "hf", 316, masked=True, source="model.type hf")
    ours = objective.micro_loss(mixtral, (x, y))
    theirs = mixtral(input_ids=x, labels=y, shift_labels=y, output_router_logits=True)
    coefficient = mixtral.config.router_aux_loss_coef
    assert coefficient > 0 and theirs.aux_loss > 0
    torch.testing.assert_close(ours.loss, theirs.loss, rtol=1e-5, atol=0)
    torch.testing.assert_close(ours.parts["aux_loss"], theirs.aux_loss.detach(), rtol=1e-6, atol=0)
    torch.testing.assert_close(ours.parts["ce_loss"] + coefficient * ours.parts["aux_loss"], theirs.loss.detach())


def test_mfu_of_a_hugging_face_moe_counts_the_experts_each_token_runs():
    pytest.importorskip("transformers")
    from transformers import AutoConfig, AutoModelForCausalLM

    from distsetup.training.throughput import flops_per_token

    config = AutoConfig.from_pretrained(HF_MOE / "model")  # 8 experts, 2 per token
    with torch.device("meta"):
        mixtral = AutoModelForCausalLM.from_config(config)
    experts = sum(p.numel() for name, p in mixtral.named_parameters() if ".experts." in name)
    dense = sum(p.numel() for p in mixtral.parameters()) - experts - mixtral.model.embed_tokens.weight.numel()
    assert experts > dense and all(p.dim() == 3 for n, p in mixtral.named_parameters() if ".experts." in n)
    expected = 6 * (dense + experts * 2 / 8) + 12 * config.num_hidden_layers * config.hidden_size * 64
    assert flops_per_token(mixtral, 64) == expected


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
        env={"PYTHONPATH": f"{REPO / 'tests'}:{SWITCH}"},
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


@pytest.mark.slow
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


@pytest.mark.slow
def test_the_hf_moe_example_reports_transformers_loss_on_two_ranks(tmp_path):
    """Step 1's loss is the mean over the step's counted tokens of the cross-entropy, plus the coefficient times
    each rank's load-balancing loss averaged over ranks: computed here with transformers itself, on the batches the
    sampler gave each rank."""
    pytest.importorskip("transformers")
    from distsetup.formats.runconfig import load_run_config
    from distsetup.training import model as models
    from distsetup.training.data import IGNORE, ShardedSampler, build_datasets

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
