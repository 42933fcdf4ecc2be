"""The model a run trains: built from the run config's model section (`build.py`: the built-in GPT of `gpt.py`, a
Hugging Face causal LM from a local folder, or the user's own module), its repeated blocks and what is done to them
before sharding (`blocks.py`), layers that run differently on each rank (`moe.py`), and its FLOPs (`throughput.py`).

May import: the training layer's base modules (world, user_code); not data/, loss/, checkpoint/ or backends/.
"""
