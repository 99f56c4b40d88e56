"""Published Llama-family sizes, one row each with its source.

Fields use the recipe's `model.model_config` names, so a preset can be pasted into a
recipe. Parameter counts follow from models/arithmetic.py (tested against the published
totals).
"""

from ascend_llm_recipes.models.config import ModelConfig

LLAMA2 = "Touvron et al. 2023, 'Llama 2', table 1; HF meta-llama/Llama-2-{}-hf config.json"
LLAMA3 = "Meta 2024, 'The Llama 3 Herd of Models', table 3; HF meta-llama/Meta-Llama-3-{}B config.json"

PRESETS = {
    "llama2-7b": dict(vocab_size=32000, hidden_size=4096, num_layers=32, num_heads=32, num_kv_heads=32,
                      intermediate_size=11008, seq_length=4096, rope_theta=10000.0, rms_norm_eps=1e-5,
                      source=LLAMA2.format("7b")),
    "llama2-13b": dict(vocab_size=32000, hidden_size=5120, num_layers=40, num_heads=40, num_kv_heads=40,
                       intermediate_size=13824, seq_length=4096, rope_theta=10000.0, rms_norm_eps=1e-5,
                       source=LLAMA2.format("13b")),
    "llama2-70b": dict(vocab_size=32000, hidden_size=8192, num_layers=80, num_heads=64, num_kv_heads=8,
                       intermediate_size=28672, seq_length=4096, rope_theta=10000.0, rms_norm_eps=1e-5,
                       source=LLAMA2.format("70b")),
    "llama3-8b": dict(vocab_size=128256, hidden_size=4096, num_layers=32, num_heads=32, num_kv_heads=8,
                      intermediate_size=14336, seq_length=8192, rope_theta=500000.0, rms_norm_eps=1e-5,
                      source=LLAMA3.format(8)),
    "llama3-70b": dict(vocab_size=128256, hidden_size=8192, num_layers=80, num_heads=64, num_kv_heads=8,
                       intermediate_size=28672, seq_length=8192, rope_theta=500000.0, rms_norm_eps=1e-5,
                       source=LLAMA3.format(70)),
    # No published model of this size: Llama-3-70B's width, heads and vocabulary, 88 layers
    # and a 36,864-wide MLP, giving 95.1B parameters, for the DP4 x TP4 x PP2 starting point
    # that practitioners report for 32 Ascend devices (a published field report on Ascend pretraining).
    "dense-100b": dict(vocab_size=128256, hidden_size=8192, num_layers=88, num_heads=64, num_kv_heads=8,
                       intermediate_size=36864, seq_length=4096, rope_theta=500000.0, rms_norm_eps=1e-5,
                       source="this repository: Llama-3-70B proportions scaled to ~100B (no published model)"),
}

# Published totals (HF model cards / safetensors index "total_size" / 2 bytes).
PUBLISHED_PARAMETERS = {
    "llama2-7b": 6_738_415_616,
    "llama2-13b": 13_015_864_320,
    "llama2-70b": 68_976_648_192,
    "llama3-8b": 8_030_261_248,
    "llama3-70b": 70_553_706_496,
}


def preset(name: str) -> ModelConfig:
    """A preset as a model_config (its `source` stays in PRESETS)."""
    if name not in PRESETS:
        raise KeyError(f"unknown preset {name!r}; known: {', '.join(PRESETS)}")
    return ModelConfig(**{key: value for key, value in PRESETS[name].items() if key != "source"})
