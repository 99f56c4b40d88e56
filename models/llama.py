"""Llama-family decoder-only language model as MindSpore Cells.

Reads top to bottom like the paper (Touvron et al. 2023, "Llama 2"): RMSNorm, rotary
position embeddings, causal self-attention with grouped KV heads, SwiGLU MLP, the
decoder block, the model, and the causal-LM head with its loss. Options cover the
family: any number of KV heads (MHA, GQA, MQA), tied input/output embeddings, bias on
q/k/v (Qwen2-style checkpoints), rope theta, and document-aware attention for packed
samples.

Parameter names follow the HuggingFace `LlamaForCausalLM` checkpoint
(`model.layers.0.self_attn.q_proj.weight`, ...) so conversion is a plain table. Only
CPU-available operators are used, so the same graph trains on CPU and Ascend; the
operators that tensor parallelism shards are Primitive attributes so that
`models/parallel.py` can give them strategies.
"""

import numpy as np
import mindspore as ms
from mindspore import Parameter, Tensor, nn, ops
from mindspore.common.initializer import Normal, initializer
from mindformers.models.configuration_utils import PretrainedConfig
from mindformers.models.modeling_utils import PreTrainedModel
from mindformers.tools.register import MindFormerModuleType, MindFormerRegister

from models import LLAMA_CONFIG_TYPE, LLAMA_MODEL_TYPE
from models.arithmetic import VOCAB_ALIGN, padded_vocab_size

DTYPES = {"float32": ms.float32, "float16": ms.float16, "bfloat16": ms.bfloat16}
MASK_VALUE = -1e9


@MindFormerRegister.register(MindFormerModuleType.CONFIG, alias=LLAMA_CONFIG_TYPE)
class LlamaConfig(PretrainedConfig):
    """Architecture of a Llama-family decoder; nothing about how it is trained."""

    model_type = "llama"

    def __init__(self, vocab_size: int = 32000, hidden_size: int = 4096, num_layers: int = 32,
                 num_heads: int = 32, num_kv_heads: int = None, intermediate_size: int = 11008,
                 seq_length: int = 4096, rms_norm_eps: float = 1e-5, rope_theta: float = 10000.0,
                 initializer_range: float = 0.02, tie_word_embeddings: bool = False, qkv_bias: bool = False,
                 vocab_pad_multiple: int = VOCAB_ALIGN, document_attention: bool = False,
                 bos_token_id: int = 1, eos_token_id: int = 2, pad_token_id: int = 0,
                 compute_dtype: str = "float32", **kwargs):
        super().__init__(bos_token_id=bos_token_id, eos_token_id=eos_token_id,
                         pad_token_id=pad_token_id, **kwargs)
        self.vocab_size = vocab_size  # real tokens; the tables are padded (see padded_vocab_size)
        self.hidden_size = hidden_size
        self.num_layers = num_layers
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads if num_kv_heads is not None else num_heads
        self.intermediate_size = intermediate_size
        self.seq_length = seq_length
        self.rms_norm_eps = rms_norm_eps
        self.rope_theta = rope_theta
        self.initializer_range = initializer_range
        self.tie_word_embeddings = tie_word_embeddings
        self.qkv_bias = qkv_bias
        self.vocab_pad_multiple = vocab_pad_multiple
        self.document_attention = document_attention  # packed documents do not see each other
        self.compute_dtype = compute_dtype  # matmul dtype; norms, softmax, rotary and loss stay float32

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def tensor_parallel(self) -> int:
        """Tensor-parallel degree MindFormers attached (parallel_config), 1 when none."""
        return getattr(getattr(self, "parallel_config", None), "model_parallel", 1) or 1

    @property
    def padded_vocab_size(self) -> int:
        return padded_vocab_size(self.vocab_size, self.vocab_pad_multiple, self.tensor_parallel)


class Linear(nn.Cell):
    """y = x W^T (+ b), with W stored (out, in) like torch.nn.Linear; master weights float32."""

    def __init__(self, in_features: int, out_features: int, std: float, bias: bool = False,
                 compute_dtype=ms.float32):
        super().__init__()
        self.weight = Parameter(initializer(Normal(sigma=std), (out_features, in_features), ms.float32),
                                name="weight")
        self.bias = Parameter(initializer("zeros", (out_features,), ms.float32), name="bias") if bias else None
        self.matmul = ops.MatMul(transpose_b=True)
        self.out_features = out_features
        self.compute_dtype = compute_dtype

    def construct(self, x):
        # (..., in) -> (N, in): a 2-D MatMul with transposed weight is the fast kernel on CPU and Ascend.
        x2d = x.reshape(-1, x.shape[-1]).astype(self.compute_dtype)
        y = self.matmul(x2d, self.weight.astype(self.compute_dtype))
        if self.bias is not None:
            y = y + self.bias.astype(self.compute_dtype)
        return y.reshape(x.shape[:-1] + (self.out_features,))


