"""MFU arithmetic and the CPU peak measurement."""

import pytest

from ascend_llm_recipes.training.metrics import measure_cpu_peak_flops, model_flops_utilisation


def test_mfu_hand_computed():
    # 46.1 GFLOP/token (Llama-2-7B) x 2,000 tokens/s over 8 devices of 100 TFLOP/s: 11.5%.
    value, flag = model_flops_utilisation(46_085_000_000, 2_000.0, 100e12, 8)
    assert value == pytest.approx(46.085e9 * 2000 / 800e12) and flag == ""


def test_mfu_above_100_percent_is_flagged_not_reported():
    value, flag = model_flops_utilisation(1_000_000, 1e9, 1e12, 1)
    assert value is None and "above 100% (100000%): the device peak is wrong" in flag


def test_mfu_without_a_peak():
    assert model_flops_utilisation(1_000_000, 1e3, None, 1) == (None, "no peak")


def test_cpu_gemm_peak_is_measured():
    peak = measure_cpu_peak_flops(size=256, repeats=3)
    assert 1e8 < peak < 1e13  # between a slow core and far more than 2 cores can do
