"""Text to token files without processes: the three formats and which tokens carry loss, packing, the cache, the
pre-tokenized path, and every bad input's one line."""

import json
import os
import stat

import numpy as np
import pytest
import torch
from text_data import answer, chat_records, write_jsonl, write_llama, write_tokenizer

from distsetup.errors import DistsetupError
from distsetup.formats.runconfig import DataConfig, ModelConfig, RunConfig, TrainingConfig
from distsetup.formats.runconfig_load import load_run_config
from distsetup.training.data.datasets import IGNORE, build_datasets, loss_weights
from distsetup.training.data.samples import SampleEncoder
from distsetup.training.data.token_files import BlockWriter
from distsetup.training.data.tokenizer import ByteTokenizer, load_tokenizer

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def tokenizer_folder(tmp_path_factory):
    return write_tokenizer(tmp_path_factory.mktemp("tokenizer"))


def run_config(tmp_path, tokenizer=None, vocab_size=320, block_size=32, **data) -> RunConfig:
    return RunConfig(
        model=ModelConfig(vocab_size=vocab_size, block_size=block_size, tokenizer=tokenizer and str(tokenizer)),
        data=DataConfig(type="files", **data),
        training=TrainingConfig(output_dir=str(tmp_path / "out"), micro_batch_size=2),
    )


def cache_folders(tmp_path):
    return [p for p in (tmp_path / "out" / "token_cache").iterdir() if not p.name.startswith(".")]


def samples(tokenizer, path, **data):
    return list(SampleEncoder(tokenizer, DataConfig(**data)).samples(path))


def test_chat_counts_what_the_template_writes_for_each_assistant_message(tmp_path, tokenizer_folder):
    tokenizer = load_tokenizer(str(tokenizer_folder))
    records = chat_records(40, seed=3)
    encoded = samples(tokenizer, write_jsonl(tmp_path / "chat.jsonl", records), format="chat")
    for record, sample in zip(records, encoded, strict=True):
        assert sample.loss is not None
        counted = tokenizer.hf.decode(sample.ids[sample.loss])
        replies = [m["content"] for m in record["messages"] if m["role"] == "assistant"]
        assert counted == "".join(f"{reply}<|eos|>" for reply in replies)
        whole = tokenizer.hf.apply_chat_template(record["messages"], tokenize=False)
        assert tokenizer.hf.decode(sample.ids) == whole  # nothing lost or added between the pieces
        assert not sample.loss[: len(tokenizer.hf.encode("<|bos|><|user|>", add_special_tokens=False))].any()


def test_prompt_completion_counts_the_completion_and_eos_with_fields_named_in_the_config(tmp_path, tokenizer_folder):
    tokenizer = load_tokenizer(str(tokenizer_folder))
    path = write_jsonl(tmp_path / "pc.jsonl", [{"q": "red fox", "a": answer("red fox")}, {"q": "dog", "a": "dog"}])
    encoded = samples(tokenizer, path, format="prompt_completion", prompt_field="q", completion_field="a")
    for sample, completion in zip(encoded, ["fox red", "dog"], strict=True):
        assert sample.ids[0] == tokenizer.bos_token_id and sample.ids[-1] == tokenizer.eos_token_id
        assert tokenizer.hf.decode(sample.ids[sample.loss]) == completion + "<|eos|>"
        assert tokenizer.hf.decode(sample.ids[~sample.loss]) == "<|bos|>" + (
            "red fox" if completion != "dog" else "dog"
        )


def test_byte_level_text_reads_txt_json_and_parquet_documents(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "a.txt").write_text("héllo\nworld")
    write_jsonl(tmp_path / "b.jsonl", [{"text": "one"}, {"text": "two"}])
    (tmp_path / "c.json").write_text(json.dumps([{"text": "three"}]))
    pq.write_table(pa.table({"text": ["four"]}), tmp_path / "d.parquet")
    stream = b"".join(
        bytes(sample.ids.tolist())
        for name in ("a.txt", "b.jsonl", "c.json", "d.parquet")
        for sample in samples(ByteTokenizer(), tmp_path / name, format="text")
    )
    assert stream == "héllo\nworld\none\ntwo\nthree\nfour\n".encode()


