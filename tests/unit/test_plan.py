"""The planner against the ZeRO paper, DeepSpeed's own estimators and the built-in model. (Against real runs:
tests/processes/test_plan_against_runs.py.)"""

import json
import shlex
from dataclasses import replace

import pytest
from repo import REPO, heavy_imports

from distsetup.errors import DistsetupError
from distsetup.planning.estimates import (
    BY_KEY,
    STRATEGIES,
    Hardware,
    Workload,
    activation_bytes,
    estimate,
    model_states,
)
from distsetup.planning.models import ModelShape, gpt_params
from distsetup.planning.planner import candidates, plan
from distsetup.planning.units import GB, parse_count, parse_memory

NO_RUNTIME = dict(runtime_bytes=0)  # model states only, as the paper and DeepSpeed's estimators count them


# -- model states: the ZeRO paper and DeepSpeed's estimators ---------------------------------------------


@pytest.mark.parametrize("key, paper_gb", [("ddp", 120), ("zero1", 31.4), ("zero2", 16.6), ("zero3", 1.9)])
def test_zero_paper_example_7_5b_on_64_gpus(key, paper_gb):
    """Rajbhandari et al. 2020, Figure 1: Psi = 7.5B, N_d = 64, K = 12, mixed-precision Adam."""
    states = model_states(BY_KEY[key], ModelShape(int(7.5e9)), Hardware(8, 8, **NO_RUNTIME), "bf16")
    paper_terms = states["params"] + states["grads"] + states["optimizer"]  # the paper has no fp32 grad copy
    assert round(paper_terms / GB, 1) == paper_gb


SETUPS = [(int(7.5e9), 8, 1), (int(1.3e9), 4, 1), (int(70e9), 8, 4), (int(350e6), 2, 1)]


@pytest.mark.parametrize("params, gpus_per_node, nodes", SETUPS)
def test_zero2_matches_deepspeed_estimator(params, gpus_per_node, nodes):
    """DeepSpeed counts 2P (16-bit params) + 18P/G (16-bit grads, fp32 grads, fp32 params, Adam m and v)."""
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs as ds_zero2

    hw = Hardware(nodes, gpus_per_node, **NO_RUNTIME)
    _, ds_gpu = ds_zero2(params, gpus_per_node, nodes, cpu_offload=False, additional_buffer_factor=1.0)
    ours = estimate(BY_KEY["zero2"], ModelShape(params), hw, Workload("bf16"), 1)
    assert ours.model_states == pytest.approx(ds_gpu, rel=0.05)
    ds_cpu, ds_gpu = ds_zero2(params, gpus_per_node, nodes, cpu_offload=True, additional_buffer_factor=1.0)
    offload = estimate(BY_KEY["zero2_offload"], ModelShape(params), hw, Workload("bf16"), 1)
    assert offload.model_states == pytest.approx(ds_gpu, rel=0.05)
    if nodes == 1 and gpus_per_node <= 4:  # above 4 GPUs DeepSpeed's CPU figure is the 4P-per-process load peak
        assert offload.cpu_per_node == pytest.approx(ds_cpu, rel=0.05)


@pytest.mark.parametrize("params, gpus_per_node, nodes", SETUPS)
@pytest.mark.parametrize(
    "key, offload_opt, offload_param",
    [("zero3", False, False), ("zero3_offload_optimizer", True, False), ("zero3_offload_all", True, True)],
)
def test_zero3_matches_deepspeed_estimator(params, gpus_per_node, nodes, key, offload_opt, offload_param):
    """DeepSpeed's ZeRO-3 figure: 4L (gathered 16-bit params + grads of the largest unit, here a block) + 2P/G (16-bit
    params) + 16P/G (fp32 grads, fp32 params, Adam m and v); it leaves out the 16-bit gradient partition,
    so that term of ours is left out here. CPU per node: 16P or 18P / nodes with zero.Init."""
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs as ds_zero3

    hidden = 8192 if params > 1e10 else 4096
    model = ModelShape(params, hidden_size=hidden, num_layers=32, vocab_size=32000)
    ds_cpu, ds_gpu, _ = ds_zero3(
        params,
        model.zero3_unit,
        gpus_per_node,
        nodes,
        cpu_offload=offload_opt,
        cpu_offload_params=offload_param,
        zero_init=True,
        additional_buffer_factor=1.0,
    )
    ours = estimate(BY_KEY[key], model, Hardware(nodes, gpus_per_node, **NO_RUNTIME), Workload("bf16"), 1)
    assert ours.model_states - ours.grads + ours.gathered == pytest.approx(ds_gpu, rel=0.05)
    if offload_opt:
        assert ours.cpu_per_node == pytest.approx(ds_cpu, rel=0.05)


def test_precision_changes_bytes_per_parameter():
    P, hw = 10**9, Hardware(1, 8, **NO_RUNTIME)
    fp32 = model_states(BY_KEY["zero2"], ModelShape(P), hw, "fp32")
    bf16 = model_states(BY_KEY["zero2"], ModelShape(P), hw, "bf16")
    assert (fp32["params"], bf16["params"]) == (4 * P, 2 * P)
    assert fp32["optimizer"] == bf16["optimizer"] == 12 * P / 8
    ddp = model_states(BY_KEY["ddp"], ModelShape(P), hw, "fp32")
    assert (ddp["params"], ddp["grads"], ddp["optimizer"]) == (4 * P, 4 * P, 8 * P)


