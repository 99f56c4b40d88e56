"""The HuggingFace model_types we convert: config.json <-> our model_config, one Family entry per model_type.

A Family says what a model_type implies for our model (q/k/v bias, q/k norms, how its Mixture-of-Experts keys
read), which config.json options must keep the one value our model implements (each refused by name with the
reason), transformers' defaults for keys save_pretrained leaves out, and the table naming its tensors
(tables.HF_TABLE, MIXTRAL_TABLE, or DeepSeek-V3's pair by rope_interleave). model_config_from_hf and
hf_config_from_model are generated from these entries; hf.py reads and writes the weights.
"""

from dataclasses import dataclass, field

from ascend_llm_recipes.common.errors import ConversionError
from ascend_llm_recipes.models.config import ModelConfig
from ascend_llm_recipes.models.conversion.ours import ARCHITECTURE_FIELDS
from ascend_llm_recipes.models.conversion.tables import DEEPSEEK_HALF_TABLE, DEEPSEEK_TABLE, HF_TABLE, MIXTRAL_TABLE


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
    first_dense: str = None         # the key counting the dense first layers (DeepSeek's first_k_dense_replace)
    shared_experts: str = None      # the key counting shared experts, each moe_intermediate_size wide (DeepSeek)
    mla: bool = False               # multi-head latent attention: MLA_MAP's keys, no head_dim, one KV head per head
    rows: dict = None               # its tensor table (tables.py); None: HF_TABLE
    interleaved_rows: dict = None   # the table when config.json's rope_interleave is true (rotary rows permuted)

    @property
    def table(self) -> dict:
        """The table write_hf writes with: interleaved_rows when the family has them (export sets rope_interleave)."""
        return self.interleaved_rows or (HF_TABLE if self.rows is None else self.rows)

    def table_for(self, hf_config: dict) -> dict:
        """The table that reads this config.json's weights."""
        if self.interleaved_rows is not None and {**self.defaults, **hf_config}[ROPE_INTERLEAVE]:
            return self.interleaved_rows
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
ROPE_INTERLEAVE = "rope_interleave"  # DeepSeek-V3: the rotary rows of q and of the shared key stored interleaved
MTP_LAYERS = "num_nextn_predict_layers"  # DeepSeek-V3: multi-token-prediction modules stored after the last layer
QWEN_MOE = (("num_experts", "num_experts"), ("num_experts_per_tok", "num_experts_per_tok"),
            ("moe_intermediate_size", "moe_intermediate_size"), ("norm_topk_prob", "norm_topk_prob"),
            ("router_aux_loss_coef", "router_aux_loss_coef"))
QWEN_MOE_DEFAULTS = {"decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": False,
                     "router_aux_loss_coef": 0.001, "max_position_embeddings": 32768, "bos_token_id": None,
                     "eos_token_id": None, "use_sliding_window": False, "sliding_window": None}

# DeepSeek-V3 (modeling_deepseek_v3.py, transformers 4.57): MLA, a sigmoid router choosing by score + correction
# bias within the best groups (scored by their two best experts), a shared expert of moe_intermediate_size x
# n_shared_experts, the first first_k_dense_replace layers dense.
DEEPSEEK_MOE = (("num_experts", "n_routed_experts"), ("num_experts_per_tok", "num_experts_per_tok"),
                ("moe_intermediate_size", "moe_intermediate_size"), ("norm_topk_prob", "norm_topk_prob"),
                ("routed_scaling_factor", "routed_scaling_factor"), ("n_group", "n_group"),
                ("topk_group", "topk_group"))
MLA_MAP = (("q_lora_rank", "q_lora_rank"), ("kv_lora_rank", "kv_lora_rank"), ("qk_nope_head_dim", "qk_nope_head_dim"),
           ("qk_rope_head_dim", "qk_rope_head_dim"), ("v_head_dim", "v_head_dim"))