def blocks_of(tmp_path, samples_in, width, masked=True):
    writer = BlockWriter(tmp_path / "t.bin", width, np.dtype(np.uint16), masked, pad_id=0)
    for sample in samples_in:
        writer.add(sample)
    counts = writer.close()
    tokens = np.fromfile(tmp_path / "t.bin", dtype=np.uint16).reshape(-1, width)
    loss = np.fromfile(tmp_path / "t.mask.bin", dtype=np.uint8).reshape(-1, width) if masked else None
    return counts, tokens, loss


def test_instruction_samples_are_packed_whole_cut_to_a_block_and_padded_without_loss(tmp_path):
    from distsetup.training.data.samples import Sample

    def sample(first, length, prompt):
        return Sample(np.arange(first, first + length), np.arange(length) >= prompt)

    counts, tokens, loss = blocks_of(
        tmp_path,
        [sample(10, 3, 1), sample(20, 4, 2), sample(30, 12, 2), sample(50, 9, 8), sample(60, 5, 9), sample(70, 2, 1)],
        width=8,
    )
    # 50..58: its one counted id is cut away; 60..64: nothing counted
    assert counts == {"blocks": 3, "truncated": 2, "dropped": 2}
    assert tokens.tolist() == [
        [10, 11, 12, 20, 21, 22, 23, 0],  # the third sample does not fit in the one free id: padding
        [30, 31, 32, 33, 34, 35, 36, 37],  # cut to the block
        [70, 71, 0, 0, 0, 0, 0, 0],
    ]
    assert loss.tolist() == [[0, 1, 1, 0, 0, 1, 1, 0], [0, 0, 1, 1, 1, 1, 1, 1], [0, 1, 0, 0, 0, 0, 0, 0]]
    assert all(row[1:].any() for row in loss)  # every block has a target that counts


def test_text_documents_run_on_across_blocks_and_the_rest_is_left_out(tmp_path):
    from distsetup.training.data.samples import Sample

    counts, tokens, _ = blocks_of(tmp_path, [Sample(np.arange(5), None), Sample(np.arange(5, 12), None)], 5, False)
    assert counts["blocks"] == 2 and tokens.tolist() == [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9]]


def test_the_cache_is_built_once_keyed_by_its_inputs_and_rebuilt_when_damaged(tmp_path, tokenizer_folder):
    path = write_jsonl(tmp_path / "chat.jsonl", chat_records(60))
    cfg = run_config(tmp_path, tokenizer_folder, format="chat", paths=[str(path)], val_fraction=0.2)
    mask = os.umask(0o022)
    try:
        first = build_datasets(cfg, ranks=2)
    finally:
        os.umask(mask)
    first_train, first_val_loss = np.array(first.train.tokens), np.array(first.val.loss)  # copies: it is damaged below
    (folder,) = cache_folders(tmp_path)
    assert stat.S_IMODE(folder.stat().st_mode) == 0o755  # not its staging folder's 0700: a shared cache
    assert first.notes[0].startswith(f"data: {len(first.train)} train blocks, {len(first.val)} val blocks")
    built = (folder / "train.bin").stat().st_mtime_ns
    again = build_datasets(cfg, ranks=2)
    assert (folder / "train.bin").stat().st_mtime_ns == built and not any("rebuilt" in n for n in again.notes)
    assert np.array_equal(first.train.tokens, again.train.tokens)

    with open(folder / "train.bin", "r+b") as f:  # a truncated token file is rebuilt, never trusted
        f.truncate(10)
    rebuilt = build_datasets(cfg, ranks=2)
    assert rebuilt.notes[0].startswith(f"rebuilt the token cache {folder}: train.bin is 10 bytes")
    assert np.array_equal(rebuilt.train.tokens, first_train) and np.array_equal(rebuilt.val.loss, first_val_loss)
    (folder / "cache.json").write_text("{garbage")
    assert "rebuilt" in build_datasets(cfg, ranks=2).notes[0]

    retemplated = write_tokenizer(tmp_path / "retemplated")  # the same vocabulary, another chat template
    (retemplated / "chat_template.jinja").write_text(
        (retemplated / "chat_template.jinja").read_text().replace("<|eos|>", "<|eos|>\n")
    )
    assert load_tokenizer(str(retemplated)).fingerprint == load_tokenizer(str(tokenizer_folder)).fingerprint
    cfg.model.tokenizer = str(retemplated)
    build_datasets(cfg, ranks=2)  # tokenized again: the template decides the ids too
    assert len(cache_folders(tmp_path)) == 2
    cfg.model.tokenizer = str(tokenizer_folder)

    cfg.model.block_size = 16  # another block size: another folder beside the first
    build_datasets(cfg, ranks=2)
    assert len(cache_folders(tmp_path)) == 3
    os.utime(path, ns=(built, built + 10**9))  # the file changed: tokenized again
    cfg.model.block_size = 32
    build_datasets(cfg, ranks=2)
    assert len(cache_folders(tmp_path)) == 4


