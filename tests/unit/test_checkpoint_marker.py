"""A checkpoint's COMPLETE marker as one typed object: written and read back the same, read by any distsetup
(keys it does not know kept aside and written again), valid JSON whatever the loss, a data position whole or none,
and what it says about the files' layout."""

import json

import pytest

from distsetup.formats.checkpoint_folder import MARKER, Marker, damage, file_sizes, step_dir


def test_a_marker_reads_back_as_it_was_written(tmp_path):
    folder = step_dir(tmp_path, 7)
    folder.mkdir()
    (folder / "state.pt").write_bytes(b"weights")
    written = Marker(
        "deepspeed",
        step=7,
        world_size=4,
        zero_stage=3,
        precision="bf16",
        model={"type": "gpt", "n_layer": 2},
        loss=2.5,
        sampler={"epoch": 0, "samples": 56, "global_batch": 8},
        files=file_sizes(folder),
    )
    (folder / MARKER).write_text(written.to_json())
    assert Marker.read(folder) == written and damage(folder, 7) is None
    assert (written.files_layout, written.written_by, written.global_batch) == ("zero", "deepspeed ZeRO-3", 8)
    assert "layout" not in json.loads(written.to_json())  # only a converted checkpoint says its layout


def test_a_converted_marker_names_its_layout_and_unknown_keys_are_kept_aside():
    raw = {"backend": "deepspeed", "step": 3, "world_size": 2, "layout": "universal", "from_the_future": 1}
    marker = Marker.from_json(raw)
    assert marker.files_layout == "universal" and marker.zero_stage is None
    assert marker.other_keys == {"from_the_future": 1} and not hasattr(marker, "from_the_future")
    assert json.loads(marker.to_json())["from_the_future"] == 1  # written again (distsetup checkpoint convert)
    assert Marker.from_json({"backend": "ddp", "step": 1, "world_size": 2}).files_layout == "state.pt"


@pytest.mark.parametrize("loss", [float("nan"), float("inf")])
def test_a_loss_that_is_not_a_number_is_written_as_null(loss):
    text = Marker("ddp", step=1, world_size=2, loss=loss).to_json()
    assert json.loads(text, parse_constant=lambda constant: pytest.fail(f"{constant} in {text}"))["loss"] is None


@pytest.mark.parametrize(
    "sampler, position",
    [
        ({"epoch": 1, "samples": 48, "global_batch": 8}, True),
        ({"epoch": 1, "position": 6, "global_batch": 8}, True),  # an older one: steps of its global batch
        (None, False),
        ({"epoch": 1}, False),
        ({"samples": 48}, False),
        ({"epoch": 1, "position": 6}, False),
        ({"epoch": "1", "samples": 48}, False),
        ([1, 48], False),
    ],
)
def test_the_data_position_is_there_whole_or_not_at_all(sampler, position):
    raw = {"backend": "ddp", "step": 6, "world_size": 2, "sampler": sampler}
    marker = Marker.from_json(raw)
    assert marker.data_position == (sampler if position else None)
    assert marker.global_batch == (sampler.get("global_batch") if isinstance(sampler, dict) else None)


@pytest.mark.parametrize(
    "raw, problem",
    [
        ({"backend": "ddp", "step": 1}, "lacks backend, step, world_size"),
        ([1, 2], "lacks backend, step, world_size"),
        ({"backend": "ddp", "step": 1, "world_size": 2, "files": [1]}, "files are not a mapping"),
    ],
)
def test_a_marker_that_is_not_ours_says_why(raw, problem):
    with pytest.raises(ValueError, match=problem):
        Marker.from_json(raw)


def test_a_failed_load_names_only_changes_that_make_other_weights():
    """What a checkpoint's marker holds of the model against the run config's: a python model's builder and args, the
    built-in GPT's shape; a dropout, a tokenizer's path or a key an older marker lacks make no other weights."""
    from distsetup.training.checkpoint.files import model_changes

    python = {"type": "python", "builder": "m:build", "args": {"hidden": 8, "depth": 2}, "dropout": 0.1}
    now = {**python, "args": {"hidden": 16, "depth": 2}, "dropout": 0.0, "zero3_leaf_classes": []}
    assert model_changes(python, now) == ["model.args.hidden 8 there, 16 here"]
    gpt = {"type": "gpt", "n_layer": 2, "n_embd": 32, "tokenizer": "a.json"}
    assert model_changes(gpt, {**gpt, "tokenizer": "b.json", "dropout": 0.2}) == []
    assert model_changes(gpt, {**gpt, "n_embd": 64}) == ["model.n_embd 32 there, 64 here"]
    assert model_changes(None, now) == []  # a marker from before distsetup stored the model section
