"""A checkpoint of the wrapper older distsetups trained Hugging Face models in (weights named hf.*): its weights
are read under the model's own names, and resuming it is refused in one line."""

import pytest
import torch


def test_a_hugging_face_checkpoint_of_the_old_wrapper_exports_its_own_names_and_is_not_resumed(tmp_path):
    """Before every model trained as itself, distsetup wrapped a Hugging Face model (its weights named hf.*)."""
    from dataclasses import replace

    from distsetup.errors import DistsetupError
    from distsetup.formats.checkpoint_folder import MARKER, Marker, file_sizes
    from distsetup.training.checkpoint.files import check_compatible
    from distsetup.training.checkpoint.named_state import weight_stream

    folder = tmp_path / "checkpoints" / "step_0000001"
    folder.mkdir(parents=True)
    weights = {"hf.model.embed_tokens.weight": torch.ones(4, 2), "hf.lm_head.weight": torch.zeros(4, 2)}
    torch.save({"model": weights, "optimizer": {"state": {}, "param_groups": []}, "scheduler": {}}, folder / "state.pt")
    old_section = {"type": "hf", "hf_path": "models/llama", "layer_cls": None}
    marker = Marker("ddp", step=1, world_size=2, model=old_section, files=file_sizes(folder))
    (folder / MARKER).write_text(marker.to_json())
    assert sorted(weight_stream(folder).shapes) == ["lm_head.weight", "model.embed_tokens.weight"]
    with pytest.raises(DistsetupError, match=r"names of the wrapper an older distsetup trained it in \(hf\.\*\)"):
        check_compatible(marker, folder, {**old_section, "layer_classes": []})
    new_section = {"type": "hf", "hf_path": "models/llama", "layer_classes": []}
    check_compatible(replace(marker, model=new_section), folder, new_section)  # written since: resumed as it is