def test_the_val_fraction_holds_out_whole_records_and_the_split_follows_the_seed(tmp_path, tokenizer_folder):
    path = write_jsonl(tmp_path / "pc.jsonl", [{"prompt": f"{i}", "completion": f"{i}"} for i in range(400)])
    cfg = run_config(
        tmp_path, tokenizer_folder, block_size=8, format="prompt_completion", paths=[str(path)], val_fraction=0.25
    )
    data = build_datasets(cfg, ranks=2)
    tokenizer = load_tokenizer(str(tokenizer_folder))

    def numbers(blocks):
        texts = tokenizer.hf.batch_decode(np.asarray(blocks.tokens).astype(np.int64), skip_special_tokens=False)
        return {t.split("<|bos|>")[1].split("<|eos|>")[0][: len(t)] for t in texts if "<|bos|>" in t}

    train, val = numbers(data.train), numbers(data.val)
    assert not train & val and 60 < len(val) < 140  # 100 expected
    cfg.training.seed += 1
    assert numbers(build_datasets(cfg, ranks=2).val) != val


def test_a_token_file_reads_as_the_text_it_came_from(tmp_path, tokenizer_folder):
    path = write_jsonl(tmp_path / "chat.jsonl", chat_records(30))
    cfg = run_config(tmp_path, tokenizer_folder, format="chat", paths=[str(path)])
    text = build_datasets(cfg, ranks=2)
    (folder,) = cache_folders(tmp_path)
    tokens = build_datasets(run_config(tmp_path, tokenizer_folder, paths=[str(folder / "train.bin")]), ranks=2)
    assert np.array_equal(tokens.train.tokens, text.train.tokens) and tokens.train.masked
    assert tokens.notes == [f"data: {len(text.train)} train blocks of {cfg.model.block_size + 1} ids (pre-tokenized)"]
    x, y = tokens.train.batch(torch.tensor([0, 3]))
    assert torch.equal(x, text.train.batch(torch.tensor([0, 3]))[0]) and (y == IGNORE).any() and (y != IGNORE).any()


def expect_error(match, cfg, ranks=2):
    with pytest.raises(DistsetupError, match=match) as raised:
        build_datasets(cfg, ranks=ranks)
    assert "\n" not in str(raised.value)
    return raised.value


def test_bad_token_files_are_refused_in_one_line(tmp_path, tokenizer_folder):
    corpus = tmp_path / "corpus.bin"
    np.arange(100, dtype=np.uint16).tofile(corpus)
    cfg = run_config(tmp_path, tokenizer_folder, paths=[str(corpus)])
    expect_error(r"data.paths\[0\]: .*corpus.bin has no sidecar corpus.bin.json naming its dtype", cfg)
    fingerprint = load_tokenizer(str(tokenizer_folder)).fingerprint
    (tmp_path / "corpus.bin.json").write_text(json.dumps({"dtype": "uint16", "tokenizer": "sha256:0123"}))
    expect_error(r"corpus.bin was tokenized by tokenizer sha256:0123; this run's model.tokenizer is sha256:", cfg)
    (tmp_path / "corpus.bin.json").write_text(json.dumps({"dtype": "uint16", "tokenizer": fingerprint}))
    cfg.model.vocab_size = 99
    expect_error(r"the tokenizer's \d+ ids need an embedding of at least \d+ rows; model.vocab_size is 99", cfg)
    cfg.model.tokenizer, cfg.model.vocab_size = None, 256
    (tmp_path / "corpus.bin.json").write_text(json.dumps({"dtype": "uint16", "tokenizer": "bytes"}))
    np.arange(200, 299, dtype=np.uint16).tofile(corpus)  # 3 blocks of 33 ids
    expect_error(r"corpus.bin holds token id 298, beyond model.vocab_size 256", cfg)