# -- activations: the formula against the built-in model's saved tensors -------------------------------


def _saved_activation_bytes(model, x, y, sliced: bool) -> int:
    """Bytes of every tensor autograd keeps for backward, parameters excluded, each storage once; the loss from
    the whole logits (GPT's own) or computed in slices inside the head (as the trainer does)."""
    import torch

    from distsetup.training.loss.sliced import as_loss_head, targets_for

    seen = {}

    def pack(t):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        if sliced:
            head = as_loss_head(model.lm_head)
            with targets_for(head, y):
                model(x)
        else:
            model(x, y)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    return sum(n for ptr, n in seen.items() if ptr not in params)


@pytest.mark.parametrize("shape", [(256, 64, 2, 4, 64, 8), (1024, 256, 4, 8, 256, 2), (8192, 128, 3, 4, 96, 2)])
@pytest.mark.parametrize("checkpointing", [False, True])
@pytest.mark.parametrize("chunked_loss", ["never", "always"])
def test_activation_formula_matches_built_in_model(shape, checkpointing, chunked_loss):
    torch = pytest.importorskip("torch")
    from distsetup.training.model.blocks import apply_activation_checkpointing
    from distsetup.training.model.gpt import GPT

    vocab, seq, layers, heads, hidden, batch = shape
    torch.manual_seed(0)
    model = GPT(vocab, seq, layers, heads, hidden, 0.0)
    if checkpointing:
        apply_activation_checkpointing(model, list(model.blocks))
    x, y = torch.randint(0, vocab, (batch, seq)), torch.randint(0, vocab, (batch, seq))
    measured = _saved_activation_bytes(model, x, y, sliced=chunked_loss == "always")
    work = Workload("fp32", seq, chunked_loss=chunked_loss)
    predicted = activation_bytes(ModelShape(1, hidden, layers, heads, vocab), work, batch, checkpointing, peak=False)
    assert predicted == pytest.approx(measured, rel=0.25)


@pytest.mark.parametrize("experts_per_token", [None, "ungated", 1, 2, 8])  # a dense Llama, a GPT-NeoX, a Mixtral
def test_activation_formula_matches_a_gated_decoder_and_a_mixture_of_experts_top_k(tmp_path, experts_per_token):
    """The planner counted an MoE's activations as a dense GPT's, whatever its routing: 4.9x under at top-8."""
    torch = pytest.importorskip("torch")
    import transformers

    from distsetup.planning.models import hf_shape_from_json

    small = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}
    small |= {"intermediate_size": 256, "vocab_size": 256}
    if experts_per_token is None:
        config, model_class = transformers.LlamaConfig(**small), transformers.LlamaForCausalLM
    elif experts_per_token == "ungated":  # up, GeLU, down; no grouped keys and values
        del small["num_key_value_heads"]
        config, model_class = transformers.GPTNeoXConfig(**small), transformers.GPTNeoXForCausalLM
    else:
        config = transformers.MixtralConfig(**small, num_local_experts=8, num_experts_per_tok=experts_per_token)
        model_class = transformers.MixtralForCausalLM
    (tmp_path / "config.json").write_text(json.dumps({**config.to_dict(), "architectures": [model_class.__name__]}))
    torch.manual_seed(0)
    model, x = model_class(config), torch.randint(0, 256, (4, 128))
    seen = {}

    def pack(t):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(x, labels=x, use_cache=False)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    measured = sum(n for ptr, n in seen.items() if ptr not in params)
    shape = hf_shape_from_json(tmp_path / "config.json", None)
    predicted = activation_bytes(shape, Workload("fp32", 128), 4, False, peak=False)
    assert predicted == pytest.approx(measured, rel=0.15)
    # the parameters too: the ungated MLP's were counted as a gated one's, 1.18x (GPT-NeoX's biases are left out)
    assert shape.params == pytest.approx(sum(p.numel() for p in model.parameters()), rel=0.02)


# -- the recommendation --------------------------------------------------------------------------------

SEVEN_B = ModelShape(parse_count("7B"), hidden_size=4096, num_layers=32, num_heads=32, vocab_size=32000)


