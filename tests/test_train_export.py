"""--export consolidates any backend's checkpoint into one file that --init_from loads in one process."""

import pytest
import torch
from train_runs import SHARED, final_weights, losses, shared_run, train, write_run_config

from distsetup.formats.checkpoint_folder import latest_complete


@pytest.mark.slow
@pytest.mark.parametrize("name", ["zero3", "fsdp_full"])
def test_export_matches_the_sharded_checkpoint_and_seeds_a_single_run(tmp_path, name):
    out = shared_run(name)
    config = SHARED / name / "config.yaml"
    exported = tmp_path / "weights.pt"
    result = train(config, 1, "--export", exported, "--export_dtype", "bf16")
    assert result.returncode == 0, result.stderr[-3000:]
    weights = torch.load(exported)
    reference = final_weights(out)
    assert weights.keys() == reference.keys()
    for key, value in weights.items():
        assert value.dtype == torch.bfloat16
        torch.testing.assert_close(value.float(), reference[key], rtol=1e-2, atol=1e-2)

    fresh = write_run_config(tmp_path / "fresh", "single", max_steps=1, warmup_steps=0)
    assert train(fresh, 1).returncode == 0
    seeded = write_run_config(tmp_path / "seeded", "single", max_steps=1, warmup_steps=0)
    result = train(seeded, 1, "--init_from", exported)
    assert result.returncode == 0, result.stderr[-3000:]
    # the same first batch: a trained start has a clearly lower loss than random weights
    assert losses(tmp_path / "seeded" / "out")[0] < losses(tmp_path / "fresh" / "out")[0] - 0.1


@pytest.mark.slow
@pytest.mark.parametrize("name", ["zero3", "zero2"])
def test_deepspeeds_own_zero_to_fp32_reads_the_checkpoints_as_they_are(name):
    """Issue 12: DeepSpeed's zero_to_fp32 said "Unable to find 'latest' file" unless given -t step_NNNNNNN (the
    trainer saved without DeepSpeed's `latest` tag). The tag is now written once a checkpoint is complete."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    checkpoints = shared_run(name) / "checkpoints"
    assert (checkpoints / "latest").read_text() == latest_complete(checkpoints).name
    theirs = get_fp32_state_dict_from_zero_checkpoint(str(checkpoints))  # no tag: DeepSpeed reads `latest`
    ours = final_weights(checkpoints.parent)
    assert set(ours) <= set(theirs)
    for key, value in ours.items():
        torch.testing.assert_close(theirs[key].float(), value.float(), rtol=0, atol=0)


def test_a_hugging_face_checkpoint_of_the_old_wrapper_exports_its_own_names_and_is_not_resumed(tmp_path):
    """Before every model trained as itself, distsetup wrapped a Hugging Face model (its weights named hf.*)."""
    import json

    from distsetup.errors import DistsetupError
    from distsetup.formats.checkpoint_folder import MARKER, file_sizes
    from distsetup.training.checkpoint import check_compatible
    from distsetup.training.named_state import weight_stream

    folder = tmp_path / "checkpoints" / "step_0000001"
    folder.mkdir(parents=True)
    weights = {"hf.model.embed_tokens.weight": torch.ones(4, 2), "hf.lm_head.weight": torch.zeros(4, 2)}
    torch.save({"model": weights, "optimizer": {"state": {}, "param_groups": []}, "scheduler": {}}, folder / "state.pt")
    old_section = {"type": "hf", "hf_path": "models/llama", "layer_cls": None}
    marker = {"backend": "ddp", "world_size": 2, "step": 1, "model": old_section, "files": file_sizes(folder)}
    (folder / MARKER).write_text(json.dumps(marker))
    assert sorted(weight_stream(folder).shapes) == ["lm_head.weight", "model.embed_tokens.weight"]
    with pytest.raises(DistsetupError, match=r"names of the wrapper an older distsetup trained it in \(hf\.\*\)"):
        check_compatible(marker, folder, {**old_section, "layer_classes": []})
    new_section = {"type": "hf", "hf_path": "models/llama", "layer_classes": []}
    check_compatible({**marker, "model": new_section}, folder, new_section)  # written since: resumed as it is
