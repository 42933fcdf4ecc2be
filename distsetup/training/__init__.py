"""What the trainer (distsetup/train.py, trainer.py) is built from. Imports torch: never import this from a command
that only generates files.

Bottom up: the base modules here (world, user_code, run_lock, run_length, preemption, metrics, memory, optim), then
model/, then data/, loss/, checkpoint/, backends/, and trainer.py on top; each sub-package's docstring says what it
owns and what it may import (tests/unit/test_layers.py holds them to it).
"""
