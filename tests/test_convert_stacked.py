"""MoE checkpoints in MindFormers' stacked expert layout (what a MoE recipe runs on Ascend), both ways, as a user
converts and loads them: `convert_checkpoint.py --expert-layout stacked` from a tiny random Qwen3-MoE saved by
transformers, read back by --verify, --to-hf and --to-megatron, and the load check of either kind of recipe."""

import json
import os
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import transformers
import yaml
from safetensors.numpy import load_file

from conftest import MOE_RECIPE, load_script
from ascend_llm_recipes.common.errors import ConversionError, LaunchError
from ascend_llm_recipes.models.conversion.hf import from_hf
from ascend_llm_recipes.models.conversion.ours import (CHECKPOINT_FILE, HF_WEIGHTS_FILE, MANIFEST_FILE,
                                                       MODEL_SECTION_FILE, read_model_file, stack_moe_layers)
from ascend_llm_recipes.training.recipe.loading import load_recipe
from ascend_llm_recipes.training.tools.export import to_hf, to_megatron
from ascend_llm_recipes.training.worker.train import check_checkpoint_parameters

# tiny_moe_cpu.yaml's sizes as transformers builds Qwen3-MoE: layer 0 dense, layer 1 with 4 experts of width 48
HF_CONFIG = dict(vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5, num_experts=4,
                 num_experts_per_tok=2, moe_intermediate_size=48, norm_topk_prob=True, mlp_only_layers=[0],
                 eos_token_id=2)


