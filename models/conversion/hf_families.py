"""The HuggingFace model_types we convert: config.json <-> our model_config, one Family entry per model_type.

A Family says what a model_type implies for our model (q/k/v bias, q/k norms, how its Mixture-of-Experts keys
read), which config.json options must keep the one value our model implements (each refused by name with the
reason), transformers' defaults for keys save_pretrained leaves out, and the table naming its tensors
(tables.HF_TABLE, or tables.MIXTRAL_TABLE). model_config_from_hf and hf_config_from_model are generated from
these entries; hf.py reads and writes the weights.
"""

from dataclasses import dataclass, field

from ascend_llm_recipes.common.errors import ConversionError
from ascend_llm_recipes.models.config import ModelConfig
from ascend_llm_recipes.models.conversion.tables import HF_TABLE, MIXTRAL_TABLE


DEFAULT_MAX_SEQ_LENGTH = 4096  # the rotary table and causal mask are seq_length-sized; long contexts opt in


@dataclass(frozen=True)
class Family:
    """A HuggingFace model_type this converter reads: what it implies and what it must not use."""

    model_type: str
    architecture: str
    qkv_bias: object     # True/False, or the config.json key holding it (Qwen2-MoE's qkv_bias)
    requirements: tuple  # (config.json key, the only supported value, why)
    defaults: dict       # transformers' class defaults for keys save_pretrained may leave out
    qk_norm: bool = False           # per-head q/k RMSNorm (Qwen3)
    head_dim: bool = False          # config.json's head_dim is the head width (else hidden_size / heads only)
    moe: tuple = ()                 # (our model_config field, config.json key) of its MoE options
    fixed: dict = field(default_factory=dict)  # our MoE fields the family implies (Mixtral: norm_topk_prob)
    sparse_step: bool = False       # mlp_only_layers + decoder_sparse_step pick the dense layers (Qwen MoE)
    rows: dict = None               # its tensor table (tables.py); None: HF_TABLE

    @property
    def table(self) -> dict:
        return HF_TABLE if self.rows is None else self.rows


COMMON_REQUIREMENTS = (
    ("hidden_act", "silu", "the MLP is SwiGLU with SiLU"),
    ("rope_scaling", None, "rotary positions are unscaled (no linear, dynamic, yarn or llama3 scaling)"),
    ("attention_dropout", 0.0, "the model has no attention dropout"),
)
COMMON_DEFAULTS = {"rms_norm_eps": 1e-6, "rope_theta": 10000.0, "initializer_range": 0.02,
                   "tie_word_embeddings": False, "pad_token_id": None, "hidden_act": "silu", "rope_scaling": None,
                   "attention_dropout": 0.0}
NO_SLIDING_WINDOW = ("use_sliding_window", False, "attention is full causal attention, never a sliding window")
# Mistral and Mixtral have no use_sliding_window switch (Qwen3-MoE's config class nulls sliding_window without it)
NO_WINDOW = ("sliding_window", None, "attention is full causal attention; a sliding window lets each token see only "
                                     "the last sliding_window tokens")
O_PROJ_BIAS = ("attention_bias", False, "it biases o_proj as well as q/k/v; the model has q/k/v bias only")
QWEN_MOE = (("num_experts", "num_experts"), ("num_experts_per_tok", "num_experts_per_tok"),
            ("moe_intermediate_size", "moe_intermediate_size"), ("norm_topk_prob", "norm_topk_prob"),
            ("router_aux_loss_coef", "router_aux_loss_coef"))
QWEN_MOE_DEFAULTS = {"decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": False,
                     "router_aux_loss_coef": 0.001, "max_position_embeddings": 32768, "bos_token_id": None,
                     "eos_token_id": None, "use_sliding_window": False, "sliding_window": None}

