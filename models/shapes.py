"""Parameter names and shapes of models/llama.py's LlamaForCausalLM, without building it.

The one description of the architecture's tensors: the converter's tensor list (models/conversion/tables.py),
the checkpoint checks against a recipe, and the parameter and FLOP counts (models/arithmetic.py,
the planner) derive from it. `cfg` is a ModelConfig (models/config.py) or a LlamaConfig.
"""

from ascend_llm_recipes.models.arithmetic import padded_vocab_size

# Every tensor ({n}: layer index), its shape in named dimensions (see dimensions()) and the config flag it
# depends on. Names are the HuggingFace checkpoint's: models/llama.py names its parameters after it.
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
    ("model.layers.{n}.post_attention_layernorm.weight", ("hidden",), None),
    ("model.layers.{n}.mlp.gate_proj.weight", ("ffn", "hidden"), None),
    ("model.layers.{n}.mlp.up_proj.weight", ("ffn", "hidden"), None),
    ("model.layers.{n}.mlp.down_proj.weight", ("hidden", "ffn"), None),
    ("model.norm.weight", ("hidden",), None),
    ("lm_head.weight", ("vocab", "hidden"), "untied"),
)


def dimensions(cfg, tensor_parallel: int = 1) -> dict:
    """Sizes of the named dimensions; `padded_vocab` is the rows of the tables (see padded_vocab_size)."""
    head_dim = cfg.hidden_size // cfg.num_heads
    return {"vocab": cfg.vocab_size, "hidden": cfg.hidden_size, "q": cfg.num_heads * head_dim,
            "kv": cfg.kv_heads * head_dim, "ffn": cfg.intermediate_size,
            "padded_vocab": padded_vocab_size(cfg.vocab_size, cfg.vocab_pad_multiple, tensor_parallel)}


def tensor_flags(cfg) -> dict:
    """{flag of TENSORS: whether cfg's model has the tensors it marks}."""
    return {None: True, "qkv_bias": cfg.qkv_bias, "untied": not cfg.tie_word_embeddings}


def tensor_dimensions(cfg, layers: range = None) -> list:
    """[(name pattern, name, dimension names)] of the tensors cfg's model has, in TENSORS order (all layers)."""
    flags = tensor_flags(cfg)
    layers = range(cfg.num_layers) if layers is None else layers
    return [(pattern, pattern.format(n=n), dims) for pattern, dims, flag in TENSORS if flags[flag]
            for n in (layers if "{n}" in pattern else (None,))]


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