def save_model(config, out_dir):
    """A tiny random transformers model (norms randomised too) saved in float32 with save_pretrained."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(torch.randn_like(param) * 0.05 + (1.0 if "norm" in name else 0.0))
    model.save_pretrained(out_dir)
    return str(out_dir)


def manifest_of(directory):
    with open(os.path.join(directory, MANIFEST_FILE), encoding="utf-8") as f:
        return json.load(f)


def assert_same_hf_tensors(exported, original):
    back, original = (load_file(os.path.join(d, HF_WEIGHTS_FILE)) for d in (exported, original))
    assert back.keys() == original.keys()
    for name, value in original.items():
        np.testing.assert_array_equal(back[name], value, err_msg=name)


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """The Qwen3-MoE converted per expert (the default) and, through the script, stacked with --verify."""
    root = tmp_path_factory.mktemp("stacked")
    hf = save_model(transformers.Qwen3MoeConfig(**HF_CONFIG), root / "hf")
    per_expert, stacked = str(root / "per_expert"), str(root / "stacked")
    from_hf(hf, per_expert, show_progress=False)
    code = load_script("convert_checkpoint").main(["--from-hf", hf, "--output", stacked, "--expert-layout", "stacked",
                                                   "--verify", "--quiet"])
    return SimpleNamespace(hf=hf, per_expert=per_expert, stacked=stacked, code=code)


def test_a_stacked_conversion_is_the_per_expert_one_stacked_and_passes_verify(converted):
    assert converted.code == 0
    manifest = manifest_of(converted.stacked)
    assert manifest["expert_layout"] == "stacked" and manifest_of(converted.per_expert)["expert_layout"] == "per-expert"
    assert manifest["verify"]["max_abs_delta"] <= manifest["verify"]["max_abs_tolerance"]  # our CPU model, unstacked
    assert any("MindFormers' MoELayer" in note for note in manifest["notes"])
    cfg = read_model_file(os.path.join(converted.stacked, MODEL_SECTION_FILE))
    stacked = load_file(os.path.join(converted.stacked, CHECKPOINT_FILE))
    expected = stack_moe_layers(load_file(os.path.join(converted.per_expert, CHECKPOINT_FILE)), cfg)
    assert stacked.keys() == expected.keys()
    assert {"model.layers.1.mlp.experts.weight1", "model.layers.0.mlp.gate_proj.weight"} <= stacked.keys()
    for name, value in expected.items():
        np.testing.assert_array_equal(stacked[name], value, err_msg=name)


def test_a_stacked_conversion_exports_to_hf_and_megatron_as_the_per_expert_one(converted, tmp_path):
    to_hf(converted.stacked, str(tmp_path / "hf"), show_progress=False)
    assert_same_hf_tensors(str(tmp_path / "hf"), converted.hf)
    for source in ("stacked", "per_expert"):
        to_megatron(getattr(converted, source), str(tmp_path / source), ep=2, show_progress=False)
    for rank in ("mp_rank_00_000", "mp_rank_00_001"):
        states = [torch.load(tmp_path / source / "release" / rank / "model_optim_rng.pt", weights_only=False)["model"]
                  for source in ("stacked", "per_expert")]
        assert states[0].keys() == states[1].keys()
        for name, value in states[1].items():
            assert torch.equal(states[0][name], value), (rank, name)


def test_the_option_is_refused_where_it_does_not_apply(converted, tmp_path, capsys):
    convert = load_script("convert_checkpoint").main
    dense = save_model(transformers.Qwen3Config(**{k: v for k, v in HF_CONFIG.items() if "expert" not in k
                                                   and k not in ("norm_topk_prob", "mlp_only_layers")}),
                       tmp_path / "dense")
    assert convert(["--from-hf", dense, "--output", str(tmp_path / "out"), "--expert-layout", "stacked"]) == 2
    assert "--expert-layout stacked: " + dense + " is a dense model (num_experts 0)" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        convert(["--to-hf", converted.stacked, "--output", str(tmp_path / "out"), "--expert-layout", "stacked"])
    assert "--expert-layout applies to conversions into our format" in capsys.readouterr().err
    with pytest.raises(ConversionError, match="--expert-layout sideways: unknown; use per-expert or stacked"):
        from_hf(converted.hf, str(tmp_path / "out"), show_progress=False, expert_layout="sideways")
    assert not (tmp_path / "out").exists()


def test_a_gated_shared_expert_is_stacked_too_and_round_trips(tmp_path):
    """Qwen2-MoE's gated shared expert: MindFormers' SharedExpertMLPInterleaved tensors, --verify, back to HF."""
    hf = save_model(transformers.Qwen2MoeConfig(**{**HF_CONFIG, "shared_expert_intermediate_size": 48}),
                    tmp_path / "hf")
    manifest = from_hf(hf, str(tmp_path / "stacked"), verify=True, show_progress=False, expert_layout="stacked")
    assert {"model.layers.1.mlp.shared_experts.linear_fc1.weight",
            "model.layers.1.mlp.shared_experts.shared_experts_gate.weight"} <= {t["name"] for t in manifest["tensors"]}
    to_hf(str(tmp_path / "stacked"), str(tmp_path / "back"), show_progress=False)
    assert_same_hf_tensors(str(tmp_path / "back"), hf)


def recipe_for(converted_dir, device_target):
    """tiny_moe_cpu.yaml loading a conversion, with its model section, on `device_target` (planning: no devices)."""
    with open(os.path.join(converted_dir, MODEL_SECTION_FILE), encoding="utf-8") as f:
        model = yaml.safe_load(f)["model"]["model_config"]
    return load_recipe(MOE_RECIPE, [f"load_checkpoint={converted_dir}", "load_ckpt_format=safetensors",
                                    f"context.device_target={device_target}",
                                    *(f"model.model_config.{k}={json.dumps(v)}" for k, v in model.items())],
                       planning=True)


def test_the_load_check_expects_the_layout_the_recipe_runs_and_names_the_other(converted):
    check_checkpoint_parameters(recipe_for(converted.stacked, "Ascend"), 0)
    check_checkpoint_parameters(recipe_for(converted.per_expert, "CPU"), 0)
    with pytest.raises(LaunchError, match=r"holds the Mixture-of-Experts layers per expert \(model\.layers\.1\.mlp\."
                                          r"experts\.0\.gate_proj\.weight, \.\.\.: our CPU model's layout\); the "
                                          r"recipe runs them as MindFormers' MoELayer \(context\.device_target "
                                          r"Ascend\)") as refused:
        check_checkpoint_parameters(recipe_for(converted.per_expert, "Ascend"), 0)
    assert (f"python scripts/convert_checkpoint.py --from-hf {converted.hf} --output {converted.per_expert}-stacked "
            "--expert-layout stacked" in str(refused.value))
    with pytest.raises(LaunchError, match=r"holds the Mixture-of-Experts layers stacked \(model\.layers\.1\.mlp\."
                                          r"experts\.weight1, \.\.\.: MindFormers' MoELayer's layout\); the recipe "
                                          r"runs them as our MoE \(context\.device_target CPU\)") as refused:
        check_checkpoint_parameters(recipe_for(converted.stacked, "CPU"), 0)
    assert f"--output {converted.stacked}-per-expert --expert-layout per-expert" in str(refused.value)


def test_write_recipe_splits_the_experts_and_says_which_conversion_loads_on_ascend(converted, tmp_path):
    """--write-recipe writes an Ascend recipe: a MoE model gets the largest expert-parallel degree the rules allow,
    and a per-expert conversion is named as the one the Ascend MoE layer will not load."""
    from ascend_llm_recipes.training.tools.export import write_recipe

    for which, warned in (("per_expert", True), ("stacked", False)):
        written = write_recipe(str(tmp_path / f"{which}.yaml"), getattr(converted, which), devices=8)
        recipe = load_recipe(written["path"], planning=True)
        assert recipe.parallel_config.expert_parallel == 4   # the 4 experts over DP 8
        assert any("expert parallel 4: each device holds 1 of every MoE layer's 4 experts" in n
                   for n in written["notes"])
        assert any("convert again with --expert-layout stacked" in n for n in written["notes"]) == warned


def test_the_conversion_command_named_works_when_the_original_source_is_gone(tmp_path):
    """A 60 GB source is often deleted after its conversion: the load check's command then goes through the
    converted weights themselves (--to-hf, then --from-hf in the wanted layout), and that command works."""
    import shlex
    import shutil

    hf = save_model(transformers.Qwen3MoeConfig(**HF_CONFIG), tmp_path / "hf")
    stacked = str(tmp_path / "stacked")
    from_hf(hf, stacked, show_progress=False, expert_layout="stacked")
    shutil.rmtree(hf)
    with pytest.raises(LaunchError) as refused:
        check_checkpoint_parameters(recipe_for(stacked, "CPU"), 0)
    command = str(refused.value).split("load that: ", 1)[1].split(" (the weights", 1)[0]
    assert command.startswith(f"python scripts/convert_checkpoint.py --to-hf {stacked} --output {stacked}-hf && ")
    convert = load_script("convert_checkpoint").main
    for part in command.split(" && "):
        assert convert(shlex.split(part)[2:] + ["--quiet"]) == 0
    check_checkpoint_parameters(recipe_for(f"{stacked}-per-expert", "CPU"), 0)
