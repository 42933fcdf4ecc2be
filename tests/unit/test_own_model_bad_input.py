"""The user's own code that cannot be used is one line naming the setting and the fix: checked before any process
group where it can be (the model is built on the meta device first), else at the first step."""

import re
import signal
import textwrap

import pytest
import torch
import yaml
from train_runs import assert_clean_error, train

from distsetup.errors import DistsetupError
from distsetup.formats.runconfig import DataConfig, ModelConfig
from distsetup.formats.runconfig_load import load_run_config
from distsetup.training.data.datasets import python_datasets
from distsetup.training.loss.python_objective import PythonObjective
from distsetup.training.loss.token_objective import TokenObjective
from distsetup.training.model import build as models

USER_CODE = """
import functools

import torch
import torch.nn as nn

NOT_A_FUNCTION = 3

class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x):
        return self.linear(x)

class Net(nn.Module):
    def __init__(self, depth=2):
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(depth))

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x.mean()

def build(depth=2):
    return Net(depth)

def build_number():
    return 3

def vector_loss(model, batch):
    return model.blocks[0](batch).sum(-1)  # one per sample, not the mean

class Batch(dict):
    def __init__(self, samples):
        super().__init__(x=torch.stack(samples))

def scaled(loss):
    @functools.wraps(loss)
    def with_scale(model, batch):
        return loss(2.0, model, batch)
    return with_scale

@scaled
def decorated_loss(scale, model, batch):
    return scale * model(batch)

def build_kw(**kw):
    return Net(**kw)

def build_reading_a_weight(depth=2):
    net = Net(depth)
    assert net.blocks[0].linear.weight.abs().sum().item() > 0  # a value, which the meta device has not
    return net

def build_broken(depth=2):
    raise ValueError("depth must be even")

def build_normed():  # running statistics in a BatchNorm and an InstanceNorm told to keep them; none in the rest
    kept = [nn.BatchNorm1d(4), nn.InstanceNorm1d(4, track_running_stats=True)]
    none = [nn.BatchNorm1d(4, track_running_stats=False), nn.InstanceNorm1d(4), nn.GroupNorm(2, 4)]
    return nn.Sequential(Block(), *kept, *none)

class NoLength(torch.utils.data.Dataset):
    def __getitem__(self, index):
        return torch.zeros(4)

def no_length(split):
    return NoLength()

def tensors(split, size=8):
    return [torch.full((4,), float(i)) for i in range(size)] if split == "train" else None

def columns(split):
    return {"obs": torch.zeros(32, 4), "actions": torch.zeros(32), "rewards": torch.zeros(32)}

def by_index(split):
    return {i: torch.zeros(4) for i in range(3)} if split == "train" else None

def with_validation(split, val=3):
    return [torch.full((4,), float(i)) for i in range(64 if split == "train" else val)]
"""


RAISED_AT = textwrap.dedent(USER_CODE).splitlines().index('    raise ValueError("depth must be even")') + 1


@pytest.fixture
def user_module(tmp_path, monkeypatch) -> str:
    """The name of a module of USER_CODE importable in this test (a name of its own: no other test's cached one)."""
    name = f"user_{tmp_path.name}"
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(USER_CODE))
    monkeypatch.syspath_prepend(str(tmp_path))
    return name


@pytest.mark.parametrize(
    "builder, args, layer_classes, message",
    [
        ("no_such_module:build", {}, [], "model.builder: cannot import no_such_module (ModuleNotFoundError"),
        ("{m}:missing", {}, [], "model.builder: {m} has no missing."),
        ("{m}:NOT_A_FUNCTION", {}, [], "model.builder: {m}:NOT_A_FUNCTION is a int, not a function."),
        ("{m}:build", {"width": 3}, [], "cannot be called with (width=3): got an unexpected keyword argument 'width'"),
        ("{m}:build_number", {}, [], "model.builder {m}:build_number returned a int, not a torch.nn.Module."),
        # where in the user's code: the builder's own line, not distsetup's or torch's
        (
            "{m}:build_broken",
            {},
            [],
            f"raised ValueError: depth must be even (at {{tmp}}/{{m}}.py:{RAISED_AT}, in build_broken).",
        ),
        ("{m}:build", {}, ["Block", "ConvBlock"], "model.layer_classes: no module of class ConvBlock in Net."),
        ("{m}:build", {}, ["block"], "model.layer_classes: no module of class block in Net. HINT: did you mean Block?"),
        # FSDP2 would shard the root twice (torch's AssertionError), checkpointing would skip it without a word
        ("{m}:build", {}, ["Net"], "model.layer_classes: Net is the whole model, not one of its blocks."),
    ],
)
def test_a_model_builder_that_cannot_build_is_one_line_before_any_process_group(
    tmp_path, user_module, builder, args, layer_classes, message
):
    section = ModelConfig(type="python", builder=builder.format(m=user_module), args=args, layer_classes=layer_classes)
    with pytest.raises(DistsetupError) as raised:
        models.describe(section)
    assert message.format(m=user_module, tmp=tmp_path) in str(raised.value)
    if layer_classes:  # also found after the process group (an FSDP file's classes): said by one rank per node
        assert raised.value.alike_on_every_rank


