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

from distsetup.errors import DistsetupError, last_line
from distsetup.formats.runconfig import FORMAT_FIELDS, TEXT_LOADERS

FIELD_SETTINGS = ("text_field", "prompt_field", "completion_field", "messages_field")
BATCH = 1000  # records tokenized together (HF tokenizers encode a batch in parallel)
TEXT_CHUNK = 1 << 20  # characters of a .txt file tokenized together


@dataclass(frozen=True)
class Sample:
    ids: np.ndarray  # int64 token ids
    loss: np.ndarray | None  # bool per id: whether predicting it counts; None: every id counts


def records(path: Path) -> Iterator[dict]:
    """The records of data file `path`, one at a time (of a .txt file: its lines, each with its line break)."""
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    from datasets import load_dataset
    from datasets.utils.logging import disable_progress_bar

    disable_progress_bar()
    empty = DistsetupError(f"data file {path} is empty.", "add records to it or remove it from the data paths.")
    if path.stat().st_size == 0:
        raise empty
    options = {"sample_by": "line", "keep_linebreaks": True} if TEXT_LOADERS[path.suffix] == "text" else {}
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

    def sample_end(self) -> tuple[int, str] | None:
        """The id that ends what the model learns to write, and what it ends: the EOS after each document or
        completion; in chat, the first token the template writes after an assistant message's content (its end of
        turn). None where there is none, or the template does not render a two-message conversation."""
        if self.format != "chat":
            return (self.eos[0], "each document" if self.format == "text" else "each completion") if self.eos else None
        reply = "That is all."
        try:
            text = self.tokenizer.chat_text(
                [{"role": "user", "content": "Say it."}, {"role": "assistant", "content": reply}], False
            )
        except Exception:  # a template that wants a system message first, or other roles: no answer here
            return None
        if (at := text.rfind(reply)) < 0:
            return None
        ids, offsets = self.tokenizer.encode_with_offsets(text)
        following = [i for i, (start, _) in zip(ids, offsets, strict=True) if start >= at + len(reply)]
        return (following[0], "each assistant turn") if following else None

    @staticmethod
    def field_settings(format: str) -> tuple[str, ...]:
        """The data settings that name the fields format `format` reads."""
        return FORMAT_FIELDS[format]

    def samples(self, path: Path) -> Iterator[Sample]:
        if path.suffix == ".txt":  # one document, tokenized a batch of lines at a time: memory stays bounded
            yield from self._text_file(path)
            return
        batch: list[tuple[int, dict]] = []
        for number, record in enumerate(records(path), 1):
            batch.append((number, record))
            if len(batch) == BATCH:
                yield from self._encode(path, batch)
                batch = []
        yield from self._encode(path, batch)

    def _text_file(self, path: Path) -> Iterator[Sample]:
        """A .txt file's pieces of about TEXT_CHUNK characters (whole lines), tokenized one at a time: BOS before
        the first, EOS after the last. Tokens never span two pieces, so a piece is cut only where a line break
        is followed by a line that does not start with a space (where tokenizers start a token anyway)."""
        yield Sample(np.array(self.bos, dtype=np.int64), None)
        piece: list[str] = []
        size = 0
        for record in records(path):
            line = record["text"]
            if size >= TEXT_CHUNK and line[:1].strip():
                yield Sample(np.asarray(self.tokenizer.encode(["".join(piece)])[0], dtype=np.int64), None)
                piece, size = [], 0
            piece.append(line)
            size += len(line)
        if piece:
            yield Sample(np.asarray(self.tokenizer.encode(["".join(piece)])[0], dtype=np.int64), None)
        yield Sample(np.array(self.eos, dtype=np.int64), None)

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
        two renderings is the message as the template writes it (content and end of turn). The whole rendering
        is tokenized once, as inference will tokenize it, and a token carries loss when any of its text lies in
        such a span."""
        if not all(isinstance(m, dict) and isinstance(m.get("content"), str) and m.get("role") for m in messages):
            raise DistsetupError(
                f"{path}: record {number}: {self.fields['messages_field']} is not a list of {{role, content}} "
                "messages.",
                'write e.g. [{"role": "user", "content": "..."}, {"role": "assistant", "content": "..."}].',
            )
        spans: list[tuple[int, int]] = []  # character spans that carry loss
        written = ""
        for i, message in enumerate(messages):
            if message["role"] == "assistant":
                prompt = self._render(path, number, messages[:i], True, written)
                written = self._render(path, number, messages[: i + 1], False, prompt)
                spans.append((len(prompt), len(written)))
        text = self._render(path, number, messages, False, written)
        if not any(start < end for start, end in spans):
            raise DistsetupError(
                f"{path}: record {number} has no assistant message: nothing in it would carry loss.",
                "add the assistant's reply, or drop the record.",
            )
        ids, offsets = self.tokenizer.encode_with_offsets(text)
        loss = np.zeros(len(ids), dtype=bool)
        for start, end in spans:  # a token with any of its text in the span (ĠHello after a prompt's space)
            loss |= (offsets[:, 1] > start) & (offsets[:, 0] < end)
        return Sample(np.asarray(ids, dtype=np.int64), loss)

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
        try:
            text = self.tokenizer.chat_text(messages, add_generation_prompt) if messages else ""
        except Exception as e:  # the template's own raise_exception ("roles must alternate"), a Jinja error
            raise DistsetupError(
                f"{path}: record {number}: the tokenizer's chat template refused it: {last_line(e)}.",
                "fix the record, or use a tokenizer whose template takes it.",
            ) from None
        if not text.startswith(prefix):
            raise DistsetupError(
                f"{path}: record {number}: the tokenizer's chat template does not render a conversation as the "
                "beginning of its continuation, so its assistant messages cannot be found in the text.",
                "use a chat template whose rendering of n messages starts with its rendering of the first n - 1.",
            )
        return text
