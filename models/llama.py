"""Llama-family decoder-only language model as MindSpore Cells.

Reads top to bottom like the paper (Touvron et al. 2023, "Llama 2"): RMSNorm, rotary
position embeddings, causal self-attention with grouped KV heads, SwiGLU MLP, the
decoder block, the model, and the causal-LM head (its loss in models/loss.py). Options cover the
family: any number of KV heads (MHA, GQA, MQA), tied input/output embeddings, bias on
q/k/v (Qwen2-style checkpoints), rope theta, and document-aware attention for packed
samples.

Parameter names follow the HuggingFace `LlamaForCausalLM` checkpoint
(`model.layers.0.self_attn.q_proj.weight`, ...) so conversion is a plain table. The
default path uses only CPU-available operators (the reference math); on Ascend the recipe
may switch attention to FlashAttentionScore and the norms to the fused RmsNorm kernel
(MindFormers' `use_flash_attention`, `fused_rms_norm`), which changes kernels, never
parameters. The loss is one fused kernel where every rank holds whole rows of logits
(stand-alone, data parallel) and MindFormers' vocabulary-parallel operators in semi-auto
parallel, where tensor parallel may split the vocabulary: the same numbers either way.
Every operator of the forward pass is a Primitive attribute, so that `models/parallel.py`
can give each one a shard strategy, as MindFormers' Llama does.
"""

import dataclasses
import functools

import numpy as np
import mindspore as ms
from mindspore import Tensor, nn, ops
from mindformers.models.configuration_utils import PretrainedConfig
from mindformers.models.modeling_utils import PreTrainedModel
from mindformers.models.utils import lazy_inline
from mindformers.tools.register import MindFormerModuleType, MindFormerRegister

from ascend_llm_recipes.models import LLAMA_CONFIG_TYPE, LLAMA_MODEL_TYPE
from ascend_llm_recipes.models.arithmetic import padded_vocab_size
from ascend_llm_recipes.models.config import ModelConfig
from ascend_llm_recipes.models.layers import (DTYPES, MLP, CoreAttention, Embedding, FlashAttention, Linear, RMSNorm,
                                              RotaryEmbedding, rotary_tables)
from ascend_llm_recipes.models.mla import MultiLatentAttention
from ascend_llm_recipes.models.moe import MoE
from ascend_llm_recipes.models.loss import CrossEntropy, WholeVocabularyCrossEntropy, loss_splits_vocabulary
from ascend_llm_recipes.models.presets import PRESETS

MASK_VALUE = -1e9
FIELDS = tuple(f.name for f in dataclasses.fields(ModelConfig) if f.name != "type")
DEFAULT_SIZES = {name: PRESETS["llama2-7b"][name] for name in ("vocab_size", "hidden_size", "num_layers",
                                                               "num_heads", "intermediate_size", "seq_length")}


@MindFormerRegister.register(MindFormerModuleType.CONFIG, alias=LLAMA_CONFIG_TYPE)
class LlamaConfig(PretrainedConfig):
    """Architecture of a Llama-family decoder; nothing about how it is trained."""

    model_type = "llama"

    def __init__(self, **kwargs):
        # models/config.py's fields and defaults; sizes not given are Llama 2 7B's (MindFormers builds a
        # default instance to list a config's non-default keys).
        values = {**DEFAULT_SIZES, **{name: kwargs.pop(name) for name in FIELDS if name in kwargs}}
        cfg = ModelConfig(**values)
        super().__init__(bos_token_id=cfg.bos_token_id, eos_token_id=cfg.eos_token_id,
                         pad_token_id=cfg.pad_token_id, **kwargs)
        for name in FIELDS:
            setattr(self, name, getattr(cfg, name))
        self.num_kv_heads = cfg.kv_heads  # vocab_size: real tokens; LlamaForCausalLM pads the tables

    @property
    def kv_heads(self) -> int:
        return self.num_kv_heads  # already resolved from ModelConfig.kv_heads

    def __repr__(self):
        """The architecture, by our fields. MindSpore's lazy_inline keys a compiled cell by str() of its constructor's
        arguments (mindspore/graph/lazy_inline.py:228); PretrainedConfig's own repr serialises the parallel configs
        MindFormers attaches (configuration_utils.py:831-839) and fails on the dict-like MindFormerConfig, whose
        missing `to_diff_dict` reads as None."""
        return f"{type(self).__name__}({', '.join(f'{name}={getattr(self, name)!r}' for name in FIELDS)})"

    # Derived sizes, as models/config.py defines them.
    head_size = ModelConfig.head_size
    mla = ModelConfig.mla
    qk_head_dim = ModelConfig.qk_head_dim
    value_head_dim = ModelConfig.value_head_dim
    rotary_dim = ModelConfig.rotary_dim
    moe = ModelConfig.moe
    is_moe_layer = ModelConfig.is_moe_layer
    expert_size = ModelConfig.expert_size


