"""Training worker entry point; msrun starts one per rank, the launcher a one-process CPU run's (see
training/worker/train.py)."""

import gc
import sys

from ascend_llm_recipes.training.worker.without_torch import keep_torch_out

keep_torch_out()  # before MindFormers is imported: it would import PyTorch only to probe for it

from ascend_llm_recipes.training.worker.train import main  # noqa: E402

if __name__ == "__main__":
    code = main()
    # The interpreter's last garbage collection at exit walks MindSpore's and MindFormers' whole object graph:
    # ~2 CPU-seconds (6-15 s of wall on a loaded 2-core machine) after the rank's status is written, which the
    # launcher waited out before reporting the run. Nothing is collected at exit that matters (files are closed
    # and statuses written by now): freezing the objects skips that walk (atexit handlers still run).
    gc.freeze()
    sys.exit(code)
