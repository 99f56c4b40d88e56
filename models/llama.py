"""Llama-style decoder-only language model as MindSpore Cells.

Reads top to bottom like the paper (Touvron et al. 2023, "Llama 2"): RMSNorm, rotary
position embeddings, causal self-attention with grouped KV heads, SwiGLU MLP, the
decoder block, the model, and the causal-LM head with its loss.

Parameter names follow the HuggingFace `LlamaForCausalLM` checkpoint
(`model.layers.0.self_attn.q_proj.weight`, ...) so conversion is a plain table.
Only CPU-available operators are used, so the same graph trains on CPU and Ascend.
"""

import numpy as np
import mindspore as ms
from mindspore import Parameter, Tensor, nn, ops
from mindspore.common.initializer import Normal, initializer
from mindformers.models.configuration_utils import PretrainedConfig
from mindformers.models.modeling_utils import PreTrainedModel
from mindformers.tools.register import MindFormerModuleType, MindFormerRegister

from models import LLAMA_CONFIG_TYPE, LLAMA_MODEL_TYPE


@MindFormerRegister.register(MindFormerModuleType.CONFIG, alias=LLAMA_CONFIG_TYPE)
class LlamaConfig(PretrainedConfig):
    """Architecture of a Llama-style decoder; nothing about how it is trained."""

    model_type = "llama"

    def __init__(self, vocab_size: int = 32000, hidden_size: int = 4096, num_layers: int = 32,
                 num_heads: int = 32, num_kv_heads: int = None, intermediate_size: int = 11008,
                 seq_length: int = 4096, rms_norm_eps: float = 1e-5, rope_theta: float = 10000.0,
                 initializer_range: float = 0.02, bos_token_id: int = 1, eos_token_id: int = 2,
                 pad_token_id: int = 0, compute_dtype: str = "float32", **kwargs):
        super().__init__(bos_token_id=bos_token_id, eos_token_id=eos_token_id,
                         pad_token_id=pad_token_id, **kwargs)
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.num_layers = num_layers
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads if num_kv_heads is not None else num_heads
        self.intermediate_size = intermediate_size
        self.seq_length = seq_length
        self.rms_norm_eps = rms_norm_eps
        self.rope_theta = rope_theta
        self.initializer_range = initializer_range
        self.compute_dtype = compute_dtype  # matmul dtype; norms, softmax, rotary and loss stay float32

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


DTYPES = {"float32": ms.float32, "float16": ms.float16, "bfloat16": ms.bfloat16}


class Linear(nn.Cell):
    """y = x W^T (+ b), with W stored (out, in) like torch.nn.Linear; master weights float32."""

    def __init__(self, in_features: int, out_features: int, std: float, bias: bool = False,
                 compute_dtype=ms.float32):
        super().__init__()
        self.compute_dtype = compute_dtype
        self.weight = Parameter(initializer(Normal(sigma=std), (out_features, in_features), ms.float32),
                                name="weight")
        self.bias = Parameter(initializer("zeros", (out_features,), ms.float32), name="bias") if bias else None
        self.matmul = ops.MatMul(transpose_b=True)
        self.out_features = out_features

    def construct(self, x):
        # (..., in) -> (N, in): a 2-D MatMul with transposed weight is the fast kernel on CPU and Ascend.
        y = self.matmul(x.reshape(-1, x.shape[-1]).astype(self.compute_dtype), self.weight.astype(self.compute_dtype))
        if self.bias is not None:
            y = y + self.bias.astype(self.compute_dtype)
        return y.reshape(x.shape[:-1] + (self.out_features,))


class Embedding(nn.Cell):
    """Token id -> vector lookup; the table is named `weight` like torch.nn.Embedding."""

    def __init__(self, vocab_size: int, hidden_size: int, std: float, compute_dtype=ms.float32):
        super().__init__()
        self.weight = Parameter(initializer(Normal(sigma=std), (vocab_size, hidden_size), ms.float32),
                                name="weight")
        self.compute_dtype = compute_dtype

    def construct(self, ids):
        return ops.gather(self.weight, ids, 0).astype(self.compute_dtype)


class RMSNorm(nn.Cell):
    """Root-mean-square normalisation (Zhang & Sennrich 2019), always computed in float32."""

    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.weight = Parameter(initializer("ones", (hidden_size,), ms.float32), name="weight")
        self.eps = eps

    def construct(self, x):
        x32 = x.astype(ms.float32)
        variance = ops.mean(x32 * x32, -1, keep_dims=True)
        return (x32 * ops.rsqrt(variance + self.eps) * self.weight).astype(x.dtype)


def rotary_tables(seq_length: int, head_dim: int, theta: float):
    """cos/sin tables of shape (seq_length, head_dim), HuggingFace half-split layout."""
    inv_freq = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    freqs = np.outer(np.arange(seq_length, dtype=np.float64), inv_freq)
    angles = np.concatenate([freqs, freqs], axis=-1)
    return Tensor(np.cos(angles), ms.float32), Tensor(np.sin(angles), ms.float32)


def apply_rotary(x, cos, sin):
    """Rotate (B, heads, S, head_dim) by position, in float32."""
    x32 = x.astype(ms.float32)
    half = x.shape[-1] // 2
    rotated = ops.cat((-x32[..., half:], x32[..., :half]), -1)
    return (x32 * cos + rotated * sin).astype(x.dtype)


