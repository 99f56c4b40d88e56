"""HuggingFace <-> ours for Qwen3, Qwen3-MoE, Qwen2-MoE, Mixtral and DeepSeek-V3, proven with real transformers
models.

Each reference is a tiny random transformers model (hidden 64, 2 layers, 4 or 8 experts, vocabulary 512) saved
with save_pretrained; norms and DeepSeek's score-correction bias are randomised too, so a swapped tensor changes
the logits.
"""

import json
import os

import pytest
import torch
import transformers
from safetensors.torch import load_file

from ascend_llm_recipes.common.errors import ConversionError
from ascend_llm_recipes.models.config import ModelConfig
from ascend_llm_recipes.models.conversion.hf import from_hf
from ascend_llm_recipes.models.conversion.hf_families import hf_config_from_model
from ascend_llm_recipes.models.conversion.ours import HF_WEIGHTS_FILE
from ascend_llm_recipes.models.conversion.tables import DEEPSEEK_TABLE, HF_TABLE, MIXTRAL_TABLE, Row
from ascend_llm_recipes.models.conversion.verify import KL_TOLERANCE
from ascend_llm_recipes.models.conversion.write import summary
from ascend_llm_recipes.training.tools.export import to_hf

TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5)
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
# DeepSeek-V3: MLA (q latent 32, kv latent 32, heads of 16 + 16 rotary, values 32), 8 experts in 4 groups of which
# the best 2 are searched, one shared expert, layer 0 dense
DEEPSEEK = dict(num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                n_shared_experts=1, n_group=4, topk_group=2, first_k_dense_replace=1, routed_scaling_factor=2.5,
                kv_lora_rank=32, q_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=32)

FAMILIES = {  # case: (config class, overrides, dtype the weights are saved in)
    "qwen3": (transformers.Qwen3Config, dict(head_dim=32), torch.float32),
    "qwen3_moe": (transformers.Qwen3MoeConfig, dict(head_dim=32, norm_topk_prob=False, **MOE), torch.bfloat16),
    "qwen3_moe_sparse_step_2": (transformers.Qwen3MoeConfig, dict(norm_topk_prob=True, decoder_sparse_step=2, **MOE),
                                torch.float32),
    "qwen2_moe": (transformers.Qwen2MoeConfig, dict(shared_expert_intermediate_size=48, **MOE), torch.float32),
    "mixtral": (transformers.MixtralConfig, dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=32),
                torch.float32),
    # rotary rows interleaved (rope_interleave: true, transformers' default and the released layout), bf16 weights
    "deepseek_v3": (transformers.DeepseekV3Config, DEEPSEEK, torch.bfloat16),
    "deepseek_v3_q_proj": (transformers.DeepseekV3Config, dict(DEEPSEEK, q_lora_rank=None), torch.float32),
    # already in half-split order: read unpermuted, exported interleaved
    "deepseek_v3_half": (transformers.DeepseekV3Config, dict(DEEPSEEK, rope_interleave=False), torch.float32),
}


def tokens(seed=1):
    return torch.randint(0, TINY["vocab_size"], (2, 16), generator=torch.Generator().manual_seed(seed))


def logits_of(hf_dir):
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    with torch.no_grad():
        return model.eval()(tokens()).logits


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory):
    """{case: (HF directory, the model as float32)}: each tiny model saved once with save_pretrained."""
    root, made = tmp_path_factory.mktemp("hf_moe"), {}
    for case, (config_class, overrides, dtype) in FAMILIES.items():
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(config_class(**{**TINY, **overrides}))
        with torch.no_grad():
            for name, param in model.named_parameters():
                param.copy_(torch.randn_like(param) * 0.05 + (1.0 if "norm" in name else 0.0))
            for name, buffer in model.named_buffers():  # DeepSeek's score-correction bias is a saved buffer
                if name.endswith("e_score_correction_bias"):
                    buffer.copy_(torch.randn_like(buffer) * 0.05)
        model = model.to(dtype)
        model.save_pretrained(root / case)
        made[case] = (root / case, model.float())
    return made