def test_a_builder_that_cannot_build_on_the_meta_device_is_built_whole_said_in_one_note(user_module):
    described = models.describe(ModelConfig(type="python", builder=f"{user_module}:build_reading_a_weight"))
    assert not described.builds_on_meta and described.parameters == 40
    assert [note for note in described.notes if "meta device" in note] == [
        "model: model.builder cannot build on the meta device (Tensor.item() cannot be called on meta tensors): "
        "checked on the CPU, and in a run of several processes every rank builds it whole"
    ]


def test_the_blocks_default_to_the_largest_list_of_one_class_and_are_said(user_module):
    description = models.describe(ModelConfig(type="python", builder=f"{user_module}:build", args={"depth": 3}))
    assert description.layer_classes == ["Block"] and description.parameters == 3 * 20
    assert description.notes == ["model: blocks of class Block (the children of blocks, its largest list of one class)"]


def test_torch_classes_are_never_the_default_blocks():
    """Blocks are found by class name: a Sequential of Sequentials, or of Conv2d, would make every one of the model's
    Sequentials (Conv2ds) an FSDP unit."""
    layers = torch.nn.Sequential(*(torch.nn.Sequential(torch.nn.Conv2d(3, 3, 3), torch.nn.ReLU()) for _ in range(3)))
    classes, notes = models.layer_classes(layers, ModelConfig(type="python", builder="m:f"))
    assert classes == [] and "has no nn.ModuleList or nn.Sequential of one block class" in notes[0]


def test_fsdp_settings_wrapping_a_class_the_model_lacks_are_refused_before_the_process_group(user_module):
    """Bug: `distsetup fsdp` writes the built-in GPT's Block unless told the model's class, and every rank stopped
    on it after the process group (torchrun's traceback after). Now the trainer's checks before it say it once."""
    from distsetup.training.backends.fsdp import FSDPBackend
    from distsetup.training.launch_env import World

    world = World(rank=0, local_rank=0, size=2, local_size=2)
    for wrapped, refused in (("DecoderLayer", True), ("Net", True), ("Block", False)):  # Net: the whole model
        settings = f"distributed.fsdp={{fsdp_transformer_layer_cls_to_wrap: {wrapped}}}"
        overrides = ["distributed.backend=fsdp", "model.type=python", f"model.builder={user_module}:build", settings]
        cfg = load_run_config(None, overrides)
        backend = FSDPBackend(cfg, world, torch.device("cpu"))
        if not refused:
            backend.check_model(models.describe(cfg.model))
            continue
        with pytest.raises(DistsetupError) as caught:
            backend.check_model(models.describe(cfg.model))
        assert str(caught.value).startswith(
            f"distributed.fsdp: fsdp_transformer_layer_cls_to_wrap: no module of class {wrapped} in the model (its "
            "blocks: Block). HINT: name the model's blocks there (`distsetup fsdp --transformer_layer_cls_to_wrap "
            "Block` writes such a file)"
        )


@pytest.mark.parametrize("model", ["gpt", "python"])
def test_a_typo_of_a_class_the_fsdp_settings_wrap_gets_the_model_s_class_before_the_process_group(model, user_module):
    """The check before the process group said no "did you mean" (the wrap-time error did), and skipped the built-in
    GPT, whose typo then stopped every rank after it."""
    from distsetup.training.backends.fsdp import FSDPBackend
    from distsetup.training.launch_env import World

    own = [] if model == "gpt" else ["model.type=python", f"model.builder={user_module}:build"]
    settings = "distributed.fsdp={fsdp_transformer_layer_cls_to_wrap: 'block'}"
    cfg = load_run_config(None, ["distributed.backend=fsdp", *own, settings])
    backend = FSDPBackend(cfg, World(rank=0, local_rank=0, size=2, local_size=2), torch.device("cpu"))
    with pytest.raises(DistsetupError) as caught:
        backend.check_model(models.describe(cfg.model))
    assert "no module of class block in the model (its blocks: Block). HINT: did you mean Block? name the" in str(
        caught.value
    )


