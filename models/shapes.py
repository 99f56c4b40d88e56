"""Parameter names and shapes of models/llama.py's LlamaForCausalLM, without building it.

The one description of the architecture's tensors: the converter's tensor list (models/conversion/tables.py),
the checkpoint checks against a recipe, and the parameter and FLOP counts (models/arithmetic.py,
the planner) derive from it. `cfg` is a ModelConfig (models/config.py) or a LlamaConfig.
"""

from ascend_llm_recipes.models.arithmetic import padded_vocab_size

# Every tensor ({n}: layer index, {e}: expert index), its shape in named dimensions (see dimensions()) and the
# config flag it depends on (see tensor_flags; "dense_mlp" and "moe" hold per layer). Names are the HuggingFace
# checkpoint's (Llama, Qwen2/3, Qwen3-MoE): models/llama.py and models/moe.py name their parameters after it.
# Linear weights are (out, in).
TENSORS = (
    ("model.embed_tokens.weight", ("vocab", "hidden"), None),
    ("model.layers.{n}.input_layernorm.weight", ("hidden",), None),
    ("model.layers.{n}.self_attn.q_proj.weight", ("q", "hidden"), "q_proj"),
    ("model.layers.{n}.self_attn.q_proj.bias", ("q",), "qkv_bias"),
    ("model.layers.{n}.self_attn.k_proj.weight", ("kv", "hidden"), "kv_proj"),
    ("model.layers.{n}.self_attn.k_proj.bias", ("kv",), "qkv_bias"),
    ("model.layers.{n}.self_attn.v_proj.weight", ("kv", "hidden"), "kv_proj"),
    ("model.layers.{n}.self_attn.v_proj.bias", ("kv",), "qkv_bias"),
    ("model.layers.{n}.self_attn.q_a_proj.weight", ("q_lora", "hidden"), "q_lora"),
    ("model.layers.{n}.self_attn.q_a_layernorm.weight", ("q_lora",), "q_lora"),
    ("model.layers.{n}.self_attn.q_b_proj.weight", ("q", "q_lora"), "q_lora"),
    ("model.layers.{n}.self_attn.kv_a_proj_with_mqa.weight", ("kv_a", "hidden"), "mla"),
    ("model.layers.{n}.self_attn.kv_a_layernorm.weight", ("kv_lora",), "mla"),
    ("model.layers.{n}.self_attn.kv_b_proj.weight", ("kv_b", "kv_lora"), "mla"),
    ("model.layers.{n}.self_attn.o_proj.weight", ("hidden", "attn_out"), None),
    ("model.layers.{n}.self_attn.q_norm.weight", ("head",), "qk_norm"),
    ("model.layers.{n}.self_attn.k_norm.weight", ("head",), "qk_norm"),
    ("model.layers.{n}.post_attention_layernorm.weight", ("hidden",), None),
    ("model.layers.{n}.mlp.gate_proj.weight", ("ffn", "hidden"), "dense_mlp"),
    ("model.layers.{n}.mlp.up_proj.weight", ("ffn", "hidden"), "dense_mlp"),
    ("model.layers.{n}.mlp.down_proj.weight", ("hidden", "ffn"), "dense_mlp"),
    ("model.layers.{n}.mlp.gate.weight", ("experts", "hidden"), "moe"),
    ("model.layers.{n}.mlp.router.expert_bias", ("experts",), "expert_bias"),
    ("model.layers.{n}.mlp.experts.{e}.gate_proj.weight", ("expert_ffn", "hidden"), "moe"),
    ("model.layers.{n}.mlp.experts.{e}.up_proj.weight", ("expert_ffn", "hidden"), "moe"),
    ("model.layers.{n}.mlp.experts.{e}.down_proj.weight", ("hidden", "expert_ffn"), "moe"),
    ("model.layers.{n}.mlp.shared_expert.gate_proj.weight", ("shared_ffn", "hidden"), "shared_expert"),
    ("model.layers.{n}.mlp.shared_expert.up_proj.weight", ("shared_ffn", "hidden"), "shared_expert"),
    ("model.layers.{n}.mlp.shared_expert.down_proj.weight", ("hidden", "shared_ffn"), "shared_expert"),
    ("model.layers.{n}.mlp.shared_expert_gate.weight", ("one", "hidden"), "shared_expert_gate"),
    ("model.norm.weight", ("hidden",), None),
    ("lm_head.weight", ("vocab", "hidden"), "untied"),
)
PER_LAYER_FLAGS = ("dense_mlp", "moe", "shared_expert", "shared_expert_gate", "expert_bias")


