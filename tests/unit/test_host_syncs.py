"""Nothing in a training step's loss reads a value back from the device: on a GPU, such a read (`.item()`,
`.tolist()`, `bool(tensor)`, `.nonzero()`, indexing by a boolean mask) makes the host wait for every kernel queued
before it, so it cannot queue the next ones meanwhile. On CPU the reads are recorded as torch sees them (its
function and dispatch modes) and, on the meta device, where tensors hold no values, any read fails outright."""

import contextlib
import types

import pytest
import torch
import torch.nn as nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from distsetup.planning.loss_slices import slice_width
from distsetup.training.data.datasets import IGNORE
from distsetup.training.loss.output_heads import loss_head
from distsetup.training.loss.sliced import _SlicedCrossEntropy, sliced_cross_entropy
from distsetup.training.loss.token_objective import TokenObjective
from distsetup.training.model.gpt import GPT

VOCAB = 9000  # three slices (test_chunked_loss.py)

TENSOR_READS = {"item", "tolist", "numpy", "__bool__", "__float__", "__int__", "__index__"}  # Python methods
OPERATOR_READS = {"_local_scalar_dense", "nonzero", "masked_select"}  # aten: item's, and those sized by the values
INDEXING = {"index", "index_put", "index_put_", "_index_put_impl_"}  # a read where an index is a boolean mask


class _TensorMethods(TorchFunctionMode):
    """Records the Python-level reads (.tolist() copies the data out without an aten operator). Not seen: those
    inside autograd's backward, which runs with the mode set aside: the operators below and the meta device are."""

    def __init__(self, reads: list[str]):
        super().__init__()
        self.reads = reads

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in TENSOR_READS:
            self.reads.append(f"Tensor.{func.__name__}")
        return func(*args, **(kwargs or {}))


class _Operators(TorchDispatchMode):
    """Records the aten operators that read values, forward and backward alike."""

    def __init__(self, reads: list[str]):
        super().__init__()
        self.reads = reads

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        masks = name in INDEXING and any(
            isinstance(index, torch.Tensor) and index.dtype in (torch.bool, torch.uint8) for index in args[1]
        )
        if name in OPERATOR_READS or masks:
            self.reads.append(f"aten::{name}" + (" (a boolean mask)" if masks else ""))
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def host_reads():
    """Within: the list of the reads of tensor values that ran, by name."""
    reads: list[str] = []
    with _TensorMethods(reads), _Operators(reads):
        yield reads


@pytest.mark.parametrize(
    "read",
    [
        lambda t: t.sum().item(),
        lambda t: t.tolist(),
        lambda t: bool(t[0] == 1.0),
        lambda t: (t > 0).nonzero(),
        lambda t: t[t > 0],
        lambda t: t.masked_select(t > 0),
        lambda t: t.index_put_((t > 0,), torch.tensor(0.0)),
    ],
    ids=["item", "tolist", "bool", "nonzero", "mask-index", "masked_select", "mask-index_put"],
)
def test_each_kind_of_read_is_recorded(read):
    with host_reads() as reads:
        read(torch.arange(-2.0, 3.0))
    assert reads


def test_a_read_inside_backward_is_recorded():
    """The sliced loss's old backward read the rows of each slice's targets with .nonzero() (now a mask)."""

    class Rows(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, grad):
            grad = grad.clone()
            rows = (grad > 0).nonzero().squeeze(1)
            grad[rows] -= 1.0
            return grad

    x = torch.ones(4, requires_grad=True)
    with host_reads() as reads:
        Rows.apply(x).sum().backward()
    assert reads == ["aten::nonzero"]


def slice_edges() -> torch.Tensor:
    """Targets at the first and the last id of each slice of VOCAB ids, IGNORE between them."""
    width = slice_width(VOCAB)
    edges = [id for start in range(0, VOCAB, width) for id in (start, min(start + width, VOCAB) - 1)]
    return torch.tensor([id for edge in edges for id in (edge, IGNORE)])


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_the_sliced_loss_reads_nothing_back(device):
    """On meta, its autograd function itself (sliced_cross_entropy asks whether autocast is on, which torch answers
    for real devices only)."""
    torch.manual_seed(0)
    targets = slice_edges().to(device)
    hidden = torch.randn(len(targets), 32, device=device, requires_grad=True)
    head = nn.Linear(32, VOCAB, device=device)
    inputs = (hidden, head.weight, head.bias, targets, slice_width(VOCAB), torch.float32)
    with host_reads() as reads:
        if device == "meta":
            _SlicedCrossEntropy.apply(*inputs).backward()
        else:
            sliced_cross_entropy(hidden, head, targets).backward()
    assert reads == []
    assert hidden.grad is not None and head.weight.grad is not None and head.bias.grad is not None


@pytest.mark.parametrize(("device", "sliced"), [("cpu", True), ("cpu", False), ("meta", False)])
def test_a_step_of_masked_data_reads_nothing_back(device, sliced):
    """The trainer's step on instruction data, as trainer.py does it: the weights of the step's micro-batches, then
    each one's forward and backward (its loss x its weight). The sliced loss on meta: the test above."""
    torch.manual_seed(0)
    model = GPT(VOCAB, 16, 2, 2, 32, 0.0)
    head = loss_head(model, types.SimpleNamespace(type="gpt"), "always")[0] if sliced else None
    objective = TokenObjective(model.to(device), "gpt", VOCAB, True, "test", head)
    batches = []
    for counted in (3, 11):  # micro-batches of as many targets, different numbers of them counted
        x, y = torch.randint(0, VOCAB, (2, 16)), torch.randint(0, VOCAB, (2, 16))
        y[:, : 16 - counted] = IGNORE
        batches.append((x.to(device), y.to(device)))
    objective.micro_loss(model, batches[0])  # the first call's checks, done once per run
    with host_reads() as reads:
        weights = objective.step_weights(batches, 1, torch.device(device))
        for batch, weight in zip(batches, weights, strict=True):
            objective.micro_loss(model, batch, weight=weight).loss.backward()
    assert reads == []
    assert all(isinstance(w, torch.Tensor) and w.device.type == device and w.dim() == 0 for w in weights)
    if device == "cpu":  # the step's loss is the mean over its counted targets: micro-batches of 3 and 11
        torch.testing.assert_close(torch.stack(list(weights)).float(), torch.tensor([6 / 14, 22 / 14]))
