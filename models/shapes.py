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
    ("model.layers.{n}.self_attn.q_proj.weight", ("q", "hidden"), None),
    ("model.layers.{n}.self_attn.q_proj.bias", ("q",), "qkv_bias"),
    ("model.layers.{n}.self_attn.k_proj.weight", ("kv", "hidden"), None),
    ("model.layers.{n}.self_attn.k_proj.bias", ("kv",), "qkv_bias"),
    ("model.layers.{n}.self_attn.v_proj.weight", ("kv", "hidden"), None),
    ("model.layers.{n}.self_attn.v_proj.bias", ("kv",), "qkv_bias"),
    ("model.layers.{n}.self_attn.o_proj.weight", ("hidden", "q"), None),
    ("model.layers.{n}.self_attn.q_norm.weight", ("head",), "qk_norm"),
    ("model.layers.{n}.self_attn.k_norm.weight", ("head",), "qk_norm"),
    ("model.layers.{n}.post_attention_layernorm.weight", ("hidden",), None),
    ("model.layers.{n}.mlp.gate_proj.weight", ("ffn", "hidden"), "dense_mlp"),
    ("model.layers.{n}.mlp.up_proj.weight", ("ffn", "hidden"), "dense_mlp"),
    ("model.layers.{n}.mlp.down_proj.weight", ("hidden", "ffn"), "dense_mlp"),
    ("model.layers.{n}.mlp.gate.weight", ("experts", "hidden"), "moe"),
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
PER_LAYER_FLAGS = ("dense_mlp", "moe", "shared_expert", "shared_expert_gate")


def dimensions(cfg, tensor_parallel: int = 1) -> dict:
    """Sizes of the named dimensions; `padded_vocab` is the rows of the tables (see padded_vocab_size)."""
    head_dim = cfg.head_size
    return {"vocab": cfg.vocab_size, "hidden": cfg.hidden_size, "q": cfg.num_heads * head_dim,
            "kv": cfg.kv_heads * head_dim, "head": head_dim, "ffn": cfg.intermediate_size,
            "experts": cfg.num_experts, "expert_ffn": cfg.expert_size,
            "shared_ffn": cfg.shared_expert_intermediate_size, "one": 1,
            "padded_vocab": padded_vocab_size(cfg.vocab_size, cfg.vocab_pad_multiple, tensor_parallel)}


def tensor_flags(cfg, layer: int = None) -> dict:
    """{flag of TENSORS: whether cfg's model has the tensors it marks}; per-layer flags for `layer` (None: any)."""
    moe = cfg.is_moe_layer(layer) if layer is not None else cfg.moe
    dense = not moe if layer is not None else not cfg.moe or len(cfg.dense_layers) > 0
    return {None: True, "qkv_bias": cfg.qkv_bias, "untied": not cfg.tie_word_embeddings, "qk_norm": cfg.qk_norm,
            "dense_mlp": dense, "moe": moe, "shared_expert": moe and cfg.shared_expert_intermediate_size > 0,
            "shared_expert_gate": moe and cfg.shared_expert_gate}


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


# RMSNorm weights stay float32 whatever param_dtype says: RMSNorm computes in float32 (models/llama.py), and
# they are a few KB, below optimizer parallel's 64 KB slicing threshold anyway.
FLOAT32_PARAMETERS = ("layernorm.weight", "model.norm.weight")


def parameter_dtype(cfg, name: str) -> str:
    """The dtype models/llama.py stores parameter `name` in: model_config.param_dtype, norms float32."""
    return "float32" if name.endswith(FLOAT32_PARAMETERS) else getattr(cfg, "param_dtype", "float32")
