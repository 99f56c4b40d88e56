"""Training worker entry point; msrun starts one per rank (see training/train.py)."""

import sys


from ascend_llm_recipes.training.train import main

if __name__ == "__main__":
    sys.exit(main())
