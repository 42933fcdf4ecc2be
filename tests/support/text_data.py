"""Local stand-ins for what a fine-tuning run downloads: a small BPE tokenizer trained on the test's own words
(with a chat template), chat and prompt/completion records, and a tiny Llama from its config."""

import json
import random
from pathlib import Path

WORDS = "the quick brown fox jumps over lazy dog cat sat on mat red blue green big small".split()
ROLES = ("<|system|>", "<|user|>", "<|assistant|>")
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|eos|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def phrase(draw: random.Random) -> str:
    return " ".join(draw.choice(WORDS) for _ in range(draw.randint(2, 5)))


def answer(question: str) -> str:
    """What the assistant says: the question's words backwards (a rule a tiny model learns)."""
    return " ".join(reversed(question.split()))


def chat_records(count: int, seed: int = 0) -> list[dict]:
    draw = random.Random(seed)
    records = []
    for _ in range(count):
        question = phrase(draw)
        messages = [{"role": "user", "content": question}, {"role": "assistant", "content": answer(question)}]
        if draw.random() < 0.3:  # a second turn
            follow_up = phrase(draw)
            messages += [{"role": "user", "content": follow_up}, {"role": "assistant", "content": answer(follow_up)}]
        records.append({"messages": messages})
    return records


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return path


def write_tokenizer(folder: Path, vocab_size: int = 320) -> Path:
    """A byte-level BPE tokenizer trained on WORDS, saved as a Hugging Face tokenizer folder."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|bos|>", "<|eos|>", *ROLES],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator([" ".join(WORDS)] * 50, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<|bos|>", eos_token="<|eos|>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(folder))
    return folder


def write_llama(
    folder: Path, vocab_size: int = 256, tie_word_embeddings: bool = False, pad_token_id: int | None = None
) -> Path:
    """A tiny Llama's config.json (random weights when built), its BOS and EOS write_tokenizer's."""
    from transformers import LlamaConfig

    LlamaConfig(
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=pad_token_id,
        tie_word_embeddings=tie_word_embeddings,
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=128,
    ).save_pretrained(folder)
    return folder
