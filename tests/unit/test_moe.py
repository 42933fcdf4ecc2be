"""Mixtures of experts in one process. A Hugging Face MoE's reported loss is transformers' own (cross-entropy plus
router_aux_loss_coef x the load-balancing loss), and its MFU counts the experts each token runs. A user's MoE whose
experts run only when tokens reach them (examples/switch_moe) is found by itself, and each of its experts gets a
gradient, zero where it did not run. The layer found is the innermost that picks which experts run: transformers'
Switch Transformer's SwitchTransformersExperts, not the SwitchTransformersSparseMLP around it, whose router changes
its input in place, which DeepSpeed's leaf hook refuses: said in one line naming the layer, not blaming the data.
(Trained on 2 processes: tests/processes/test_moe_runs.py.)"""

import copy
import json

import pytest
import torch
from repo import REPO

from distsetup.errors import DistsetupError
from distsetup.training.model import moe

SWITCH = REPO / "examples" / "switch_moe"
HF_MOE = REPO / "examples" / "hf_moe"


@pytest.fixture
def switch(monkeypatch):
    monkeypatch.syspath_prepend(str(SWITCH))
    import switch

    return switch


def test_layers_whose_experts_run_per_token_are_found_and_a_list_of_blocks_is_not(switch):
    from distsetup.training.model.gpt import GPT

    model = switch.build_model(layers=3)
    found = moe.conditional_layers(model, {"Block"}, [])
    assert found == [block.moe for block in model.blocks]
    assert moe.conditional_layers(GPT(64, 16, 2, 2, 16, 0.0), {"Block"}, []) == []
    assert moe.conditional_layers(model, {"Block"}, ["Block"]) == list(model.blocks)  # named: outermost only
    # experts named among the blocks (to checkpoint or compile each) are still experts: a router picks among them
    assert moe.conditional_layers(model, {"Block", "Expert"}, []) == moe.conditional_layers(model, {"Expert"}, [])
    assert moe.conditional_layers(model, {"Expert"}, []) == found

    # a dense model's blocks in a list of stages (Swin's) are no experts, its blocks named or its stages too
    class Stage(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = torch.nn.ModuleList(switch.Expert(8) for _ in range(2))

    towers = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ModuleList(Stage() for _ in range(2)))
    assert moe.conditional_layers(towers, {"Expert"}, []) == []
    assert moe.conditional_layers(towers, {"Stage", "Expert"}, []) == []
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


def test_an_expert_container_with_a_forward_of_its_own_is_the_layer_itself():
    class Experts(torch.nn.ModuleList):  # calls only the experts its tokens reach
        def forward(self, x, choice):
            out = torch.zeros_like(x)
            for e, expert in enumerate(self):
                if (choice == e).any():
                    out[choice == e] = expert(x[choice == e])
            return out

    class MoE(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.router = torch.nn.Linear(8, 3)
            self.experts = Experts(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU()) for _ in range(3))

        def forward(self, x):
            return self.experts(x, self.router(x).argmax(-1))

    layer = MoE()
    assert moe.conditional_layers(layer, set(), []) == [layer.experts]  # inside the root: a leaf of its own
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), MoE(), MoE())
    assert moe.conditional_layers(model, set(), []) == [model[1].experts, model[2].experts]
    assert moe.conditional_layers(model, set(), ["MoE"]) == [model[1], model[2]]  # named: outermost only


def hf_switch_batch() -> dict:
    ids = torch.randint(1, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids, "labels": ids}


def test_the_leaf_of_a_transformers_switch_transformer_is_its_experts_container(switch):
    """DeepSpeed's ZeRO-3 hooks each leaf with register_full_backward_hook (stage3.py's reduce_leaf_module_grads)."""
    import moe_per_rank
    from transformers.models.switch_transformers import modeling_switch_transformers as hf

    from distsetup.training.loss.first_step_errors import rejected_input

    model = moe_per_rank.build_hf_switch().train()
    sparse = [m for m in model.modules() if isinstance(m, hf.SwitchTransformersSparseMLP)]
    layers = moe.conditional_layers(model, {"SwitchTransformersBlock"}, [])
    assert len(sparse) == 2 and layers == [m.experts for m in sparse]
    experts_named = {"SwitchTransformersBlock", "SwitchTransformersDenseActDense"}
    assert moe.conditional_layers(model, experts_named, []) == layers
    assert all(isinstance(layer, hf.SwitchTransformersExperts) and moe.runs_itself(layer) for layer in layers)
    hooked = [layer.register_full_backward_hook(lambda *_: None) for layer in layers]
    model(**hf_switch_batch()).loss.backward()
    for layer in layers:  # one process is rank 0: its tokens reach expert_0 alone
        assert all(p.grad is not None and p.grad.any() for p in layer["expert_0"].parameters())
        assert all(p.grad is None for p in layer["expert_1"].parameters())
    for handle in hooked:
        handle.remove()

    named = moe.conditional_layers(model, {"SwitchTransformersBlock"}, ["SwitchTransformersSparseMLP"])
    assert named == sparse  # named, the layer around the experts: its router jitters its input in place
    for layer in named:
        layer.register_full_backward_hook(lambda *_: None)
    with pytest.raises(RuntimeError, match="BackwardHookFunction is a view and is being modified inplace") as caught:
        model(**hf_switch_batch())
    assert moe.leaf_hook_refused(caught.value) and not rejected_input(caught.value)
    assert not moe.leaf_hook_refused(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))


