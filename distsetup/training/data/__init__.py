"""What a run reads: the synthetic task, the user's files through a tokenizer (`tokenizer.py`, `samples.py`) into
memory-mapped token files and their cache (`token_files.py`), the user's own datasets (`datasets.py`), the order
each rank reads them in and the batches on the device (`loader.py`), and the validation loss (`evaluation.py`).

May import: the training layer's base modules and model/ (the vocabulary's size); not loss/, checkpoint/ or
backends/.
"""
