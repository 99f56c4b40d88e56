"""The training benchmark's smallest mode runs end to end (both frameworks, same batches); no timing asserted."""

import math

from ascend_llm_recipes.training import benchmark


def test_smoke_shape_trains_both_frameworks_side_by_side(tmp_path):
    result = benchmark.compare_shape(benchmark.SMOKE, warmup=1, steps=2, torch_compile=False, run_dir=str(tmp_path))
    assert set(result["rows"]) == {"mindspore", "pytorch"}
    for row in result["rows"].values():
        assert row["tokens_per_s"] > 0 and 0 < row["mfu"] < 1
        # Same data, same initial scale: both start near the uniform loss log(vocab).
        assert abs(row["loss_first"] - math.log(benchmark.SMOKE.vocab_size)) < 0.1
    assert result["peak"]["mindspore"] > 0 and math.isfinite(result["ratio"]["pytorch"])
    assert math.isfinite(result["best_ratio"]["pytorch"]) and math.isfinite(result["paired_ratio"]["pytorch"])
    assert len(result["load_average"]) == 2