def test_a_zero3_leaf_whose_input_is_changed_in_place_is_named_not_the_data(switch, tmp_path):
    import moe_per_rank
    from train_runs import ds_file

    from distsetup.formats.runconfig_load import load_run_config
    from distsetup.training.backends.deepspeed import DeepSpeedBackend
    from distsetup.training.launch_env import World
    from distsetup.training.loss.python_objective import PythonObjective

    (tmp_path / "ds.json").write_text(json.dumps(ds_file(3)))
    cfg = load_run_config(
        None,
        [
            "distributed.backend=deepspeed",
            f"distributed.deepspeed_config={tmp_path / 'ds.json'}",
            "model.zero3_leaf_classes=[SwitchTransformersSparseMLP]",
        ],
    )
    backend = DeepSpeedBackend(cfg, World(rank=0, local_rank=0, size=2, local_size=2), torch.device("cpu"))
    model = moe_per_rank.build_hf_switch().train()
    layers = moe.conditional_layers(model, {"SwitchTransformersBlock"}, cfg.model.zero3_leaf_classes)
    backend._choose_leaves(model, [], layers)  # what wrap does before deepspeed.initialize, which then hooks each leaf:
    for layer in layers:
        layer.register_full_backward_hook(lambda *_: None)
    backend.model = model  # the engine calls it as it is
    objective = PythonObjective(None, None, "model.builder moe_per_rank:build_hf_switch", {})
    with pytest.raises(DistsetupError) as caught:
        backend.backward(lambda m: objective.micro_loss(m, hf_switch_batch()), last_micro=True)
    message = str(caught.value)
    assert message.startswith("DeepSpeed ZeRO-3 cannot hook its leaf layer SwitchTransformersSparseMLP (x2): ")
    assert "model.zero3_leaf_classes" in message and "data.builder" not in message and "\n" not in message


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


@pytest.mark.parametrize("model_type", ["hf", "python"])  # python: a builder returning the transformers model
def test_a_tiny_mixtral_loss_is_transformers_own_with_the_router_loss(model_type):
    """Built by a builder (model.type python), the router loss was added 50x too strong, or left out."""
    pytest.importorskip("transformers")
    from distsetup.formats.runconfig_load import load_run_config
    from distsetup.training.loss.token_objective import TokenObjective
    from distsetup.training.model import build as models

    cfg = load_run_config(None, ["model.type=hf", f"model.hf_path={HF_MOE / 'model'}", "model.vocab_size=316"])
    torch.manual_seed(0)
    mixtral = models.build(cfg.model)
    x, y = torch.randint(0, 316, (2, 2, 16)).unbind(0)
    y[0, :5] = -100  # targets that carry no loss, as in chat data
    objective = TokenObjective(mixtral, model_type, 316, masked=True, source=f"model.type {model_type}")
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

    from distsetup.training.model.throughput import flops_per_token

    config = AutoConfig.from_pretrained(HF_MOE / "model")  # 8 experts, 2 per token
    with torch.device("meta"):
        mixtral = AutoModelForCausalLM.from_config(config)
    experts = sum(p.numel() for name, p in mixtral.named_parameters() if ".experts." in name)
    dense = sum(p.numel() for p in mixtral.parameters()) - experts - mixtral.model.embed_tokens.weight.numel()
    assert experts > dense and all(p.dim() == 3 for n, p in mixtral.named_parameters() if ".experts." in n)
    expected = 6 * (dense + experts * 2 / 8) + 12 * config.num_hidden_layers * config.hidden_size * 64
    assert flops_per_token(mixtral, 64) == expected


def test_a_hugging_face_encoder_decoder_as_model_type_hf_is_one_line_naming_model_type_python(tmp_path):
    """Bug: a SwitchTransformers folder passed every check, then each rank died of a 50-line traceback from
    AutoModelForCausalLM ("Unrecognized configuration class"); model.type python trains it (tests/processes)."""
    from transformers import SwitchTransformersConfig

    from distsetup.training.model.build import describe

    SwitchTransformersConfig(vocab_size=64, d_model=16, num_layers=1, num_decoder_layers=1).save_pretrained(tmp_path)
    section = type("Model", (), {"type": "hf", "hf_path": str(tmp_path), "vocab_size": 64, "layer_classes": []})
    with pytest.raises(DistsetupError) as refused:
        describe(section)
    assert "holds a SwitchTransformersConfig, which transformers builds no causal LM of" in str(refused.value)
    assert "model.type python" in (refused.value.hint or "")


