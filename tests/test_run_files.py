"""The run directory's file names are spelled once, in training/run_files.py."""

import ast
import glob
import os

from conftest import REPO_ROOT
from ascend_llm_recipes.training import run_files

NAMED = {value for name, value in vars(run_files).items() if name.isupper() and isinstance(value, str)}
# Named by the data layer (data/ sits below training/ and cannot import run_files).
DATA_LAYER = {"data_skips.json"}


def test_run_directory_names_are_spelled_only_in_run_files():
    spelled = []
    for path in sorted(glob.glob(os.path.join(REPO_ROOT, "training", "**", "*.py"), recursive=True)
                       + glob.glob(os.path.join(REPO_ROOT, "scripts", "*.py"))):
        if os.path.basename(path) == "run_files.py":
            continue
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), path)
        where = os.path.relpath(path, REPO_ROOT)
        # "status" and "profile" are also JSON and recipe keys; their paths are built by status_path and train.py
        spelled += [f"{where}:{node.lineno}: {node.value!r}" for node in ast.walk(tree)
                    if isinstance(node, ast.Constant) and node.value in (NAMED | DATA_LAYER) - {"status", "profile"}]
    assert spelled == [], "\n".join(spelled)
