"""A Hugging Face model's layer class to wrap: one the model does not have is an error before training."""

import pytest
from train_runs import train, write_llama_config

pytest.importorskip("transformers")


def test_unknown_layer_class_is_an_error(tmp_path):
    result = train(write_llama_config(tmp_path, "NoSuchLayer"), 1)
    assert result.returncode != 0 and "no module of class NoSuchLayer" in result.stderr
