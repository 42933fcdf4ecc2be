"""`distsetup checkpoint ls` on the checkpoints real runs wrote (DDP, FSDP, ZeRO-3 on 2 CPU processes), and on
the same folders damaged and half-written: what it says must be what a resumed run does."""

import json
import shutil

import pytest
from train_runs import RUNS, shared_run

from distsetup.formats.checkpoint_folder import MARKER, find_resume


@pytest.mark.parametrize("name", ["ddp", "fsdp_full", "zero3"])
def test_ls_shows_what_each_checkpoint_holds_and_which_one_resumes(run_cli, tmp_path, name):
    run = tmp_path / "run"
    shutil.copytree(shared_run(name), run)  # a copy: other tests read the shared run
    result = run_cli("checkpoint", "ls", run, "--json")
    assert result.exit_code == 0, result.output
    listed = json.loads(result.stdout)
    folders = sorted((run / "checkpoints").glob("step_*"))
    assert [c["step"] for c in listed] == [int(f.name.split("_")[1]) for f in folders] and len(listed) >= 2
    backend = {"ddp": "ddp", "fsdp_full": "fsdp", "zero3": "deepspeed"}[name]
    for c, folder in zip(listed, folders, strict=True):
        meta = json.loads((folder / MARKER).read_text())
        assert (c["backend"], c["world_size"], c["precision"]) == (backend, RUNS[name][0], meta["precision"])
        assert c["zero_stage"] == (3 if name == "zero3" else None) and c["complete"]
        assert c["size_bytes"] == sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())
    assert [c["resume"] for c in listed] == [False] * (len(listed) - 1) + [True]

    newest, before = folders[-1], folders[-2]
    biggest = max((f for f in newest.rglob("*") if f.is_file() and f.name != MARKER), key=lambda f: f.stat().st_size)
    biggest.write_bytes(biggest.read_bytes()[:-1])  # a truncated file: damage
    (before / MARKER).unlink()  # and the one before it never completed
    listed = json.loads(run_cli("checkpoint", "ls", run, "--json").stdout)
    assert "bytes, not the" in listed[-1]["problem"] and not listed[-1]["complete"]
    assert "no COMPLETE marker" in listed[-2]["problem"]
    resumes = [c["path"] for c in listed if c["resume"]]
    assert resumes == [str(find_resume(run / "checkpoints")[0])] and resumes == [str(folders[-3])]
    table = run_cli("checkpoint", "ls", run).stdout
    assert "<- resume" in table.splitlines()[len(listed) - 1] and "no: " in table


@pytest.mark.parametrize("name", ["ddp", "fsdp_full", "zero3"])
def test_export_writes_safetensors_any_model_loads(run_cli, tmp_path, name):
    import torch
    from safetensors.torch import load_file
    from train_runs import final_weights

    from distsetup.training.model.gpt import GPT

    run = shared_run(name)
    result = run_cli("checkpoint", "export", run, "-o", tmp_path / "exported", "--dtype", "bf16")
    assert result.exit_code == 0, result.output
    weights = load_file(tmp_path / "exported" / "model.safetensors")
    expected = final_weights(run)  # the consolidated fp32 state of the newest checkpoint
    assert sorted(weights) == sorted(expected)
    for key, tensor in expected.items():
        assert weights[key].dtype == (torch.bfloat16 if tensor.is_floating_point() else tensor.dtype)
        assert torch.equal(weights[key], tensor.to(weights[key].dtype)), key
    model = json.loads((tmp_path / "exported" / "model.json").read_text())
    gpt = GPT(model["vocab_size"], model["block_size"], model["n_layer"], model["n_head"], model["n_embd"], 0.0)
    fit = gpt.load_state_dict({k: v.float() for k, v in weights.items()}, strict=True)
    assert not fit.missing_keys and not fit.unexpected_keys

    again = run_cli("checkpoint", "export", run, "-o", tmp_path / "exported")
    assert again.exit_code == 1 and "exists and is not an empty folder" in again.stderr
    as_hf = run_cli("checkpoint", "export", run, "-o", tmp_path / "hf", "--format", "hf")
    assert as_hf.exit_code == 1 and "holds the built-in GPT" in as_hf.stderr and "without --format hf" in as_hf.stderr
    shard = run_cli("checkpoint", "export", run, "-o", tmp_path / "hf", "--format", "hf", "--max_shard_size", "lots")
    assert shard.exit_code == 1 and "--max_shard_size lots is not a size" in shard.stderr
    unsharded = run_cli("checkpoint", "export", run, "-o", tmp_path / "hf", "--max_shard_size", "5GB")
    assert unsharded.exit_code == 1 and "--max_shard_size shards a Hugging Face folder" in unsharded.stderr
    assert not (tmp_path / "hf").exists() and [p.name for p in tmp_path.iterdir()] == ["exported"]


@pytest.mark.parametrize("name", ["ddp", "fsdp_full", "zero2", "zero3"])
def test_weights_read_one_at_a_time_equal_each_backends_own_consolidation(tmp_path, name):
    import torch

    from distsetup.formats.checkpoint_folder import latest_complete
    from distsetup.training.checkpoint.named_state import weight_stream

    path = latest_complete(shared_run(name) / "checkpoints")
    if name.startswith("zero"):
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        reference = get_fp32_state_dict_from_zero_checkpoint(str(path.parent), tag=path.name)
    elif name == "fsdp_full":  # a DCP folder, read here one key at a time
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

        dcp_to_torch_save(path / "model", tmp_path / "model.pt")
        reference = torch.load(tmp_path / "model.pt", weights_only=False)
    else:
        reference = torch.load(path / "state.pt", weights_only=False)["model"]
    streamed = dict(weight_stream(path).tensors())
    assert streamed.keys() == reference.keys()
    for key, tensor in reference.items():
        assert torch.equal(streamed[key], tensor) and not streamed[key].requires_grad, key


def test_zero3_weights_are_found_under_bf16_file_names_and_a_missing_rank_is_named(tmp_path):
    """With bf16 DeepSpeed names the optimizer files bf16_zero_pp_rank_R_...; a rank's file missing is said."""
    import torch

    from distsetup.formats.checkpoint_folder import latest_complete
    from distsetup.training.checkpoint.named_state import weight_stream

    source = latest_complete(shared_run("zero3") / "checkpoints")
    copy = tmp_path / "checkpoints" / source.name
    shutil.copytree(source, copy)
    for file in copy.glob("zero_pp_rank_*_optim_states.pt"):
        file.rename(file.with_name("bf16_" + file.name))
    reference = dict(weight_stream(source).tensors())
    renamed = dict(weight_stream(copy).tensors())
    assert renamed.keys() == reference.keys() and all(torch.equal(renamed[k], v) for k, v in reference.items())
    next(copy.glob("bf16_zero_pp_rank_1_*")).unlink()
    with pytest.raises(ValueError, match=r"optimizer files of ranks \[0\] where 2 ranks wrote it"):
        weight_stream(copy)