@pytest.mark.parametrize("gpu_memory, gpus", [("80GB", 8), ("40GB", 8), ("24GB", 8), ("80GB", 2), ("200GB", 4)])
def test_recommendation_is_the_first_strategy_that_fits(gpu_memory, gpus):
    hw, work = Hardware(1, gpus, parse_memory(gpu_memory)), Workload("bf16", 4096, global_batch_size=64)
    result = plan(SEVEN_B, hw, work)
    assert result.choice is not None and result.choice.fits
    order = candidates(hw)
    chosen = BY_KEY[result.choice.strategy]
    assert result.micro_batch * result.accumulation * hw.world_size == 64
    # every faster choice (earlier, same or less offload, without recomputation) does not fit micro-batch 1
    for s in order[: order.index(chosen)]:
        if s.offload <= chosen.offload:
            assert not estimate(s, SEVEN_B, hw, work, 1, result.choice.activation_checkpointing).fits
    # the micro-batch is the largest dividing the per-GPU batch that fits
    per_gpu = 64 // gpus
    bigger = [m for m in range(result.micro_batch + 1, per_gpu + 1) if per_gpu % m == 0]
    if bigger:
        assert not estimate(chosen, SEVEN_B, hw, work, bigger[0], result.choice.activation_checkpointing).fits


@pytest.mark.parametrize(
    "memory, advice",
    [
        ("1GB", "a GPU of 1 GB leaves 0.90 GB usable, less than the 1.0 GB each process takes"),  # not the model
        ("2GB", "even one layer with micro-batch 1 does not fit a GPU"),
    ],
)
def test_a_gpu_the_runtime_alone_fills_is_said_apart_from_a_model_too_large(memory, advice):
    """--gpu_memory 1 (a GB meant, and 1 GB given) was answered "the model needs tensor or pipeline parallelism" for
    a model of 0.1M parameters: the runtime's 1 GB took the usable 0.9 before any model."""
    hw = Hardware(1, 1, parse_memory(memory))
    huge = ModelShape(parse_count("70B"), hidden_size=8192, num_layers=80, num_heads=64, vocab_size=32000)
    for model in (huge, ModelShape(parse_count("0.1M"), hidden_size=64, num_layers=2, num_heads=4, vocab_size=256)):
        result = plan(model, hw, Workload("bf16", 64, micro_batch_size=1))
        if result.choice is None:
            assert [a for a in result.advice if a.startswith(advice)], result.advice
    assert plan(huge, hw, Workload("bf16", 64, micro_batch_size=1)).choice is None


