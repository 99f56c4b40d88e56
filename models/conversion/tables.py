"""The mapping tables, one per format, from which conversion in both directions is generated.

HuggingFace (= ours): KEY_MAP names the transform of each tensor of models/shapes.py (identity but for the
vocabulary tables, padded on our side); TRANSFORMS holds each transform in both directions.
Megatron-core: MEGATRON_TENSORS (names, tensor-parallel split dimension, fusing, pipeline stage) and
HF_FROM_MEGATRON (each HF tensor's Megatron tensor and part); megatron.py reads and writes by them.
Meta consolidated: META_LAYOUT (Meta's name, transform, model-parallel split dimension); read only.
"""

import re
from dataclasses import dataclass

import numpy as np

from ascend_llm_recipes.common.errors import ConversionError
from ascend_llm_recipes.models.config import ModelConfig
from ascend_llm_recipes.models.shapes import dimensions, tensor_dimensions


# The key map. Our names equal HF's (models/llama.py names its parameters after the HF checkpoint),
# Linear weights are (out, in) on both sides and rotary uses the same half-split layout, so every tensor
# of the model (models/shapes.py TENSORS, with its shape) maps to itself unchanged, except the vocabulary
# tables: they gain padding rows (never predicted) on our side.
KEY_MAP = {"model.embed_tokens.weight": "pad_vocab_rows", "lm_head.weight": "pad_vocab_rows"}  # others: identity

