"""--export consolidates any backend's checkpoint into one file that --init_from loads in one process."""

import pytest
import torch
from train_runs import SHARED, final_weights, losses, shared_run, train, write_run_config

from distsetup.formats.checkpoint_folder import latest_complete


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

    seeded = write_run_config(tmp_path / "seeded", "single", max_steps=1, warmup_steps=0)
    result = train(seeded, 1, "--init_from", exported)
    assert result.returncode == 0, result.stderr[-3000:]
    # the same first batch as the single run from random weights (its first loss is theirs: no step has run): a
    # trained start has a clearly lower loss
    assert losses(tmp_path / "seeded" / "out")[0] < losses(shared_run("single"))[0] - 0.1
    assert f"weights from {exported}; the optimizer and the schedule start at step 0" in result.stdout
    # run again, it resumes its own checkpoint, whose weights replace the file's: said (it was not)
    result = train(seeded, 1, "--init_from", exported, "training.max_steps=2")
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"resumes from its own checkpoint, whose weights replace --init_from {exported}" in result.stdout


@pytest.mark.parametrize("name", ["zero3", "zero2"])
def test_deepspeeds_own_zero_to_fp32_reads_the_checkpoints_as_they_are(name):
    """DeepSpeed's zero_to_fp32 finds the newest checkpoint by itself, without -t step_NNNNNNN: the trainer writes
    DeepSpeed's `latest` tag once a checkpoint is complete (without it: "Unable to find 'latest' file")."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    checkpoints = shared_run(name) / "checkpoints"
    assert (checkpoints / "latest").read_text() == latest_complete(checkpoints).name
    theirs = get_fp32_state_dict_from_zero_checkpoint(str(checkpoints))  # no tag: DeepSpeed reads `latest`
    ours = final_weights(checkpoints.parent)
    assert set(ours) <= set(theirs)
    for key, value in ours.items():
        torch.testing.assert_close(theirs[key].float(), value.float(), rtol=0, atol=0)
