"""The cross-entropy computed a slice of the vocabulary at a time gives the plain one's loss and gradients (fp32
rounding), for the built-in GPT and Hugging Face models, in training and in evaluation; a model that changes its
logits after the head keeps the plain loss. (Under DDP, FSDP2 and ZeRO: the parity runs of test_train_parity.py
compute it sliced, their single-process reference plain.)"""

import types

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from distsetup.planning import loss_slices
from distsetup.planning.loss_slices import slice_width
from distsetup.training.data.datasets import IGNORE
from distsetup.training.loss.output_heads import loss_head
from distsetup.training.loss.sliced import LossHead, _subtract_targets, sliced_cross_entropy
from distsetup.training.loss.token_objective import TokenObjective
from distsetup.training.model.gpt import GPT

VOCAB = 9000  # three slices of at least MIN_SLICE ids, the last one narrower


def test_a_large_vocabulary_is_sliced_by_default_and_a_small_one_is_not():
    assert loss_slices.chunked("auto", 32000) and not loss_slices.chunked("auto", 31999)
    assert loss_slices.chunked("always", 256) and not loss_slices.chunked("never", 131072)
    assert slice_width(131072) * 16 == 131072 and slice_width(VOCAB) == loss_slices.MIN_SLICE


def plain_and_sliced(hidden, head, targets):
    """(loss, gradients) of the plain summed cross-entropy and of the sliced one."""
    inputs = [hidden, *head.parameters()]
    plain = F.cross_entropy(head(hidden).float(), targets, ignore_index=IGNORE, reduction="sum")
    sliced = sliced_cross_entropy(hidden, head, targets)
    return (plain, torch.autograd.grad(plain, inputs)), (sliced, torch.autograd.grad(sliced, inputs))