def test_the_validation_means_of_the_losss_terms_take_one_element_tensors_of_any_shape():
    """The first step takes a term of one number in any shape ([1] too); evaluation stacked them as they came, and a
    [1] beside 0-d stopped the run at its first evaluation."""
    from types import SimpleNamespace

    from distsetup.training.data.evaluation import evaluate
    from distsetup.training.data.loader import Placement
    from distsetup.training.launch_env import World

    def loss(model, batch):
        inputs, targets = batch
        error = (model(inputs) - targets).abs()
        return {"loss": error.mean().reshape(1), "close": (error < 0.5).float().mean().reshape(1, 1)}

    torch.manual_seed(0)
    model = torch.nn.Linear(2, 1)
    inputs = torch.randn(10, 2)
    dataset = torch.utils.data.TensorDataset(inputs, torch.zeros(10, 1))
    backend = SimpleNamespace(placement=Placement(torch.device("cpu")), micro_batch=4, evaluate=lambda f: f(model))
    data = SimpleNamespace(val=dataset, collate=torch.utils.data.default_collate, collating="default_collate")
    objective = PythonObjective(loss, "training.loss m:loss", "model.builder m:build", {})
    result = evaluate(backend, objective, data, World(rank=0, local_rank=0, size=1, local_size=1), num_workers=0)
    with torch.no_grad():
        error = model(inputs).abs()
    assert result == pytest.approx({"val_loss": error.mean().item(), "val_close": (error < 0.5).float().mean().item()})


def test_user_data_must_be_a_map_style_dataset(user_module):
    with pytest.raises(DistsetupError, match="returned NoLength for split 'train', not a map-style dataset"):
        python_datasets(DataConfig(type="python", builder=f"{user_module}:no_length"), seed=0)
    with pytest.raises(DistsetupError) as columns:  # its length was its keys': "3 samples, fewer than a batch"
        python_datasets(DataConfig(type="python", builder=f"{user_module}:columns"), seed=0)
    by_index = python_datasets(DataConfig(type="python", builder=f"{user_module}:by_index"), seed=0)
    assert len(by_index.train) == 3  # a dict of samples keyed 0..n-1 is one
    assert "returned a dict for split 'train', a mapping: no dataset of samples" in str(columns.value)
    assert "TensorDataset" in str(columns.value)
    with pytest.raises(DistsetupError, match=r"cannot be called with \('train', rows=3\)"):
        python_datasets(DataConfig(type="python", builder=f"{user_module}:tensors", args={"rows": 3}), seed=0)
    data = python_datasets(DataConfig(type="python", builder=f"{user_module}:tensors", args={"size": 5}), seed=0)
    assert len(data.train) == 5 and data.val is None
    assert torch.equal(data.collate([data.train[1], data.train[2]]), torch.tensor([[1.0] * 4, [2.0] * 4]))


def linear_model():
    return torch.nn.Linear(4, 1)


@pytest.mark.parametrize(
    "loss, batch, message",
    [
        (None, {"images": torch.zeros(2, 4)}, "model.builder m:f's model rejected the first batch, {'images': [2, 4]}"),
        (None, (torch.zeros(2, 4),), "model.builder m:f's model returned a torch.float32 tensor of shape [2, 1] as"),
        (lambda model, batch: torch.tensor(3), (torch.zeros(2, 4),), "a torch.int64 tensor of shape [] as the loss"),
        (lambda model, batch: model(batch[0]).sum() * float("nan"), (torch.zeros(2, 4),), "returned a loss of nan"),
        (
            lambda model, batch: batch[5],
            (torch.zeros(2, 4),),
            "raised IndexError: tuple index out of range (at tests/unit/test_own_model_bad_input.py:",
        ),
        (
            lambda model, batch: {"total": model(batch[0]).mean(), "ce": model(batch[0]).mean()},
            (torch.zeros(2, 4),),
            "training.loss m:loss returned a dict without 'loss' (its keys: total, ce). HINT: put the micro-batch's "
            "mean loss, the one backward takes, under 'loss'; the other entries are logged beside it.",
        ),
        (
            lambda model, batch: {"loss": model(batch[0]).mean(), "kl": model(batch[0])[:, 0]},
            (torch.zeros(2, 4),),
            "returned a torch.float32 tensor of shape [2] as its term 'kl', not a floating-point scalar tensor",
        ),
        (
            lambda model, batch: {"loss": model(batch[0]).mean(), "lr": torch.tensor(0.1)},
            (torch.zeros(2, 4),),
            "returned a term named 'lr', a name the log line has for its own figure",
        ),
        (
            lambda model, batch: {"loss": model(batch[0]).mean(), "val_loss": torch.tensor(0.1)},
            (torch.zeros(2, 4),),
            "returned a term named 'val_loss', a name the log line has for its own figure",
        ),
    ],
)
def test_a_loss_that_cannot_train_is_one_line_at_the_first_step(loss, batch, message):
    objective = PythonObjective(loss, loss and "training.loss m:loss", "model.builder m:f", {})
    with pytest.raises(DistsetupError) as raised:
        objective.micro_loss(linear_model(), batch)
    assert message in str(raised.value) and str(raised.value).count("HINT") == 1, str(raised.value)


