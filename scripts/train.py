"""Training worker entry point; msrun starts one per rank, the launcher a one-process CPU run's (see
training/worker/train.py)."""

import sys

from ascend_llm_recipes.training.worker.without_torch import keep_torch_out

keep_torch_out()  # before MindFormers is imported: it would import PyTorch only to probe for it

from ascend_llm_recipes.training.worker.train import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