class Embedding(nn.Cell):
    """Token id -> vector lookup; the table is named `weight` like torch.nn.Embedding."""

    def __init__(self, vocab_size: int, hidden_size: int, std: float, compute_dtype=ms.float32):
        super().__init__()
        self.weight = Parameter(initializer(Normal(sigma=std), (vocab_size, hidden_size), ms.float32),
                                name="weight")
        self.gather = ops.Gather()
        self.compute_dtype = compute_dtype

    def construct(self, ids):
        return self.gather(self.weight, ids, 0).astype(self.compute_dtype)


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
    """Rotate (B, heads, S, head_dim) by position, in float32; cos/sin broadcast to it."""
    x32 = x.astype(ms.float32)
    half = x.shape[-1] // 2
    rotated = ops.cat((-x32[..., half:], x32[..., :half]), -1)
    return (x32 * cos + rotated * sin).astype(x.dtype)


class CoreAttention(nn.Cell):
    """softmax(q k^T / sqrt(d) + mask) v: the part selective recompute recomputes."""

    def __init__(self, head_dim: int):
        super().__init__()
        self.scale = 1.0 / float(np.sqrt(head_dim))
        self.qk_matmul = ops.BatchMatMul(transpose_b=True)
        self.softmax = ops.Softmax(-1)
        # The CPU backend has no kernel for Softmax's gradient and expands it into four passes over
        # the (B, heads, S, S) scores (~40 ms per layer at S 256); LogSoftmax has a fused forward and
        # backward kernel there, and exp(log_softmax(x)) equals softmax(x) to float32 rounding.
        self.softmax_via_log = ms.get_context("device_target") == "CPU"
        self.log_softmax = ops.LogSoftmax(-1)
        self.exp = ops.Exp()
        self.pv_matmul = ops.BatchMatMul()

    def construct(self, q, k, v, mask):
        # Scaling q (B, heads, S, head_dim) costs S/head_dim times less than scaling the scores.
        scores = self.qk_matmul(q * self.scale, k).astype(ms.float32) + mask  # (B, heads, S, S)
        if self.softmax_via_log:
            probs = self.exp(self.log_softmax(scores))
        else:
            probs = self.softmax(scores)
        return self.pv_matmul(probs.astype(v.dtype), v)  # (B, heads, S, head_dim)