def lazy_inline_applies(device_target: str, parallel_mode: str) -> bool:
    """Whether the model is compiled once and reused per micro-batch (lazy_inline).

    MindFormers skips it in stand-alone mode (mindformers/version_control.py:101-112); MindSpore
    2.9's CPU backend rejects lazy-inlined graphs ("Input[0] must be a Primitive ValueNode",
    segment_runner.cc:131, tests/test_model.py), so on CPU the network is inlined as before.
    """
    return device_target == "Ascend" and parallel_mode != "stand_alone"


def lazy_inline_where_supported(init):
    """MindFormers' lazy_inline decorator (mindformers/models/utils.py:200), applied where it can run."""
    @functools.wraps(init)
    def wrapped(self, *args, **kwargs):
        if lazy_inline_applies(ms.get_context("device_target"), ms.get_auto_parallel_context("parallel_mode")):
            return lazy_inline(init)(self, *args, **kwargs)
        return init(self, *args, **kwargs)
    return wrapped


class Attention(nn.Cell):
    """Causal self-attention with rotary positions and grouped KV heads (MHA, GQA, MQA)."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        std, dtype, bias = config.initializer_range, DTYPES[config.compute_dtype], config.qkv_bias
        stored = DTYPES[config.param_dtype]
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_size
        kv_size = self.num_kv_heads * self.head_dim
        self.q_proj = Linear(config.hidden_size, self.num_heads * self.head_dim, std, bias, dtype, stored)
        self.k_proj = Linear(config.hidden_size, kv_size, std, bias, dtype, stored)
        self.v_proj = Linear(config.hidden_size, kv_size, std, bias, dtype, stored)
        self.split_heads = ops.Transpose()
        self.rotary = RotaryEmbedding()
        self.flash = config.use_flash_attention
        self.core = FlashAttention(config) if self.flash else CoreAttention(self.head_dim)
        self.tile_kv = ops.Tile()
        self.o_proj = Linear(self.num_heads * self.head_dim, config.hidden_size, std, compute_dtype=dtype,
                             param_dtype=stored)
        # Qwen3: each head's q and k RMS-normalised over head_dim before the rotation (q_norm, k_norm)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, config.fused_rms_norm) if config.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, config.fused_rms_norm) if config.qk_norm else None

    def repeat_kv(self, x):
        """Share each KV head with num_heads // num_kv_heads query heads."""
        if self.num_kv_heads == self.num_heads or self.flash:
            return x
        b, kv, s, d = x.shape
        rep = self.num_heads // self.num_kv_heads
        # (B, kv, S, D) -> (B, kv, 1, S * D) -> (B, kv, rep, S * D) -> (B, heads, S, D)
        x = self.tile_kv(x.reshape(b, kv, 1, s * d), (1, 1, rep, 1))
        return x.reshape(b, kv * rep, s, d)

    def construct(self, x, cos, sin, mask, seq_ends=None):
        b, s, _ = x.shape
        # (B, S, H) -> (B, S, heads, head_dim) [-> per-head norm] -> (B, heads, S, head_dim)
        q = self.q_proj(x).reshape(b, s, self.num_heads, self.head_dim)
        k = self.k_proj(x).reshape(b, s, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.split_heads(q, (0, 2, 1, 3)), self.split_heads(k, (0, 2, 1, 3))
        v = self.split_heads(self.v_proj(x).reshape(b, s, self.num_kv_heads, self.head_dim), (0, 2, 1, 3))
        q, k = self.rotary(q, cos, sin), self.rotary(k, cos, sin)
        out = self.core(q, self.repeat_kv(k), self.repeat_kv(v), mask, seq_ends)  # (B, S, H)
        return self.o_proj(out)


class DecoderLayer(nn.Cell):
    """Pre-norm block: x + attn(norm(x)), then + mlp(norm(x)); the MLP is models/moe.py's MoE in a MoE layer.

    In a model with MoE layers every layer takes and returns, beside x, the (1,) router loss of the layers before it,
    a MoE layer's MLP adding its own: see LlamaModel.
    """

    def __init__(self, config: LlamaConfig, index: int = 0, moe_block=None):
        """`moe_block`: builds the MoE layer (models/parallel.py moe_block: MindFormers' on Ascend), else MoE."""
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, config.fused_rms_norm)
        self.self_attn = MultiLatentAttention(config) if config.mla else Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, config.fused_rms_norm)
        self.is_moe, self.returns_router_loss = config.is_moe_layer(index), config.moe
        self.mlp = (moe_block or MoE)(config) if self.is_moe else MLP(config)
        self.add = ops.Add()

    def construct(self, x, cos, sin, mask, seq_ends=None, router_loss=None):
        x = self.add(x, self.self_attn(self.input_layernorm(x), cos, sin, mask, seq_ends))
        if self.is_moe:
            out, router_loss = self.mlp(self.post_attention_layernorm(x), router_loss)
            return self.add(x, out), router_loss
        x = self.add(x, self.mlp(self.post_attention_layernorm(x)))
        if self.returns_router_loss:
            return x, router_loss
        return x


