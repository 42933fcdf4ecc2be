"""The speed features on the CPU: selective activation checkpointing recomputes no matmul yet gives the same
gradients, training.activation_checkpointing still reads its old boolean spelling, DeepSpeed sets up without
torch.compile's work for functions it never calls, and the trainer asks for huge pages for large CPU tensors (the
import checks in a fresh interpreter each). (torch.compile's runs: tests/processes/test_compiled_runs.py.)"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from repo import REPO
from torch._dynamo.testing import CompileCounter

from distsetup.formats.runconfig_load import load_run_config
from distsetup.training.backends.deferred_compile import compile_deferred
from distsetup.training.model.blocks import apply_activation_checkpointing
from distsetup.training.model.gpt import GPT


def gradients_and_backward_flops(mode: str) -> tuple[list[torch.Tensor], int]:
    from torch.utils.flop_counter import FlopCounterMode

    torch.manual_seed(0)
    model = GPT(256, 32, 2, 2, 64, 0.0)
    if mode != "none":
        apply_activation_checkpointing(model, list(model.blocks), mode)
    x = torch.randint(0, 256, (4, 32), generator=torch.Generator().manual_seed(1))
    loss = model(x, x)
    with FlopCounterMode(display=False) as flops:
        loss.backward()
    return [p.grad for p in model.parameters()], flops.get_total_flops()


def test_selective_checkpointing_recomputes_no_matmul_and_changes_no_gradient():
    plain, plain_flops = gradients_and_backward_flops("none")
    full, full_flops = gradients_and_backward_flops("full")
    selective, selective_flops = gradients_and_backward_flops("selective")
    assert full_flops > plain_flops == selective_flops  # full checkpointing runs each block's matmuls again
    for a, b, c in zip(plain, full, selective, strict=True):
        assert torch.allclose(a, b, atol=1e-7) and torch.allclose(a, c, atol=1e-7)


def test_a_block_inside_another_is_recomputed_once_in_backward():
    """model.layer_classes naming a layer and a part of it (Block and CausalSelfAttention): the outer block's
    recomputation covers the inner one, which runs forward twice (once more than without checkpointing), not three
    times."""
    from distsetup.training.model.blocks import layer_modules

    model = GPT(256, 32, 2, 2, 64, 0.0)
    blocks = layer_modules(model, ["Block", "CausalSelfAttention"])
    attention_forwards = []
    model.blocks[0].attn.register_forward_pre_hook(lambda *_: attention_forwards.append(1))
    apply_activation_checkpointing(model, blocks)
    x = torch.randint(0, 256, (2, 16))
    model(x, x).backward()
    assert len(attention_forwards) == 2


class NormedBlock(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear, self.norm = torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4)

    def forward(self, x):
        return torch.relu(self.norm(self.linear(x)))


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_recomputed_blocks_update_batchnorms_running_statistics_once_a_step(mode):
    """Backward's recompute ran each BatchNorm again in training mode: its running statistics moved twice a step
    (num_batches_tracked 6 after 3 steps), so the model evaluated and exported differed from the one trained without
    checkpointing, which computes the same gradients."""

    def trained(checkpointed: bool) -> dict:
        torch.manual_seed(0)
        model = torch.nn.Sequential(NormedBlock(), NormedBlock())
        if checkpointed:
            apply_activation_checkpointing(model, list(model), mode)
        for step in range(3):
            model(torch.randn(8, 4, generator=torch.Generator().manual_seed(step))).square().mean().backward()
        with torch.no_grad():  # evaluation's forward leaves them as they are
            model.eval()(torch.randn(8, 4))
        return {name.replace("_checkpoint_wrapped_module.", ""): b for name, b in model.named_buffers()}

    plain, recomputed = trained(False), trained(True)
    assert plain.keys() == recomputed.keys() and plain["0.norm.num_batches_tracked"] == 3
    for name, value in plain.items():
        torch.testing.assert_close(recomputed[name], value, rtol=0, atol=0, msg=name)


class RunsMoreTheSecondTime(torch.nn.Module):
    """A block whose recompute runs an operation its forward did not (as a ZeRO-3 block gathered in one and not the
    other)."""

    def __init__(self):
        super().__init__()
        self.linear, self.calls = torch.nn.Linear(4, 4), 0

    def forward(self, x):
        self.calls += 1
        return self.linear(x if self.calls == 1 else x.clone())


def test_a_recompute_that_differs_from_its_forward_is_one_line_naming_the_fix():
    """Selective checkpointing refuses it with torch's words on every rank, a traceback after: now one line."""
    from distsetup.training.model.blocks import recompute_mismatch

    model = torch.nn.Sequential(RunsMoreTheSecondTime())
    apply_activation_checkpointing(model, list(model), "selective")
    with pytest.raises(RuntimeError) as refused:
        model(torch.ones(2, 4, requires_grad=True)).sum().backward()
    said = recompute_mismatch(refused.value)
    assert said is not None and said.alike_on_every_rank and "\n" not in str(said)
    assert str(said).startswith(
        "training.activation_checkpointing selective: backward's recompute of a block ran other operations than its "
        "forward (aten.clone.default;"
    )
    assert str(said).endswith(
        "HINT: set training.activation_checkpointing: full, which recomputes whatever the block runs."
    )
    assert recompute_mismatch(RuntimeError("something else")) is None