class Attention(nn.Cell):
    """Causal self-attention with rotary positions and grouped KV heads (MHA, GQA, MQA)."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        std, dtype, bias = config.initializer_range, DTYPES[config.compute_dtype], config.qkv_bias
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        kv_size = self.num_kv_heads * self.head_dim
        self.q_proj = Linear(config.hidden_size, self.num_heads * self.head_dim, std, bias, dtype)
        self.k_proj = Linear(config.hidden_size, kv_size, std, bias, dtype)
        self.v_proj = Linear(config.hidden_size, kv_size, std, bias, dtype)
        self.core = CoreAttention(self.head_dim)
        self.o_proj = Linear(self.num_heads * self.head_dim, config.hidden_size, std, compute_dtype=dtype)

    def repeat_kv(self, x):
        """Share each KV head with num_heads // num_kv_heads query heads."""
        if self.num_kv_heads == self.num_heads:
            return x
        b, kv, s, d = x.shape
        rep = self.num_heads // self.num_kv_heads
        # (B, kv, S, D) -> (B, kv, rep, S, D) -> (B, heads, S, D)
        x = ops.broadcast_to(x.reshape(b, kv, 1, s, d), (b, kv, rep, s, d))
        return x.reshape(b, kv * rep, s, d)

    def construct(self, x, cos, sin, mask):
        b, s, _ = x.shape
        # (B, S, H) -> (B, heads, S, head_dim)
        q = self.q_proj(x).reshape(b, s, self.num_heads, self.head_dim).transpose(0, 2, 1, 3)
        k = self.k_proj(x).reshape(b, s, self.num_kv_heads, self.head_dim).transpose(0, 2, 1, 3)
        v = self.v_proj(x).reshape(b, s, self.num_kv_heads, self.head_dim).transpose(0, 2, 1, 3)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        out = self.core(q, self.repeat_kv(k), self.repeat_kv(v), mask)
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

    def construct(self, x, cos, sin, mask):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Cell):
    """Token embedding, the decoder stack and the final norm."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.embed_tokens = Embedding(config.padded_vocab_size, config.hidden_size, config.initializer_range,
                                      DTYPES[config.compute_dtype])
        self.layers = nn.CellList([DecoderLayer(config) for _ in range(config.num_layers)])
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.cos, self.sin = rotary_tables(config.seq_length, config.head_dim, config.rope_theta)
        self.causal_mask = Tensor(np.triu(np.full((config.seq_length, config.seq_length), MASK_VALUE,
                                                  dtype=np.float32), k=1))
        self.document_attention = config.document_attention
        self.eod_id = config.eos_token_id

    def positions_and_mask(self, tokens):
        """Rotary tables and additive mask; per document when document_attention is on.

        With documents packed back to back, each one restarts at position 0 and attends
        only to itself (and earlier tokens of it); its closing EOD belongs to it.
        """
        s = tokens.shape[1]
        causal = self.causal_mask[:s, :s]
        if not self.document_attention:
            return self.cos[:s], self.sin[:s], causal
        is_eod = (tokens == self.eod_id).astype(ms.int32)                         # (B, S)
        doc = ops.cumsum(is_eod, 1) - is_eod                                       # document index per token
        index = ops.arange(s, dtype=ms.int32).reshape(1, s)
        starts_doc = ops.pad(is_eod[:, :-1], (1, 0)) * index                       # a doc starts after an EOD
        positions = index - ops.cummax(starts_doc, 1)[0]                           # (B, S)
        cos = ops.gather(self.cos, positions, 0).expand_dims(1)                    # (B, 1, S, head_dim)
        sin = ops.gather(self.sin, positions, 0).expand_dims(1)
        same_doc = (doc.expand_dims(2) == doc.expand_dims(1)).astype(ms.float32)   # (B, S, S)
        mask = causal + (1.0 - same_doc) * MASK_VALUE
        return cos, sin, mask.expand_dims(1)                                       # mask (B, 1, S, S)

    def construct(self, tokens):
        cos, sin, mask = self.positions_and_mask(tokens)
        x = self.embed_tokens(tokens)
        for layer in self.layers:
            x = layer(x, cos, sin, mask)
        return self.norm(x)


@MindFormerRegister.register(MindFormerModuleType.MODELS, alias=LLAMA_MODEL_TYPE)
class LlamaForCausalLM(PreTrainedModel):
    """Decoder + vocabulary projection; in training, returns the mean next-token loss.

    Input `input_ids` has seq_length + 1 tokens per row: positions [0, S) are the model
    input, positions [1, S] the labels. Labels equal to `pad_token_id` (-1 when the tokenizer
    has none) are excluded from the loss. The padding rows of the vocabulary tables are cut
    off before the softmax, so they never receive probability mass (nor gradient).
    """

    config_class = LlamaConfig
    base_model_prefix = "model"

    def __init__(self, config: LlamaConfig, **kwargs):
        # auto_prefix keeps parameter names unique ("model.layers.0...", "lm_head.weight").
        super().__init__(config, auto_prefix=True)
        self.model = LlamaModel(config)
        self.tie_word_embeddings = config.tie_word_embeddings
        if not self.tie_word_embeddings:
            self.lm_head = Linear(config.hidden_size, config.padded_vocab_size, config.initializer_range,
                                  compute_dtype=DTYPES[config.compute_dtype])
        self.head_matmul = ops.MatMul(transpose_b=True)  # used with the tied embedding table
        self.pad_token_id = config.pad_token_id
        self.vocab_size = config.vocab_size
        self.compute_dtype = DTYPES[config.compute_dtype]
        self.apply_parallel_layout(getattr(config, "parallel_config", None))

    def apply_parallel_layout(self, parallel_config) -> None:
        """Shard strategies, pipeline stages and recompute, all from models/parallel.py."""
        if parallel_config is not None:
            from models.parallel import apply_layout, plan_layout_from_mindformers
            apply_layout(self, plan_layout_from_mindformers(self.config, parallel_config))

    def logits(self, tokens):
        """(B, S) token ids -> (B, S, vocab_size) float32 logits (padding rows cut off)."""
        h = self.model(tokens)
        if self.tie_word_embeddings:
            b, s, hidden = h.shape
            table = self.model.embed_tokens.weight.astype(self.compute_dtype)
            logits = self.head_matmul(h.reshape(b * s, hidden), table).reshape(b, s, -1)
        else:
            logits = self.lm_head(h)
        if logits.shape[-1] != self.vocab_size:
            # Only when the table is padded: even a no-op StridedSlice of the (B, S, vocab) logits
            # costs ~1.2 s per step on CPU (hidden 256, vocab 8192, B*S 2048), half the step.
            logits = logits[..., :self.vocab_size]
        return logits.astype(ms.float32)

    def construct(self, input_ids):
        # Padding is -1 when the tokenizer has no pad token (data/tokenizer.py NO_PAD): looked up as id 0. Its
        # labels are masked, and it only follows a row's last real token, which causal attention never lets see it.
        ids = ops.maximum(input_ids, 0)
        tokens = ids[:, :-1]
        labels = input_ids[:, 1:].reshape(-1)
        logits = self.logits(tokens).reshape(-1, self.vocab_size)  # (B*S, vocab)
        mask = (labels != self.pad_token_id).astype(ms.float32)
        log_probs = ops.log_softmax(logits, -1)
        nll = -ops.gather_elements(log_probs, 1, ids[:, 1:].reshape(-1, 1)).reshape(-1)
        return (nll * mask).sum() / ops.maximum(mask.sum(), 1.0)