def test_nothing_fits_says_what_would():
    hw, work = Hardware(1, 2, parse_memory("24GB")), Workload("bf16", 2048, micro_batch_size=4)
    huge = ModelShape(parse_count("70B"), hidden_size=8192, num_layers=80, num_heads=64, vocab_size=32000)
    result = plan(huge, hw, replace(work), allowed=tuple(s.key for s in STRATEGIES if not s.offload))
    assert result.choice is None
    more = [a for a in result.advice if a.startswith("more GPUs")]
    assert more, result.advice
    nodes = int(more[0].split(" on ")[1].split(" nodes")[0])
    bigger = plan(huge, replace(hw, num_nodes=nodes), Workload("bf16", 2048, micro_batch_size=1))
    assert bigger.choice is not None
    assert (
        plan(
            huge,
            replace(hw, num_nodes=nodes // 2),
            Workload("bf16", 2048, micro_batch_size=1),
            allowed=("zero3", "fsdp_full_shard"),
        ).choice
        is None
    )


def test_printed_command_writes_the_same_file_as_write(run_cli, tmp_path):
    args = [
        "plan",
        "--params",
        "7B",
        "--hidden_size",
        "4096",
        "--num_layers",
        "32",
        "--vocab_size",
        "32000",
        "--num_gpus",
        "8",
        "--gpu_memory",
        "40GB",
        "--seq_len",
        "2048",
        "--bf16",
        "--global_batch_size",
        "256",
    ]
    result = run_cli(*args, "--json", "--write", tmp_path / "written")
    assert result.exit_code == 0, result.output
    plan_json = json.loads(result.stdout)
    command = shlex.split(plan_json["command"])
    framework = "fsdp" if plan_json["recommendation"]["label"].startswith("FSDP") else "deepspeed"
    assert command[:2] == ["distsetup", framework]
    name = command[-1].split("/")[-1]
    again = run_cli(*command[1:-1], str(tmp_path / "by_command" / name))
    assert again.exit_code == 0, again.output
    assert json.loads((tmp_path / "written" / name).read_text()) == json.loads(
        (tmp_path / "by_command" / name).read_text()
    )
    rec = plan_json["recommendation"]
    assert rec["micro_batch_size"] * rec["gradient_accumulation_steps"] * 8 == 256


def test_table_output_and_fsdp_command(run_cli):
    result = run_cli(
        "plan",
        "--params",
        "1B",
        "--hidden-size",
        "2048",
        "--num-layers",
        "16",
        "--vocab-size",
        "32000",
        "--num-gpus",
        "4",
        "--gpu-memory",
        "24GB",
        "--bf16",
        "--strategy",
        "fsdp_full_shard",
        "--strategy",
        "fsdp_shard_grad_op",
    )
    assert result.exit_code == 0, result.output
    assert "Recommended: FSDP" in result.stdout
    assert "Next: distsetup fsdp --sharding_strategy" in result.stdout
    for s in STRATEGIES:
        assert s.label in result.stdout


def test_config_counts_the_built_in_model_exactly(run_cli, tmp_path):
    pytest.importorskip("torch")
    from distsetup.training.model.gpt import GPT

    cfg = tmp_path / "config.yaml"
    cfg.write_text(
        "model: {n_layer: 3, n_embd: 96, n_head: 4, block_size: 128, vocab_size: 512}\n"
        "training: {micro_batch_size: 4, gradient_accumulation_steps: 2, precision: bf16}\n"
    )
    result = run_cli("plan", "--config", cfg, "--num_gpus", "2", "--gpu_memory", "8GB", "--json")
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    real = sum(p.numel() for p in GPT(512, 128, 3, 4, 96, 0.0).parameters())
    assert out["model"]["params"] == real == gpt_params(512, 128, 3, 96)
    assert out["workload"]["precision"] == "bf16" and out["workload"]["seq_len"] == 128
    assert out["recommendation"]["global_batch_size"] == 4 * 2 * 2


@pytest.mark.parametrize(
    "model",
    [
        "{n_layer: 3, n_embd: 96, n_head: 4, block_size: 128, vocab_size: 512}",
        "{n_layer: 2, n_embd: 64, n_head: 4, block_size: 4096, vocab_size: 256}",  # the positions the largest module
    ],
)
def test_the_built_in_model_is_counted_without_torch_as_on_the_meta_device(tmp_path, model):
    """plan --config imported torch to count the built-in GPT on the meta device (seconds; generating or checking a
    file never imports torch): its numbers give every count the planner reads, the same."""
    from distsetup.cli.plan_model import count_on_meta, shape_from_run_config
    from distsetup.formats.runconfig_load import load_run_config

    cfg = tmp_path / "config.yaml"
    cfg.write_text(f"model: {model}\n")
    counted, exact = shape_from_run_config(load_run_config(cfg)), count_on_meta(load_run_config(cfg))
    for shape in (counted, exact):
        assert shape.layer_cls == exact.layer_cls
    assert [(s.params, s.block, s.largest_module, s.root) for s in (counted, exact)] == [
        (exact.params, exact.block, exact.largest_module, exact.root)
    ] * 2
    args = ["plan", "--config", str(cfg), "--num_gpus", "2", "--gpu_memory", "8GB"]
    assert heavy_imports(args, ("torch", "deepspeed")) == ([], 0)


def test_a_deepspeed_run_config_is_planned_before_its_file_is_written(run_cli, tmp_path):
    """The run config names the DeepSpeed file plan --write is about to write: plan refused it ("file
    config/ds_config.json does not exist"), though it plans every strategy and reads no backend file."""
    (tmp_path / "config").mkdir()
    cfg = tmp_path / "config" / "config.yaml"
    cfg.write_text(
        "model: {n_layer: 3, n_embd: 96, n_head: 4, block_size: 128, vocab_size: 512}\n"
        "distributed: {backend: deepspeed, deepspeed_config: ds_config.json}\n"
    )
    assert run_cli("validate", cfg).exit_code != 0  # the file is still missing for a run
    args = ("plan", "--config", cfg, "--num_gpus", "2", "--gpu_memory", "8GB", "--strategy", "zero2")
    result = run_cli(*args, "--write", tmp_path / "config")
    assert result.exit_code == 0, result.output
    assert "Recommended: ZeRO-2" in result.stdout
    assert run_cli("validate", cfg).exit_code == 0, "plan --write wrote the file the run config names"


def test_config_counts_your_own_model_on_the_meta_device(run_cli, monkeypatch):
    pytest.importorskip("torch")
    example = REPO / "examples" / "pairwise_scorer"
    result = run_cli("plan", "--config", example / "config.yaml", "--num_gpus", "8", "--gpu_memory", "80GB", "--json")
    assert result.exit_code == 0, result.output
    monkeypatch.syspath_prepend(str(example))
    from scorer import build_model

    model = build_model(channels=32, depth=4)  # the example's model.args
    assert json.loads(result.stdout)["model"]["params"] == sum(p.numel() for p in model.parameters())
    assert json.loads(result.stdout)["model"]["layer_cls"] == "ConvBlock"
    assert "activations are not counted for model.type python" in result.stderr
    assert all(row["activations"] == 0 for row in json.loads(result.stdout)["estimates"])
    table = run_cli("plan", "--config", example / "config.yaml", "--num_gpus", "8", "--gpu_memory", "80GB")
    assert table.stdout.startswith("Model: ") and "; fp32. GB per GPU" in table.stdout.splitlines()[0]  # no sequence
    # the shape flags give its activations, a transformer's (they were passed over without a word)
    shaped = run_cli(
        "plan", "--config", example / "config.yaml", "--num_gpus", "8", "--gpu_memory", "80GB", "--json",
        "--hidden_size", 64, "--num_layers", 4, "--num_heads", 4,
    )  # fmt: skip
    assert shaped.exit_code == 0, shaped.output
    ddp = json.loads(shaped.stdout)["estimates"][0]
    assert ddp["micro_batch"] == 32  # the run config's (the file plan writes must agree with it)
    expected = activation_bytes(ModelShape(1, 64, 4, 4), Workload("fp32", 2048), 32, False)  # no logits: its data
    assert ddp["activations"] == pytest.approx(expected)
    assert "activations of a transformer of hidden 64, 4 layers (the flags'), 4 heads, no logits" in shaped.stderr


def test_shape_flags_beside_a_run_config_that_gives_the_shape_are_one_line(run_cli, tmp_path):
    cfg = tmp_path / "config.yaml"
    cfg.write_text("model: {n_layer: 3, n_embd: 96, n_head: 4, block_size: 128, vocab_size: 512}\n")
    result = run_cli("plan", "--config", cfg, "--num_gpus", "2", "--gpu_memory", "8GB", "--hidden_size", 4096)
    assert result.exit_code != 0 and "--hidden_size with --config: model.type gpt's shape is the run config's" in (
        result.output
    )
    assert "Traceback" not in result.output


def test_plan_never_imports_torch():
    args = ["plan", "--params", "13B", "--num_gpus", "8", "--gpu_memory", "80GB", "--hidden_size", "5120"]
    args += ["--num_layers", "40", "--vocab_size", "32000"]
    assert heavy_imports(args, ("torch", "deepspeed", "pynvml")) == ([], 0)


def test_plan_without_gpu_memory_on_a_machine_without_gpus(run_cli, tmp_path):
    """Without --gpu_memory the plan is for this machine's GPUs; where it has none (a laptop, a login node, CI), the
    error says how to plan for the GPUs the run will use, before a run config's model is counted (with torch)."""
    config = tmp_path / "config.yaml"
    config.write_text("model: {n_layer: 2, n_embd: 64, n_head: 2, block_size: 32, vocab_size: 128}\n")
    for args in (["--params", "1B", "--num_gpus", "2"], ["--config", str(config)]):
        result = run_cli("plan", *args)
        if result.exit_code == 0:  # a machine with GPUs: their memory was used
            assert "GPU(s) of" in result.stdout
            continue
        assert result.exit_code == 1 and len(result.output.strip().splitlines()) == 1, result.output
        assert "no NVIDIA GPU" in result.output and "HINT: give --gpu_memory" in result.output
        assert heavy_imports(["plan", *args], ("torch",)) == ([], 1)


def test_bad_sizes_are_errors(run_cli):
    assert run_cli("plan", "--params", "seven", "--gpu_memory", "80GB").exit_code == 1
    assert run_cli("plan", "--params", "7B", "--gpu_memory", "80 parsecs").exit_code == 1
    assert "more than any machine has" in run_cli("plan", "--params", "7B", "--gpu_memory", "80TB").stderr
    assert parse_memory("24GiB") == 24 * 2**30 and parse_count("1.3e9") == 1_300_000_000
    # as Kubernetes and SLURM users write memory: G decimal (Kubernetes' meaning), Gi binary
    assert (parse_memory("80G"), parse_memory("80Gi"), parse_memory("80")) == (80e9, 80 * 2**30, 80e9)


def test_gpus_in_total_and_per_node_give_the_nodes(run_cli):
    """--num_gpus 16 --num_gpus_per_node 8 was refused as not matching --num_nodes 1, a flag not given."""
    result = run_cli("plan", "--params", "70B", "--num_gpus", "16", "--num_gpus_per_node", "8", "--gpu_memory", "80GB")
    assert result.exit_code == 0 and "; 2 node(s) x 8 GPU(s) of 80.0 GB" in result.stdout, result.stderr
    result = run_cli("plan", "--params", "7B", "--num_gpus", "3", "--num_gpus_per_node", "2", "--gpu_memory", "8GB")
    assert (result.exit_code, result.stderr.strip()) == (
        1,
        "Error: --num_gpus 3 does not fill whole nodes of --num_gpus_per_node 2. HINT: give a multiple of 2, or "
        "--num_nodes with --num_gpus_per_node.",
    )
    given = run_cli("plan", "--params", "7B", "--num_gpus", "8", "--num_nodes", "1", "--num_gpus_per_node", "4")
    assert given.exit_code == 1 and "does not match --num_nodes 1 x --num_gpus_per_node 4" in given.stderr


SMALL_DECODER = {"hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2}
HF_DECODERS = {  # class, and its config's keys beyond SMALL_DECODER
    "LlamaForCausalLM": {"intermediate_size": 96, "tie_word_embeddings": False},
    "LlamaForCausalLM with biases": {"intermediate_size": 96, "attention_bias": True, "head_dim": 24},
    "MixtralForCausalLM": {"intermediate_size": 96, "num_local_experts": 8},
    "Qwen2MoeForCausalLM": {  # a shared expert, a sparse layer every second, the last one dense
        "num_experts": 6, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 80, "decoder_sparse_step": 2,
        "mlp_only_layers": [3],
    },
    "Qwen3MoeForCausalLM": {"num_experts": 6, "moe_intermediate_size": 32},
    "OlmoeForCausalLM": {"num_experts": 6, "intermediate_size": 48},
}  # fmt: skip


@pytest.mark.parametrize("architecture", sorted(HF_DECODERS))
def test_hf_config_counted_without_torch_matches_the_meta_device(tmp_path, run_cli, architecture):
    """`init` counts a Hugging Face folder from its config.json alone (it imports no torch): as transformers builds
    it, a mixture of experts' experts, routers and shared experts included (they were left out: Mixtral 8x7B counted
    7x small). Qwen3-MoE's and OLMoE's query and key norms are left out: under 0.1%."""
    import transformers

    from distsetup.cli.plan_model import count_on_meta
    from distsetup.formats.runconfig_load import load_run_config
    from distsetup.planning.models import hf_shape_from_json

    name = architecture.split()[0]
    config_class = getattr(transformers, name.replace("ForCausalLM", "Config"))
    config = config_class(**SMALL_DECODER, vocab_size=1000, **HF_DECODERS[architecture]).to_dict()
    (tmp_path / "config.json").write_text(json.dumps({**config, "architectures": [name]}))
    cfg = tmp_path / "run.yaml"
    cfg.write_text(json.dumps({"model": {"type": "hf", "hf_path": str(tmp_path), "vocab_size": 256, "block_size": 96}}))
    exact = count_on_meta(load_run_config(cfg))
    analytic = hf_shape_from_json(tmp_path / "config.json", None)
    assert analytic.params == pytest.approx(exact.params, rel=2e-3) and analytic.block == pytest.approx(
        exact.block, rel=2e-3
    )
    assert analytic.root == pytest.approx(exact.root, rel=2e-3) and exact.root > 1000 * 64  # the embeddings, head
    if name in ("LlamaForCausalLM", "MixtralForCausalLM", "Qwen2MoeForCausalLM"):
        assert (analytic.params, analytic.block, analytic.root) == (exact.params, exact.block, exact.root)
    assert exact.layer_cls == analytic.layer_cls == name.replace("ForCausalLM", "DecoderLayer")
    planned = run_cli("plan", "--config", cfg, "--num_gpus", "2", "--gpu_memory", "8GB", "--json")
    assert json.loads(planned.stdout)["workload"]["seq_len"] == 96  # the run's samples, not 2048


def test_which_layers_of_a_mixture_of_experts_hold_experts_by_each_familys_keys():
    from distsetup.planning.models import decoder_blocks

    def sparse_layers(**keys) -> list[int]:
        config = {**SMALL_DECODER, "num_hidden_layers": 6, "intermediate_size": 96, **keys}
        dense = decoder_blocks(config)[0]
        return [i for i, block in enumerate(decoder_blocks({**config, "num_experts": 4})) if block != dense]

    assert sparse_layers() == [0, 1, 2, 3, 4, 5]
    assert sparse_layers(decoder_sparse_step=2, mlp_only_layers=[3]) == [1, 5]  # Qwen2-MoE
    assert sparse_layers(interleave_moe_layer_step=3) == [2, 5]  # Llama 4
    assert sparse_layers(first_k_dense_replace=1, moe_layer_freq=2) == [2, 4]  # DeepSeek-V2
    dense = {**SMALL_DECODER, "intermediate_size": 96, "moe_intermediate_size": [1]}  # no experts: not read
    assert decoder_blocks(dense) == decoder_blocks({**SMALL_DECODER, "intermediate_size": 96})


# -- `distsetup deepspeed --scale_lr`: the lr scaled from a base batch to the global one ----------------------


@pytest.mark.parametrize("rule, factor", [("linear", 4.0), ("sqrt", 2.0)])
def test_deepspeed_command_writes_the_scaled_lr(run_cli, rule, factor):
    result = run_cli(
        "deepspeed",
        "--zero_stage",
        "1",
        "--world_size",
        "8",
        "--micro_batch_size",
        "4",
        "--gradient_accumulation_steps",
        "2",
        "--lr",
        "1e-4",
        "--scheduler",
        "WarmupLR",
        "--scale_lr",
        rule,
        "--base_batch_size",
        "16",
    )
    assert result.exit_code == 0, result.output
    config = json.loads(result.stdout)
    assert config["train_batch_size"] == 64
    assert config["optimizer"]["params"]["lr"] == pytest.approx(1e-4 * factor)
    assert config["scheduler"]["params"]["warmup_max_lr"] == pytest.approx(1e-4 * factor)
    assert f"scaled {rule} from base batch 16 to global batch 64" in result.stderr


def test_deepspeed_scale_lr_needs_base_batch_and_world_size(run_cli):
    assert "--base_batch_size" in run_cli("deepspeed", "--world_size", "2", "--scale_lr", "linear").output
    assert "world size" in run_cli("deepspeed", "--scale_lr", "linear", "--base_batch_size", "8").output


def test_params_alone_assumes_a_published_shape_and_says_so(run_cli):
    from distsetup.planning.models import assumed_shape

    assert assumed_shape(7_000_000_000)[:2] == (4096, 32)
    assert assumed_shape(120_000_000)[:2] == (768, 12)
    result = run_cli(
        "plan",
        "--params",
        "7B",
        "--num_gpus",
        "8",
        "--gpu_memory",
        "80GB",
        "--seq_len",
        "4096",
        "--micro_batch_size",
        "2",
        "--bf16",
        "--json",
    )
    assert "activations assume hidden 4096, 32 layers" in result.stderr
    plan = json.loads(result.stdout)
    zero3 = next(e for e in plan["estimates"] if e["strategy"] == "zero3")
    assert zero3["activations"] > 10e9  # s=4096, b=2, h=4096, 32 layers in bf16
    assert zero3["gathered"] < 0.1 * 2 * 7e9  # gathered a block at a time, not the whole model


def test_fsdp_recommendation_wraps_the_users_layer_class(run_cli):
    args = [
        "plan",
        "--params",
        "7B",
        "--num_gpus",
        "8",
        "--gpu_memory",
        "80GB",
        "--seq_len",
        "4096",
        "--micro_batch_size",
        "2",
        "--bf16",
        "--strategy",
        "fsdp_full_shard",
    ]
    result = run_cli(*args)
    assert "--transformer_layer_cls_to_wrap Block" in result.stdout and "give --layer_cls" in result.stderr
    result = run_cli(*args, "--layer_cls", "LlamaDecoderLayer")
    assert "--transformer_layer_cls_to_wrap LlamaDecoderLayer" in result.stdout and "--layer_cls" not in result.stderr


def test_setup_counts_one_whole_model_on_rank_0_whatever_the_strategy():
    """Set-up's host memory (issue 37): rank 0 alone builds the whole fp32 model, the others fill their shards or
    their whole copies from it; a --cpu_memory that holds one whole model but not one per GPU rules out only the
    strategies whose offloaded states it does not hold."""
    model, hw = ModelShape(int(7e9)), Hardware(1, 8, gpu_memory=1000 * GB, cpu_memory=100 * GB, **NO_RUNTIME)
    for strategy in STRATEGIES:
        e = estimate(strategy, model, hw, Workload("bf16"), 1)
        assert (e.setup_rank0, e.setup_others) == (4 * 7e9, 0.0), strategy.key
        # one whole copy: 28 GB of the 90 usable (8 would be 224 GB)
        assert e.fits == (e.cpu_per_node <= 90 * GB), strategy.key


def test_the_table_says_what_the_host_memory_does_not_hold(run_cli):
    """A row whose offloaded state a node's --cpu_memory does not hold is "no (CPU)" in the table, as its JSON is
    not fit (the table said "yes" from the GPU's figure alone); a row whose GPU figure fits and host holds it, yes."""
    args = ["plan", "--params", "7B", "--num_gpus", "8", "--gpu_memory", "80GB", "--bf16", "--cpu_memory", "64GB"]
    verdicts = {line[:34].strip(): line.split()[-1] for line in run_cli(*args).stdout.splitlines()[2:12]}
    fits = {e["label"]: e["fits"] for e in json.loads(run_cli(*args, "--json").stdout)["estimates"]}
    assert verdicts["ZeRO-2 + optimizer offload"] == "(CPU)" and not fits["ZeRO-2 + optimizer offload"]
    assert verdicts["ZeRO-3"] == "yes" and fits["ZeRO-3"]


# torch.cuda.max_memory_allocated of benchmarks/gpu_throughput.py's runs in the GPU check on an NVIDIA H200
# (2026-11-30; torch 2.11, DeepSpeed 0.19.8): a 1B GPT of 20 blocks x 2048, sequence 2048, micro-batch 4, bf16, one
# process. `distsetup plan` strategy -> GB: the plain run (DDP's on one GPU), FSDP2 and ZeRO-3 (DeepSpeed's own buffer
# sizes, which the trainer keeps where a rank has room for them, as the plan with 10 TB does).
H200_PEAK_GB = {"ddp": 26.73, "fsdp_full_shard": 23.42, "zero3": 28.35}


def test_the_peak_is_within_ten_percent_of_an_h200s(run_cli):
    """The end of forward is the peak: the gradients a step frees do not exist yet, and torch.autocast's 16-bit
    weights do (before, the plan added both gradients and activations: 16-20% over each of these)."""
    shape = ["--hidden_size", "2048", "--num_layers", "20", "--num_heads", "16", "--vocab_size", "256"]
    batch = ["--seq_len", "2048", "--micro_batch_size", "4", "--bf16"]
    one_gpu = ["--num_gpus", "1", "--gpu_memory", "10TB", "--json"]
    result = run_cli("plan", "--params", gpt_params(256, 2048, 20, 2048), *shape, *batch, *one_gpu)
    assert result.exit_code == 0, result.output
    planned = json.loads(result.stdout)
    runtime = planned["hardware"]["runtime_bytes"]  # the CUDA context: max_memory_allocated never sees it
    peaks = {e["strategy"]: (e["total"] - runtime) / GB for e in planned["estimates"]}
    for strategy, measured in H200_PEAK_GB.items():
        assert peaks[strategy] == pytest.approx(measured, rel=0.10), strategy


def test_gradients_exist_in_forward_where_they_outlive_the_step_or_accumulate():
    model = ModelShape(int(1e9), hidden_size=2048, num_layers=20, num_heads=16, vocab_size=256)
    one_gpu, two_gpus = Hardware(**NO_RUNTIME), Hardware(1, 2, **NO_RUNTIME)
    alone = Workload(micro_batch_size=4)
    accumulating = Workload(micro_batch_size=4, global_batch_size=16)
    for key, hw, work, held in [
        ("ddp", one_gpu, alone, False),  # one process: set_to_none, and made anew in backward
        ("ddp", two_gpus, alone, True),  # .grad aliases DDP's buckets, allocated once
        ("fsdp_full_shard", two_gpus, alone, False),  # FSDP2's reduce-scatter makes the sharded ones in backward
        ("fsdp_full_shard", two_gpus, accumulating, True),
        ("zero3", two_gpus, alone, True),  # DeepSpeed's flat 16-bit partition, allocated once
    ]:
        est = estimate(BY_KEY[key], model, hw, work, 4)
        assert est.grads_in_forward == (est.grads if held else 0.0), key
        assert est.total >= est.model_states + est.gathered + est.buffers  # the step holds every state


def test_a_shape_that_cannot_be_the_params_is_refused(run_cli):
    """--params 7B with --hidden_size 64 --num_layers 2 (2M parameters) planned a micro-batch of 1412; an MoE model
    of several times its dense shape (Mixtral 8x7B: 47B on a 7B shape) is still planned."""
    args = ["plan", "--gpu_memory", "80GB", "--num_gpus", "8"]
    refused = run_cli(*args, "--params", "7B", "--hidden_size", "64", "--num_layers", "2")
    assert refused.exit_code == 1 and "about 2.15M parameters" in refused.stderr
    assert run_cli(*args, "--params", "47B", "--hidden_size", "4096", "--num_layers", "32").exit_code == 0
    assert "Model: 1000B parameters" in run_cli(*args, "--params", "1000B").stdout  # not 1e+03B


def test_the_recommended_files_warnings_are_said_as_its_command_says_them(run_cli):
    """`distsetup fsdp` warns that Accelerate's FSDP2 does not hybrid-shard from the file; plan recommending that
    file (and writing it with --write) says the same."""
    args = ["plan", "--params", "7B", "--num_nodes", "2", "--num_gpus_per_node", "8", "--gpu_memory", "80GB", "--bf16"]
    result = run_cli(*args, "--strategy", "fsdp_hybrid_shard")
    assert result.exit_code == 0 and "Warning: HYBRID_SHARD with FSDP2" in result.stderr, result.stderr


def test_an_encoder_decoder_folder_is_named_so_by_plan_and_init_as_by_validate(tmp_path):
    """init --model on a Switch Transformer's folder said it described no decoder (KeyError: 'hidden_size') and
    asked for a transformers config.json, which it was."""
    from distsetup.planning.models import hf_shape_from_json

    config = {"model_type": "switch_transformers", "is_encoder_decoder": True, "d_model": 768, "num_experts": 8}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(DistsetupError, match=r"holds an encoder-decoder \(switch_transformers\); model.type hf trains"):
        hf_shape_from_json(tmp_path / "config.json", None)


def test_plan_config_writes_the_run_configs_micro_batch_and_its_next_command_takes_the_run_config(run_cli, tmp_path):
    """plan --config wrote the largest micro-batch that fit (8 x 1) beside a run config of 4 x 2, and the launcher
    then refused the pair; its Next command left the run config out (the built-in GPT would have trained)."""
    cfg = tmp_path / "my run.yaml"
    cfg.write_text(
        "model: {n_layer: 4, n_embd: 256, n_head: 4, block_size: 256, vocab_size: 512}\n"
        "training: {micro_batch_size: 4, gradient_accumulation_steps: 2}\n"
    )
    hardware = ("--num_gpus_per_node", 8, "--gpu_memory", "16GB")
    zero2 = run_cli("plan", "--config", cfg, *hardware, "--strategy", "zero2", "--write", tmp_path / "files")
    assert zero2.exit_code == 0, zero2.output
    written = json.loads((tmp_path / "files" / "ds_config.json").read_text())
    assert (written["train_micro_batch_size_per_gpu"], written["gradient_accumulation_steps"]) == (4, 2)
    ddp = run_cli("plan", "--config", cfg, *hardware, "--strategy", "ddp")
    assert f"Next: distsetup launcher --config {shlex.quote(str(cfg))} --num_nodes 1" in ddp.stdout
    other_batch = run_cli("plan", "--config", cfg, *hardware, "--global_batch_size", 24)  # not the run config's
    assert other_batch.exit_code == 0 and "micro-batch 3, gradient accumulation 1" in other_batch.stdout
    big = tmp_path / "big.yaml"
    big.write_text(
        "model: {n_layer: 48, n_embd: 4096, n_head: 32, block_size: 4096, vocab_size: 32000}\n"
        "training: {micro_batch_size: 64}\n"
    )
    refused = run_cli("plan", "--config", big, "--num_gpus_per_node", 8, "--gpu_memory", "80GB")
    assert (
        "training.micro_batch_size 64 (the run config's) fits no strategy: ZeRO-2 with activation checkpointing "
        in (refused.stdout)
    )
