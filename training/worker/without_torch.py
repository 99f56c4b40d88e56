"""Keep PyTorch out of the training worker's process: it is never used there, and importing it costs every rank
4-10 CPU-seconds at start-up (measured: importing MindFormers' Trainer and our worker took 15.3 s of CPU with
PyTorch installed, 10.4 s without it).

MindFormers pulls it in only by probing: mindformers/utils/tensorboard.py imports tensorboardX, whose
writer.py:42-46 does `try: import torch` to accept torch tensors; HF `datasets` (imported by
mindformers/dataset/dataloader/hf_dataloader.py:25) asks importlib whether torch exists unless USE_TORCH says no
(datasets/config.py:43-50). Neither is on our training path. An import of torch in the worker then fails with
a message naming this module; ASCEND_LLM_WORKER_TORCH=1 lets it through.
"""

import importlib.abc
import importlib.machinery
import os
import sys

ALLOW = "ASCEND_LLM_WORKER_TORCH"


class _TorchRefused(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds `torch` (so a probe's find_spec still answers) and fails its import with ModuleNotFoundError,
    which `try: import torch ... except ImportError` callers take as 'not installed'."""

    def find_spec(self, name, path, target=None):
        if name == "torch" or name.startswith("torch."):
            return importlib.machinery.ModuleSpec(name, self)
        return None

    def create_module(self, spec):
        raise ModuleNotFoundError(
            f"No module named {spec.name!r}: the training worker keeps PyTorch out "
            f"(training/worker/without_torch.py); set {ALLOW}=1 to allow it", name=spec.name)

    def exec_module(self, module):  # never reached: create_module raises
        raise ModuleNotFoundError(module.__name__)


def keep_torch_out() -> None:
    """Before MindFormers is imported: PyTorch imports fail as if it were not installed (unless ALLOW is 1)."""
    if os.environ.get(ALLOW) == "1" or "torch" in sys.modules:
        return
    os.environ.setdefault("USE_TORCH", "0")  # HF datasets/transformers: do not probe for it
    if not any(isinstance(finder, _TorchRefused) for finder in sys.meta_path):
        sys.meta_path.insert(0, _TorchRefused())
