"""scripts/profile_step.py on the smallest benchmark shape: the classes account for the whole profile, the
rule tables put known operators where they belong, and a written result reads back through --compare."""

import importlib.util
import json
import math

import pytest

from conftest import load_script


@pytest.fixture(scope="module")
def profiled(tmp_path_factory):
    load_script("benchmark_training")  # profile_step imports it by name, as scripts/ is on sys.path when run
    profile = load_script("profile_step")
    out = tmp_path_factory.mktemp("profile")
    with_torch = importlib.util.find_spec("torch") is not None and importlib.util.find_spec("transformers") is not None
    result = profile.profile_shape("smoke", warmup=1, steps=1, out_dir=str(out), with_torch=with_torch)
    return profile, result, out


def class_total(fw: dict) -> float:
    return sum(sum(phases.values()) for phases in fw["classes"].values())


def test_mindspore_classes_add_up_to_the_profilers_total(profiled):
    profile, result, _ = profiled
    ms = result["frameworks"]["mindspore"]
    assert set(ms["classes"]) == set(profile.CLASSES)
    # Classified from the per-launch timestamps, checked against the profiler's own per-op CSV.
    assert class_total(ms["mean"]) == pytest.approx(ms["profiler_total_per_step_s"], rel=1e-3)
    assert class_total(ms) == pytest.approx(ms["op_per_step_s"])
    assert ms["op_per_step_s"] > 0 and ms["wall_per_step_s"] >= ms["op_per_step_s"] * 0.9
    assert math.isclose(ms["host_per_step_s"], ms["wall_per_step_s"] - ms["op_per_step_s"])
    for cls in (profile.GEMM, profile.LOSS, profile.ATTENTION, profile.NORM, profile.OPTIMIZER):
        assert sum(ms["classes"][cls].values()) > 0, cls
    assert ms["classes"][profile.GEMM]["backward"] > 0 and ms["classes"][profile.OPTIMIZER]["update"] > 0
    other = sum(ms["classes"][profile.OTHER].values())
    assert other == pytest.approx(sum(op["s_per_step"] for op in ms["unclassified"]), abs=1e-9)


def test_known_operators_fall_in_their_classes(profiled):
    profile, result, _ = profiled
    families = {(f["name"], f["phase"]): f["class"] for f in result["frameworks"]["mindspore"]["families"]}
    assert families[("Default/network-LlamaForCausalLM/lm_head-Linear/MatMul", "forward")] == profile.GEMM
    assert families[("Expand/_SiLUGrad/Sigmoid", "backward")] == profile.ACTIVATION
    ms = result["frameworks"]["mindspore"]
    assert 0 < ms["inherited_per_step_s"] < ms["op_per_step_s"]
    # The stand-alone loss is the fused kernel (models/loss.py WholeVocabularyCrossEntropy), forward and backward.
    assert any(cls == profile.LOSS and "fused_loss-WholeVocabularyCrossEntropy" in name and phase == "backward"
               for (name, phase), cls in families.items())
    assert any(cls == profile.ATTENTION and name.startswith("Expand/_SoftmaxBackward/") and phase == "backward"
               for (name, phase), cls in families.items())
    head = "Default/network-LlamaForCausalLM/model-LlamaModel/layers-CellList/0-DecoderLayer/"
    assert profile.classify(profile.MINDSPORE_RULES, head + "self_attn-Attention/rotary-RotaryEmbedding/Mul-op1",
                            "Mul") == profile.ROTARY
    assert profile.classify(profile.MINDSPORE_RULES, head + "input_layernorm-RMSNorm/Rsqrt-op0",
                            "Rsqrt") == profile.NORM
    assert profile.classify(profile.MINDSPORE_RULES, "Default/AdamWeightDecay-op3", "AdamWeightDecay") == \
        profile.OPTIMIZER
    assert profile.classify(profile.MINDSPORE_RULES, "Default/clip_grad_norm-ClipGradNorm/Sqrt-op0", "Sqrt") == \
        profile.CLIP
    assert families[("Default/clip_grad_norm-ClipGradNormByRows/Mul", "update")] == profile.CLIP
    assert profile.classify(profile.MINDSPORE_RULES, "Default/Square-op29", "Square") == profile.CLIP
    assert profile.classify(profile.MINDSPORE_RULES, head + "Unheard-op0", "Unheard") == profile.OTHER


def test_pytorch_peer_is_classified_like_ours(profiled):
    profile, result, _ = profiled
    if "pytorch" not in result["frameworks"]:
        pytest.skip("torch or transformers is not installed: only our side was profiled")
    pt = result["frameworks"]["pytorch"]
    assert class_total(pt) == pytest.approx(pt["op_per_step_s"])
    assert 0 < pt["op_per_step_s"] <= pt["wall_per_step_s"]
    for cls, phase in ((profile.GEMM, "forward"), (profile.GEMM, "backward"), (profile.LOSS, "backward"),
                       (profile.NORM, "backward"), (profile.OPTIMIZER, "update"), (profile.CLIP, "update")):
        assert pt["classes"][cls][phase] > 0, (cls, phase)
    assert any(op["name"] == "aten::mm [lm_head]" and op["class"] == profile.GEMM for op in pt["families"])


def test_the_json_reads_back_through_compare(profiled, capsys):
    profile, result, out = profiled
    path = profile.write_result(result, str(out))
    with open(path, encoding="utf-8") as f:
        assert json.load(f)["frameworks"]["mindspore"]["classes"] == result["frameworks"]["mindspore"]["classes"]
    assert profile.main(["--compare", path, path]) == 0
    printed = capsys.readouterr().out
    assert "before fwd" in printed and "after fwd" in printed and profile.GEMM in printed
    ms = result["frameworks"]["mindspore"]
    assert f"{ms['wall_per_step_s'] * 1e3:.0f}" in printed


def test_bad_arguments_are_refused_before_anything_runs(tmp_path, capsys):
    load_script("benchmark_training")
    profile = load_script("profile_step")
    not_a_profile = tmp_path / "other.json"
    not_a_profile.write_text('{"loss": 1}', encoding="utf-8")
    garbage = tmp_path / "garbage.json"
    garbage.write_text("{", encoding="utf-8")
    blocked = tmp_path / "a-file"
    blocked.write_text("", encoding="utf-8")
    cases = [(["--compare", str(tmp_path / "missing.json")], "missing.json: cannot read it"),
             (["--compare", str(garbage)], "garbage.json: not JSON"),
             (["--compare", str(not_a_profile)], "not a profile written by scripts/profile_step.py"),
             (["--out", str(blocked / "sub")], "cannot write there"),
             (["--steps", "0"], "--steps and --warmup must be at least 1")]
    for argv, message in cases:
        with pytest.raises(SystemExit) as exit_info:
            profile.main(argv)
        assert exit_info.value.code == 2
        assert message in capsys.readouterr().err, argv