class DocumentMask(nn.Cell):
    """Per-document positions and attention for packed samples: each document restarts at
    position 0 and attends only to itself (and earlier tokens of it); its closing EOD belongs to it."""

    def __init__(self, seq_length: int, eod_id: int):
        super().__init__()
        self.eod_id = eod_id
        self.index = Tensor(np.arange(seq_length, dtype=np.int32).reshape(1, seq_length))
        self.equal = ops.Equal()
        self.cumsum = ops.CumSum()
        self.sub = ops.Sub()
        self.shift = ops.Pad(((0, 0), (1, 0)))
        self.slice = ops.StridedSlice()
        self.mul = ops.Mul()
        self.cummax = ops.Cummax(1)
        self.gather = ops.Gather()
        self.same_doc = ops.Equal()
        self.other_doc = ops.Sub()
        self.mask_mul = ops.Mul()
        self.mask_add = ops.Add()

    def construct(self, tokens, cos_table, sin_table, causal):
        b, s = tokens.shape
        index = self.index if s == self.index.shape[1] else self.index[:, :s]
        is_eod = self.equal(tokens, self.eod_id).astype(ms.int32)                      # (B, S)
        doc = self.sub(self.cumsum(is_eod, 1), is_eod)                                  # document index per token
        after_eod = self.shift(self.slice(is_eod, (0, 0), (b, s - 1), (1, 1)))          # a doc starts after an EOD
        positions = self.sub(index, self.cummax(self.mul(after_eod, index))[0])         # (B, S)
        # (B, S, head_dim) -> (B, 1, S, head_dim)
        cos = self.gather(cos_table, positions, 0).reshape(b, 1, s, -1)
        sin = self.gather(sin_table, positions, 0).reshape(b, 1, s, -1)
        same = self.same_doc(doc.reshape(b, s, 1), doc.reshape(b, 1, s)).astype(ms.float32)  # (B, S, S)
        apart = self.mask_mul(self.other_doc(1.0, same), MASK_VALUE).reshape(b, 1, s, s)
        return cos, sin, self.mask_add(causal, apart)                                   # mask (B, 1, S, S)


