"""Writes what this example reads, all made here (nothing is downloaded): model/config.json, a tiny Mixtral (8
experts, top-2 routing, the router's load-balancing loss at router_aux_loss_coef), model/tokenizer.json and
tokenizer_config.json (a small byte-level BPE with a chat template), and data/chat.jsonl (conversations in which
the assistant repeats the user's words backwards, a rule a tiny model learns). The files it wrote are checked in;
run it again to remake them: python examples/hf_moe/prepare.py
"""

import json
import random
from pathlib import Path

HERE = Path(__file__).resolve().parent
WORDS = "the quick brown fox jumps over lazy dog cat sat on mat red blue green big small".split()
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|eos|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def write_tokenizer(folder: Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=["<|bos|>", "<|eos|>", "<|system|>", "<|user|>", "<|assistant|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator([" ".join(WORDS)] * 50, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<|bos|>", eos_token="<|eos|>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(folder))
    return fast


def write_model(folder: Path, tokenizer) -> None:
    """The model's BOS and EOS are the tokenizer's: generate() stops at the EOS that ends each turn."""
    from transformers import MixtralConfig

    MixtralConfig(
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=8,
        num_experts_per_tok=2,
        router_aux_loss_coef=0.02,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    ).save_pretrained(folder)


def chat_records(count: int) -> list[dict]:
    draw = random.Random(0)
    records = []
    for _ in range(count):
        question = " ".join(draw.choice(WORDS) for _ in range(draw.randint(2, 5)))
        answer = " ".join(reversed(question.split()))
        records.append({"messages": [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]})
    return records


if __name__ == "__main__":
    tokenizer = write_tokenizer(HERE / "model")
    write_model(HERE / "model", tokenizer)
    (HERE / "data").mkdir(exist_ok=True)
    records = chat_records(640)
    for name, part in (("chat.jsonl", records[:520]), ("chat_val.jsonl", records[520:])):
        (HERE / "data" / name).write_text("".join(json.dumps(r) + "\n" for r in part))
    print(f"wrote {HERE / 'model'} (vocabulary {len(tokenizer)}) and {HERE / 'data'}")
