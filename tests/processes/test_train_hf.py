"""A tiny Llama built locally from LlamaConfig: a ZeRO-3 run of it exports as a Hugging Face folder that
from_pretrained loads, with the same logits, and that FSDP2 fine-tunes from, each rank reading only its shards' rows.
(It trains under every backend, FSDP2 sharded per LlamaDecoderLayer: tests/processes/test_finetune.py; its layer class
is checked in tests/unit/test_hf_layer_class.py.)"""

import json
from pathlib import Path

import pytest
import yaml
from train_runs import train, write_llama_config

pytest.importorskip("transformers")


def test_a_zero3_tied_llama_exported_as_hf_loads_in_transformers_and_in_fsdp2_a_shard_at_a_time(run_cli, tmp_path):
    import torch
    from train_runs import ds_file
    from transformers import AutoModelForCausalLM

    from distsetup.formats.checkpoint_folder import latest_complete
    from distsetup.formats.runconfig_load import load_run_config
    from distsetup.training.checkpoint.export import consolidated_state_dict
    from distsetup.training.model import build as models

    config = write_llama_config(tmp_path, "LlamaDecoderLayer", tie_word_embeddings=True)  # one weight, two names
    run = yaml.safe_load(config.read_text())
    llama = Path(run["model"]["hf_path"])
    batch = {"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 1, "train_batch_size": 16}
    (tmp_path / "ds.json").write_text(json.dumps({**ds_file(3), **batch}))  # micro_batch_size 8 on 2 ranks
    run["training"].update(max_steps=4, checkpoint_interval=4)
    run["distributed"] = {"backend": "deepspeed", "deepspeed_config": str(tmp_path / "ds.json")}
    config.write_text(yaml.safe_dump(run))
    result = train(config, 2)
    assert result.returncode == 0, result.stderr[-3000:]

    exported = tmp_path / "exported"
    result = run_cli(
        "checkpoint", "export", tmp_path / "out", "-o", exported, "--format", "hf", "--max_shard_size", "60KB"
    )
    assert result.exit_code == 0, result.output
    plain = run_cli("checkpoint", "export", tmp_path / "out", "-o", tmp_path / "plain")  # the default format
    assert plain.exit_code == 0 and "--format hf writes one it does" in plain.output
    loaded, info = AutoModelForCausalLM.from_pretrained(exported, local_files_only=True, output_loading_info=True)
    assert not any(info.values()), info  # no missing, unexpected or mismatched key

    trained = models.build(load_run_config(config).model)
    trained.load_state_dict(consolidated_state_dict(latest_complete(tmp_path / "out" / "checkpoints")), strict=True)
    tokens = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.allclose(loaded(input_ids=tokens).logits, trained(tokens).logits, rtol=0, atol=1e-5)

    # sharded as save_pretrained shards the same weights: the same files, and each tensor in the same one
    loaded.save_pretrained(tmp_path / "by_transformers", max_shard_size="60KB")
    ours = json.loads((exported / "model.safetensors.index.json").read_text())["weight_map"]
    theirs = json.loads((tmp_path / "by_transformers" / "model.safetensors.index.json").read_text())["weight_map"]
    assert ours == theirs and len(set(ours.values())) > 1

    # fine-tuned from that folder under FSDP2: each rank reads only the rows of its own shards, from every shard file
    run["model"]["hf_path"] = str(exported)
    run["training"].update(max_steps=1, checkpoint_interval=1, lr=1e-30, output_dir=str(tmp_path / "tuned"))
    run["training"]["chunked_loss"] = "always"  # rank 0's head check: a forward on a copy of no rank's values
    run["distributed"] = {"backend": "fsdp", "fsdp_config": str(tmp_path / "fsdp.json")}
    config.write_text(yaml.safe_dump(run))
    result = train(config, 2)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "cross-entropy over the 256 ids" in result.stdout, result.stdout[-2000:]
    started = consolidated_state_dict(latest_complete(tmp_path / "tuned" / "checkpoints"))
    for name, tensor in loaded.state_dict().items():  # an update of 1e-30: the folder's weights, tie included
        torch.testing.assert_close(started[name], tensor, rtol=0, atol=1e-28, msg=name)
    read = json.loads((tmp_path / "tuned" / "summary.json").read_text())["pretrained_read_bytes"]
    weights = sum(p.numel() * 4 for p in loaded.parameters())
    assert sum(read) == weights and all(0.3 * weights < r < 0.7 * weights for r in read), (read, weights)

    # the model folder moved since the run: named with --hf_path (the hint said to run the export from the folder
    # the training ran in, the only fix, and the user was there)
    llama.rename(tmp_path / "moved")
    lost = run_cli("checkpoint", "export", tmp_path / "out", "-o", tmp_path / "again", "--format", "hf")
    assert lost.exit_code == 1 and "has no config.json here. HINT: give the model folder" in lost.stderr, lost.output
    assert "with --hf_path" in lost.stderr and not (tmp_path / "again").exists()
    args = ["--format", "hf", "--max_shard_size", "60KB", "--hf_path", tmp_path / "moved"]
    assert run_cli("checkpoint", "export", tmp_path / "out", "-o", tmp_path / "again", *args).exit_code == 0
    for name in ("config.json", "model.safetensors.index.json"):
        assert (tmp_path / "again" / name).read_text() == (exported / name).read_text(), name
