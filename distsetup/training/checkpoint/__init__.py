"""Checkpoints: atomic writes, RNG state and resume checks (`files.py`), the whole training state by parameter name
that every backend reads any other's checkpoint through (`named_state.py`), each layout's reader and writer
(torch's DCP and state.pt, DeepSpeed's ZeRO files, ZeRO-0's wrapper, DeepSpeed's universal folder), tensors read and
written one at a time (`streamed_io.py`, `weight_stream.py`, `safetensors_file.py`), `distsetup checkpoint convert`
(`convert.py`) and export (`export.py`).

May import: the training layer's base modules (optim for optimizer state by name), model/ (building a model to
convert or export into) and data/; not loss/ or backends/.
"""