DEEPSEEK_REQUIREMENTS = (
    ("rope_scaling", None, "rotary positions are unscaled; DeepSeek-V3's released config.json sets yarn (factor 40 "
                           "over 4096 original positions, whose mscale_all_dim also rescales attention scores), which "
                           "our rotary embedding does not implement. A checkpoint trained with yarn needs it"),
    ("attention_bias", False, "it biases q_a_proj, kv_a_proj_with_mqa and o_proj; our latent attention has no bias"),
    # transformers 4.57's DeepseekV3TopkRouter reads neither key: it always does what these values name
    ("scoring_func", "sigmoid", "the router scores experts with a sigmoid (transformers' DeepseekV3TopkRouter)"),
    ("topk_method", "noaux_tc", "the router picks the top k by score + e_score_correction_bias within the "
                                "topk_group best groups (transformers' DeepseekV3TopkRouter)"),
    ("moe_layer_freq", 1, "every layer from first_k_dense_replace on has experts (as transformers builds them)"),
)

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
    # DeepSeek-V3: the router's fields are read as above; router_score and the correction bias are the family's.
    # Its rotary rows are read in either layout (rope_interleave) and written interleaved, as released.
    "deepseek_v3": Family("deepseek_v3", "DeepseekV3ForCausalLM", qkv_bias=False, mla=True,
                          requirements=DEEPSEEK_REQUIREMENTS, moe=DEEPSEEK_MOE, first_dense="first_k_dense_replace",
                          shared_experts="n_shared_experts", fixed={"router_score": "sigmoid", "expert_bias": True},
                          rows=DEEPSEEK_HALF_TABLE, interleaved_rows=DEEPSEEK_TABLE,
                          defaults={**COMMON_DEFAULTS, "max_position_embeddings": 4096, "bos_token_id": 0,
                                    "eos_token_id": 1, "num_key_value_heads": 128, "n_routed_experts": 256,
                                    "num_experts_per_tok": 8, "moe_intermediate_size": 2048, "norm_topk_prob": True,
                                    "routed_scaling_factor": 2.5, "n_group": 8, "topk_group": 4,
                                    "n_shared_experts": 1, "first_k_dense_replace": 3, "q_lora_rank": 1536,
                                    "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
                                    "v_head_dim": 128, ROPE_INTERLEAVE: True, "attention_bias": False,
                                    "scoring_func": "sigmoid", "topk_method": "noaux_tc", "moe_layer_freq": 1,
                                    MTP_LAYERS: 0}),
}
REFUSED_FAMILIES = {
    # transformers 4.57's DeepseekV2MoEGate: softmax scores, top k greedy or within the groups scored by their best
    # expert, no correction bias, top-k weights never renormalised (norm_topk_prob is read but unused)
    "deepseek_v2": "its router (softmax scores, greedy or group-limited-greedy top k with groups scored by their "
                   "best expert, no score-correction bias) is not DeepSeek-V3's, which is the one ours implements",
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
                                   "optional q/k/v bias and q/k norms, softmax top-k Mixture of Experts, and "
                                   "DeepSeek-V3's latent attention with its sigmoid router")
    return FAMILIES[model_type]


def sparse_layers(hf: dict) -> list:
    """The layers transformers' Qwen MoE decoders build sparse (Qwen2MoeDecoderLayer, Qwen3MoeDecoderLayer)."""
    return [i for i in range(hf["num_hidden_layers"]) if i not in (hf["mlp_only_layers"] or ())
            and hf["num_experts"] > 0 and (i + 1) % hf["decoder_sparse_step"] == 0]


def wrong_moe_value(key: str, value, lowest: int) -> str:
    """What a MoE value of config.json must be when it is not ('' when it is fine); integers from `lowest` on."""
    if key == "norm_topk_prob":
        return "" if type(value) is bool else "true or false"
    if key == "router_aux_loss_coef":
        return "" if type(value) in (int, float) and value >= 0 else "a number >= 0"
    if key == "routed_scaling_factor":
        return "" if type(value) in (int, float) and value > 0 else "a positive number"
    return "" if type(value) is int and value >= lowest else f">= {lowest}"