FAMILIES = {
    "llama": Family("llama", "LlamaForCausalLM", qkv_bias=False, requirements=(
        O_PROJ_BIAS,
        ("mlp_bias", False, "the MLP has no biases"),
    ), defaults={**COMMON_DEFAULTS, "max_position_embeddings": 2048, "bos_token_id": 1, "eos_token_id": 2,
                 "attention_bias": False, "mlp_bias": False}),
    "qwen2": Family("qwen2", "Qwen2ForCausalLM", qkv_bias=True, requirements=(NO_SLIDING_WINDOW,),
                    defaults={**COMMON_DEFAULTS, "max_position_embeddings": 32768, "bos_token_id": None,
                              "eos_token_id": None, "num_key_value_heads": 32, "use_sliding_window": False}),
    # Mistral 7B v0.2/v0.3 (sliding_window null) are Llama's decoder under another model_type; v0.1's
    # window of 4096 equals full attention only up to 4096 tokens, and transformers' default is that window.
    "mistral": Family("mistral", "MistralForCausalLM", qkv_bias=False, requirements=(NO_WINDOW,),
                      defaults={**COMMON_DEFAULTS, "max_position_embeddings": 131072, "bos_token_id": 1,
                                "eos_token_id": 2, "num_key_value_heads": 8, "sliding_window": 4096}),
    # Qwen3 (modeling_qwen3.py): Qwen2's decoder without q/k/v bias, with per-head q/k RMSNorm and its own head_dim.
    "qwen3": Family("qwen3", "Qwen3ForCausalLM", qkv_bias=False, qk_norm=True, head_dim=True,
                    requirements=(O_PROJ_BIAS, NO_SLIDING_WINDOW),
                    defaults={**COMMON_DEFAULTS, "max_position_embeddings": 32768, "bos_token_id": None,
                              "eos_token_id": None, "num_key_value_heads": 32, "head_dim": 128,
                              "attention_bias": False, "use_sliding_window": False}),
    # Qwen3-MoE: Qwen3's attention; layer i is sparse iff i not in mlp_only_layers and (i + 1) % decoder_sparse_step
    # == 0 (modeling_qwen3_moe.py Qwen3MoeDecoderLayer).
    "qwen3_moe": Family("qwen3_moe", "Qwen3MoeForCausalLM", qkv_bias=False, qk_norm=True, head_dim=True,
                        requirements=(O_PROJ_BIAS, NO_SLIDING_WINDOW), moe=QWEN_MOE, sparse_step=True,
                        defaults={**COMMON_DEFAULTS, **QWEN_MOE_DEFAULTS, "num_key_value_heads": 4,
                                  "attention_bias": False, "num_experts": 128, "num_experts_per_tok": 8,
                                  "moe_intermediate_size": 768}),
    # Qwen2-MoE: Qwen2's attention (q/k/v bias from its qkv_bias key), a shared expert scaled by a sigmoid gate.
    "qwen2_moe": Family("qwen2_moe", "Qwen2MoeForCausalLM", qkv_bias="qkv_bias", requirements=(NO_SLIDING_WINDOW,),
                        moe=QWEN_MOE + (("shared_expert_intermediate_size", "shared_expert_intermediate_size"),),
                        fixed={"shared_expert_gate": True}, sparse_step=True,
                        defaults={**COMMON_DEFAULTS, **QWEN_MOE_DEFAULTS, "num_key_value_heads": 16, "qkv_bias": True,
                                  "num_experts": 60, "num_experts_per_tok": 4, "moe_intermediate_size": 1408,
                                  "shared_expert_intermediate_size": 5632}),
    # Mixtral: every layer sparse, top-k weights always renormalised, experts as wide as intermediate_size.
    "mixtral": Family("mixtral", "MixtralForCausalLM", qkv_bias=False, head_dim=True, rows=MIXTRAL_TABLE,
                      requirements=(NO_WINDOW, ("router_jitter_noise", 0.0, "the router multiplies no noise into "
                                                                            "its input")),
                      moe=(("num_experts", "num_local_experts"), ("num_experts_per_tok", "num_experts_per_tok"),
                           ("moe_intermediate_size", "intermediate_size"),
                           ("router_aux_loss_coef", "router_aux_loss_coef")),
                      fixed={"norm_topk_prob": True},
                      defaults={**COMMON_DEFAULTS, "max_position_embeddings": 131072, "bos_token_id": 1,
                                "eos_token_id": 2, "num_key_value_heads": 8, "rms_norm_eps": 1e-5,
                                "rope_theta": 1e6, "sliding_window": None, "num_local_experts": 8,
                                "num_experts_per_tok": 2, "router_aux_loss_coef": 0.001, "router_jitter_noise": 0.0}),
}
REFUSED_FAMILIES = {
    "deepseek_v2": "multi-head latent attention and sigmoid routing are not built yet",
    "deepseek_v3": "multi-head latent attention and sigmoid routing are not built yet",
}

# model_config field <-> config.json key. seq_length and qkv_bias are derived (see below).
CONFIG_MAP = (
    ("vocab_size", "vocab_size"),
    ("hidden_size", "hidden_size"),
    ("num_layers", "num_hidden_layers"),
    ("num_heads", "num_attention_heads"),
    ("num_kv_heads", "num_key_value_heads"),
    ("intermediate_size", "intermediate_size"),
    ("rms_norm_eps", "rms_norm_eps"),
    ("rope_theta", "rope_theta"),
    ("initializer_range", "initializer_range"),
    ("tie_word_embeddings", "tie_word_embeddings"),
    ("bos_token_id", "bos_token_id"),
    ("eos_token_id", "eos_token_id"),
    ("pad_token_id", "pad_token_id"),
)
REQUIRED_HF_KEYS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size")
TOKEN_ID_FIELDS = ("bos_token_id", "eos_token_id", "pad_token_id")
NO_TOKEN = -1  # a token id HF leaves unset (null); no label equals it, so nothing is masked


