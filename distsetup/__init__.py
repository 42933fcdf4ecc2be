"""distsetup: configs, launchers and a training script for distributed PyTorch runs."""

__version__ = "0.1.0"