class LlamaModel(nn.Cell):
    """Token embedding, the decoder stack and the final norm."""

    def __init__(self, config: LlamaConfig, padded_vocab: int, moe_block=None):
        super().__init__()
        self.embed_tokens = Embedding(padded_vocab, config.hidden_size, config.initializer_range,
                                      DTYPES[config.compute_dtype], DTYPES[config.param_dtype])
        self.layers = nn.CellList([DecoderLayer(config, index, moe_block) for index in range(config.num_layers)])
        self.moe = config.moe
        # The router loss starts as a (1,) zero and passes through every layer, as MindFormers' transformer block
        # carries its extra_loss (transformer_block.py:146, 183-213): under pipeline stages it reaches the last stage
        # from layer to layer, sent beside the hidden states. Summed here, outside the layers, as a 0-d tensor, the
        # stage-0 layers' part reached the last stage as a scalar and neither stage compiled (stage 1: "For
        # Operator[Add], input's type 'Float32' does not match expected type 'Tensor'"; tests/test_dryrun_moe.py).
        self.no_router_loss = Tensor(np.zeros((1,), np.float32))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, config.fused_rms_norm)
        self.seq_length = config.seq_length
        cos, sin = rotary_tables(config.seq_length, config.rotary_dim, config.rope_theta)
        self.cos_table, self.sin_table = cos, sin
        # (1, 1, S, head_dim): broadcast to every sequence and head
        self.cos, self.sin = cos.reshape(1, 1, *cos.shape), sin.reshape(1, 1, *sin.shape)
        causal = np.triu(np.full((config.seq_length, config.seq_length), MASK_VALUE, dtype=np.float32), k=1)
        self.causal_mask = Tensor(causal.reshape(1, 1, *causal.shape))                  # (1, 1, S, S)
        self.document_attention = config.document_attention
        self.documents = DocumentMask(config.seq_length, config.eos_token_id) if config.document_attention else None
        self.flash_mask = FlashMask(config) if config.use_flash_attention else None

    def positions_and_mask(self, tokens):
        """Rotary tables and mask (seq_ends too for FlashAttention's EOD mode); per document when
        document_attention is on."""
        s = tokens.shape[1]
        causal, cos, sin = self.causal_mask, self.cos, self.sin
        cos_table, sin_table = self.cos_table, self.sin_table
        if s != self.seq_length:  # shorter inputs (inference, tests); training always runs at seq_length
            causal, cos, sin = causal[:, :, :s, :s], cos[:, :, :s], sin[:, :, :s]
            cos_table, sin_table = cos_table[:s], sin_table[:s]
        mask = causal
        if self.document_attention:
            cos, sin, mask = self.documents(tokens, cos_table, sin_table, causal)
        if self.flash_mask is not None:
            mask, seq_ends = self.flash_mask(tokens, mask)
            return cos, sin, mask, seq_ends
        return cos, sin, mask, None

    def construct(self, tokens):
        """(B, S) -> (B, S, hidden) final hidden states; with MoE layers (those, the layers' (1,) router loss)."""
        cos, sin, mask, seq_ends = self.positions_and_mask(tokens)
        x = self.embed_tokens(tokens)
        if not self.moe:
            for layer in self.layers:
                x = layer(x, cos, sin, mask, seq_ends)
            return self.norm(x)
        router_loss = self.no_router_loss
        for layer in self.layers:
            x, router_loss = layer(x, cos, sin, mask, seq_ends, router_loss)
        return self.norm(x), router_loss