def test_bad_text_inputs_are_refused_in_one_line(tmp_path, tokenizer_folder):
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "not_a_tokenizer").mkdir()
    (tmp_path / "not_a_tokenizer" / "config.json").write_text("{}")
    good = write_jsonl(tmp_path / "good.jsonl", [{"text": "the quick brown fox " * 20}] * 30)
    expect_error(
        r"model.tokenizer .*not_a_tokenizer is not a tokenizer folder",
        run_config(tmp_path, tmp_path / "not_a_tokenizer", paths=[str(good)]),
    )
    missing = write_jsonl(tmp_path / "missing.jsonl", [{"text": "a"}, {"body": "b"}])
    expect_error(
        r"missing.jsonl: record 2 has no field 'text' \(its fields: body\)", run_config(tmp_path, paths=[str(missing)])
    )
    pq.write_table(pa.table({"question": ["q"], "reply": ["r"]}), tmp_path / "pc.parquet")
    error = expect_error(
        r"pc.parquet: record 1 has no field 'prompt' \(its fields: question, reply\)",
        run_config(tmp_path, tokenizer_folder, paths=[str(tmp_path / "pc.parquet")], format="prompt_completion"),
    )
    assert "data.prompt_field" in error.hint
    write_jsonl(tmp_path / "short.jsonl", [{"text": "tiny"}])
    expect_error(
        r"data.paths hold no whole block of 33 ids", run_config(tmp_path, paths=[str(tmp_path / "short.jsonl")])
    )
    expect_error(
        r"the validation split is empty: data.val_fraction 0.001 drew no sample",
        run_config(tmp_path, paths=[str(good)], val_fraction=0.001),
    )
    expect_error(
        r"the validation split is empty\. HINT: add data to data\.val_paths\.$",
        run_config(tmp_path, paths=[str(good)], val_paths=[str(write_jsonl(tmp_path / "v0.jsonl", [{"text": "x"}]))]),
    )
    expect_error(
        r"the validation set \(data.val_paths\) has 1 block, fewer than the 4 processes that evaluate it .*"
        r"HINT: add validation data to data.val_paths, or train on fewer processes\.$",
        run_config(
            tmp_path, paths=[str(good)], val_paths=[str(write_jsonl(tmp_path / "v.jsonl", [{"text": "x" * 40}]))]
        ),
        4,
    )
    expect_error(
        r"byte-level text need an embedding of at least 256 rows; model.vocab_size is 128",
        run_config(tmp_path, vocab_size=128, paths=[str(good)]),
    )
    strict = write_tokenizer(tmp_path / "strict")
    (strict / "chat_template.jinja").write_text("{{ raise_exception('Conversation roles must alternate') }}")
    chat = write_jsonl(tmp_path / "chat.jsonl", chat_records(3))
    expect_error(
        r"chat.jsonl: record 1: the tokenizer's chat template refused it: Conversation roles must alternate",
        run_config(tmp_path, strict, paths=[str(chat)], format="chat"),
    )
    (strict / "chat_template.jinja").unlink()
    expect_error(
        r"data.format chat needs a chat template; model.tokenizer .*strict has none",
        run_config(tmp_path, strict, paths=[str(chat)], format="chat"),
    )
    llama = write_llama(tmp_path / "llama", vocab_size=100)
    cfg = run_config(tmp_path, tokenizer_folder, paths=[str(good)])
    cfg.model.type, cfg.model.hf_path = "hf", str(llama)
    expect_error(r"need an embedding of at least \d+ rows; .*llama's vocab_size is 100", cfg)
    staging = [p for p in (tmp_path / "out" / "token_cache").glob(".*") if p.is_dir()]
    assert staging == []  # nothing half-written


