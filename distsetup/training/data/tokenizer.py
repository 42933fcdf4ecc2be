"""Text to token ids: a local Hugging Face tokenizer folder (model.tokenizer, read by AutoTokenizer, nothing
downloaded) or, without one, bytes (UTF-8, 256 ids, documents ended by a newline)."""

import hashlib
import json
from pathlib import Path

import numpy as np

from distsetup.errors import DistsetupError, first_line

BYTES = "bytes"  # the byte-level tokenizer's fingerprint
# A tokenizer's `fingerprint` names its vocabulary (what an id means: a token file's sidecar names it); its
# `tokenization` also covers what else decides the ids of a text (a token cache is keyed by it).


class ByteTokenizer:
    """UTF-8 bytes as token ids: what distsetup trained on before it read tokenizers."""

    vocab_size = 256
    bos_token_id = None
    eos_token_id = ord("\n")  # a document ends with a newline, as text files join them
    fingerprint = tokenization = BYTES
    has_chat_template = has_offsets = False

    def encode(self, texts: list[str]) -> list[np.ndarray]:
        return [np.frombuffer(text.encode("utf-8"), dtype=np.uint8) for text in texts]

    def chat_text(self, messages: list[dict], add_generation_prompt: bool) -> str:
        raise AssertionError("byte-level text has no chat template")  # refused with model.tokenizer unset


class HFTokenizer:
    """A Hugging Face tokenizer from a local folder; encode() adds no special tokens (the formats place BOS
    and EOS themselves, chat templates write their own)."""

    def __init__(self, folder: Path):
        from transformers import AutoTokenizer

        try:
            self.hf = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
        except Exception as e:  # OSError, ValueError, a broken tokenizer.json: what transformers raises varies
            raise DistsetupError(
                f"model.tokenizer {folder} is not a tokenizer folder ({first_line(e)}).",
                "point it at a folder written by tokenizer.save_pretrained() (tokenizer.json or the vocabulary "
                "files, tokenizer_config.json).",
            ) from None
        self.vocab_size = len(self.hf)  # added tokens included
        self.eos_token_id = self.hf.eos_token_id
        self.bos_token_id = self.hf.bos_token_id
        self.has_chat_template = bool(getattr(self.hf, "chat_template", None))
        self.has_offsets = bool(getattr(self.hf, "is_fast", False))  # where each token's text lies
        vocabulary = json.dumps(sorted(self.hf.get_vocab().items()))
        self.fingerprint = "sha256:" + hashlib.sha256(vocabulary.encode()).hexdigest()[:16]
        backend = getattr(self.hf, "backend_tokenizer", None)
        rules = [  # what else shapes the ids of a text: normalizer, pre-tokenizer, merges, template, BOS/EOS
            backend.to_str() if backend is not None else vocabulary,
            str(getattr(self.hf, "chat_template", None)),
            str(self.bos_token_id),
            str(self.eos_token_id),
        ]
        self.tokenization = "sha256:" + hashlib.sha256("\n".join(rules).encode()).hexdigest()[:16]

    def encode(self, texts: list[str]) -> list[list[int]]:
        return self.hf(texts, add_special_tokens=False)["input_ids"] if texts else []

    def encode_with_offsets(self, text: str) -> tuple[list[int], np.ndarray]:
        """The ids of `text` and each id's (start, end) characters in it (fast tokenizers alone say them)."""
        encoded = self.hf(text, add_special_tokens=False, return_offsets_mapping=True)
        return encoded["input_ids"], np.array(encoded["offset_mapping"], dtype=np.int64).reshape(-1, 2)

    def chat_text(self, messages: list[dict], add_generation_prompt: bool) -> str:
        text = self.hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
        return str(text)


def load_tokenizer(folder: str | None) -> ByteTokenizer | HFTokenizer:
    if folder is None:
        return ByteTokenizer()
    from distsetup.training.model.build import require_transformers

    require_transformers()
    if not Path(folder).is_dir():
        raise DistsetupError(f"model.tokenizer {folder} is not a folder.", "point it at a local tokenizer folder.")
    return HFTokenizer(Path(folder))


def check_vocabulary(tokenizer, model_vocab_size: int, where: str) -> None:
    """Every id the tokenizer can produce must have a row in the model's embedding."""
    if tokenizer.vocab_size > model_vocab_size:
        what = "byte-level text" if tokenizer.fingerprint == BYTES else f"the tokenizer's {tokenizer.vocab_size} ids"
        raise DistsetupError(
            f"{what} need an embedding of at least {tokenizer.vocab_size} rows; {where} is {model_vocab_size}.",
            f"raise {where} to {tokenizer.vocab_size} or more.",
        )


def stop_mismatch(tokenizer, end: tuple[int, str], stop_ids: set[int], where: str) -> str | None:
    """A note where the model would not stop generating where its data end: `end`, the id that ends what it learns
    to write and what it ends (SampleEncoder.sample_end), is not among the ids that `where` (the model's
    generation_config.json or config.json) names."""
    ending, what = end
    if not isinstance(tokenizer, HFTokenizer) or ending in stop_ids:
        return None
    token = tokenizer.hf.convert_ids_to_tokens(ending)
    named = ", ".join(str(i) for i in sorted(stop_ids))
    fix = f"add {ending} to it" if len(stop_ids) > 1 else f"set it to {ending}"
    return (
        f"note: model: the data end {what} with {token} (id {ending}), but {where} names eos_token_id {named}: "
        f"generate() on the trained model will not stop at {token}; {fix}"
    )