class FlashMask(nn.Cell):
    """The mask FlashAttentionScore reads (uint8, 1 = masked), built as MindFormers builds it.

    Compressed: the constant 2048 x 2048 causal band of LowerTriangularMaskWithDynamic
    (mindformers/modules/transformer/transformer.py:820-823), with, for documents, each
    document's end offset in the flattened batch (MindFormers' actual_seq_len: EOD position + 1,
    padded with the sequence end, offset per row; blended_datasets/gpt_dataset.py:614-646,
    dataset/causal_language_model_dataset.py:90-113). Otherwise the (B, 1, S, S) mask.
    """

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.compressed = config.use_attn_mask_compression or config.use_eod_attn_mask_compression
        self.eod = config.use_eod_attn_mask_compression
        self.eod_id = config.eos_token_id
        self.band = Tensor(np.triu(np.ones((2048, 2048), dtype=np.uint8), k=1), ms.uint8)
        self.not_equal = ops.NotEqual()
        self.tile = ops.Tile()
        self.equal = ops.Equal()
        self.mul = ops.Mul()
        self.pad_mul = ops.Mul()
        self.add = ops.Add()
        self.maximum = ops.Maximum()
        self.not_end = ops.Sub()
        self.sort = ops.Sort()

    def construct(self, tokens, mask):
        b, s = tokens.shape
        if not self.compressed:
            full = self.not_equal(mask, 0.0).astype(ms.uint8)
            if full.shape[0] != b:
                full = self.tile(full, (b, 1, 1, 1))                                    # (B, 1, S, S)
            return full, None
        if not self.eod:
            return self.band, None
        # A document ends after each EOD and at each row's end; other tokens point past the batch,
        # so after sorting the ends come first and the padding (B * S) last, as MindFormers pads.
        ends = self.equal(tokens, self.eod_id).astype(ms.int32)
        last = Tensor(np.eye(1, s, s - 1, dtype=np.int32))                              # (1, S)
        ends = self.maximum(ends, last)
        offsets = Tensor(np.arange(1, b * s + 1, dtype=np.int32).reshape(b, s))
        padded = self.add(self.mul(ends, offsets), self.pad_mul(self.not_end(1, ends), b * s)).reshape(-1)
        return self.band, self.sort(padded.astype(ms.float32))[0].astype(ms.int32)


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

    # MindFormers decorates its LlamaForCausalLM.__init__ the same way (mindformers/models/llama/llama.py:486):
    # the network is compiled once and reused by every micro-batch instead of being inlined into each.
    @lazy_inline_where_supported
    def __init__(self, config: LlamaConfig, layout=None, **kwargs):
        """`layout`: a models/parallel.py LlamaLayout (shard strategies, pipeline stages, recompute), or None."""
        # auto_prefix keeps parameter names unique ("model.layers.0...", "lm_head.weight").
        super().__init__(config, auto_prefix=True)
        # The tables are padded to a multiple of vocab_pad_multiple x TP, so they split evenly over TP.
        padded_vocab = padded_vocab_size(config.vocab_size, config.vocab_pad_multiple,
                                         layout.tensor_parallel if layout is not None else 1)
        if layout is not None:
            from ascend_llm_recipes.models.parallel import apply_layout, moe_block
        self.model = LlamaModel(config, padded_vocab, moe_block(layout) if layout is not None else None)
        self.moe = config.moe
        self.tie_word_embeddings = config.tie_word_embeddings
        if not self.tie_word_embeddings:
            self.lm_head = Linear(config.hidden_size, padded_vocab, config.initializer_range,
                                  compute_dtype=DTYPES[config.compute_dtype], param_dtype=DTYPES[config.param_dtype])
        if self.tie_word_embeddings:
            self.head_matmul = ops.MatMul(transpose_b=True)
        self.pad_token_id = config.pad_token_id
        self.vocab_size = config.vocab_size
        self.compute_dtype = DTYPES[config.compute_dtype]
        # The padding rows of the table are masked out of the loss's softmax with -1e9 (exp gives 0), so
        # the vocabulary axis stays whole and splits evenly over tensor parallel.
        padding = np.zeros((1, padded_vocab), np.float32)
        padding[:, config.vocab_size:] = MASK_VALUE
        self.vocab_padding = Tensor(padding) if padded_vocab != config.vocab_size else None
        self.no_negative_ids = ops.Maximum()
        self.inputs = ops.StridedSlice()
        self.labels = ops.StridedSlice()
        self.loss = CrossEntropy()
        self.whole_vocabulary_loss = not loss_splits_vocabulary(ms.get_auto_parallel_context("parallel_mode"))
        if self.whole_vocabulary_loss:
            self.fused_loss = WholeVocabularyCrossEntropy(config.vocab_size, config.pad_token_id)
            self.keep_mul = ops.Mul()
        if layout is not None:
            apply_layout(self, layout)

    def hidden_states(self, tokens):
        """(B, S) -> ((B, S, hidden) final hidden states, the MoE layers' summed router loss or 0)."""
        if self.moe:
            return self.model(tokens)
        return self.model(tokens), 0.0

    def padded_logits(self, tokens):
        """(B, S) token ids -> (B * S, padded vocabulary) logits in the compute dtype."""
        return self.head(self.hidden_states(tokens)[0])

    def head(self, h):
        """(B, S, hidden) final hidden states -> (B * S, padded vocabulary) logits in the compute dtype."""
        b, s, hidden = h.shape
        if self.tie_word_embeddings:
            table = self.model.embed_tokens.weight.astype(self.compute_dtype)
            return self.head_matmul(h.reshape(b * s, hidden).astype(self.compute_dtype), table)
        return self.lm_head(h.reshape(b * s, hidden))

    def logits(self, tokens):
        """(B, S) token ids -> (B, S, vocab_size) float32 logits (padding rows cut off)."""
        b, s = tokens.shape
        logits = self.padded_logits(tokens).reshape(b, s, -1)
        if logits.shape[-1] != self.vocab_size:
            logits = logits[..., :self.vocab_size]
        return logits.astype(ms.float32)

    def construct(self, input_ids):
        b, s1 = input_ids.shape
        # Padding is -1 when the tokenizer has no pad token (data/tokenizer.py NO_PAD): looked up as id 0. Its
        # labels are masked, and it only follows a row's last real token, which causal attention never lets see it.
        tokens = self.inputs(self.no_negative_ids(input_ids, 0), (0, 0), (b, s1 - 1), (1, 1))
        labels = self.labels(input_ids, (0, 1), (b, s1), (1, 1)).reshape(-1)
        h, router_loss = self.hidden_states(tokens)
        if not self.whole_vocabulary_loss:
            loss = self.loss(self.head(h), labels, self.vocab_padding, self.pad_token_id)
        else:
            # Padding positions get zero hidden states, so their logits are the constant row the fused loss
            # takes back out (see WholeVocabularyCrossEntropy); nothing of them reaches the weights' gradients.
            keep = self.fused_loss.keep(labels)                                      # (B * S,) 1.0 or 0.0
            h = self.keep_mul(h, keep.reshape(b, s1 - 1, 1).astype(h.dtype))
            loss = self.fused_loss(self.head(h), labels, keep, self.vocab_padding)
        if self.moe:
            # models/moe.py: load-balancing and z-loss, weighted by their coefficients; (1,) -> () as the loss
            return loss + router_loss.reshape(())
        return loss