def assert_nothing_written(out_dir):
    parent, name = os.path.split(os.path.abspath(out_dir))
    assert not os.path.exists(out_dir)
    assert not [p for p in os.listdir(parent) if p.startswith(f".{name}.partial")]


@pytest.mark.parametrize("case", FAMILIES)
def test_logits_match_transformers_and_export_gives_the_same_model(hf_models, tmp_path, case):
    hf_dir, model = hf_models[case]
    ours, back = tmp_path / "ours", tmp_path / "back"
    manifest = from_hf(str(hf_dir), str(ours), verify=True, show_progress=False)
    parity = manifest["verify"]
    print(f"\n[parity] {case}: max |delta logits| {parity['max_abs_delta']:.3e}, KL(hf || ours) {parity['kl']:.3e}")
    assert parity["max_abs_delta"] <= parity["max_abs_tolerance"] and parity["kl"] <= KL_TOLERANCE
    cfg, deepseek = manifest["model"], case.startswith("deepseek")
    assert cfg["num_experts"] == (0 if case == "qwen3" else 8 if deepseek else 4)
    assert cfg["qk_norm"] == case.startswith("qwen3")
    # qwen3_moe_sparse_step_2: layer 1 sparse ((1+1) % 2 == 0); DeepSeek: first_k_dense_replace 1
    assert cfg["dense_layers"] == ([0] if case == "qwen3_moe_sparse_step_2" or deepseek else [])
    interleaved = model.config.to_dict().get("rope_interleave")
    if deepseek:
        assert (cfg["kv_lora_rank"], cfg.get("q_lora_rank"), cfg["shared_expert_intermediate_size"]) == \
            (32, model.config.q_lora_rank, 32)
        assert (cfg["router_score"], cfg["expert_bias"], cfg["expert_bias_update_rate"]) == ("sigmoid", True, 0.0)
        assert manifest["source"]["rope_interleave"] is interleaved
        assert any(note.startswith("expert_bias_update_rate: 0") for note in manifest["notes"])

    to_hf(str(ours), str(back), show_progress=False)
    restored, expected = load_file(str(back / HF_WEIGHTS_FILE)), model.state_dict()
    assert sorted(restored) == sorted(expected)
    exported = transformers.AutoConfig.from_pretrained(str(back))
    assert exported.model_type == model.config.model_type
    if interleaved is False:  # exported interleaved (the released layout): the rotary rows differ, not the logits
        assert exported.rope_interleave is True
        torch.testing.assert_close(logits_of(str(back)), logits_of(str(hf_dir)), rtol=0, atol=1e-5)
        return
    for name, tensor in expected.items():  # bf16 sources widen exactly and come back as those float32 values
        assert torch.equal(restored[name], tensor), name
    # (reloaded in float32 from hf_dir, not model.float(): to(bfloat16) rounded the rotary frequencies too)
    torch.testing.assert_close(logits_of(str(back)), logits_of(str(hf_dir)), rtol=0, atol=0)


def swapped(rows, ours_a, ours_b):
    """(our name, the row reading the other tensor's name) for both: a table mapping the two tensors crosswise."""
    return [(x, Row(x, rows[y].theirs, rows[x].transform)) for x, y in ((ours_a, ours_b), (ours_b, ours_a))]


EXPERT = "model.layers.{n}.mlp.experts.{e}"
WRONG = {  # case: the table a mistaken converter would use, with two of its rows crossed
    "qwen3_moe": (HF_TABLE, f"{EXPERT}.gate_proj.weight", f"{EXPERT}.up_proj.weight"),
    "mixtral": (MIXTRAL_TABLE, f"{EXPERT}.gate_proj.weight", f"{EXPERT}.up_proj.weight"),  # w1 <-> w3
}