def family_of(hf_config: dict, where: str) -> Family:
    """Dispatch on config.json's model_type; anything else is refused by name."""
    model_type = hf_config.get("model_type")
    if model_type in REFUSED_FAMILIES:
        raise ConversionError(f"{where}: model_type {model_type!r} is not supported: {REFUSED_FAMILIES[model_type]}",
                              hint=f"supported: {', '.join(FAMILIES)}")
    if model_type not in FAMILIES:
        raise ConversionError(f"{where}: model_type {model_type!r} (architectures "
                              f"{hf_config.get('architectures')}) is not supported; supported: "
                              f"{', '.join(FAMILIES)}",
                              hint="only Llama-style decoders convert: RMSNorm, rotary positions, SwiGLU, "
                                   "optional q/k/v bias and q/k norms, softmax top-k Mixture of Experts")
    return FAMILIES[model_type]


def sparse_layers(hf: dict) -> list:
    """The layers transformers' Qwen MoE decoders build sparse (Qwen2MoeDecoderLayer, Qwen3MoeDecoderLayer)."""
    return [i for i in range(hf["num_hidden_layers"]) if i not in (hf["mlp_only_layers"] or ())
            and hf["num_experts"] > 0 and (i + 1) % hf["decoder_sparse_step"] == 0]


def moe_values(family: Family, hf: dict, problems: list) -> dict:
    """Our MoE fields from config.json (problems appended), {} for a dense family."""
    if not family.moe:
        return {}
    values = {ours: hf.get(theirs) for ours, theirs in family.moe}
    for ours, theirs in family.moe:
        kind = {"norm_topk_prob": bool, "router_aux_loss_coef": (int, float)}.get(ours, int)
        # Qwen's num_experts 0 is a dense model (sparse_layers); Mixtral always has its MoE block
        low = 0 if ours == "num_experts" and family.sparse_step else 1
        if not isinstance(values[ours], kind) or (kind is int and values[ours] < low):
            wanted = "a number" if kind is not int else f">= {low}"
            problems.append(f"{theirs}: {values[ours]!r} is not valid ({wanted})")
    if problems:
        return {}
    if values["num_experts_per_tok"] > max(values["num_experts"], 1):
        problems.append(f"num_experts_per_tok: {values['num_experts_per_tok']} exceeds the number of experts "
                        f"{values['num_experts']}")
    if family.sparse_step:
        step = hf["decoder_sparse_step"]
        if type(step) is not int or step < 1:
            problems.append(f"decoder_sparse_step: {step!r} is not a positive integer")
            return {}
        sparse = sparse_layers(hf)
        values["dense_layers"] = [i for i in range(hf["num_hidden_layers"]) if i not in sparse]
        if not sparse:  # transformers builds no MoE block at all: a dense model
            return {}
    return {**values, **family.fixed}