@pytest.mark.parametrize("written, read", [(True, "full"), (False, "none"), ("selective", "selective")])
def test_activation_checkpointing_reads_its_old_boolean_spelling(written, read):
    cfg = load_run_config(None, [f"training.activation_checkpointing={str(written).lower()}"])
    assert cfg.training.activation_checkpointing == read


DEEPSPEED_SET_UP = """
import json, os, socket, sys, tempfile
from pathlib import Path
import torch
from distsetup.formats.runconfig_load import load_run_config
from distsetup.training import memory
from distsetup.training.backends.deepspeed import DeepSpeedBackend
from distsetup.training.model import build as models
from distsetup.training.launch_env import World

folder = Path(tempfile.mkdtemp())
batch = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "train_batch_size": 2}
(folder / "ds.json").write_text(json.dumps({**batch, "zero_optimization": {"stage": 2}}))
settings = ["model.n_layer=1", "model.n_embd=16", "model.n_head=2", "model.block_size=8", "training.micro_batch_size=2"]
chosen = ["distributed.backend=deepspeed", f"distributed.deepspeed_config={folder / 'ds.json'}"]
cfg = load_run_config(None, [*settings, *chosen])
os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1")
with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
backend = DeepSpeedBackend(cfg, World(rank=0, local_rank=0, size=1, local_size=1), torch.device("cpu"))
memory.device_memory_per_rank = lambda device, local_processes: 0  # no room: the hidden size's sizes
backend.fit_to_the_model(models.describe(cfg.model).parameters)
backend.wrap(models.parts(models.build(cfg.model), cfg.model, ["Block"]), cfg.training.max_steps)
torch.distributed.destroy_process_group()
engine = backend.engine
inductor = "torch._inductor.compile_fx" in sys.modules
print(json.dumps([type(engine.optimizer).__name__, inductor, engine.zero_reduce_bucket_size()]))
"""


def test_deepspeed_sets_up_without_importing_inductor_for_functions_it_never_calls():
    """DeepSpeed's ZeRO imports its Muon optimizer, whose torch.compile decorators import torch._inductor (3 s of each
    rank's start): the DeepSpeed backend's set-up (deepspeed.initialize, one process) runs inside compile_deferred,
    and nothing imports it."""
    from train_runs import environment

    run = subprocess.run([sys.executable, "-c", DEEPSPEED_SET_UP], env=environment(), capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-2000:]
    optimizer, inductor_imported, reduce_bucket = json.loads(run.stdout.strip().splitlines()[-1])  # after its logs
    assert optimizer == "DeepSpeedZeroOptimizer"  # ZeRO-2's, which imports the Muon optimizer
    assert not inductor_imported
    assert reduce_bucket == 16 * 16  # the engine's reduce bucket is the one the backend sized (test_zero_buffers.py)


def test_a_deferred_function_compiles_at_its_first_call_as_torch_compile_would():
    """Compiled once, at the first call (one frame, also where one deferred function calls another, as torch.compile's
    own are inlined); a module is compiled at once; torch.compile is itself again afterwards."""
    eager, counter = torch.compile, CompileCounter()
    with compile_deferred():

        @torch.compile(backend=counter)
        def double(x):
            return x * 2

        @torch.compile(backend=counter)
        def double_plus_one(x):
            return double(x) + 1

        module = torch.compile(torch.nn.Linear(2, 2), backend=counter)
    assert torch.compile is eager
    assert isinstance(module, torch._dynamo.eval_frame.OptimizedModule)
    for _ in range(2):
        assert torch.equal(double_plus_one(torch.ones(3)), torch.full((3,), 3.0))
    assert counter.frame_count == 1
    assert torch.equal(double(torch.ones(3)), torch.full((3,), 2.0)) and counter.frame_count == 2


