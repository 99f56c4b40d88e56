"""Multi-head latent attention (DeepSeek-V2, DeepSeek-AI 2024; DeepSeek-V3) as a MindSpore Cell.

Keys and values come from one low-rank latent per token: x -> kv_a_proj_with_mqa -> [latent (kv_lora_rank) |
rotary key (qk_rope_head_dim)], the latent normalised (kv_a_layernorm) and expanded by kv_b_proj into each head's
non-rotary key (qk_nope_head_dim) and value (v_head_dim); the rotary key is one for all heads ("decoupled RoPE").
Queries go through their own latent (q_a_proj, q_a_layernorm, q_b_proj) when q_lora_rank is set, else q_proj, and
split into a non-rotary and a rotary part. Attention runs over heads of qk_nope_head_dim + qk_rope_head_dim, scaled
by 1/sqrt of that, and o_proj maps heads x v_head_dim back.

Parameters are named as Hugging Face's DeepseekV3ForCausalLM names them. Rotary embeddings use the half-split
layout of models/layers.py; checkpoints that store the rotary rows interleaved (transformers' rope_interleave)
are permuted on conversion (models/conversion/tables.py), as Meta's are.
"""

from mindspore import nn, ops

from ascend_llm_recipes.models.layers import DTYPES, CoreAttention, Linear, RMSNorm, RotaryEmbedding


class MultiLatentAttention(nn.Cell):
    """(B, S, hidden) -> (B, S, hidden), causal, with rotary positions on qk_rope_head_dim of each head."""

    def __init__(self, config):
        super().__init__()
        std, dtype, stored = config.initializer_range, DTYPES[config.compute_dtype], DTYPES[config.param_dtype]
        self.num_heads = config.num_heads
        self.nope, self.rope, self.v_dim = config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim
        self.kv_lora_rank = config.kv_lora_rank
        q_dim = self.num_heads * (self.nope + self.rope)
        if config.q_lora_rank is None:
            self.q_proj = Linear(config.hidden_size, q_dim, std, compute_dtype=dtype, param_dtype=stored)
        else:
            self.q_proj = None
            self.q_a_proj = Linear(config.hidden_size, config.q_lora_rank, std, compute_dtype=dtype, param_dtype=stored)
            self.q_a_layernorm = RMSNorm(config.q_lora_rank, config.rms_norm_eps)
            self.q_b_proj = Linear(config.q_lora_rank, q_dim, std, compute_dtype=dtype, param_dtype=stored)
        self.kv_a_proj_with_mqa = Linear(config.hidden_size, self.kv_lora_rank + self.rope, std, compute_dtype=dtype,
                                         param_dtype=stored)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, config.rms_norm_eps)
        self.kv_b_proj = Linear(self.kv_lora_rank, self.num_heads * (self.nope + self.v_dim), std, compute_dtype=dtype,
                                param_dtype=stored)
        self.o_proj = Linear(self.num_heads * self.v_dim, config.hidden_size, std, compute_dtype=dtype,
                             param_dtype=stored)
        self.split_heads = ops.Transpose()
        self.split_kv = ops.Transpose()
        self.rotary = RotaryEmbedding()
        self.concat = ops.Concat(-1)
        self.tile = ops.Tile()
        self.core = CoreAttention(self.nope + self.rope)

    def queries(self, x):
        if self.q_proj is not None:
            return self.q_proj(x)
        return self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))

    def construct(self, x, cos, sin, mask, seq_ends=None):
        b, s, _ = x.shape
        n = self.num_heads
        # (B, S, heads x (nope + rope)) -> (B, heads, S, nope + rope)
        q = self.split_heads(self.queries(x).reshape(b, s, n, self.nope + self.rope), (0, 2, 1, 3))
        q_nope, q_rope = q[..., :self.nope], q[..., self.nope:]
        compressed = self.kv_a_proj_with_mqa(x)                                  # (B, S, kv_lora_rank + rope)
        latent, k_rope = compressed[..., :self.kv_lora_rank], compressed[..., self.kv_lora_rank:]
        # (B, S, heads x (nope + v)) -> (B, heads, S, nope + v)
        kv = self.split_kv(self.kv_b_proj(self.kv_a_layernorm(latent)).reshape(b, s, n, self.nope + self.v_dim),
                           (0, 2, 1, 3))
        k_nope, v = kv[..., :self.nope], kv[..., self.nope:]
        # the rotary key: (B, S, rope) -> (B, 1, S, rope), one for every head
        k_rope = self.rotary(k_rope.reshape(b, 1, s, self.rope), cos, sin)
        q = self.concat((q_nope, self.rotary(q_rope, cos, sin)))
        k = self.concat((k_nope, self.tile(k_rope, (1, n, 1, 1))))              # (B, heads, S, nope + rope)
        return self.o_proj(self.core(q, k, v, mask, seq_ends))                   # (B, S, heads x v) -> (B, S, H)
