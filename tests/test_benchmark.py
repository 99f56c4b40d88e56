"""The training benchmark's smallest mode runs end to end (both frameworks, same batches); no timing asserted."""

import ast
import glob
import math
import os

from conftest import REPO_ROOT, load_script


def benchmark_script():
    return load_script("benchmark_training")


def test_smoke_shape_trains_both_frameworks_side_by_side(tmp_path):
    benchmark = benchmark_script()
    result = benchmark.compare_shape(benchmark.SMOKE, warmup=1, steps=2, torch_compile=False, run_dir=str(tmp_path))
    assert set(result["rows"]) == {"mindspore", "pytorch"}
    for row in result["rows"].values():
        assert row["tokens_per_s"] > 0 and 0 < row["mfu"] < 1
        # Same data, same initial scale: both start near the uniform loss log(vocab).
        assert abs(row["loss_first"] - math.log(benchmark.SMOKE.vocab_size)) < 0.1
    assert result["peak"]["mindspore"] > 0 and math.isfinite(result["ratio"]["pytorch"])
    assert math.isfinite(result["best_ratio"]["pytorch"]) and math.isfinite(result["paired_ratio"]["pytorch"])
    assert len(result["load_average"]) == 2


def test_the_installed_training_package_imports_neither_torch_nor_transformers():
    """They are not install_requires (only test extras): comparisons with PyTorch live in scripts/."""
    found = []
    for path in sorted(glob.glob(os.path.join(REPO_ROOT, "training", "*.py"))):
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), path)
        for node in ast.walk(tree):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            found += [f"{os.path.basename(path)}:{node.lineno}: {n}" for n in names
                      if n.split(".")[0] in ("torch", "transformers")]
    assert found == [], found