def dimensions(cfg, tensor_parallel: int = 1) -> dict:
    """Sizes of the named dimensions; `padded_vocab` is the rows of the tables (see padded_vocab_size)."""
    head_dim = cfg.head_size
    # (a recipe's other checks read these while an incomplete MLA section is being reported: unset counts as 0)
    nope, rope, v = (getattr(cfg, name) or 0 for name in ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"))
    mla = {"q_lora": cfg.q_lora_rank, "kv_lora": cfg.kv_lora_rank, "kv_a": cfg.kv_lora_rank + rope,
           "kv_b": cfg.num_heads * (nope + v)} if cfg.mla else {}
    return {"vocab": cfg.vocab_size, "hidden": cfg.hidden_size, "q": cfg.num_heads * cfg.qk_head_dim,
            "kv": cfg.kv_heads * head_dim, "head": head_dim, "ffn": cfg.intermediate_size,
            "attn_out": cfg.num_heads * cfg.value_head_dim, **mla,
            "experts": cfg.num_experts, "expert_ffn": cfg.expert_size,
            "shared_ffn": cfg.shared_expert_intermediate_size, "one": 1,
            "padded_vocab": padded_vocab_size(cfg.vocab_size, cfg.vocab_pad_multiple, tensor_parallel)}


def tensor_flags(cfg, layer: int = None) -> dict:
    """{flag of TENSORS: whether cfg's model has the tensors it marks}; per-layer flags for `layer` (None: any)."""
    moe = cfg.is_moe_layer(layer) if layer is not None else cfg.moe
    dense = not moe if layer is not None else not cfg.moe or len(cfg.dense_layers) > 0
    return {None: True, "qkv_bias": cfg.qkv_bias, "untied": not cfg.tie_word_embeddings, "qk_norm": cfg.qk_norm,
            "q_proj": not cfg.mla or cfg.q_lora_rank is None, "kv_proj": not cfg.mla, "mla": cfg.mla,
            "q_lora": cfg.mla and cfg.q_lora_rank is not None,
            "dense_mlp": dense, "moe": moe, "shared_expert": moe and cfg.shared_expert_intermediate_size > 0,
            "shared_expert_gate": moe and cfg.shared_expert_gate, "expert_bias": moe and cfg.expert_bias}


def tensor_dimensions(cfg, layers: range = None) -> list:
    """[(name pattern, name, dimension names)] of the tensors cfg's model has, in TENSORS order (all layers,
    all experts)."""
    layers = range(cfg.num_layers) if layers is None else layers
    flags, per_layer = tensor_flags(cfg), {n: tensor_flags(cfg, n) for n in layers}
    out = []
    for pattern, dims, flag in TENSORS:
        if "{n}" not in pattern:
            out += [(pattern, pattern, dims)] if flags[flag] else []
            continue
        for n in (n for n in layers if per_layer[n][flag]):
            out += [(pattern, pattern.format(n=n, e=e), dims)
                    for e in (range(cfg.num_experts) if "{e}" in pattern else (None,))]
    return out


def parameter_shapes(cfg, tensor_parallel: int = 1, padded: bool = True, layers: range = None) -> dict:
    """{parameter name: shape}; with padded=True the vocabulary tables have their padding rows."""
    dims = dimensions(cfg, tensor_parallel)
    if padded:
        dims["vocab"] = dims["padded_vocab"]
    return {name: tuple(dims[d] for d in names) for _, name, names in tensor_dimensions(cfg, layers)}


# Parameters that are not weights: MoE layers' per-step counters (models/moe.py's; and mlp.router.expert_load,
# mlp.router.fi_accu of MindFormers' MoELayer, models/expert_parallel.py; zeroed after every step; never converted
# or required at load), and DeepSeek's correction bias, a weight of the model that the training loop moves
# (training/worker/router_stats.py), not the optimizer: it has no AdamW moments.
STATISTICS = ("expert_load", "router_losses", "fi_accu")
UNTRAINED_PARAMETERS = ("router.expert_bias",)


# RMSNorm weights stay float32 whatever param_dtype says: RMSNorm computes in float32 (models/llama.py), and
# they are a few KB, below optimizer parallel's 64 KB slicing threshold anyway.
FLOAT32_PARAMETERS = ("layernorm.weight", "_norm.weight", "model.norm.weight",
                      "mlp.gate.weight", "router.expert_bias")  # + the MoE router (models/moe.py), float32 throughout


def parameter_dtype(cfg, name: str) -> str:
    """The dtype models/llama.py stores parameter `name` in: model_config.param_dtype, norms float32."""
    return "float32" if name.endswith(FLOAT32_PARAMETERS) else getattr(cfg, "param_dtype", "float32")
