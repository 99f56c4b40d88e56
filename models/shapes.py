"""Parameter names and shapes of models/llama.py's LlamaForCausalLM, without building it.

Used to check a checkpoint against a recipe before any weight is loaded (a checkpoint of
another model would otherwise fail an hour later, or load silently into the wrong shapes).
"""

from ascend_llm_recipes.models.arithmetic import VOCAB_ALIGN, padded_vocab_size


def parameter_shapes(cfg, tensor_parallel: int = 1) -> dict:
    """{parameter name: shape} for a config with the LlamaConfig / recipe model_config fields."""
    h = cfg.hidden_size
    head_dim = h // cfg.num_heads
    kv = (cfg.num_kv_heads or cfg.num_heads) * head_dim
    vocab = padded_vocab_size(cfg.vocab_size, getattr(cfg, "vocab_pad_multiple", VOCAB_ALIGN), tensor_parallel)
    shapes = {"model.embed_tokens.weight": (vocab, h)}
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (h, h),
            p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h),
            p + "self_attn.o_proj.weight": (h, h),
            p + "post_attention_layernorm.weight": (h,),
            p + "mlp.gate_proj.weight": (cfg.intermediate_size, h),
            p + "mlp.up_proj.weight": (cfg.intermediate_size, h),
            p + "mlp.down_proj.weight": (h, cfg.intermediate_size),
        })
        if getattr(cfg, "qkv_bias", False):
            shapes.update({p + "self_attn.q_proj.bias": (h,), p + "self_attn.k_proj.bias": (kv,),
                           p + "self_attn.v_proj.bias": (kv,)})
    shapes["model.norm.weight"] = (h,)
    if not getattr(cfg, "tie_word_embeddings", False):
        shapes["lm_head.weight"] = (vocab, h)
    return shapes
