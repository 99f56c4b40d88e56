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

from ascend_llm_recipes.models.layers import (DTYPES, CoreAttention, FlashAttention, Linear, RMSNorm,
                                              RotaryEmbedding)


class LastAxis(nn.Cell):
    """x[..., start:stop] as one StridedSlice Primitive, so that models/parallel.py can shard it."""

    def __init__(self, start: int, stop: int):
        super().__init__()
        self.start, self.stop = start, stop
        self.slice = ops.StridedSlice()

    def construct(self, x):
        begin = (0,) * (x.ndim - 1) + (self.start,)
        return self.slice(x, begin, x.shape[:-1] + (self.stop,), (1,) * x.ndim)


class MultiLatentAttention(nn.Cell):
    """(B, S, hidden) -> (B, S, hidden), causal, with rotary positions on qk_rope_head_dim of each head.

    On Ascend the recipe may switch the attention core to FlashAttentionScore and the latent norms to the fused
    RmsNorm (use_flash_attention, fused_rms_norm), as MindFormers 1.9's MLA does (layers.py FlashAttention).
    """

    def __init__(self, config):
        super().__init__()
        std, dtype, stored = config.initializer_range, DTYPES[config.compute_dtype], DTYPES[config.param_dtype]
        fused = config.fused_rms_norm
        self.num_heads = config.num_heads
        self.nope, self.rope, self.v_dim = config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim
        self.kv_lora_rank = config.kv_lora_rank
        q_dim = self.num_heads * (self.nope + self.rope)
        if config.q_lora_rank is None:
            self.q_proj = Linear(config.hidden_size, q_dim, std, compute_dtype=dtype, param_dtype=stored)
        else:
            self.q_proj = None
            self.q_a_proj = Linear(config.hidden_size, config.q_lora_rank, std, compute_dtype=dtype, param_dtype=stored)
            self.q_a_layernorm = RMSNorm(config.q_lora_rank, config.rms_norm_eps, fused)
            self.q_b_proj = Linear(config.q_lora_rank, q_dim, std, compute_dtype=dtype, param_dtype=stored)
        self.kv_a_proj_with_mqa = Linear(config.hidden_size, self.kv_lora_rank + self.rope, std, compute_dtype=dtype,
                                         param_dtype=stored)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, config.rms_norm_eps, fused)
        self.kv_b_proj = Linear(self.kv_lora_rank, self.num_heads * (self.nope + self.v_dim), std, compute_dtype=dtype,
                                param_dtype=stored)
        self.o_proj = Linear(self.num_heads * self.v_dim, config.hidden_size, std, compute_dtype=dtype,
                             param_dtype=stored)
        self.split_heads = ops.Transpose()
        self.split_kv = ops.Transpose()
        self.q_nope, self.q_rope = LastAxis(0, self.nope), LastAxis(self.nope, self.nope + self.rope)
        self.latent, self.k_rope = LastAxis(0, self.kv_lora_rank), LastAxis(self.kv_lora_rank,
                                                                             self.kv_lora_rank + self.rope)
        self.k_nope, self.value = LastAxis(0, self.nope), LastAxis(self.nope, self.nope + self.v_dim)
        # two cells, since the queries' rotary part has a head per query head and the key's one for all heads
        self.rotary_q, self.rotary_k = RotaryEmbedding(), RotaryEmbedding()
        self.concat_q, self.concat_k = ops.Concat(-1), ops.Concat(-1)
        self.tile = ops.Tile()
        self.flash = config.use_flash_attention
        self.core = FlashAttention(config) if self.flash else CoreAttention(self.nope + self.rope)

    def queries(self, x):
        if self.q_proj is not None:
            return self.q_proj(x)
        return self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))

    def construct(self, x, cos, sin, mask, seq_ends=None):
        b, s, _ = x.shape
        n = self.num_heads
        # (B, S, heads x (nope + rope)) -> (B, heads, S, nope + rope)
        q = self.split_heads(self.queries(x).reshape(b, s, n, self.nope + self.rope), (0, 2, 1, 3))
        compressed = self.kv_a_proj_with_mqa(x)                                  # (B, S, kv_lora_rank + rope)
        # (B, S, heads x (nope + v)) -> (B, heads, S, nope + v)
        kv = self.split_kv(self.kv_b_proj(self.kv_a_layernorm(self.latent(compressed))).reshape(
            b, s, n, self.nope + self.v_dim), (0, 2, 1, 3))
        # the rotary key: (B, S, rope) -> (B, 1, S, rope), one for every head
        k_rope = self.rotary_k(self.k_rope(compressed).reshape(b, 1, s, self.rope), cos, sin)
        q = self.concat_q((self.q_nope(q), self.rotary_q(self.q_rope(q), cos, sin)))
        k = self.concat_k((self.k_nope(kv), self.tile(k_rope, (1, n, 1, 1))))  # (B, heads, S, nope + rope)
        return self.o_proj(self.core(q, k, self.value(kv), mask, seq_ends))  # (B, S, heads x v) -> (B, S, H)
