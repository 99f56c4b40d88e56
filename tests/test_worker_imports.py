"""The training worker's process keeps PyTorch out (training/worker/without_torch.py)."""

import os
import subprocess
import sys

from conftest import REPO_ROOT

PROBE = """
import sys
from ascend_llm_recipes.training.worker.without_torch import keep_torch_out
keep_torch_out()
import mindformers
from mindformers import Trainer
import ascend_llm_recipes.training.worker.train
import tensorboardX.writer
assert "torch" not in sys.modules, "torch was imported"
assert tensorboardX.writer.numpy_compatible.__module__ == "numpy", tensorboardX.writer.numpy_compatible
try:
    import torch
except ModuleNotFoundError as e:
    print("REFUSED", e)
"""


def run_probe(**env):
    result = subprocess.run([sys.executable, "-c", PROBE], cwd=REPO_ROOT, capture_output=True, text=True,
                            env={**os.environ, **env}, timeout=600)
    return result


def test_the_worker_imports_mindformers_without_pytorch_and_says_why_torch_is_refused():
    result = run_probe(ASCEND_LLM_WORKER_TORCH="0")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "REFUSED" in result.stdout and "training/worker/without_torch.py" in result.stdout, result.stdout
    assert "ASCEND_LLM_WORKER_TORCH=1" in result.stdout, result.stdout
