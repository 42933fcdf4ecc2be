"""The user's files as samples: records streamed from .txt, .jsonl, .json and .parquet files by the datasets
library (offline; nothing is copied into its cache), each turned into token ids and, for instruction data, the
mask of the ids that carry loss.

    text               the text field (a .txt file is one document): BOS (if the tokenizer has one), the text,
                       EOS; every token carries loss
    prompt_completion  BOS, the prompt, the completion, EOS; the completion and EOS carry loss
    chat               a list of {"role", "content"} messages rendered by the tokenizer's chat template; what the
                       template writes for each assistant message (its content and end-of-turn) carries loss
"""

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from distsetup.errors import DistsetupError
from distsetup.formats.runconfig import TEXT_LOADERS
from distsetup.training.world import last_line

FIELD_SETTINGS = ("text_field", "prompt_field", "completion_field", "messages_field")
BATCH = 1000  # records tokenized together (HF tokenizers encode a batch in parallel)


@dataclass(frozen=True)
class Sample:
    ids: np.ndarray  # int64 token ids
    loss: np.ndarray | None  # bool per id: whether predicting it counts; None: every id counts


def records(path: Path) -> Iterator[dict]:
    """The records of data file `path`, one at a time."""
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    from datasets import load_dataset
    from datasets.utils.logging import disable_progress_bar

    disable_progress_bar()
    empty = DistsetupError(f"data file {path} is empty.", "add records to it or remove it from the data paths.")
    if path.stat().st_size == 0:
        raise empty
    options = {"sample_by": "document"} if TEXT_LOADERS[path.suffix] == "text" else {}
    read_any = False
    try:
        dataset = load_dataset(
            TEXT_LOADERS[path.suffix], data_files=[str(path)], split="train", streaming=True, **options
        )
        for record in dataset:
            read_any = True
            yield record
    except DistsetupError:
        raise
    except Exception as e:  # pyarrow's parse errors, a truncated Parquet file, an unreadable file
        raise DistsetupError(f"cannot read data file {path}: {last_line(e)}.", "fix or remove the file.") from None
    if not read_any:
        raise empty


class SampleEncoder:
    """Records of one data format into Samples, a batch at a time."""

    def __init__(self, tokenizer, data):
        self.tokenizer, self.format = tokenizer, data.format
        self.fields = {key: getattr(data, key) for key in FIELD_SETTINGS}
        self.bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
        self.eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []

    @staticmethod
    def field_settings(format: str) -> tuple[str, ...]:
        """The data settings that name the fields format `format` reads."""
        return {"text": ("text_field",), "prompt_completion": ("prompt_field", "completion_field")}.get(
            format, ("messages_field",)
        )

    def samples(self, path: Path) -> Iterator[Sample]:
        batch: list[tuple[int, dict]] = []
        for number, record in enumerate(records(path), 1):
            batch.append((number, record))
            if len(batch) == BATCH:
                yield from self._encode(path, batch)
                batch = []
        yield from self._encode(path, batch)

    def _encode(self, path: Path, batch: list[tuple[int, dict]]) -> Iterator[Sample]:
        if self.format == "chat":
            for number, record in batch:
                yield self._chat(path, number, self._field(path, number, record, "messages_field", list))
            return
        if self.format == "text":
            texts = [self._field(path, n, record, "text_field", str) for n, record in batch]
            for ids in self.tokenizer.encode(texts):
                yield Sample(
                    np.concatenate(
                        [
                            np.array(self.bos, dtype=np.int64),
                            np.asarray(ids, dtype=np.int64),
                            np.array(self.eos, dtype=np.int64),
                        ]
                    ),
                    None,
                )
            return
        prompts = self.tokenizer.encode([self._field(path, n, record, "prompt_field", str) for n, record in batch])
        completions = self.tokenizer.encode(
            [self._field(path, n, record, "completion_field", str) for n, record in batch]
        )
        for prompt, completion in zip(prompts, completions, strict=True):
            head, tail = self.bos + list(prompt), list(completion) + self.eos
            yield Sample(np.array(head + tail, dtype=np.int64), np.arange(len(head) + len(tail)) >= len(head))

    def _chat(self, path: Path, number: int, messages: list) -> Sample:
        """Renders the conversation up to each assistant message, with and without it: the text between those
        two renderings is the message as the template writes it, and carries loss. Each piece is tokenized on
        its own, so no token straddles a boundary between loss and no loss."""
        if not all(isinstance(m, dict) and isinstance(m.get("content"), str) and m.get("role") for m in messages):
            raise DistsetupError(
                f"{path}: record {number}: {self.fields['messages_field']} is not a list of {{role, content}} "
                "messages.",
                'write e.g. [{"role": "user", "content": "..."}, {"role": "assistant", "content": "..."}].',
            )
        pieces: list[tuple[str, bool]] = []
        written = ""
        for i, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            prompt = self._render(path, number, messages[:i], True, written)
            answered = self._render(path, number, messages[: i + 1], False, prompt)
            pieces += [(prompt[len(written) :], False), (answered[len(prompt) :], True)]
            written = answered
        pieces.append((self._render(path, number, messages, False, written)[len(written) :], False))
        if not any(loss and text for text, loss in pieces):
            raise DistsetupError(
                f"{path}: record {number} has no assistant message: nothing in it would carry loss.",
                "add the assistant's reply, or drop the record.",
            )
        encoded = self.tokenizer.encode([text for text, _ in pieces])
        ids = [token for piece in encoded for token in piece]
        loss = [counts for piece, (_, counts) in zip(encoded, pieces, strict=True) for _ in piece]
        return Sample(np.array(ids, dtype=np.int64), np.array(loss, dtype=bool))

    def _field(self, path: Path, number: int, record: dict, setting: str, kind: type):
        """The value of the field data.`setting` names in `record`, of type `kind`."""
        name = self.fields[setting]
        value = record.get(name)
        if isinstance(value, kind):
            return value
        if value is None:
            columns = ", ".join(k for k, v in record.items() if v is not None) or "none"
            raise DistsetupError(
                f"{path}: record {number} has no field '{name}' (its fields: {columns}).",
                f"add '{name}' to every record, or name the field with data.{setting}.",
            )
        raise DistsetupError(
            f"{path}: record {number}: field '{name}' holds {type(value).__name__}, not {kind.__name__}.",
            f"write '{name}' as {'text' if kind is str else 'a list of messages'}.",
        )

    def _render(self, path: Path, number: int, messages: list, add_generation_prompt: bool, prefix: str) -> str:
        text = self.tokenizer.chat_text(messages, add_generation_prompt) if messages else ""
        if not text.startswith(prefix):
            raise DistsetupError(
                f"{path}: record {number}: the tokenizer's chat template does not render a conversation as the "
                "beginning of its continuation, so its assistant messages cannot be found in the text.",
                "use a chat template whose rendering of n messages starts with its rendering of the first n - 1.",
            )
        return text