def test_a_loss_returning_named_terms_logs_each_beside_the_loss():
    """A latent-variable model's loss, ce + kl: both terms are logged, the sum is what backward takes."""

    def ce_and_kl(model, batch):
        ce, kl = model(batch[0]).pow(2).mean(), model(batch[0]).abs().mean()
        return {"loss": ce + kl, "ce": ce, "kl": kl}

    objective = PythonObjective(ce_and_kl, "training.loss m:ce_and_kl", "model.builder m:f", {})
    model, batch = linear_model(), (torch.randn(2, 4),)
    micro = objective.micro_loss(model, batch)
    assert set(micro.parts) == {"ce", "kl"} and not micro.parts["ce"].requires_grad
    assert micro.loss.item() == pytest.approx(micro.parts["ce"].item() + micro.parts["kl"].item())
    micro.loss.backward()
    assert model.weight.grad is not None
    from transformers.modeling_outputs import MoeCausalLMOutputWithPast  # what model(**batch) returns, passed on

    passed_on = PythonObjective(
        lambda model, batch: MoeCausalLMOutputWithPast(loss=model(batch[0]).mean(), logits=model(batch[0])),
        "training.loss m:passed_on",
        "model.builder m:f",
        {},
    )
    assert passed_on.micro_loss(model, batch).parts == {}  # its logits are no term to log
    with_aux = PythonObjective(
        lambda model, batch: MoeCausalLMOutputWithPast(loss=model(batch[0]).mean(), aux_loss=torch.tensor(0.5)),
        "training.loss m:with_aux",
        "model.builder m:f",
        {},
    )
    assert set(with_aux.micro_loss(model, batch).parts) == {"aux_loss"}
    from collections import OrderedDict

    ordered = PythonObjective(lambda model, batch: OrderedDict(ce_and_kl(model, batch)), "m", "model.builder m:f", {})
    assert set(ordered.micro_loss(model, batch).parts) == {"ce", "kl"}  # a dict of its own, as a dict


def test_evaluation_checks_its_own_first_batch_and_takes_a_number_as_a_term():
    """Evaluation may take paths training does not (a latent model's KL computed in training only, a forward's branch
    for sampling): its first batch is checked as the first step's is, in one line, not a traceback hours in. A term
    returned as a Python number (a KL of 0.0 in evaluation) is logged as one."""

    def kl_in_training(model, batch):
        ce = model(batch[0]).pow(2).mean()
        kl = model(batch[0]).abs().mean() if model.training else 0.0
        return {"loss": ce + kl, "ce": ce, "kl": kl, "positive": (model(batch[0]) > 0).sum()}  # a count: int64

    objective = PythonObjective(kl_in_training, "training.loss m:kl_in_training", "model.builder m:f", {})
    model, batch = linear_model(), (torch.randn(2, 4),)
    assert objective.micro_loss(model, batch).parts["positive"].dtype == torch.float32
    model.eval()
    sums, samples = objective.eval_sums(model, batch, 2)
    assert sums["kl"].item() == 0.0 and sums["ce"].item() == pytest.approx(sums["loss"].item()) and samples == 2

    class AuxInTraining(torch.nn.Module):  # a token model whose auxiliary loss is 0.0 where it does not train
        def __init__(self):
            super().__init__()
            self.embedding = torch.nn.Embedding(8, 8)

        def forward(self, ids):
            logits = self.embedding(ids)
            return {"logits": logits, "aux_loss": logits.pow(2).mean() if self.training else 0.0}

    tokens = AuxInTraining()
    ids = torch.randint(0, 8, (2, 3))
    by_tokens = TokenObjective(tokens, "python", 8, masked=False, source="model.builder m:f")
    by_tokens.micro_loss(tokens, (ids, ids))
    tokens.eval()
    assert by_tokens.eval_sums(tokens, (ids, ids), 2)[1] == 6  # evaluation adds no auxiliary loss: not checked

    def samples_in_bf16_when_evaluating(model, batch):
        inputs = batch[0] if model.training else batch[0].bfloat16()  # a branch without .to(x.dtype)
        return model(inputs).mean()

    sampling = PythonObjective(samples_in_bf16_when_evaluating, "training.loss m:s", "model.builder m:f", {})
    sampling.weights_cast = "FSDP2's mixed-precision policy casts the weights to bf16"
    model.train()
    sampling.micro_loss(model, batch)
    model.eval()
    with pytest.raises(DistsetupError) as raised:
        sampling.eval_sums(model, batch, 2)
    said = str(raised.value)
    assert "training.loss m:s raised RuntimeError" in said and "on the first validation batch" in said, said
    assert said.count("HINT") == 1 and "\n" not in said