@pytest.mark.parametrize(
    "data, training, problem",
    [
        ({"format": "chat", "paths": ["{jsonl}"]}, {}, "data.format: format chat needs a chat template"),
        ({"format": "chat", "paths": ["{txt}"]}, {}, r"data.paths\[0\]: format chat reads fields of records"),
        ({"paths": ["{jsonl}", "{bin}"]}, {}, r"data.paths\[1\]: .*a pre-tokenized .bin file is the only file"),
        ({"paths": ["{jsonl}"], "val_paths": ["{jsonl}"], "val_fraction": 0.1}, {}, "val_paths and val_fraction"),
        ({"paths": ["{bin}"], "val_fraction": 0.1}, {}, "data.val_fraction: a pre-tokenized .bin is not split"),
        ({"paths": ["{tmp}/a.csv"]}, {}, r"data.paths\[0\]: .*a.csv is not a .txt, .jsonl, .json, .parquet or .bin"),
        ({"paths": ["{jsonl}"]}, {"eval_interval": 5}, "training.eval_interval: there is no validation set"),
        ({"paths": ["{jsonl}"]}, {"epochs": 2, "max_steps": 5}, "training.epochs: epochs and max_steps are both set"),
    ],
)
def test_data_settings_that_cannot_work_are_config_problems(tmp_path, data, training, problem):
    files = {"jsonl": tmp_path / "a.jsonl", "txt": tmp_path / "a.txt", "bin": tmp_path / "a.bin", "tmp": tmp_path}
    for name in ("jsonl", "txt", "bin"):
        files[name].write_text("x")
    data = {k: [p.format(**files) for p in v] if isinstance(v, list) else v for k, v in data.items()}
    overrides = [f"data.{k}={json.dumps(v)}" for k, v in {"type": "files", **data}.items()]
    overrides += [f"training.{k}={v}" for k, v in training.items()]
    with pytest.raises(DistsetupError, match=problem):
        load_run_config(None, overrides)


def test_loss_weights_make_the_step_loss_the_mean_over_every_counted_target():
    torch.manual_seed(0)
    per_token = [torch.rand(2, 6) for _ in range(3)]
    targets = [torch.where(torch.rand(2, 6) < p, 1, IGNORE) for p in (0.2, 0.5, 0.9)]
    weights = loss_weights(targets, world_size=1, device=torch.device("cpu"))
    micro_means = [loss[y != IGNORE].mean() for loss, y in zip(per_token, targets, strict=True)]
    weighted = sum(w * m for w, m in zip(weights, micro_means, strict=True)) / len(targets)
    every_target = torch.cat([loss[y != IGNORE] for loss, y in zip(per_token, targets, strict=True)]).mean()
    assert torch.allclose(weighted.double(), every_target.double()) and not torch.allclose(
        torch.stack(micro_means).mean(), every_target
    )


def test_prompt_targets_get_no_gradient_and_completion_targets_do(tmp_path, tokenizer_folder):
    """Through the trainer's own batch and model: the gradient reaching the logits is exactly zero wherever the
    target is a prompt token, so changing prompt targets changes no gradient."""
    from distsetup.training.model.gpt import GPT

    path = write_jsonl(tmp_path / "chat.jsonl", chat_records(20))
    data = build_datasets(run_config(tmp_path, tokenizer_folder, format="chat", paths=[str(path)]), ranks=2)
    x, y = data.train.batch(torch.arange(4))
    model = GPT(320, 32, 1, 2, 32, 0.0)
    logits = model(x).detach().requires_grad_()
    torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten(), ignore_index=IGNORE).backward()
    assert logits.grad is not None
    counted = y != IGNORE
    assert torch.all(logits.grad[~counted] == 0) and torch.all(logits.grad[counted].abs().sum(-1) > 0)
    assert model(x, y).item() == pytest.approx(
        torch.nn.functional.cross_entropy(logits[counted], y[counted]).item(), rel=1e-6
    )