@pytest.mark.parametrize("bias", [False, True])
def test_sliced_cross_entropy_is_the_plain_one_in_fp32(bias):
    torch.manual_seed(0)
    hidden = torch.randn(96, 32, requires_grad=True)
    head = nn.Linear(32, VOCAB, bias=bias)
    targets = torch.randint(0, VOCAB, (96,))
    targets[::5] = IGNORE  # not counted: no loss, no gradient
    targets[1] = VOCAB - 1  # the last id of the last, narrower slice
    (plain, plain_grads), (sliced, sliced_grads) = plain_and_sliced(hidden, head, targets)
    torch.testing.assert_close(sliced, plain, rtol=1e-6, atol=0)
    for a, b in zip(sliced_grads, plain_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def slice_edges() -> torch.Tensor:
    """Targets at the first and the last id of each slice of VOCAB ids, each followed by an IGNORE."""
    width = slice_width(VOCAB)
    edges = [id for start in range(0, VOCAB, width) for id in (start, min(start + width, VOCAB) - 1)]
    return torch.tensor([id for edge in edges for id in (edge, IGNORE)])


@pytest.mark.parametrize("bias", [False, True])
def test_sliced_cross_entropy_at_the_slices_edges_is_the_plain_one(bias):
    torch.manual_seed(0)
    targets = slice_edges()
    hidden = torch.randn(len(targets), 32, requires_grad=True)
    head = nn.Linear(32, VOCAB, bias=bias)
    (plain, plain_grads), (sliced, sliced_grads) = plain_and_sliced(hidden, head, targets)
    torch.testing.assert_close(sliced, plain, rtol=1e-6, atol=0)
    for a, b in zip(sliced_grads, plain_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    assert (sliced_grads[0][targets == IGNORE] == 0).all()


def test_the_target_is_subtracted_as_by_indexing_its_rows_bit_for_bit():
    """The backward's one-hot subtraction (a masked scatter_add_, which needs no rows' indices) gives what the
    indexing of the rows whose target falls in the slice (.nonzero(), a read back from the device) gave."""
    torch.manual_seed(0)
    targets = slice_edges()
    safe = torch.where(targets != IGNORE, targets, 0)  # as the loss makes them: an ignored target is id 0
    width = slice_width(VOCAB)
    for start in range(0, VOCAB, width):
        softmax = torch.rand(len(safe), min(width, VOCAB - start))
        softmax[:, :2] = 0.0  # x - 1.0 and x + -0.0 at exact zeros too
        rows = ((safe >= start) & (safe < start + softmax.shape[1])).nonzero().squeeze(1)
        indexed = softmax.clone()
        indexed[rows, safe[rows] - start] -= 1.0
        scattered = softmax.clone()
        _subtract_targets(scattered, safe, start)
        assert len(rows) > 0 and torch.equal(scattered, indexed)
        assert torch.equal(scattered.signbit(), indexed.signbit())


def test_sliced_cross_entropy_in_bf16_keeps_the_dtypes_and_the_values():
    torch.manual_seed(0)
    hidden = torch.randn(64, 32, dtype=torch.bfloat16, requires_grad=True)
    head = nn.Linear(32, VOCAB, bias=False).to(torch.bfloat16)
    targets = torch.randint(0, VOCAB, (64,))
    (plain, plain_grads), (sliced, sliced_grads) = plain_and_sliced(hidden, head, targets)
    assert sliced.dtype == torch.float32 and [g.dtype for g in sliced_grads] == [torch.bfloat16] * 2
    torch.testing.assert_close(sliced, plain, rtol=1e-4, atol=0)
    for a, b in zip(sliced_grads, plain_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=1e-3)


def objectives(model, m, masked: bool) -> tuple[TokenObjective, TokenObjective, str]:
    """The plain objective of `model`, the sliced one (its head turned into a LossHead), and loss_head's note."""
    plain = TokenObjective(model, m.type, VOCAB, masked, "test")
    head, note = loss_head(model, m, "always")
    assert isinstance(head, LossHead), note
    return plain, TokenObjective(model, m.type, VOCAB, masked, "test", head), note


def assert_same_training_and_evaluation(model, plain: TokenObjective, sliced: TokenObjective, batch):
    results = []
    for objective in (plain, sliced):
        model.zero_grad()
        micro = objective.micro_loss(model, batch, weight=0.75)
        micro.loss.backward()
        grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
        with torch.no_grad():
            terms, counted = objective.eval_sums(model, batch, samples=batch[0].shape[0])
            summed = terms["loss"]
        results.append((micro, grads, summed, counted))
    (micro_a, grads_a, sum_a, n_a), (micro_b, grads_b, sum_b, n_b) = results
    torch.testing.assert_close(micro_b.loss, micro_a.loss, rtol=1e-6, atol=0)
    assert micro_b.parts.keys() == micro_a.parts.keys()
    for name in micro_a.parts:
        torch.testing.assert_close(micro_b.parts[name], micro_a.parts[name], rtol=1e-6, atol=0)
    assert grads_a.keys() == grads_b.keys() and len(grads_a) == len(list(model.parameters()))
    for name in grads_a:
        torch.testing.assert_close(grads_b[name], grads_a[name], rtol=1e-4, atol=1e-7, msg=name)
    torch.testing.assert_close(sum_b, sum_a, rtol=1e-6, atol=0)
    assert n_a == n_b


def token_batch(masked: bool):
    torch.manual_seed(1)
    x, y = torch.randint(0, VOCAB, (2, 16)), torch.randint(0, VOCAB, (2, 16))
    if masked:
        y[:, :5] = IGNORE  # an instruction's prompt: no loss there
    return x, y


@pytest.mark.parametrize("masked", [False, True])
def test_the_built_in_gpt_trains_and_evaluates_alike_from_its_head(masked):
    torch.manual_seed(0)
    model = GPT(VOCAB, 16, 2, 2, 32, 0.0)
    m = types.SimpleNamespace(type="gpt")
    plain, sliced, note = objectives(model, m, masked)
    assert note == f"loss: cross-entropy over the {VOCAB} ids in 3 slices, never their whole logits"
    assert_same_training_and_evaluation(model, plain, sliced, token_batch(masked))
    assert [name for name, _ in model.named_parameters()] == list(GPT(VOCAB, 16, 2, 2, 32, 0.0).state_dict())


def hf_model(tmp_path, config):
    from transformers import AutoModelForCausalLM

    config.save_pretrained(tmp_path)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return model, types.SimpleNamespace(type="hf", hf_path=str(tmp_path), vocab_size=VOCAB)


SMALL = {"vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2}
HEADS = {"num_attention_heads": 2, "num_key_value_heads": 2, "max_position_embeddings": 64}


@pytest.mark.parametrize("kind", ["llama", "mixtral"])
def test_hugging_face_models_train_and_evaluate_alike_router_loss_included(tmp_path, kind):
    transformers = pytest.importorskip("transformers")
    config = (
        transformers.LlamaConfig(**SMALL, **HEADS)
        if kind == "llama"
        else transformers.MixtralConfig(**SMALL, **HEADS, num_local_experts=4, num_experts_per_tok=2)
    )
    model, m = hf_model(tmp_path, config)
    plain, sliced, _ = objectives(model, m, masked=False)
    assert_same_training_and_evaluation(model, plain, sliced, token_batch(False))
    if kind == "mixtral":
        assert set(sliced.micro_loss(model, token_batch(False)).parts) == {"ce_loss", "aux_loss"}


def test_a_model_that_soft_caps_its_logits_keeps_the_plain_loss(tmp_path):
    transformers = pytest.importorskip("transformers")
    config = transformers.Gemma2Config(**SMALL, **HEADS, head_dim=16, final_logit_softcapping=30.0)
    model, m = hf_model(tmp_path, config)
    head, note = loss_head(model, m, "always")
    assert head is None and type(model.get_output_embeddings()) is nn.Linear
    assert (
        note
        == f"loss: from the whole logits over {VOCAB} ids (Gemma2ForCausalLM changes its logits after the output head)"
    )


def test_under_autocast_the_slices_compute_as_the_plain_head_does():
    """bf16 autocast (the single and DDP backends' bf16): forward and backward's matrix products in bf16 alike; the
    loss as the plain one's, the gradients within bf16 rounding."""
    torch.manual_seed(0)
    model = GPT(VOCAB, 16, 2, 2, 32, 0.0)
    plain, sliced, _ = objectives(model, types.SimpleNamespace(type="gpt"), masked=False)
    results = []
    for objective in (plain, sliced):
        model.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = objective.micro_loss(model, token_batch(False)).loss
        loss.backward()
        results.append((loss, [p.grad.clone() for p in model.parameters()]))
    (plain_loss, plain_grads), (sliced_loss, sliced_grads) = results
    torch.testing.assert_close(sliced_loss, plain_loss, rtol=1e-5, atol=0)
    for a, b in zip(sliced_grads, plain_grads, strict=True):
        assert (a - b).norm() <= 0.02 * b.norm()