def test_an_expert_no_token_reached_is_stepped_by_adamw_under_one_process_as_under_fsdp2_and_zero():
    """Its gradient is zero, as FSDP2 and ZeRO give it: AdamW's moments carry it on. Under one process its grad was
    None, which AdamW passes over, so one process trained other MoE weights than the sharded backends (DDP: in
    tests/processes/test_moe_runs.py)."""
    from distsetup.formats.runconfig_load import load_run_config
    from distsetup.training.backends import make_backend
    from distsetup.training.launch_env import World
    from distsetup.training.model.build import ModelParts

    class Routed(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.experts = torch.nn.ModuleList([torch.nn.Linear(3, 3), torch.nn.Linear(3, 3)])

        def forward(self, x, expert: int):
            return self.experts[expert](x)

    cfg = load_run_config(None, ["distributed.backend=single", "training.warmup_steps=0", "training.lr=0.1"])
    backend = make_backend("single", cfg, World(rank=0, local_rank=0, size=1, local_size=1), torch.device("cpu"))
    model = Routed()
    backend.wrap(ModelParts(module=model, blocks=[], conditional=[model.experts]), steps=10)
    weights = []
    for expert in (1, 0):  # expert 1 runs at the first step only
        backend.model(torch.ones(2, 3), expert).sum().backward()
        backend.step()
        weights.append(model.experts[1].bias.detach().clone())  # a bias: no weight decay, only the moments move it
    assert not torch.equal(weights[1], weights[0])


def zero3_backend(tmp_path, zero: dict):
    """A DeepSpeed backend of rank 0 of 2 at ZeRO-3, the file's zero_optimization block given `zero` besides."""
    from train_runs import ds_file

    from distsetup.formats.runconfig_load import load_run_config
    from distsetup.training.backends.deepspeed import DeepSpeedBackend
    from distsetup.training.launch_env import World

    ds = ds_file(3)
    ds["zero_optimization"].update(zero)
    (tmp_path / "ds.json").write_text(json.dumps(ds))
    cfg = load_run_config(
        None, ["distributed.backend=deepspeed", f"distributed.deepspeed_config={tmp_path / 'ds.json'}"]
    )
    return DeepSpeedBackend(cfg, World(rank=0, local_rank=0, size=2, local_size=2), torch.device("cpu"))


def test_zero3_gathers_each_block_whole_with_its_experts_unless_the_file_chooses(switch, tmp_path):
    """Each block, as activation checkpointing left it, is a ZeRO-3 leaf (one all-gather a block, as FSDP2); an MoE
    layer inside is gathered with its block, not a leaf of its own (DeepSpeed would hook it twice). A file that sets
    stage3_module_granularity_threshold leaves the choice to DeepSpeed: then the MoE layers alone are leaves."""
    from deepspeed.utils import z3_leaf_module

    from distsetup.training.model.blocks import apply_activation_checkpointing, in_place_of

    for zero in ({}, {"stage3_module_granularity_threshold": 0}):
        model = switch.build_model(layers=3)
        blocks = [m for m in model.modules() if type(m).__name__ == "Block"]
        layers = moe.conditional_layers(model, {"Block"}, [])
        assert len(blocks) == 3 and len(layers) == 3
        apply_activation_checkpointing(model, blocks)
        backend = zero3_backend(tmp_path, zero)
        backend._choose_leaves(model, blocks, layers)  # what wrap does before deepspeed.initialize hooks each leaf
        backend._handle_conditional(layers)
        leaves = [m for m in model.modules() if z3_leaf_module(m)]
        if zero:
            assert backend.whole_blocks == () and leaves == layers == list(backend.leaves)
        else:
            wrappers = in_place_of(model, blocks)
            assert {type(w).__name__ for w in wrappers} == {"CheckpointWrapper"}
            assert leaves == wrappers == list(backend.leaves) == list(backend.whole_blocks)
            assert any("ZeRO-3 gathers each block whole" in note for note in backend.notes)


class ChangesItsInputInPlace(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.mlp = torch.nn.Linear(4, 4)

    def forward(self, x):
        x += self.mlp(x)
        return x


def test_a_block_changing_its_input_in_place_is_told_how_to_gather_layer_by_layer(tmp_path):
    from distsetup.training.loss.micro_loss import MicroLoss

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), ChangesItsInputInPlace())
    backend = zero3_backend(tmp_path, {})
    backend._choose_leaves(model, [model[1]], [])
    for leaf in backend.leaves:  # as DeepSpeed hooks each leaf (stage3.py's reduce_leaf_module_grads)
        leaf.register_full_backward_hook(lambda *_: None)
    backend.model = model
    with pytest.raises(DistsetupError) as caught:
        backend.backward(lambda m: MicroLoss(m(torch.randn(2, 4)).sum(), {}), last_micro=True)
    message = str(caught.value)
    assert message.startswith("DeepSpeed ZeRO-3 cannot hook its leaf layer ChangesItsInputInPlace (x1): ")
    assert "stage3_module_granularity_threshold to 0" in message and "\n" not in message


