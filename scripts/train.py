"""Training worker entry point; msrun starts one per rank (see training/train.py)."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from training.train import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