def moe_values(family: Family, hf: dict, problems: list) -> dict:
    """Our MoE fields from config.json (problems appended), {} for a dense family."""
    if not family.moe:
        return {}
    values = {ours: hf.get(theirs) for ours, theirs in family.moe}
    counts = {key: hf.get(key) for key in (family.first_dense, family.shared_experts) if key}
    # Qwen's num_experts 0 is a dense model (sparse_layers), Mixtral always has its MoE block; DeepSeek's
    # first_k_dense_replace may be 0, its shared experts transformers always builds
    checks = [(theirs, values[ours], 0 if ours == "num_experts" and family.sparse_step else 1)
              for ours, theirs in family.moe]
    checks += [(key, value, 0 if key == family.first_dense else 1) for key, value in counts.items()]
    for key, value, lowest in checks:
        wanted = wrong_moe_value(key, value, lowest)
        if wanted:
            problems.append(f"{key}: {value!r} is not valid ({wanted})")
    if problems:
        return {}
    if values["num_experts_per_tok"] > max(values["num_experts"], 1):
        problems.append(f"num_experts_per_tok: {values['num_experts_per_tok']} exceeds the number of experts "
                        f"{values['num_experts']}")
    if "n_group" in values:
        groups, chosen, experts = values["n_group"], values["topk_group"], values["num_experts"]
        if experts % groups or chosen > groups or experts // groups < 2:
            problems.append(f"n_group, topk_group: {groups} groups of n_routed_experts {experts} (each scored by its "
                            f"two best experts, so at least 2 per group) with topk_group {chosen} <= n_group")
        elif chosen * (experts // groups) < values["num_experts_per_tok"]:
            problems.append(f"topk_group: {chosen} group(s) of {experts // groups} experts hold fewer than "
                            f"num_experts_per_tok ({values['num_experts_per_tok']})")
    if family.first_dense:
        values["dense_layers"] = list(range(counts[family.first_dense]))
        if counts[family.first_dense] >= hf["num_hidden_layers"]:
            problems.append(f"{family.first_dense}: {counts[family.first_dense]} makes every one of the "
                            f"{hf['num_hidden_layers']} layers dense; such a model has no experts to convert")
    if family.shared_experts:
        values["shared_expert_intermediate_size"] = counts[family.shared_experts] * values["moe_intermediate_size"]
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
    for key, (supported, why) in requirements(family).items():
        if hf.get(key) != supported:
            problems.append(f"{key}: {hf.get(key)!r} is not supported ({supported!r} only): {why}")
    if hf.get("quantization_config"):
        problems.append(f"quantization_config: {hf['quantization_config']!r} is not supported: quantised weights "
                        "(FP8 blocks with their scales, ...) are not read; dequantise to bfloat16 first (DeepSeek-V3: "
                        "its inference/fp8_cast_bf16.py) and remove quantization_config from config.json")
    hidden, heads = hf["hidden_size"], hf["num_attention_heads"]
    head_dim = hf.get("head_dim") or hidden // heads  # Mistral and Mixtral write null
    if family.mla:
        head_dim = hidden // heads  # DeepseekV3Config writes head_dim = qk_rope_head_dim; MLA has no such width
        problems += mla_problems(hf)
    elif not family.head_dim and (hidden % heads or head_dim != hidden // heads):
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
    mla = {ours: hf[theirs] for ours, theirs in MLA_MAP} if family.mla else {}
    return ModelConfig(**values, **moe, **mla, qkv_bias=bool(qkv_bias), qk_norm=family.qk_norm,
                       head_dim=head_dim if head_dim != hidden // heads else None)


def requirements(family: Family) -> dict:
    """{config.json key: (the only supported value, why)}: the common ones, each family's overriding."""
    return {key: (supported, why) for key, supported, why in COMMON_REQUIREMENTS + family.requirements}


def mla_problems(hf: dict) -> list:
    """What our multi-head latent attention cannot take from a DeepSeek config.json, each named."""
    problems = [f"{theirs}: {hf[theirs]!r} is not a positive integer" for _, theirs in MLA_MAP
                if not (theirs == "q_lora_rank" and hf[theirs] is None)  # null: a full q_proj
                and (type(hf[theirs]) is not int or hf[theirs] < 1)]
    if not problems and hf["qk_rope_head_dim"] % 2:
        problems.append(f"qk_rope_head_dim: {hf['qk_rope_head_dim']} is not even (rotary rotates pairs)")
    if hf["num_key_value_heads"] != hf["num_attention_heads"]:
        problems.append(f"num_key_value_heads: {hf['num_key_value_heads']} is not supported (num_attention_heads "
                        f"{hf['num_attention_heads']} only): multi-head latent attention expands the latent into "
                        "one key/value head per query head")
    if type(hf[ROPE_INTERLEAVE]) is not bool:
        problems.append(f"{ROPE_INTERLEAVE}: {hf[ROPE_INTERLEAVE]!r} is not true or false")
    if type(hf[MTP_LAYERS]) is not int or hf[MTP_LAYERS] < 0:
        problems.append(f"{MTP_LAYERS}: {hf[MTP_LAYERS]!r} is not an integer >= 0")
    return problems


def options(cfg: ModelConfig) -> str:
    """The model's options that decide its HF family, for a refusal."""
    return (f"qk_norm={cfg.qk_norm}, qkv_bias={cfg.qkv_bias}, head_dim={cfg.head_size} (hidden_size / num_heads = "
            f"{cfg.hidden_size // cfg.num_heads}), kv_lora_rank={cfg.kv_lora_rank}, num_experts={cfg.num_experts}, "
            f"shared_expert_intermediate_size={cfg.shared_expert_intermediate_size}, shared_expert_gate="
            f"{cfg.shared_expert_gate}, norm_topk_prob={cfg.norm_topk_prob}, dense_layers={cfg.dense_layers}, "
            f"router_score={cfg.router_score}, expert_bias={cfg.expert_bias}, n_group={cfg.n_group}, "
            f"routed_scaling_factor={cfg.routed_scaling_factor}")


def deepseek_v3_has(cfg: ModelConfig) -> bool:
    """Whether transformers' DeepseekV3ForCausalLM has exactly the options of cfg (a model with MLA)."""
    shared = cfg.shared_expert_intermediate_size
    return (cfg.moe and cfg.router_score == "sigmoid" and cfg.expert_bias and not cfg.shared_expert_gate
            and shared > 0 and shared % cfg.expert_size == 0 and not cfg.qk_norm and not cfg.qkv_bias
            and sorted(cfg.dense_layers) == list(range(len(cfg.dense_layers))))


def family_for(cfg: ModelConfig) -> Family:
    """The HF family that has exactly cfg's options; refuses a combination none of them has."""
    shared = cfg.shared_expert_intermediate_size > 0
    softmax_router = (cfg.router_score == "softmax" and not cfg.expert_bias and cfg.n_group == 1
                      and cfg.routed_scaling_factor == 1.0)
    if cfg.mla:
        name = "deepseek_v3" if deepseek_v3_has(cfg) else None
    elif not cfg.moe:
        name = "qwen3" if cfg.qk_norm and not cfg.qkv_bias else None if cfg.qk_norm else \
            "qwen2" if cfg.qkv_bias else "llama"
    elif not softmax_router:
        name = None
    elif cfg.qk_norm:
        name = "qwen3_moe" if not shared and not cfg.qkv_bias else None
    elif shared:
        name = "qwen2_moe" if cfg.shared_expert_gate else None
    else:
        name = "mixtral" if cfg.norm_topk_prob and not cfg.dense_layers and not cfg.qkv_bias else None
    family = FAMILIES.get(name)
    if family is not None and not family.head_dim and not family.mla and \
            cfg.head_size * cfg.num_heads != cfg.hidden_size:
        family = None
    if family is None:
        raise ConversionError(f"no HuggingFace family has this model's combination of options ({options(cfg)})",
                              hint="exportable: llama, qwen2, qwen3 (q/k norms, no bias); qwen3_moe (q/k norms, no "
                                   "shared expert, no bias); qwen2_moe (gated shared expert, no q/k norms); "
                                   "mixtral (norm_topk_prob; without q/k norms, shared expert, dense layers or bias), "
                                   "each with the softmax router (no correction bias, groups or scaling); "
                                   "deepseek_v3 (multi-head latent attention, the sigmoid router with expert_bias, "
                                   "an ungated shared expert a whole number of experts wide, dense layers first)")
    return family


def hf_config_from_model(cfg: ModelConfig) -> dict:
    """Our model_config -> config.json of the HF family that has exactly its options.

    DeepSeek-V3 is written with rope_interleave: true (the released checkpoints' layout, transformers' default;
    write_hf permutes the rotary rows back) and no multi-token-prediction module.
    """
    family = family_for(cfg)
    config = {"architectures": [family.architecture], "model_type": family.model_type}
    config.update({theirs: getattr(cfg, ours) for ours, theirs in CONFIG_MAP})
    config["num_key_value_heads"] = cfg.kv_heads
    for name in TOKEN_ID_FIELDS:
        config[name] = None if config[name] == NO_TOKEN else config[name]
    config["max_position_embeddings"] = cfg.seq_length
    config.update({key: supported for key, (supported, _) in requirements(family).items()})
    if family.mla:
        config.update({theirs: getattr(cfg, ours) for ours, theirs in MLA_MAP})
        config.update({ROPE_INTERLEAVE: True, MTP_LAYERS: 0})
    else:
        config["head_dim"] = cfg.head_size
    if isinstance(family.qkv_bias, str):
        config[family.qkv_bias] = cfg.qkv_bias
    if cfg.moe:
        config.update({theirs: getattr(cfg, ours) if ours != "moe_intermediate_size" else cfg.expert_size
                       for ours, theirs in family.moe})
    if family.sparse_step:
        config.update(decoder_sparse_step=1, mlp_only_layers=list(cfg.dense_layers))
    if family.first_dense:
        config[family.first_dense] = len(cfg.dense_layers)
    if family.shared_experts:
        config[family.shared_experts] = cfg.shared_expert_intermediate_size // cfg.expert_size
    config["torch_dtype"] = "float32"
    return config


DTYPE_KEYS = ("torch_dtype", "dtype")  # the weights' dtype: transformers before 4.56 writes torch_dtype, since dtype
POSITIONS = "max_position_embeddings"


def export_config(cfg: ModelConfig, source: dict = None) -> tuple:
    """(config.json, notes) for exporting cfg's weights: hf_config_from_model's keys written over the config.json of
    the HuggingFace source they were converted from (ours.hf_source), so its context length and every key our model
    does not read (use_cache, layer_types, ...) are kept. A source value changed is a note naming key, old and new.

    Without a source (a model trained from scratch) max_position_embeddings is the model_config's seq_length, and a
    note says so; so it is when the source's architecture is not cfg's (it is then not used at all).
    """
    config = hf_config_from_model(cfg)
    theirs = source["config"] if source else None
    if theirs is not None:
        differ = ([theirs.get("model_type")] if theirs.get("model_type") != config["model_type"] else
                  [name for name in ARCHITECTURE_FIELDS if getattr(model_config_from_hf(theirs, source["path"]), name)
                   != getattr(cfg, name)])
        if differ:
            return config, [f"{POSITIONS}: {cfg.seq_length}, the model_config's seq_length: the source config.json "
                            f"these weights were converted from ({source['path']}) is not used, its model differs in "
                            f"{', '.join(map(str, differ))}; set {POSITIONS} to the context length the model serves"]
    if theirs is None:
        return config, [f"{POSITIONS}: {cfg.seq_length}, the model_config's seq_length: no HuggingFace config.json "
                        "travels with these weights (a model trained from scratch; converted from Megatron-LM or a "
                        "state dict without one; or a resumed run, whose recorded recipe names its own checkpoint "
                        f"instead of the conversion it started from); set {POSITIONS} to the context length the model serves"]
    if any(key in theirs for key in DTYPE_KEYS):  # the source's own spelling of the weights' dtype, float32 here
        config = {key: value for key, value in config.items() if key not in DTYPE_KEYS}
        config.update({key: "float32" for key in DTYPE_KEYS if key in theirs})
    if theirs.get(POSITIONS, 0) >= cfg.seq_length:
        config[POSITIONS] = theirs[POSITIONS]  # trained on shorter sequences than the source serves: its context
    for name in TOKEN_ID_FIELDS:  # the first of a list of ids is the one our model_config holds
        if isinstance(theirs.get(name), list) and theirs[name][:1] == [config[name]]:
            config[name] = theirs[name]
    why = {POSITIONS: f"the model was trained on sequences of {cfg.seq_length} tokens, longer than the source's",
           **{key: "the exported weights are float32" for key in DTYPE_KEYS}}
    notes = [f"{key}: {theirs[key]!r} -> {value!r} ({why.get(key, 'the model_config value')})"
             for key, value in config.items() if key in theirs and theirs[key] != value]
    return {**theirs, **config}, notes


def conversion_notes(family: Family, hf_config: dict) -> list:
    """What a user of the converted model must know that its model_config cannot say (DeepSeek-V3's)."""
    hf = {**family.defaults, **hf_config}
    notes = []
    if family.interleaved_rows is not None:
        notes.append(f"{ROPE_INTERLEAVE}: {str(hf[ROPE_INTERLEAVE]).lower()} in config.json: " +
                     (f"the rotary rows of {'q_proj' if hf['q_lora_rank'] is None else 'q_b_proj'} (per head) and "
                      "of kv_a_proj_with_mqa were permuted from interleaved to our half-split order"
                      if hf[ROPE_INTERLEAVE] else
                      "the rotary rows are in our half-split order already (no permutation)"))
    if hf.get(MTP_LAYERS):
        notes.append(f"{MTP_LAYERS}: {hf[MTP_LAYERS]}: the multi-token-prediction module(s) (model.layers."
                     f"{mtp_layers(hf)[0]}.* on) are not converted; our model has no MTP head, and the main "
                     "model's logits do not depend on them")
    coefficient = hf.get("router_aux_loss_coef")
    if coefficient and not family.fixed.get("expert_bias"):
        notes.append(f"router_aux_loss_coef: {coefficient:g} carried as it is; transformers' term pools every "
                     "layer's tokens (k times one layer of ours), ours sums one term per MoE layer (Megatron's): for "
                     "about the same pull on the router, model.model_config.router_aux_loss_coef = this x "
                     "num_experts_per_tok / the number of MoE layers")
    if family.fixed.get("expert_bias"):
        notes.append("expert_bias_update_rate: 0 (config.json has no key for it): the converted correction bias "
                     "stays as trained; to keep balancing the experts during training set "
                     "model.model_config.expert_bias_update_rate in the recipe (DeepSeek-V3 used 0.001)")
    return notes


def mtp_layers(hf: dict) -> range:
    """The layer numbers under which a DeepSeek checkpoint stores its multi-token-prediction modules."""
    return range(hf["num_hidden_layers"], hf["num_hidden_layers"] + (hf.get(MTP_LAYERS) or 0))


def export_notes(family: Family, cfg: ModelConfig) -> list:
    """What write_hf's config.json and weights cannot say (an expert capacity, DeepSeek-V3's)."""
    notes = [f"capacity_factor: {cfg.capacity_factor:g} is not exported (config.json has no key for it): "
             "transformers' MoE blocks route every token to its top k, so their outputs differ from the trained "
             "model's wherever an expert was over capacity"] if cfg.capacity_factor else []
    if not family.mla:
        return notes
    q = "q_proj" if cfg.q_lora_rank is None else "q_b_proj"
    return notes + [f"{ROPE_INTERLEAVE}: true: the rotary rows of {q} and kv_a_proj_with_mqa were permuted back to "
                    "interleaved order, the released checkpoints' layout",
                    f"{MTP_LAYERS}: 0: our model has no multi-token-prediction module",
                    f"expert_bias_update_rate: {cfg.expert_bias_update_rate:g} is not exported (config.json has no "
                    "key for it); e_score_correction_bias holds the bias as trained"]