# Source tensors that hold no weights, consumed by being named here: (pattern, kind for the summary).
IGNORED_HF = (
    (r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq", "rotary frequencies (recomputed from rope_theta)"),
    (r"model\.rotary_emb\.inv_freq", "rotary frequencies (recomputed from rope_theta)"),
)
IGNORED_OURS = (
    (r"adam_[mv]\..+", "AdamW moments"),
    (r"global_step|epoch_num|step_num|loss_scale|scale_sense|global_batch_size", "training counters"),
    (r"current_iterator_step|last_overflow_iterator_step", "training counters"),
)
TIED_HEAD = "lm_head.weight"  # in a tied HF checkpoint, a copy of the embedding when present at all
TIED_COPY_KIND = "copy of the tied embedding"


def ignored_kinds(names: list) -> dict:
    """{kind: count} of ignored tensor names, for a one-line summary instead of the list."""
    counts: dict = {}
    for name in names:
        kind = next((k for pattern, k in IGNORED_HF + IGNORED_OURS if re.fullmatch(pattern, name)),
                    TIED_COPY_KIND if name == TIED_HEAD else "other")
        counts[kind] = counts.get(kind, 0) + 1
    return dict(sorted(counts.items(), key=lambda item: -item[1]))


def identity(x: np.ndarray, shape: tuple) -> np.ndarray:
    return x


def pad_vocab_rows(x: np.ndarray, shape: tuple) -> np.ndarray:
    """(vocab, hidden) -> (padded_vocab, hidden), zero rows appended (never predicted, never looked up)."""
    if x.shape == shape:  # the usual case (32000, 128256, 151936 rows): no second copy of the largest tensor
        return x
    padded = np.zeros(shape, np.float32)
    padded[:x.shape[0]] = x
    return padded


def strip_vocab_rows(x: np.ndarray, shape: tuple) -> np.ndarray:
    """(padded_vocab, hidden) -> (vocab, hidden)."""
    return np.ascontiguousarray(x[:shape[0]])


TRANSFORMS = {  # name: (HF -> ours, ours -> HF)
    "identity": (identity, identity),
    "pad_vocab_rows": (pad_vocab_rows, strip_vocab_rows),
}


@dataclass(frozen=True)
class TensorPlan:
    hf: str
    ours: str
    hf_shape: tuple
    our_shape: tuple
    transform: str


def tensor_plan(cfg: ModelConfig, tensor_parallel: int = 1) -> list:
    """Every tensor of the model for `cfg` (models/shapes.py order), with both names, shapes and its transform."""
    dims = dimensions(cfg, tensor_parallel)
    plan = []
    for pattern, name, names in tensor_dimensions(cfg):
        hf_shape = tuple(dims[d] for d in names)
        our_shape = tuple(dims["padded_vocab" if d == "vocab" else d] for d in names)
        plan.append(TensorPlan(name, name, hf_shape, our_shape, KEY_MAP.get(pattern, "identity")))
    return plan


def check_tensors(found: dict, expected: dict, ignored: tuple, where: str, extra_ok=()) -> list:
    """Compare tensor name -> shape maps; returns the ignored names, raises listing every problem."""
    problems, skipped = [], []
    for name, shape in found.items():
        if name in expected:
            if tuple(shape) != tuple(expected[name]):
                problems.append(f"{name}: expected shape {tuple(expected[name])} from the config, found "
                                f"{tuple(shape)}")
        elif name in extra_ok or any(re.fullmatch(pattern, name) for pattern, _ in ignored):
            skipped.append(name)
        else:
            problems.append(f"{name}: unknown tensor (not in the key map for this config)")
    problems += [f"{name}: missing" for name in expected if name not in found]
    if problems:
        shown = problems[:20] + ([f"... and {len(problems) - 20} more"] if len(problems) > 20 else [])
        raise ConversionError(f"{where}: {len(problems)} tensor problem(s):\n" + "\n".join(f"  - {p}" for p in shown),
                              hint="the weights do not match the config (num_hidden_layers, sizes, "
                                   "tie_word_embeddings, bias?)")
    return skipped


@dataclass(frozen=True)
class MegatronTensor:
    """One tensor of a Megatron-core GPT model: its names, its tensor-parallel split and how HF parts fuse into it."""

    names: tuple        # the first is written (local spec); the others are read too (TransformerEngine spec)
    tp_dim: int = None  # the dimension tensor-parallel ranks split; None: replicated on every rank
    fuse: str = None    # how its HF parts make one rank's tensor (FUSE); None: a single part
    stage: str = None   # a tensor outside the layers: the pipeline stage holding it ("first", "last")


# The Megatron-core table (megatron-core gpt_layer_specs.py, local and TransformerEngine specs), in the order
# rank files are written. Norms fused into the next linear (TransformerEngine) are read under their second name.
MEGATRON_TENSORS = {
    "embedding": MegatronTensor(("embedding.word_embeddings.weight",), tp_dim=0, stage="first"),
    "input_norm": MegatronTensor(("input_layernorm.weight", "self_attention.linear_qkv.layer_norm_weight")),
    "mlp_norm": MegatronTensor(("pre_mlp_layernorm.weight", "mlp.linear_fc1.layer_norm_weight")),
    "qkv": MegatronTensor(("self_attention.linear_qkv.weight",), tp_dim=0, fuse="qkv"),
    "qkv_bias": MegatronTensor(("self_attention.linear_qkv.bias",), tp_dim=0, fuse="qkv"),
    "proj": MegatronTensor(("self_attention.linear_proj.weight",), tp_dim=1),
    "fc1": MegatronTensor(("mlp.linear_fc1.weight",), tp_dim=0, fuse="gate_up"),
    "fc2": MegatronTensor(("mlp.linear_fc2.weight",), tp_dim=1),
    "final_norm": MegatronTensor(("decoder.final_layernorm.weight",), stage="last"),
    "output": MegatronTensor(("output_layer.weight",), tp_dim=0, stage="last"),
}

# HF name (as in KEY_MAP) -> (Megatron kind, part). Parts: q/k/v of the grouped qkv, gate/up of fc1
# (in fusing order), vocab: rows padded to make_vocab_size_divisible_by x TP. Reading and writing both follow it.
HF_FROM_MEGATRON = {
    "model.embed_tokens.weight": ("embedding", "vocab"),
    "model.layers.{n}.input_layernorm.weight": ("input_norm", None),
    "model.layers.{n}.self_attn.q_proj.weight": ("qkv", "q"),
    "model.layers.{n}.self_attn.k_proj.weight": ("qkv", "k"),
    "model.layers.{n}.self_attn.v_proj.weight": ("qkv", "v"),
    "model.layers.{n}.self_attn.q_proj.bias": ("qkv_bias", "q"),
    "model.layers.{n}.self_attn.k_proj.bias": ("qkv_bias", "k"),
    "model.layers.{n}.self_attn.v_proj.bias": ("qkv_bias", "v"),
    "model.layers.{n}.self_attn.o_proj.weight": ("proj", None),
    "model.layers.{n}.post_attention_layernorm.weight": ("mlp_norm", None),
    "model.layers.{n}.mlp.gate_proj.weight": ("fc1", "gate"),
    "model.layers.{n}.mlp.up_proj.weight": ("fc1", "up"),
    "model.layers.{n}.mlp.down_proj.weight": ("fc2", None),
    "model.norm.weight": ("final_norm", None),
    "lm_head.weight": ("output", "vocab"),
}
# Megatron kind -> [(part, HF name template)], the table read the other way: what writing fuses.
MEGATRON_PARTS = {kind: [(part, hf) for hf, (k, part) in HF_FROM_MEGATRON.items() if k == kind]
                  for kind in MEGATRON_TENSORS}


def megatron_kinds(qkv_bias: bool, tied: bool) -> list:
    """The kinds of MEGATRON_TENSORS a model holds (q/k/v bias only with add_qkv_bias, an output layer untied)."""
    return [kind for kind in MEGATRON_TENSORS if (qkv_bias or kind != "qkv_bias") and (not tied or kind != "output")]


def layer_names(kind: str, local: int = None) -> tuple:
    """Candidate names of a kind: `decoder.layers.{local}.` + name for a layer's tensor (layers. when stacked)."""
    spec = MEGATRON_TENSORS[kind]
    if spec.stage is not None:
        return spec.names
    prefix = "decoder.layers." if local is None else f"decoder.layers.{local}."
    return tuple(prefix + name for name in spec.names)


def interleaved_to_half(x: np.ndarray, head_dim: int) -> np.ndarray:
    """q/k rows of each head from Meta's rotary order (pairs 2i, 2i+1) to HF's (i, i + head_dim/2).

    transformers' convert_llama_weights_to_hf.py `permute`: (heads, head_dim/2, 2, in) -> (heads, 2, head_dim/2, in).
    """
    rows, cols = x.shape
    return np.ascontiguousarray(x.reshape(rows // head_dim, head_dim // 2, 2, cols).transpose(0, 2, 1, 3)
                                .reshape(rows, cols))


META_TRANSFORMS = {"identity": lambda x, head_dim: x, "interleaved_to_half": interleaved_to_half}
VOCAB_OR_HIDDEN = (1, 0)  # tok_embeddings: Llama 1/2 shard the hidden dimension, Llama 3 the vocabulary

# HF name: (Meta's name, transform Meta -> HF, the dimension model-parallel shards split; None = replicated)
META_LAYOUT = {
    "model.embed_tokens.weight": ("tok_embeddings.weight", "identity", VOCAB_OR_HIDDEN),
    "model.layers.{n}.input_layernorm.weight": ("layers.{n}.attention_norm.weight", "identity", None),
    "model.layers.{n}.self_attn.q_proj.weight": ("layers.{n}.attention.wq.weight", "interleaved_to_half", (0,)),
    "model.layers.{n}.self_attn.k_proj.weight": ("layers.{n}.attention.wk.weight", "interleaved_to_half", (0,)),
    "model.layers.{n}.self_attn.v_proj.weight": ("layers.{n}.attention.wv.weight", "identity", (0,)),
    "model.layers.{n}.self_attn.o_proj.weight": ("layers.{n}.attention.wo.weight", "identity", (1,)),
    "model.layers.{n}.post_attention_layernorm.weight": ("layers.{n}.ffn_norm.weight", "identity", None),
    "model.layers.{n}.mlp.gate_proj.weight": ("layers.{n}.feed_forward.w1.weight", "identity", (0,)),
    "model.layers.{n}.mlp.down_proj.weight": ("layers.{n}.feed_forward.w2.weight", "identity", (1,)),
    "model.layers.{n}.mlp.up_proj.weight": ("layers.{n}.feed_forward.w3.weight", "identity", (0,)),
    "model.norm.weight": ("norm.weight", "identity", None),
    "lm_head.weight": ("output.weight", "identity", (0,)),
}