class RotaryLike(torch.nn.Module):
    """A forward that computes in fp32 from a buffer (a rotary inv_freq's habit): under autocast its product is cast,
    but not beside weights that FSDP2's mixed-precision policy (or DeepSpeed's engine) made bf16 without autocast."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)
        self.register_buffer("inv_freq", torch.ones(4), persistent=False)

    def forward(self, x):
        return self.linear(x * self.inv_freq).mean()


class ScaledThenNormed(torch.nn.Module):
    """An fp32 buffer scaling the embedding's output (as a scale a model registers), then a LayerNorm: on the CPU its
    error names no 16-bit dtype ("mixed dtype (CPU): expect parameter to have scalar type of Float")."""

    def __init__(self):
        super().__init__()
        self.norm = torch.nn.LayerNorm(4)
        self.register_buffer("scale", torch.full((1,), 0.5))

    def forward(self, x):
        return self.norm(x * self.scale).mean()


@pytest.mark.parametrize("loss", [None, lambda model, batch: model(batch[0])], ids=["the model's own", "training.loss"])
def test_a_forward_mixing_dtypes_beside_16_bit_weights_is_told_to_cast(loss):
    batch = (torch.zeros(2, 4, dtype=torch.bfloat16),)  # FSDP2 casts the root's inputs too
    cast = "FSDP2's mixed-precision policy casts the weights to bf16"
    for weights_cast, told in ((cast, f"{cast} in the forward, with no torch.autocast: cast what it"), (None, "HINT")):
        objective = PythonObjective(loss, loss and "training.loss m:loss", "model.builder m:f", {})
        objective.weights_cast = weights_cast
        for model in (RotaryLike(), ScaledThenNormed()):
            for layer in model.children():
                layer.bfloat16()  # its weights, as FSDP2 gathers them; its buffer stays fp32
            with pytest.raises(DistsetupError) as raised:
                objective.micro_loss(model, batch)
            said = str(raised.value)
            assert told in said and (".to(x.dtype)" in said) == (weights_cast is not None), (type(model), said)


def test_a_device_out_of_memory_at_the_first_step_is_not_called_a_bad_batch():
    def out_of_memory(model, batch):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")

    objective = PythonObjective(out_of_memory, "training.loss m:loss", "model.builder m:f", {})
    with pytest.raises(torch.OutOfMemoryError):
        objective.micro_loss(linear_model(), (torch.zeros(2, 4),))


def test_token_data_needs_logits_from_the_model():
    objective = TokenObjective(linear_model(), "python", 4, masked=False, source="model.builder m:f")
    ids = torch.zeros(2, 3, dtype=torch.long)
    with pytest.raises(DistsetupError, match=r"returned \[2, 3\] for input ids of shape \[2, 3\]; with token data"):
        objective.micro_loss(lambda x: torch.zeros(2, 3), (ids, ids))
    with pytest.raises(DistsetupError, match="logits over 2 ids, fewer than model.vocab_size 4"):
        objective.micro_loss(lambda x: {"logits": torch.zeros(2, 3, 2, requires_grad=True)}, (ids, ids))
    logits = torch.zeros(2, 3, 4, requires_grad=True)

    def needs_a_mask(input_ids, attention_mask):
        return logits

    with pytest.raises(DistsetupError, match=r"rejected the first batch of token data, input ids of shape \[2, 3\], "):
        objective.micro_loss(needs_a_mask, (ids, ids))
    with pytest.raises(DistsetupError, match=r"returned a tensor of shape \[2\] as its aux_loss, not a floating-point"):
        objective.micro_loss(lambda x: {"logits": logits, "aux_loss": torch.ones(2)}, (ids, ids))  # one per sample
    assert objective.micro_loss(lambda x: {"logits": logits, "aux_loss": torch.tensor(0.5)}, (ids, ids)).loss > 0


def test_the_trainer_stops_before_training_with_the_line(tmp_path, user_module):
    config = tmp_path / "config.yaml"
    config.write_text(
        f"model: {{type: python, builder: '{user_module}:build_number'}}\n"
        f"data: {{type: python, builder: '{user_module}:tensors'}}\n"
        f"training: {{output_dir: {tmp_path / 'out'}}}\n"
        "distributed: {backend: single}\n"
    )
    load_run_config(config)  # a valid run config: the builder's module is next to it
    result = train(config, 1)
    lines = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert lines == [
        f"error: model.builder {user_module}:build_number returned a int, not a torch.nn.Module. HINT: return the "
        "model (an nn.Module) from it."
    ]
    assert not (tmp_path / "out" / "metrics.jsonl").exists()


def test_a_first_step_error_beside_loader_workers_leaves_no_semaphores_behind(tmp_path, user_module):
    """After the one line, Python's resource tracker warned of 14 leaked semaphores: the loader's closed workers'
    queues, kept alive to the interpreter's exit."""
    config = tmp_path / "config.yaml"
    config.write_text(
        f"model: {{type: python, builder: '{user_module}:build'}}\n"
        f"data: {{type: python, builder: '{user_module}:tensors', num_workers: 2}}\n"
        f"training: {{output_dir: {tmp_path / 'out'}, loss: '{user_module}:vector_loss', micro_batch_size: 2}}\n"
        "distributed: {backend: single}\n"
    )
    result = train(config, 1)
    assert_clean_error(result, "training.loss", "not a floating-point scalar tensor")
    assert "leaked" not in result.stderr, result.stderr