class Attention(nn.Cell):
    """Causal multi-head self-attention with rotary positions and grouped KV heads (GQA)."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        std = config.initializer_range
        dtype = DTYPES[config.compute_dtype]
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_proj = Linear(config.hidden_size, self.num_heads * self.head_dim, std, compute_dtype=dtype)
        self.k_proj = Linear(config.hidden_size, self.num_kv_heads * self.head_dim, std, compute_dtype=dtype)
        self.v_proj = Linear(config.hidden_size, self.num_kv_heads * self.head_dim, std, compute_dtype=dtype)
        self.o_proj = Linear(self.num_heads * self.head_dim, config.hidden_size, std, compute_dtype=dtype)
        self.scale = 1.0 / float(np.sqrt(self.head_dim))
        self.qk_matmul = ops.BatchMatMul(transpose_b=True)

    def repeat_kv(self, x):
        """Share each KV head with num_heads // num_kv_heads query heads."""
        if self.num_kv_heads == self.num_heads:
            return x
        b, kv, s, d = x.shape
        rep = self.num_heads // self.num_kv_heads
        # (B, kv, S, D) -> (B, kv, rep, S, D) -> (B, heads, S, D)
        x = ops.broadcast_to(x.reshape(b, kv, 1, s, d), (b, kv, rep, s, d))
        return x.reshape(b, kv * rep, s, d)

    def construct(self, x, cos, sin, causal_mask):
        b, s, _ = x.shape
        # (B, S, H) -> (B, heads, S, head_dim)
        q = self.q_proj(x).reshape(b, s, self.num_heads, self.head_dim).transpose(0, 2, 1, 3)
        k = self.k_proj(x).reshape(b, s, self.num_kv_heads, self.head_dim).transpose(0, 2, 1, 3)
        v = self.v_proj(x).reshape(b, s, self.num_kv_heads, self.head_dim).transpose(0, 2, 1, 3)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        k, v = self.repeat_kv(k), self.repeat_kv(v)
        scores = self.qk_matmul(q, k).astype(ms.float32) * self.scale + causal_mask  # (B, heads, S, S)
        probs = ops.softmax(scores, -1).astype(v.dtype)
        out = ops.matmul(probs, v)
        # (B, heads, S, head_dim) -> (B, S, H)
        out = out.transpose(0, 2, 1, 3).reshape(b, s, self.num_heads * self.head_dim)
        return self.o_proj(out)


class MLP(nn.Cell):
    """SwiGLU feed-forward (Shazeer 2020): down(silu(gate(x)) * up(x))."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        std, dtype = config.initializer_range, DTYPES[config.compute_dtype]
        self.gate_proj = Linear(config.hidden_size, config.intermediate_size, std, compute_dtype=dtype)
        self.up_proj = Linear(config.hidden_size, config.intermediate_size, std, compute_dtype=dtype)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, std, compute_dtype=dtype)

    def construct(self, x):
        return self.down_proj(ops.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Cell):
    """Pre-norm block: x + attn(norm(x)), then + mlp(norm(x))."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def construct(self, x, cos, sin, causal_mask):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, causal_mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Cell):
    """Token embedding, the decoder stack and the final norm."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size, config.initializer_range,
                                      DTYPES[config.compute_dtype])
        self.layers = nn.CellList([DecoderLayer(config) for _ in range(config.num_layers)])
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.cos, self.sin = rotary_tables(config.seq_length, config.head_dim, config.rope_theta)
        mask = np.triu(np.full((config.seq_length, config.seq_length), -1e9, dtype=np.float32), k=1)
        self.causal_mask = Tensor(mask, ms.float32)

    def construct(self, tokens):
        s = tokens.shape[1]
        cos, sin = self.cos[:s], self.sin[:s]
        mask = self.causal_mask[:s, :s]
        x = self.embed_tokens(tokens)
        for layer in self.layers:
            x = layer(x, cos, sin, mask)
        return self.norm(x)


@MindFormerRegister.register(MindFormerModuleType.MODELS, alias=LLAMA_MODEL_TYPE)
class LlamaForCausalLM(PreTrainedModel):
    """Decoder + vocabulary projection; in training, returns the mean next-token loss.

    Input `input_ids` has seq_length + 1 tokens per row: positions [0, S) are the
    model input, positions [1, S] the labels. Labels equal to `pad_token_id` are
    excluded from the loss.
    """

    config_class = LlamaConfig
    base_model_prefix = "model"

    def __init__(self, config: LlamaConfig, **kwargs):
        # auto_prefix keeps parameter names unique ("model.layers.0...", "lm_head.weight").
        super().__init__(config, auto_prefix=True)
        self.model = LlamaModel(config)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, config.initializer_range,
                              compute_dtype=DTYPES[config.compute_dtype])
        self.pad_token_id = config.pad_token_id
        self.vocab_size = config.vocab_size
        self.apply_parallel_layout(getattr(config, "parallel_config", None))

    def apply_parallel_layout(self, parallel_config) -> None:
        """The one place the parallel layout touches this model: full recompute per decoder layer.

        `parallel_config` is MindFormers' TransformerOpParallelConfig, built from the recipe's
        parallel_config and recompute_config sections.
        """
        recompute = getattr(parallel_config, "recompute", None)
        if recompute is not None and recompute.recompute:
            for layer in self.model.layers:
                layer.recompute()

    def logits(self, tokens):
        """(B, S) token ids -> (B, S, vocab) float32 logits."""
        return self.lm_head(self.model(tokens)).astype(ms.float32)

    def construct(self, input_ids):
        tokens = input_ids[:, :-1]
        labels = input_ids[:, 1:]
        logits = self.logits(tokens).reshape(-1, self.vocab_size)  # (B*S, vocab)
        labels = labels.reshape(-1)
        mask = (labels != self.pad_token_id).astype(ms.float32)
        log_probs = ops.log_softmax(logits, -1)
        nll = -ops.gather_elements(log_probs, 1, labels.reshape(-1, 1)).reshape(-1)
        return (nll * mask).sum() / ops.maximum(mask.sum(), 1.0)