def test_a_text_file_goes_whole_into_one_split(tmp_path, monkeypatch):
    import distsetup.training.data.samples as samples_module

    monkeypatch.setattr(samples_module, "TEXT_CHUNK", 20)  # a piece for about every line
    paths = []
    for i in range(30):
        paths.append(tmp_path / f"doc{i}.txt")
        paths[-1].write_text("".join(f"f{i:02d}-line{j}\n" for j in range(8)))
    cfg = run_config(tmp_path, block_size=8, paths=[str(p) for p in paths], val_fraction=0.3)
    data = build_datasets(cfg, ranks=2)
    streams = {
        split: bytes(np.asarray(blocks.tokens).reshape(-1).tolist()).decode()
        for split, blocks in (("train", data.train), ("val", data.val))
    }
    where = {i: {split for split, text in streams.items() if f"f{i:02d}-" in text} for i in range(30)}
    assert all(len(splits) <= 1 for splits in where.values()), where  # never a file's lines in both
    assert sum(splits == {"val"} for splits in where.values()) >= 4  # and the draw did send some to val


def test_the_first_answer_token_counts_when_the_prompt_ends_in_a_space(tmp_path):
    folder = write_tokenizer(tmp_path / "spaced")
    (folder / "chat_template.jinja").write_text(
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}<|eos|>{% endfor %}"
        "{% if add_generation_prompt %}assistant: {% endif %}"
    )
    tokenizer = load_tokenizer(str(folder))
    records = [{"messages": [{"role": "user", "content": "red fox"}, {"role": "assistant", "content": "fox red"}]}]
    (sample,) = samples(tokenizer, write_jsonl(tmp_path / "c.jsonl", records), format="chat")
    first_answer_token = tokenizer.hf.convert_ids_to_tokens(sample.ids[sample.loss].tolist())[0]
    assert first_answer_token == "Ġfox"  # its text starts on the prompt's space, and it counts
    assert tokenizer.hf.decode(sample.ids[sample.loss]) == " fox red<|eos|>"


def test_a_model_that_would_not_stop_where_the_data_end_gets_a_note(tmp_path, tokenizer_folder):
    """What the data end with (the EOS after a document; in chat, the end of turn the template writes after an
    assistant message) must be an id the model stops at. A model whose config.json names another EOS (as a config
    made with a model class's defaults does) would generate on past it once trained: said in one note, naming the
    file and the id to set or add; none where the config, or a generation_config.json beside it, names it."""
    from transformers import GenerationConfig

    chat = write_jsonl(tmp_path / "chat.jsonl", chat_records(40))
    cfg = run_config(tmp_path, tokenizer_folder, format="chat", paths=[str(chat)], val_fraction=0.2)
    llama = write_llama(tmp_path / "llama", vocab_size=320)
    cfg.model.type, cfg.model.hf_path = "hf", str(llama)
    eos = load_tokenizer(str(tokenizer_folder)).eos_token_id  # the template's end of turn too (<|eos|>)

    def stop_notes() -> list[str]:
        return [note for note in build_datasets(cfg, ranks=2).notes if "eos_token_id" in note]

    assert stop_notes() == []
    config = json.loads((llama / "config.json").read_text())
    (llama / "config.json").write_text(json.dumps({**config, "eos_token_id": eos + 1}))
    assert stop_notes() == [
        f"note: model: the data end each assistant turn with <|eos|> (id {eos}), but {llama / 'config.json'} names "
        f"eos_token_id {eos + 1}: generate() on the trained model will not stop at <|eos|>; set it to {eos}"
    ]
    text = write_jsonl(tmp_path / "text.jsonl", [{"text": f"the fox {i}"} for i in range(200)])
    cfg.data.format, cfg.data.paths = "text", [str(text)]
    assert [note.split(",")[0] for note in stop_notes()] == [
        f"note: model: the data end each document with <|eos|> (id {eos})"
    ]
    GenerationConfig(eos_token_id=[eos + 1, eos + 2]).save_pretrained(llama)  # what from_pretrained reads first
    (note,) = stop_notes()
    assert f"{llama / 'generation_config.json'} names eos_token_id {eos + 1}, {eos + 2}" in note
    assert note.endswith(f"add {eos} to it")
    GenerationConfig(eos_token_id=[eos + 1, eos]).save_pretrained(llama)
    assert stop_notes() == []