def model_config_from_hf(hf_config: dict, where: str, seq_length: int = None) -> ModelConfig:
    """config.json -> our model_config, refusing every option the model does not implement."""
    family = family_of(hf_config, where)
    hf = {**family.defaults, **hf_config}
    problems = [f"{key}: missing" for key in REQUIRED_HF_KEYS if key not in hf]
    problems += [f"{key}: {hf[key]!r} is not a positive integer" for key in
                 REQUIRED_HF_KEYS + ("num_key_value_heads", "max_position_embeddings")
                 if key in hf and hf[key] is not None and (type(hf[key]) is not int or hf[key] < 1)]
    problems += [f"{key}: {hf[key]!r} is not a positive number" for key in ("rms_norm_eps", "rope_theta")
                 if type(hf[key]) not in (int, float) or not hf[key] > 0]
    if problems:
        raise ConversionError(f"{where}: {'; '.join(problems)}")
    hf.setdefault("num_key_value_heads", hf["num_attention_heads"])
    for key, supported, why in COMMON_REQUIREMENTS + family.requirements:
        if hf.get(key) != supported:
            problems.append(f"{key}: {hf.get(key)!r} is not supported ({supported!r} only): {why}")
    hidden, heads = hf["hidden_size"], hf["num_attention_heads"]
    head_dim = hf.get("head_dim") or hidden // heads  # Mistral and Mixtral write null
    if not family.head_dim and (hidden % heads or head_dim != hidden // heads):
        problems.append(f"head_dim: {hf.get('head_dim')!r} with hidden_size {hidden} and {heads} heads is not "
                        f"supported by {family.model_type}: the model uses head_dim = hidden_size / "
                        "num_attention_heads")
    elif type(head_dim) is not int or head_dim < 2 or head_dim % 2:
        problems.append(f"head_dim: {head_dim!r} is not a positive even integer (rotary rotates pairs)")
    if any(kind != "full_attention" for kind in hf.get("layer_types") or ()):
        problems.append(f"layer_types: {sorted(set(hf['layer_types']))} is not supported: every layer must be "
                        "full_attention")
    max_positions = hf["max_position_embeddings"]
    if seq_length is not None and seq_length > max_positions:
        problems.append(f"--seq-length {seq_length} exceeds max_position_embeddings {max_positions}")
    moe = moe_values(family, hf, problems)
    if family.model_type == "qwen2_moe" and moe and moe["shared_expert_intermediate_size"] < 1:
        problems.append("shared_expert_intermediate_size: must be >= 1 (transformers' Qwen2-MoE always has its "
                        "gated shared expert)")
    if problems:
        raise ConversionError(f"{where}: {len(problems)} unsupported setting(s):\n" +
                              "\n".join(f"  - {p}" for p in problems))
    values = {ours: hf[theirs] for ours, theirs in CONFIG_MAP}
    for name in TOKEN_ID_FIELDS:
        value = values[name]
        values[name] = NO_TOKEN if value is None else value[0] if isinstance(value, list) else value
    values["seq_length"] = seq_length or min(max_positions, DEFAULT_MAX_SEQ_LENGTH)
    qkv_bias = hf[family.qkv_bias] if isinstance(family.qkv_bias, str) else family.qkv_bias
    return ModelConfig(**values, **moe, qkv_bias=bool(qkv_bias), qk_norm=family.qk_norm,
                       head_dim=head_dim if head_dim != hidden // heads else None)


def options(cfg: ModelConfig) -> str:
    """The model's options that decide its HF family, for a refusal."""
    return (f"qk_norm={cfg.qk_norm}, qkv_bias={cfg.qkv_bias}, head_dim={cfg.head_size} (hidden_size / num_heads = "
            f"{cfg.hidden_size // cfg.num_heads}), num_experts={cfg.num_experts}, shared_expert_intermediate_size="
            f"{cfg.shared_expert_intermediate_size}, shared_expert_gate={cfg.shared_expert_gate}, norm_topk_prob="
            f"{cfg.norm_topk_prob}, dense_layers={cfg.dense_layers}")


def family_for(cfg: ModelConfig) -> Family:
    """The HF family that has exactly cfg's options; refuses a combination none of them has."""
    shared = cfg.shared_expert_intermediate_size > 0
    if not cfg.moe:
        name = "qwen3" if cfg.qk_norm and not cfg.qkv_bias else None if cfg.qk_norm else \
            "qwen2" if cfg.qkv_bias else "llama"
    elif cfg.qk_norm:
        name = "qwen3_moe" if not shared and not cfg.qkv_bias else None
    elif shared:
        name = "qwen2_moe" if cfg.shared_expert_gate else None
    else:
        name = "mixtral" if cfg.norm_topk_prob and not cfg.dense_layers and not cfg.qkv_bias else None
    family = FAMILIES.get(name)
    if family is not None and not family.head_dim and cfg.head_size * cfg.num_heads != cfg.hidden_size:
        family = None
    if family is None:
        raise ConversionError(f"no HuggingFace family has this model's combination of options ({options(cfg)})",
                              hint="exportable: llama, qwen2, qwen3 (q/k norms, no bias); qwen3_moe (q/k norms, no "
                                   "shared expert, no bias); qwen2_moe (gated shared expert, no q/k norms); "
                                   "mixtral (no q/k norms, shared expert, dense layers or bias; norm_topk_prob)")
    return family


def hf_config_from_model(cfg: ModelConfig) -> dict:
    """Our model_config -> config.json of the HF family that has exactly its options."""
    family = family_for(cfg)
    config = {"architectures": [family.architecture], "model_type": family.model_type}
    config.update({theirs: getattr(cfg, ours) for ours, theirs in CONFIG_MAP})
    config["num_key_value_heads"] = cfg.kv_heads
    for name in TOKEN_ID_FIELDS:
        config[name] = None if config[name] == NO_TOKEN else config[name]
    config["max_position_embeddings"] = cfg.seq_length
    config.update({key: supported for key, supported, _ in COMMON_REQUIREMENTS + family.requirements})
    config["head_dim"] = cfg.head_size
    if isinstance(family.qkv_bias, str):
        config[family.qkv_bias] = cfg.qkv_bias
    if cfg.moe:
        config.update({theirs: getattr(cfg, ours) if ours != "moe_intermediate_size" else cfg.expert_size
                       for ours, theirs in family.moe})
    if family.sparse_step:
        config.update(decoder_sparse_step=1, mlp_only_layers=list(cfg.dense_layers))
    config["torch_dtype"] = "float32"
    return config

