"""When the trainer computes the token cross-entropy a slice of the vocabulary at a time (training/loss/sliced.py),
and how wide a slice is: pure arithmetic, shared by the trainer and the memory planner."""

LARGE_VOCABULARY = 32000  # auto: from here on the logits outgrow a layer's activations many times over
SLICES = 16  # of the vocabulary: a slice's logits are 1/16 of the whole
MIN_SLICE = 4096  # ids: narrower matrix products cost more than the memory they save


def chunked(mode: str, vocab: int) -> bool:
    """Whether training.chunked_loss `mode` (auto, always or never) slices a vocabulary of `vocab` ids."""
    return mode == "always" or (mode == "auto" and vocab >= LARGE_VOCABULARY)


def slice_width(vocab: int) -> int:
    """The ids in one slice (the last one may hold fewer)."""
    return min(vocab, max(MIN_SLICE, -(-vocab // SLICES)))