def test_an_hf_models_own_loss_weighs_each_micro_batch_by_its_counted_labels(tmp_path):
    """data.type python, a Hugging Face causal LM's own loss on batches with labels (-100 where no loss): the step's
    loss and the validation loss are the mean over every counted next-token label, as the HF Trainer makes them with
    num_items_in_batch, whatever the split into micro-batches; each micro-batch counted as its samples, a batch of
    2 counted labels weighed as much as one of 20."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from distsetup.training.loss.counted_labels import labels_averaged
    from distsetup.training.loss.python_objective import PythonObjective

    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(write_llama(tmp_path / "llama")))
    model.eval()
    torch.manual_seed(0)
    ids = torch.randint(2, 256, (4, 16))
    labels = ids.clone()
    for row, counted in enumerate((2, 15, 5, 11)):  # next-token labels left counted in each sample
        labels[row, : 16 - counted] = IGNORE
    batches = [{"input_ids": ids[i : i + 2], "labels": labels[i : i + 2]} for i in (0, 2)]
    logits = model(input_ids=ids).logits[:, :-1]
    targets = labels[:, 1:]
    every_label = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE)

    objective = PythonObjective(None, None, "model.type python", {}, labels_averaged(model))
    weights = objective.step_weights(batches, world_size=1, device=torch.device("cpu"))
    step = sum(objective.micro_loss(model, b, w).loss for b, w in zip(batches, weights, strict=True)) / len(batches)
    sums = [objective.eval_sums(model, b, samples=2) for b in batches]
    validation = sum(terms["loss"] for terms, _ in sums) / sum(counted for _, counted in sums)
    assert step.item() == pytest.approx(every_label.item(), abs=1e-5)
    assert validation.item() == pytest.approx(every_label.item(), abs=1e-5)
    by_samples = PythonObjective(None, None, "model.type python", {})  # a model whose loss is not the labels' mean
    assert by_samples.step_weights(batches, 1, torch.device("cpu")) == [1.0, 1.0]
    unweighted = sum(by_samples.micro_loss(model, b).loss for b in batches) / 2
    assert abs(unweighted.item() - every_label.item()) > 1e-4  # ten times the tolerance: the test tells them apart


def test_a_micro_batch_whose_labels_are_all_ignored_weighs_nothing_rather_than_nan(tmp_path):
    """An SFT sample cut before its completion, alone in a micro-batch: the model's own mean over no labels is nan,
    and the step's loss, its gradients and the validation loss are the mean over the other micro-batches' labels
    (the HF Trainer's num_items_in_batch gives the same), even where that micro-batch comes first (the first step's
    check of the loss does not take its nan for a broken loss function)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from distsetup.training.loss.counted_labels import labels_averaged
    from distsetup.training.loss.python_objective import PythonObjective

    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(write_llama(tmp_path / "llama")))
    torch.manual_seed(0)
    ids = torch.randint(2, 256, (3, 16))
    labels = ids.clone()
    labels[0] = IGNORE  # the truncated sample
    labels[1:, :8] = IGNORE  # the prompts
    batches = [{"input_ids": ids[i : i + 1], "labels": labels[i : i + 1]} for i in range(3)]
    every_label = model(input_ids=ids[1:], labels=labels[1:]).loss  # the mean over the counted labels

    objective = PythonObjective(None, None, "model.type python", {}, labels_averaged(model))
    weights = objective.step_weights(batches, world_size=1, device=torch.device("cpu"))
    step = sum(objective.micro_loss(model, b, w).loss for b, w in zip(batches, weights, strict=True)) / len(batches)
    step.backward()
    sums = [objective.eval_sums(model, b, samples=1) for b in batches]
    validation = sum(terms["loss"] for terms, _ in sums) / sum(counted for _, counted in sums)
    assert step.item() == pytest.approx(every_label.item(), abs=1e-5)
    assert validation.item() == pytest.approx(every_label.item(), abs=1e-5)
    assert all(p.grad is None or p.grad.isfinite().all() for p in model.parameters())