def test_check_finds_a_builder_that_is_not_there_or_takes_other_arguments(tmp_path, user_module, capsys):
    """`--check`, which the launch scripts run before torchrun, imports the user's code, matches the builders'
    arguments and builds a python model on the meta device: a launch stops in one line instead of torchrun's
    traceback of every failed rank."""
    from distsetup.train import main

    config = tmp_path / "run.yaml"
    (tmp_path / "needs_its_launcher.py").write_text(
        'import os\nRANK = int(os.environ["LOCAL_RANK"])\ndef build():\n    pass\n'
    )
    for builder, args, said in (
        (f"{user_module}:build_modl", {}, f"model.builder: {user_module} has no build_modl."),
        (f"{user_module}:build", {"width": 3}, f"model.args: {user_module}:build takes no argument 'width'"),
        (f"{user_module}:build", {"depth": 4}, None),
        ("needs_its_launcher:build", {}, None),  # its import needs what the launcher sets: left to the ranks
        # what only building it (on the meta device) tells: an argument refused under **kwargs, a class typo
        (f"{user_module}:build_kw", {"width": 3}, "raised TypeError: Net.__init__() got an unexpected keyword"),
        (
            f"{user_module}:build",
            {"layer_classes": ["Blok"]},
            "no module of class Blok in Net. HINT: did you mean Block",
        ),
        (f"{user_module}:build", {"zero3_leaf_classes": ["Blok"]}, "model.zero3_leaf_classes: no module of class Blok"),
        # an FSDP file's class typo (the ranks refused it after torchrun started them)
        (f"{user_module}:build", {"fsdp": "Blok"}, "fsdp_transformer_layer_cls_to_wrap: no module of class Blok"),
        (f"{user_module}:build_reading_a_weight", {}, None),  # cannot build on the meta device: left to the ranks
    ):
        model = {"type": "python", "builder": builder, "args": args}
        for key in ("layer_classes", "zero3_leaf_classes"):
            if key in args:
                model[key] = model.pop("args")[key]
        wrapped = model.get("args", {}).pop("fsdp", None)
        fsdp = {"backend": "fsdp", "fsdp": {"fsdp_transformer_layer_cls_to_wrap": wrapped}} if wrapped else {}
        config.write_text(yaml.safe_dump({"model": model, "distributed": fsdp} if fsdp else {"model": model}))
        before = signal.getsignal(signal.SIGTERM)
        try:
            status = main(["--config", str(config), "--check"])
        finally:
            signal.signal(signal.SIGTERM, before)  # main() takes SIGTERM over, as a rank
        err = capsys.readouterr().err
        assert (status, err.count("\n")) == ((1, 1) if said else (0, 0)), err
        assert said is None or (err.startswith("error: ") and said in err), err


