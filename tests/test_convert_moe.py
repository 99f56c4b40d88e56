"""HuggingFace <-> ours for Qwen3, Qwen3-MoE, Qwen2-MoE and Mixtral, proven with real transformers models.

Each reference is a tiny random transformers model (hidden 64, 2 layers, 4 experts, vocabulary 512) saved with
save_pretrained; norms are randomised too, so a swapped tensor changes the logits.
"""

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
from ascend_llm_recipes.models.conversion.tables import HF_TABLE, MIXTRAL_TABLE, Row
from ascend_llm_recipes.models.conversion.verify import KL_TOLERANCE
from ascend_llm_recipes.training.tools.export import to_hf

TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5)
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)

FAMILIES = {  # case: (config class, overrides, dtype the weights are saved in)
    "qwen3": (transformers.Qwen3Config, dict(head_dim=32), torch.float32),
    "qwen3_moe": (transformers.Qwen3MoeConfig, dict(head_dim=32, norm_topk_prob=False, **MOE), torch.bfloat16),
    "qwen3_moe_sparse_step_2": (transformers.Qwen3MoeConfig, dict(norm_topk_prob=True, decoder_sparse_step=2, **MOE),
                                torch.float32),
    "qwen2_moe": (transformers.Qwen2MoeConfig, dict(shared_expert_intermediate_size=48, **MOE), torch.float32),
    "mixtral": (transformers.MixtralConfig, dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=32),
                torch.float32),
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
    cfg = manifest["model"]
    assert cfg["num_experts"] == (0 if case == "qwen3" else 4)
    assert cfg["qk_norm"] == case.startswith("qwen3")
    assert cfg["dense_layers"] == ([0] if case == "qwen3_moe_sparse_step_2" else [])  # layer 1 sparse: (1+1) % 2 == 0

    to_hf(str(ours), str(back), show_progress=False)
    restored, expected = load_file(str(back / HF_WEIGHTS_FILE)), model.state_dict()
    assert sorted(restored) == sorted(expected)
    for name, tensor in expected.items():  # bf16 sources widen exactly and come back as those float32 values
        assert torch.equal(restored[name], tensor), name
    assert transformers.AutoConfig.from_pretrained(str(back)).model_type == model.config.model_type
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


REFUSED = {  # case: (config, what the error names)
    "deepseek_v3": (lambda: transformers.DeepseekV3Config(**TINY),
                    "'deepseek_v3' is not supported: multi-head latent attention and sigmoid routing"),
    "deepseek_v2": (lambda: transformers.DeepseekV2Config(**TINY),
                    "'deepseek_v2' is not supported: multi-head latent attention and sigmoid routing"),
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
    for options in (dict(qk_norm=True, shared_expert_intermediate_size=48),  # Qwen3-MoE has no shared expert
                    dict(shared_expert_intermediate_size=48),                # Qwen2-MoE's shared expert is gated
                    dict(norm_topk_prob=False),                              # Mixtral always renormalises
                    dict(dense_layers=[0])):                                 # Mixtral has no dense layers
        with pytest.raises(ConversionError, match="no HuggingFace family has this model's combination of options"):
            hf_config_from_model(ModelConfig(**base, **options))