@pytest.mark.parametrize("case", WRONG)
def test_verify_refuses_crossed_expert_tensors(hf_models, tmp_path, monkeypatch, case):
    """Gate and up projections have the same shape: only the logits check sees them crossed."""
    rows, a, b = WRONG[case]
    for ours, row in swapped(rows, a, b):
        monkeypatch.setitem(rows, ours, row)
    with pytest.raises(ConversionError, match="converted logits differ from transformers'"):
        from_hf(str(hf_models[case][0]), str(tmp_path / "ours"), verify=True, show_progress=False)
    assert_nothing_written(tmp_path / "ours")


def test_verify_refuses_interleaved_rotary_rows_read_unpermuted(hf_models, tmp_path, monkeypatch):
    """rope_interleave: true read as if half-split: same shapes, wrong rotary pairs; only the logits show it."""
    for ours in ("model.layers.{n}.self_attn.q_b_proj.weight", "model.layers.{n}.self_attn.kv_a_proj_with_mqa.weight"):
        monkeypatch.setitem(DEEPSEEK_TABLE, ours, Row(ours, DEEPSEEK_TABLE[ours].theirs))
    with pytest.raises(ConversionError, match="converted logits differ from transformers'"):
        from_hf(str(hf_models["deepseek_v3"][0]), str(tmp_path / "ours"), verify=True, show_progress=False)
    assert_nothing_written(tmp_path / "ours")


def deepseek_v3(**overrides):
    return transformers.DeepseekV3Config(**{**TINY, **DEEPSEEK, **overrides})


YARN = {"type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096, "beta_fast": 32, "beta_slow": 1,
        "mscale": 1.0, "mscale_all_dim": 1.0}  # DeepSeek-V3's released config.json
REFUSED = {  # case: (config, what the error names)
    "deepseek_v2": (lambda: transformers.DeepseekV2Config(**TINY),
                    "'deepseek_v2' is not supported: its router (softmax scores, greedy or group-limited-greedy"),
    "deepseek_v3_yarn": (lambda: deepseek_v3(rope_scaling=YARN, max_position_embeddings=163840),
                         "is not supported (None only): rotary positions are unscaled; DeepSeek-V3's released "
                         "config.json sets yarn"),
    "deepseek_v3_attention_bias": (lambda: deepseek_v3(attention_bias=True),
                                   "attention_bias: True is not supported (False only): it biases q_a_proj"),
    "deepseek_v3_kv_heads": (lambda: deepseek_v3(num_key_value_heads=2),
                             "num_key_value_heads: 2 is not supported (num_attention_heads 4 only)"),
    "deepseek_v3_softmax": (lambda: deepseek_v3(scoring_func="softmax"),
                            "scoring_func: 'softmax' is not supported ('sigmoid' only)"),
    "deepseek_v3_greedy": (lambda: deepseek_v3(topk_method="greedy"),
                           "topk_method: 'greedy' is not supported ('noaux_tc' only)"),
    "deepseek_v3_moe_layer_freq": (lambda: deepseek_v3(moe_layer_freq=2),
                                   "moe_layer_freq: 2 is not supported (1 only)"),
    "deepseek_v3_fp8": (lambda: deepseek_v3(quantization_config={"quant_method": "fp8", "fmt": "e4m3",
                                                                 "weight_block_size": [128, 128]}),
                        "is not supported: quantised weights (FP8 blocks with their scales, ...) are not read"),
    "mixtral_sliding_window": (lambda: transformers.MixtralConfig(**TINY, sliding_window=32),
                               "sliding_window: 32 is not supported (None only): attention is full causal"),
    "mixtral_no_experts": (lambda: transformers.MixtralConfig(**TINY, num_local_experts=0),
                           "num_local_experts: 0 is not valid (>= 1)"),
    "mixtral_jitter": (lambda: transformers.MixtralConfig(**TINY, router_jitter_noise=0.1),
                       "router_jitter_noise: 0.1 is not supported (0.0 only)"),
    "qwen3_attention_bias": (lambda: transformers.Qwen3Config(**TINY, attention_bias=True),
                             "attention_bias: True is not supported (False only): it biases o_proj"),
    "qwen3_moe_sliding_window": (lambda: transformers.Qwen3MoeConfig(**TINY, use_sliding_window=True, **MOE),
                                 "use_sliding_window: True is not supported (False only)"),
    "qwen2_moe_sliding_window": (lambda: transformers.Qwen2MoeConfig(**TINY, use_sliding_window=True, **MOE),
                                 "use_sliding_window: True is not supported (False only)"),
}


