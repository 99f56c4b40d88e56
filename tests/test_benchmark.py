"""The training benchmark's smallest mode runs end to end (both frameworks, same batches); no timing asserted."""

import ast
import glob
import math
import os

import pytest

from ascend_llm_recipes.models.arithmetic import flops_per_token
from ascend_llm_recipes.models.conversion.hf import transformers_config
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
    for name in ("mindspore", "torch"):  # one yardstick round between every timed round of steps
        assert len(result["gemm_step_s"][name]) == 2 and 0 < result["yardstick"][name][0]
    assert all(row["mfu_shapes"] > 0 for row in result["rows"].values())


def test_moe_shape_trains_our_dispatch_variants_beside_transformers_qwen3_moe(tmp_path, capsys):
    benchmark = benchmark_script()
    shape = benchmark.SMOKE_MOE
    result = benchmark.compare_shape(shape, warmup=1, steps=1, torch_compile=False, run_dir=str(tmp_path),
                                     moe_dispatch=("loop",))
    assert set(result["rows"]) == {"mindspore", "mindspore[loop]", "pytorch"}
    rows = result["rows"]
    # same seed, same batches: the dispatch variants compute the same numbers
    assert rows["mindspore"]["loss_first"] == pytest.approx(rows["mindspore[loop]"]["loss_first"], rel=1e-5)
    assert abs(rows["pytorch"]["loss_first"] - math.log(shape.vocab_size)) < 0.1
    recipe = benchmark.load_shape_recipe(shape, total_steps=1)
    m = recipe.model.model_config
    assert (m.num_experts, m.num_experts_per_tok, m.moe_intermediate_size, m.head_dim, m.qk_norm) == (
        4, 2, 48, 16, True)
    assert type(transformers_config(m)).__name__ == "Qwen3MoeConfig"  # the peer TorchTrainer builds
    assert result["flops_per_token"] == flops_per_token(m)  # from the active parameters
    benchmark.print_shape(result)
    out = capsys.readouterr().out
    assert "4 experts top-2 of width 48" in out and f"CPU: {benchmark.cpu_model()}" in out
    assert "ratio (ours / mindspore[loop])" in out and "ratio (ours / pytorch)" in out


def test_gemm_only_prints_a_row_per_step_gemm(monkeypatch, capsys):
    from ascend_llm_recipes.models.arithmetic import step_gemms

    benchmark = benchmark_script()
    monkeypatch.setattr("sys.argv", ["benchmark_training.py", "--gemm-only", "--shapes", "smoke",
                                     "--gemm-rounds", "1", "--gemm-repeats", "1"])
    assert benchmark.main() == 0
    lines = capsys.readouterr().out.splitlines()
    recipe = benchmark.load_shape_recipe(benchmark.SMOKE, total_steps=1)
    gemms = step_gemms(recipe.model.model_config, benchmark.SMOKE.batch_size)
    for gemm in gemms:
        dims = "x".join(str(d) for d in gemm.batch + (gemm.m, gemm.n, gemm.k))
        rows = [line.split() for line in lines if line.strip().startswith(gemm.name + " ")]
        assert len(rows) == 1, gemm.name
        form, shape, count, ms_rate, torch_rate, ratio = rows[0][-7:-1]
        assert (form, shape, int(count)) == (gemm.form, dims, gemm.count)
        assert float(ms_rate) > 0 and float(torch_rate) > 0 and float(ratio) > 0
    for name in ("mindspore", "torch"):
        assert any(line.split()[:4] == [name, "step", "GEMM", "time"] for line in lines)


def test_the_installed_training_package_imports_neither_torch_nor_transformers():
    """They are not install_requires (only test extras): comparisons with PyTorch live in scripts/."""
    found = []
    for path in sorted(glob.glob(os.path.join(REPO_ROOT, "training", "**", "*.py"), recursive=True)):
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), path)
        for node in ast.walk(tree):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            found += [f"{os.path.basename(path)}:{node.lineno}: {n}" for n in names
                      if n.split(".")[0] in ("torch", "transformers")]
    assert found == [], found


def test_counts_and_a_missing_demo_dataset_are_refused_before_anything_runs(capsys):
    import pytest

    bench = load_script("benchmark_training")
    for argv, message in ((["--steps", "0"], "--steps must be at least 1, got 0"),
                          (["--warmup", "0"], "--warmup must be at least 1"),
                          (["--demo-steps", "2"], "--demo-steps must be at least 5"),
                          (["--demo-dataset", "/nonexistent/dataset"], "--demo-dataset /nonexistent/dataset: no such")):
        with pytest.raises(SystemExit) as exit_info:
            bench.main(argv)
        assert exit_info.value.code == 2 and message in capsys.readouterr().err, argv