def test_zero3_gathers_layer_by_layer_where_a_block_may_not_run_once_on_an_input_needing_its_gradient(tmp_path):
    """DeepSpeed reduces a leaf's gradients in a full backward hook: too early for a block whose inputs need no
    gradient, twice for a block run twice a step. So blocks are gathered whole only for the trainer's own models and
    loss, with parameters of their own, and a block fed an input needing no gradient is refused in one line."""
    from distsetup.training.backends.zero3_blocks import gathered_whole

    def blocks_and_model(shared: bool = False):
        blocks = [torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)]
        if shared:
            blocks[1].weight = blocks[0].weight
        return blocks, torch.nn.Sequential(torch.nn.Linear(4, 4), *blocks)

    backend = zero3_backend(tmp_path, {})
    cfg, ds = backend.cfg, backend.ds_config
    blocks, model = blocks_and_model()
    assert gathered_whole(cfg, ds, model, blocks) == blocks
    assert gathered_whole(cfg, ds, *reversed(blocks_and_model(shared=True))) == []
    offloaded = {**ds, "zero_optimization": {**ds["zero_optimization"], "offload_param": {"device": "nvme"}}}
    assert gathered_whole(cfg, offloaded, *reversed(blocks_and_model())) == []
    for section, key, value in (("model", "type", "python"), ("training", "loss", "losses:pairwise")):
        setattr(getattr(cfg, section), key, value)
        assert gathered_whole(cfg, ds, *reversed(blocks_and_model())) == []
        setattr(getattr(cfg, section), key, getattr(type(getattr(cfg, section))(), key))

    model(torch.randn(2, 4, requires_grad=True))  # the first layer's output needs its gradient: the blocks run
    with pytest.raises(DistsetupError) as caught:
        blocks[0](torch.randn(2, 4))
    message = str(caught.value)
    assert "block Linear takes no positional input that needs a gradient" in message and "\n" not in message
    with torch.no_grad():  # evaluation: no backward, no hook
        blocks[0](torch.randn(2, 4))


def test_deepspeed_s_own_moe_layer_is_refused_in_one_line_before_any_process_group():
    """Its engine hung at start (its ranks broadcasting in different groups): its expert parallelism is not set up."""
    from deepspeed.moe.layer import MoE

    expert = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 8))
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), MoE(hidden_size=8, expert=expert, num_experts=2, ep_size=1, k=1))
    with pytest.raises(DistsetupError, match=r"^Sequential holds DeepSpeed's own MoE layer \(MoE \(x1\), deepspeed"):
        moe.refuse_deepspeed_moe(model)
    moe.refuse_deepspeed_moe(expert)  # plain modules: no word


def test_layers_are_described_by_the_user_s_class_also_once_fsdp2_sharded_them(switch):
    """fully_shard makes a layer's class a subclass named FSDP<class>: a note said FSDPSwitchFFN (x2)."""
    from torch.distributed.fsdp import FSDPModule

    sharded = type("FSDPSwitchFFN", (FSDPModule, switch.SwitchFFN), {})  # as torch names it
    layers = switch.build_model(layers=2).blocks
    layers[0].moe.__class__ = sharded
    assert moe.described_layers([block.moe for block in layers]) == "SwitchFFN (x2)"


def test_a_users_own_transformers_model_is_called_with_only_the_keywords_its_forward_takes():
    """A PreTrainedModel of the user's whose forward takes the input ids alone was called with use_cache=False."""
    import transformers

    from distsetup.training.loss.model_outputs import forward_kwargs

    class Config(transformers.PretrainedConfig):
        model_type = "distsetup-test"

    class Mine(transformers.PreTrainedModel):
        config_class = Config

        def __init__(self, config):
            super().__init__(config)
            self.linear = torch.nn.Linear(2, 2)

        def forward(self, input_ids):
            return self.linear(input_ids)

    assert forward_kwargs(Mine(Config()), "python") == {}
    assert forward_kwargs(torch.nn.Linear(2, 2), "python") == {}  # no transformers model: as before