@pytest.mark.parametrize(
    "where, name, said",
    [
        (
            "training.loss",
            "Net",
            "training.loss: {m}:Net is a class, which training.loss(model, batch) would construct",
        ),
        (
            "training.loss",
            "build",
            "training.loss: {m}:build cannot be called as training.loss(model, batch): too many",
        ),
        ("data.collate", "Block", "data.collate: {m}:Block cannot be called as data.collate(samples): too many"),
        ("data.collate", "build", None),  # one parameter: the samples
        ("data.collate", "Batch", None),  # a class of one parameter: the batch is one of its instances
        ("training.loss", "decorated_loss", None),  # called as its decorator's wrapper is, not as the function
        ("model.builder", "Net", None),  # a class makes the model
    ],
)
def test_a_loss_or_collate_that_cannot_be_called_on_the_batches_is_refused_when_loaded(user_module, where, name, said):
    """A class named as training.loss passed --check, and the run failed at its first step."""
    from distsetup.training import user_code

    if said is None:
        assert callable(user_code.load(f"{user_module}:{name}", where))
        return
    with pytest.raises(DistsetupError, match=re.escape(said.format(m=user_module))):
        user_code.load(f"{user_module}:{name}", where)


def test_a_module_in_the_working_folder_is_found_by_validate_and_by_the_trainer_under_both_names(
    tmp_path, run_cli, monkeypatch
):
    """The project's own module beside config/: `python -m distsetup.train` (what the scripts run, in the folder
    they were written in) imports it from the working folder, so validate, doctor and launcher take it too, and
    `python src/train.py` (the guides' name) finds it as well."""
    import subprocess
    import sys

    from repo import REPO
    from train_runs import environment

    name = f"project_{tmp_path.name}"
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(USER_CODE))
    (tmp_path / "config").mkdir()
    (tmp_path / "config" / "config.yaml").write_text(
        yaml.safe_dump({"model": {"type": "python", "builder": f"{name}:build"}})
    )
    elsewhere = tmp_path / "config"  # from a folder without the module: not found, said in one line
    for folder, found in ((tmp_path, True), (elsewhere, False)):
        monkeypatch.chdir(folder)
        validated = run_cli("validate", tmp_path / "config" / "config.yaml")
        assert (validated.exit_code == 0) == found, validated.output
    checked = subprocess.run(  # python -m has the working folder on its path already
        [sys.executable, str(REPO / "src" / "train.py"), "--config", "config/config.yaml", "--check"],
        cwd=tmp_path,
        env=environment(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert checked.returncode == 0, checked.stderr


def test_a_validation_set_shorter_than_an_evaluation_batch_is_evaluated_as_it_is(user_module):
    """It was refused below micro-batch x world size, which evaluation never needed (a rank's share shorter than a
    micro-batch is evaluated as it is, a rank out of samples repeats one uncounted): a sample a rank is enough."""
    from distsetup.training.data.datasets import build_datasets

    def config(val: int):
        data = ["data.type=python", f"data.builder={user_module}:with_validation", f"data.args={{val: {val}}}"]
        return load_run_config(None, [*data, "training.micro_batch_size=16"])

    assert len(build_datasets(config(3), ranks=2).val) == 3
    with pytest.raises(DistsetupError) as refused:
        build_datasets(config(1), ranks=2)
    assert str(refused.value) == (
        'the validation set (data.builder("val")) has 1 sample, fewer than the 2 processes that evaluate it (a '
        "share of one at least each). HINT: add validation samples, or train on fewer processes."
    )


STATIC_CASES = """
import functools

def build_model(channels=64, depth=8):
    pass

def build_any(**args):
    pass

@functools.lru_cache
def build_decorated(depth=2):
    pass

try:
    from os import path as build_imported
except ImportError:
    def build_imported():
        pass
"""


@pytest.mark.parametrize(
    "builder, args, said",
    [
        ("build_modle", {}, "model.builder: scorer has no build_modle. Fix: did you mean scorer:build_model?"),
        ("build_model", {"chanels": 16}, "model.args: scorer:build_model takes no argument 'chanels' (its parameters: "
         "channels, depth). Fix: did you mean 'channels'? make model.args match its parameters."),
        ("build_model", {"channels": 16}, None),
        ("build_any", {"chanels": 16}, None),  # **args: it takes any
        ("build_decorated", {"chanels": 16}, None),  # a decorator may change what it takes: the import says
        ("build_imported", {}, None),  # names made by imports and inside try blocks are the module's too
    ],
)  # fmt: skip
def test_validate_reads_the_functions_and_parameters_the_run_config_names_from_their_source(
    run_cli, tmp_path, builder, args, said
):
    """Bug: validate said "no problems" of a builder's typo and of its arguments', which --check (importing the user's
    code, and torch) and the run then refused: the module's source says both, without running it."""
    (tmp_path / "scorer.py").write_text(STATIC_CASES)
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump({"model": {"type": "python", "builder": f"scorer:{builder}", "args": args}}))
    result = run_cli("validate", config)
    assert result.exit_code == (1 if said else 0), result.output
    assert said is None or f"{config}: {said}" in result.output.splitlines(), result.output


@pytest.mark.parametrize(
    "source",
    [
        "def __getattr__(name):\n    return lambda **args: None\n",  # a module __getattr__
        "import lazy_loader\n__getattr__, __dir__, __all__ = lazy_loader.attach(__name__)\n",  # the lazy idiom
        "def setup():\n    global anything\n    def anything(x):\n        pass\n\nsetup()\n",  # bound by `global`
        "import sys\nsys.modules[__name__] = object()\n",
        "import os\nif os.environ.get('V2'):\n    def anything(x, y):\n        pass\n"
        "else:\n    def anything(x):\n        pass\n",  # bound twice: which one runs is the run's to know
    ],
    ids=["getattr", "lazy", "global", "sys.modules", "conditional"],
)
def test_validate_leaves_what_only_running_the_module_can_tell_to_the_import(run_cli, tmp_path, source):
    """The review's cases: each a module the run would import and call as the run config says."""
    (tmp_path / "scorer.py").write_text(source)
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump({"model": {"type": "python", "builder": "scorer:anything", "args": {"y": 1}}}))
    result = run_cli("validate", config)
    assert result.exit_code == 0, result.output