@pytest.mark.parametrize("case", REFUSED)
def test_unsupported_options_are_refused_by_name(tmp_path, case):
    make, message = REFUSED[case]
    make().save_pretrained(tmp_path / "hf")  # a real config.json; the refusal comes before any weight is read
    with pytest.raises(ConversionError, match=message.replace("(", r"\(").replace(")", r"\)")):
        from_hf(str(tmp_path / "hf"), str(tmp_path / "ours"), show_progress=False)
    assert_nothing_written(tmp_path / "ours")


def test_export_refuses_a_combination_no_family_has():
    base = dict(vocab_size=512, hidden_size=64, num_layers=2, num_heads=4, intermediate_size=96, seq_length=64,
                num_experts=4, moe_intermediate_size=32)
    assert hf_config_from_model(ModelConfig(**base, qk_norm=True))["model_type"] == "qwen3_moe"
    assert hf_config_from_model(ModelConfig(**base))["model_type"] == "mixtral"
    assert hf_config_from_model(ModelConfig(**base, shared_expert_intermediate_size=48, shared_expert_gate=True,
                                            qkv_bias=True))["model_type"] == "qwen2_moe"
    mla = dict(kv_lora_rank=32, q_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=32,
               router_score="sigmoid", expert_bias=True, shared_expert_intermediate_size=64, dense_layers=[0])
    assert hf_config_from_model(ModelConfig(**base, **mla))["model_type"] == "deepseek_v3"
    for options in (dict(qk_norm=True, shared_expert_intermediate_size=48),  # Qwen3-MoE has no shared expert
                    dict(shared_expert_intermediate_size=48),                # Qwen2-MoE's shared expert is gated
                    dict(norm_topk_prob=False),                              # Mixtral always renormalises
                    dict(dense_layers=[0]),                                  # Mixtral has no dense layers
                    dict(router_score="sigmoid", expert_bias=True),          # DeepSeek's router needs MLA's family
                    dict(mla, router_score="softmax", expert_bias=False),    # and MLA DeepSeek-V3's router
                    dict(mla, shared_expert_intermediate_size=48),           # shared experts as wide as k experts
                    dict(mla, shared_expert_gate=True),
                    dict(mla, dense_layers=[1])):                            # dense layers first
        with pytest.raises(ConversionError, match="no HuggingFace family has this model's combination of options"):
            hf_config_from_model(ModelConfig(**base, **options))


def test_multi_token_prediction_modules_are_set_aside_with_a_note(tmp_path):
    """A released DeepSeek-V3 stores its MTP module as layer num_hidden_layers: named in the manifest, not converted."""
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(deepseek_v3(num_hidden_layers=3)).save_pretrained(tmp_path / "hf")
    with open(tmp_path / "hf" / "config.json", encoding="utf-8") as f:
        config = json.load(f)
    with open(tmp_path / "hf" / "config.json", "w", encoding="utf-8") as f:  # layer 2 becomes the MTP module
        json.dump({**config, "num_hidden_layers": 2, "num_nextn_predict_layers": 1}, f)
    manifest = from_hf(str(tmp_path / "hf"), str(tmp_path / "ours"), show_progress=False)
    layer_2 = sorted(name for name in load_file(str(tmp_path / "hf" / "model.safetensors"))
                     if name.startswith("model.layers.2."))
    assert sorted(manifest["not_converted"]) == layer_2 and manifest["model"]["num_layers"] == 2
    assert not any(name.startswith("model.layers.2.") for name in manifest["ignored"])
    assert f"did not convert {len(layer_2)} tensors" in summary(manifest, str(tmp_path / "ours"))
    assert any("multi-token-prediction module(s) (model.layers.2.* on) are not converted" in note
               for note in manifest["notes"])
