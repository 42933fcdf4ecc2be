"""What the trainer (distsetup/train.py) is built from (model, data, backends, checkpoints). Imports torch: never import
this from a command that only generates files."""
