"""The trainer under the name the guides use: `python src/train.py ...` is `python -m distsetup.train ...`
(the code ships inside the package, so a wheel install has it too)."""

import sys
from pathlib import Path

try:
    import distsetup  # noqa: F401
except ImportError:  # run from a checkout without installing
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from distsetup.train import run

if __name__ == "__main__":
    run()