FLAGS_OF_A_LARGE_TENSOR = """
import json, re, sys
from distsetup.train import ask_for_huge_pages
assert "torch" not in sys.modules, "distsetup.train imported torch before it could ask for huge pages"
ask_for_huge_pages()
import torch
large = torch.ones(16 * 2**20)  # kept: freed, it would be unmapped
for mapping in re.split(r"\\n(?=[0-9a-f]+-[0-9a-f]+ )", open("/proc/self/smaps").read()):
    low, high = (int(end, 16) for end in mapping.split()[0].split("-"))
    if low <= large.data_ptr() < high:
        print(json.dumps(re.search(r"VmFlags: (.*)", mapping).group(1).split()))
"""


def large_tensor_flags(**setting) -> list[str]:
    env = {key: value for key, value in os.environ.items() if key != "THP_MEM_ALLOC_ENABLE"} | setting
    run = subprocess.run([sys.executable, "-c", FLAGS_OF_A_LARGE_TENSOR], env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-2000:]
    return json.loads(run.stdout)


def test_the_trainer_asks_for_huge_pages_for_large_cpu_tensors_unless_told_not_to():
    """The trainer's module leaves torch unimported, sets THP_MEM_ALLOC_ENABLE, and torch then advises huge pages for
    a 64 MiB tensor (the 'hg' flag of its mapping: set whatever the kernel's THP mode, where the kernel has THP at
    all); a value the user set (0) is kept."""
    kernel_has_thp = Path("/sys/kernel/mm/transparent_hugepage").is_dir()
    assert ("hg" in large_tensor_flags()) == kernel_has_thp
    assert "hg" not in large_tensor_flags(THP_MEM_ALLOC_ENABLE="0")


FREED_LAYERS_RESIDENT = """
import sys, torch
from distsetup.train import load_config, parse_args, prepare
args = parse_args(["--config", "config/config.yaml", *sys.argv[1:]])
prepare(load_config(args), args)  # the trainer's process, as it is when it builds the model
def resident():
    return int(next(l for l in open("/proc/self/status") if l.startswith("VmRSS:")).split()[1]) * 1024
torch.ones(1024).sum()  # torch's own first-use allocations, before the count
before = resident()
torch.ones(24 * 2**20 // 4)  # a large block, freed at once: glibc's own threshold rises past the sizes below
layers = [torch.ones(2**20 // 4 * size) for size in (5, 6, 7) * 8]  # 144 MiB of gathered layers and gradients
del layers[:-1]  # all freed but the last: a heap could not shrink below it
print((resident() - before) / 2**20)
"""


def resident_after_freeing_layers(backend: str, output_dir: Path) -> float:
    """MiB a trainer's process of `backend` still holds after gathering and freeing 144 MiB of layers, 7 kept."""
    overrides = [f"distributed.backend={backend}", f"training.output_dir={output_dir}"]
    env = {key: value for key, value in os.environ.items() if not key.startswith("MALLOC_")}  # glibc's own settings
    command = [sys.executable, "-c", FREED_LAYERS_RESIDENT, *overrides]
    run = subprocess.run(command, env=env, cwd=REPO, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-2000:]
    return float(run.stdout)


def test_freed_layers_leave_the_process_where_the_backend_gathers_them(tmp_path):
    """A backend that gathers each layer's weights (FSDP2 here; ZeRO-3 alike: Strategy.gathers_weights) fixes glibc's
    mmap threshold, so a layer's worth of memory freed is the system's again; glibc's own threshold would have risen
    above these sizes and kept them in its heap, which it does for DDP, whose activations of 4 MiB or more would
    otherwise be faulted in afresh every step (glibc is this project's C library)."""
    assert resident_after_freeing_layers("fsdp", tmp_path / "fsdp") < 48  # the 7 MiB layer kept, and the interpreter's
    assert resident_after_freeing_layers("ddp", tmp_path / "ddp") > 96  # the heap keeps what was freed


def test_the_strategies_that_gather_weights_are_the_sharded_ones():
    from distsetup.planning.estimates import STRATEGIES

    gathering = {s.key for s in STRATEGIES if s.gathers_weights}
    assert gathering == {
        "fsdp_shard_grad_op",
        "fsdp_hybrid_shard",
        "fsdp_full_shard",
        "zero3",
        "zero3_offload_optimizer",
        "zero3_offload_all",
    }
