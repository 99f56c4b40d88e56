"""The decoder's parts every model family shares: Linear, Embedding, RMSNorm, the SwiGLU MLP, rotary
embeddings and the attention core.

Parameters are stored as torch.nn stores them (Linear weight (out, in), Embedding weight (vocab, hidden)),
so checkpoints convert by name (models/conversion/tables.py). Every operator is a Primitive attribute, so that
models/parallel.py can give each one a shard strategy, as MindFormers does.
"""

import numpy as np
import mindspore as ms
from mindspore import Parameter, Tensor, nn, ops
from mindspore.common.initializer import Normal, initializer
from mindspore.ops.auto_generate.gen_ops_prim import SiLU
from mindspore.ops.operations.nn_ops import FlashAttentionScore

DTYPES = {"float32": ms.float32, "float16": ms.float16, "bfloat16": ms.bfloat16}


class Linear(nn.Cell):
    """y = x W^T (+ b), with W stored (out, in) like torch.nn.Linear, in param_dtype (model_config.param_dtype)."""

    def __init__(self, in_features: int, out_features: int, std: float, bias: bool = False,
                 compute_dtype=ms.float32, param_dtype=ms.float32):
        super().__init__()
        # A 16-bit initializer draws the same float32 numbers and rounds them (lazily, so optimizer parallel
        # materialises only each rank's slice).
        self.weight = Parameter(initializer(Normal(sigma=std), (out_features, in_features), param_dtype),
                                name="weight")
        self.bias = Parameter(initializer("zeros", (out_features,), param_dtype), name="bias") if bias else None
        self.matmul = ops.MatMul(transpose_b=True)
        self.bias_add = ops.Add()
        self.out_features = out_features
        self.compute_dtype = compute_dtype

    def construct(self, x):
        # (..., in) -> (N, in): a 2-D MatMul with transposed weight is the fast kernel on CPU and Ascend.
        x2d = x.reshape(-1, x.shape[-1]).astype(self.compute_dtype)
        y = self.matmul(x2d, self.weight.astype(self.compute_dtype))
        if self.bias is not None:
            y = self.bias_add(y, self.bias.astype(self.compute_dtype))
        return y.reshape(x.shape[:-1] + (self.out_features,))


class Embedding(nn.Cell):
    """Token id -> vector lookup; the table is named `weight` like torch.nn.Embedding."""

    def __init__(self, vocab_size: int, hidden_size: int, std: float, compute_dtype=ms.float32,
                 param_dtype=ms.float32):
        super().__init__()
        self.weight = Parameter(initializer(Normal(sigma=std), (vocab_size, hidden_size), param_dtype),
                                name="weight")
        self.gather = ops.Gather()
        self.compute_dtype = compute_dtype

    def construct(self, ids):
        return self.gather(self.weight, ids, 0).astype(self.compute_dtype)


class RMSNorm(nn.Cell):
    """Root-mean-square normalisation (Zhang & Sennrich 2019), always computed in float32."""

    def __init__(self, hidden_size: int, eps: float, fused: bool = False):
        super().__init__()
        self.weight = Parameter(initializer("ones", (hidden_size,), ms.float32), name="weight")
        self.eps = eps
        self.fused = fused
        if fused:  # Ascend's RmsNorm kernel, as MindFormers' LlamaRMSNorm (llama_layer.py:186-194, 214-217)
            self.norm = ops.RmsNorm(eps)
        self.square = ops.Square()
        self.mean = ops.ReduceMean(keep_dims=True)
        self.add = ops.Add()
        self.rsqrt = ops.Rsqrt()
        self.mul = ops.Mul()
        self.mul_weight = ops.Mul()

    def construct(self, x):
        x32 = x.astype(ms.float32)
        if self.fused:
            return self.norm(x32, self.weight)[0].astype(x.dtype)
        variance = self.mean(self.square(x32), -1)
        return self.mul_weight(self.mul(x32, self.rsqrt(self.add(variance, self.eps))), self.weight).astype(x.dtype)


class MLP(nn.Cell):
    """SwiGLU feed-forward (Shazeer 2020): down(silu(gate(x)) * up(x)), of width `width` (intermediate_size)."""

    def __init__(self, config, width: int = None):
        super().__init__()
        width = config.intermediate_size if width is None else width
        std, dtype, stored = config.initializer_range, DTYPES[config.compute_dtype], DTYPES[config.param_dtype]
        self.gate_proj = Linear(config.hidden_size, width, std, compute_dtype=dtype, param_dtype=stored)
        self.up_proj = Linear(config.hidden_size, width, std, compute_dtype=dtype, param_dtype=stored)
        self.down_proj = Linear(width, config.hidden_size, std, compute_dtype=dtype, param_dtype=stored)
        self.silu = SiLU()
        self.mul = ops.Mul()

    def construct(self, x):
        return self.down_proj(self.mul(self.silu(self.gate_proj(x)), self.up_proj(x)))


def rotary_tables(seq_length: int, head_dim: int, theta: float):
    """cos/sin tables of shape (seq_length, head_dim), HuggingFace half-split layout."""
    inv_freq = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    freqs = np.outer(np.arange(seq_length, dtype=np.float64), inv_freq)
    angles = np.concatenate([freqs, freqs], axis=-1)
    return Tensor(np.cos(angles), ms.float32), Tensor(np.sin(angles), ms.float32)