def test_batchnorm_in_16_bits_under_fsdp2_is_refused_with_selective_recompute_before_the_process_group(user_module):
    """FSDP2 keeps each layer with running statistics in fp32 as a unit of its own in bf16 and fp16 runs, and
    selective checkpointing cannot recompute a unit's gathers inside a block: a traceback on every rank at the first
    backward, before."""
    from distsetup.training.backends.fsdp import FSDPBackend
    from distsetup.training.launch_env import World

    world = World(rank=0, local_rank=0, size=2, local_size=2)
    normed = models.describe(ModelConfig(type="python", builder=f"{user_module}:build_normed"))
    assert normed.running_statistics_classes == {"BatchNorm1d", "InstanceNorm1d"}
    for precision, recompute, refused in (
        ("bf16", "selective", True),
        ("bf16", "full", False),
        ("fp32", "selective", False),
    ):
        cfg = load_run_config(
            None,
            [
                "distributed.backend=fsdp",
                f"training.precision={precision}",
                f"training.activation_checkpointing={recompute}",
            ],
        )
        backend = FSDPBackend(cfg, world, torch.device("cpu"))
        if not refused:
            backend.check_model(normed)
            continue
        with pytest.raises(
            DistsetupError, match="training.activation_checkpointing selective with BatchNorm1d, InstanceNorm1d in bf16"
        ):
            backend.check_model(normed)


def test_a_term_with_a_gradient_beside_the_logits_is_said_once_as_left_out_of_token_data_s_loss():
    objective = TokenObjective(linear_model(), "python", 4, masked=False, source="model.builder m:f")
    said: list[str] = []
    objective.say = said.append
    ids = torch.zeros(2, 3, dtype=torch.long)
    logits, kl = torch.zeros(2, 3, 4, requires_grad=True), torch.tensor(2.0, requires_grad=True)

    def free_transformer(x):
        return {"logits": logits, "kl": kl * 1.0, "bits_used": torch.tensor(3.0), "aux_loss": kl * 0.5}

    loss = objective.micro_loss(free_transformer, (ids, ids)).loss
    assert loss.item() == pytest.approx(torch.log(torch.tensor(4.0)).item() + 1.0)  # the cross-entropy + aux_loss
    assert said == [
        "note: model.builder m:f's model returned kl beside its logits: the next-token loss leaves it out (it adds "
        "aux_loss only); return it in aux_loss, weighted inside the model, or compute the loss in training.loss"
    ]  # not the number without a gradient (a statistic), nor aux_loss
    objective.micro_loss(free_transformer, (ids, ids))
    assert len(said) == 1  # the first step's check only
