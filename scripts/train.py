"""Training worker entry point; msrun starts one per rank (see training/worker/train.py)."""

import sys


from ascend_llm_recipes.training.worker.train import main

if __name__ == "__main__":
    sys.exit(main())