class RotaryEmbedding(nn.Cell):
    """Rotate (B, heads, S, head_dim) by position, in float32; cos/sin broadcast to it."""

    def __init__(self):
        super().__init__()
        self.slice = ops.StridedSlice()
        self.neg = ops.Neg()
        self.concat = ops.Concat(-1)
        self.mul = ops.Mul()
        self.add = ops.Add()

    def construct(self, x, cos, sin):
        x32 = x.astype(ms.float32)
        b, n, s, d = x.shape
        first = self.slice(x32, (0, 0, 0, 0), (b, n, s, d // 2), (1, 1, 1, 1))
        second = self.slice(x32, (0, 0, 0, d // 2), (b, n, s, d), (1, 1, 1, 1))
        rotated = self.concat((self.neg(second), first))
        return self.add(self.mul(x32, cos), self.mul(rotated, sin)).astype(x.dtype)


class CoreAttention(nn.Cell):
    """softmax(q k^T / sqrt(d) + mask) v: the part selective recompute recomputes."""

    def __init__(self, head_dim: int):
        super().__init__()
        self.scale = 1.0 / float(np.sqrt(head_dim))
        self.mul_scale = ops.Mul()
        self.qk_matmul = ops.BatchMatMul(transpose_b=True)
        self.mask_add = ops.Add()
        self.softmax = ops.Softmax(-1)
        self.pv_matmul = ops.BatchMatMul()
        self.merge_heads = ops.Transpose()

    def construct(self, q, k, v, mask, seq_ends=None):
        b, n, s, _ = q.shape
        d = v.shape[-1]  # the value head (MLA's v_head_dim may differ from the query/key head)
        # Scaling q (B, heads, S, head_dim) costs S/head_dim times less than scaling the scores.
        scores = self.mask_add(self.qk_matmul(self.mul_scale(q, self.scale), k).astype(ms.float32), mask)
        probs = self.softmax(scores)
        out = self.pv_matmul(probs.astype(v.dtype), v)  # (B, heads, S, head_dim)
        # (B, heads, S, head_dim) -> (B, S, H)
        return self.merge_heads(out, (0, 2, 1, 3)).reshape(b, s, n * d)


class FlashAttention(nn.Cell):
    """The same attention on Ascend's FlashAttentionScore kernel: no S x S scores are stored.

    Called as MindFormers 1.9 calls it (mindformers/modules/flash_attention.py:172-179, 337-346;
    layout and sparse_mode chosen as in mindformers/models/llama/llama_transformer.py:429-452):
    BNSD with a uint8 mask (1 = masked), sparse_mode 0 with the full (B, 1, S, S) mask, 2 with the
    compressed 2048 x 2048 causal mask (use_attn_mask_compression); with document attention under
    use_eod_attn_mask_compression, TND layout, sparse_mode 8 and the documents' end offsets as
    actual sequence lengths. Grouped KV heads are read by the kernel without repeating them.
    Scaled by 1/sqrt of the query/key head (config.qk_head_dim); the value head may be narrower, as
    multi-head latent attention's is: MindFormers 1.9's MLA passes its 192-wide queries and keys and
    128-wide values to the kernel unpadded (parallel_core/training_graph/transformer/
    multi_latent_attention.py:284-295, its scale :137-138; flash_attention.py:139-148).
    """

    def __init__(self, config):
        super().__init__()
        self.eod = config.use_eod_attn_mask_compression
        sparse_mode = 8 if self.eod else 2 if config.use_attn_mask_compression else 0
        self.layout = "TND" if self.eod else "BNSD"
        self.flash_attention = FlashAttentionScore(
            head_num=config.num_heads, keep_prob=1.0, scale_value=1.0 / float(np.sqrt(config.qk_head_dim)),
            pre_tokens=2147483647, next_tokens=0, inner_precise=0, input_layout=self.layout, sparse_mode=sparse_mode)
        self.merge_heads = ops.Transpose()
        self.to_tokens_q = ops.Transpose()
        self.to_tokens_kv = ops.Transpose()

    def construct(self, q, k, v, mask, seq_ends=None):
        b, n, s, d = q.shape
        dv = v.shape[-1]
        if self.eod:
            # (B, heads, S, head_dim) -> (B * S, heads, head_dim), MindFormers' _merge_seq_len
            q = self.to_tokens_q(q, (0, 2, 1, 3)).reshape(b * s, n, d)
            k = self.to_tokens_kv(k, (0, 2, 1, 3)).reshape(b * s, -1, d)
            v = self.to_tokens_kv(v, (0, 2, 1, 3)).reshape(b * s, -1, dv)
            out = self.flash_attention(q, k, v, None, None, None, mask, None, seq_ends, seq_ends)[3]
            return out.reshape(b, s, n * dv)
        out = self.flash_attention(q, k, v, None, None, None, mask, None, None, None)[3]
        # (B, heads, S, value head) -> (B, S, heads x value head)
        return self.merge_heads(out, (0, 2, 1, 3)).reshape(b, s, n * dv)
