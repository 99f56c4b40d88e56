"""The conversion tables: one per format, every row of one type, from which both directions are generated.

A Row says how a format holds one of our tensors (named as models/shapes.py names it, which is HuggingFace's
name): the format's name for it, a named transform, the dimension its tensor/model-parallel ranks split and,
where the format fuses several of our tensors into one (Megatron's grouped qkv, its [gate; up] fc1), the fusing
rule and this tensor's part. Reading a format applies its rows forwards (merge ranks, unfuse, transform),
writing applies them backwards (transform back, split ranks, fuse); hf.py, megatron.py, megatron_files.py and
torch_state.py hold no tensor name or layout of their own. A second model family (q/k norms, per-expert
weights with {e} in their names) is its tensors in models/shapes.py plus rows here.

    HF_TABLE        HuggingFace safetensors/bin (our names; our vocabulary tables gain padding rows)
    MIXTRAL_TABLE   HuggingFace Mixtral (HF_TABLE with its block_sparse_moe.experts.{e}.w1/w3/w2 names)
    DEEPSEEK_TABLE  HuggingFace DeepSeek-V3, rotary rows interleaved (rope_interleave: true, the released layout)
    DEEPSEEK_HALF_TABLE  the same with rope_interleave: false (rotary rows already in our half-split order)
    MEGATRON_TABLE  Megatron-core GPT, local and TransformerEngine specs (read and written)
    GROUPED_EXPERTS Megatron-core's GroupedMLP (--moe-grouped-gemm): a layer's experts stacked (read and written)
    META_TABLE      Meta's consolidated.NN.pth shards (read)
    (ours.py EXPERT_STACKS: ours with MoE layers as MindFormers' MoELayer holds them, --expert-layout stacked)
"""

import re
from dataclasses import dataclass

import numpy as np

from ascend_llm_recipes.common.errors import ConversionError
from ascend_llm_recipes.models.config import ModelConfig
from ascend_llm_recipes.models.shapes import STATISTICS, TENSORS, dimensions, tensor_dimensions, tensor_flags


@dataclass(frozen=True)
class Row:
    """How a format holds one of our tensors. Templates: {n} a layer number, {e} an expert number."""

    ours: str                   # our (= HuggingFace) name template
    theirs: tuple               # the format's name templates: the first is written, every one is read
    transform: str = "identity"  # TRANSFORMS: theirs -> ours, and back
    split: tuple = ()           # the dimension(s) parallel ranks split, () = replicated (Meta: candidates)
    fuse: str = None            # the FUSE rule by which this and sibling rows make one tensor of theirs
    part: str = None            # this row's part of that fused tensor (q/k/v, gate/up)
    stage: str = None           # a tensor outside the layers: the pipeline stage holding it ("first", "last")


def table(*rows: Row) -> dict:
    """{our name template: row}."""
    return {row.ours: row for row in rows}


# Per-tensor transforms, each f(x, shape, cfg) with `shape` the shape it must produce.

def identity(x: np.ndarray, shape: tuple, cfg=None) -> np.ndarray:
    return x


def pad_vocab_rows(x: np.ndarray, shape: tuple, cfg=None) -> np.ndarray:
    """(vocab, hidden) -> (padded_vocab, hidden), zero rows appended (never predicted, never looked up)."""
    if x.shape == shape:  # the usual case (32000, 128256, 151936 rows): no second copy of the largest tensor
        return x
    padded = np.zeros(shape, np.float32)
    padded[:x.shape[0]] = x
    return padded


def strip_vocab_rows(x: np.ndarray, shape: tuple, cfg=None) -> np.ndarray:
    """(padded_vocab, hidden) -> (vocab, hidden)."""
    return np.ascontiguousarray(x[:shape[0]])


def interleaved_to_half(x: np.ndarray, shape: tuple, cfg) -> np.ndarray:
    """q/k rows of each head from Meta's rotary order (pairs 2i, 2i+1) to HF's (i, i + head_dim/2).

    transformers' convert_llama_weights_to_hf.py `permute`: (heads, head_dim/2, 2, in) -> (heads, 2, head_dim/2, in).
    """
    rows, cols = x.shape
    return np.ascontiguousarray(x.reshape(rows // cfg.head_size, cfg.head_size // 2, 2, cols).transpose(0, 2, 1, 3)
                                .reshape(rows, cols))


def half_to_interleaved(x: np.ndarray, shape: tuple, cfg) -> np.ndarray:
    """The inverse of interleaved_to_half."""
    rows, cols = x.shape
    return np.ascontiguousarray(x.reshape(rows // cfg.head_size, 2, cfg.head_size // 2, cols).transpose(0, 2, 1, 3)
                                .reshape(rows, cols))


def permute_rope_rows(x: np.ndarray, block: int, rope: int, inverse: bool) -> np.ndarray:
    """x's rows as blocks of `block` rows whose last `rope` are rotary, those from interleaved to half order.

    transformers' apply_rotary_pos_emb_interleave reads rotary pair i from rows 2i, 2i+1 of a block's rotary part
    (view(rope/2, 2).transpose); our half-split layout from rows i, i + rope/2. inverse: half -> interleaved.
    """
    rows, cols = x.shape
    order = np.concatenate([np.arange(0, rope, 2), np.arange(1, rope, 2)])  # half row j <- interleaved row order[j]
    blocks = x.reshape(rows // block, block, cols).copy()                    # (rows, in) -> (blocks, block, in)
    blocks[:, block - rope:] = blocks[:, block - rope:][:, np.argsort(order) if inverse else order]
    return blocks.reshape(rows, cols)


def q_rope_interleaved_to_half(x: np.ndarray, shape: tuple, cfg) -> np.ndarray:
    """MLA's q_b_proj / q_proj rows (heads x (nope + rope)): each head's rotary rows (its last qk_rope_head_dim)."""
    return permute_rope_rows(x, cfg.qk_head_dim, cfg.qk_rope_head_dim, inverse=False)


def q_rope_half_to_interleaved(x: np.ndarray, shape: tuple, cfg) -> np.ndarray:
    return permute_rope_rows(x, cfg.qk_head_dim, cfg.qk_rope_head_dim, inverse=True)


def kv_rope_interleaved_to_half(x: np.ndarray, shape: tuple, cfg) -> np.ndarray:
    """MLA's kv_a_proj_with_mqa rows (kv_lora_rank + rope): the shared rotary key's rows (the last rope)."""
    return permute_rope_rows(x, x.shape[0], cfg.qk_rope_head_dim, inverse=False)


def kv_rope_half_to_interleaved(x: np.ndarray, shape: tuple, cfg) -> np.ndarray:
    return permute_rope_rows(x, x.shape[0], cfg.qk_rope_head_dim, inverse=True)


TRANSFORMS = {  # name: (theirs -> ours, ours -> theirs)
    "identity": (identity, identity),
    "pad_vocab_rows": (pad_vocab_rows, strip_vocab_rows),
    "strip_vocab_rows": (strip_vocab_rows, pad_vocab_rows),
    "interleaved_to_half": (interleaved_to_half, half_to_interleaved),
    "q_rope_interleaved_to_half": (q_rope_interleaved_to_half, q_rope_half_to_interleaved),
    "kv_rope_interleaved_to_half": (kv_rope_interleaved_to_half, kv_rope_half_to_interleaved),
}


# Fusing rules: how the parts of one tensor of theirs (its rows, in table order) make it and back.
# `groups` are the KV groups the tensor holds (all of them, or one tensor-parallel rank's).

def fuse_qkv(parts: list, groups: int, head_dim: int) -> np.ndarray:
    """Our q, k, v rows of `groups` KV groups -> Megatron's grouped rows [q_1 .. q_{heads/groups}, k, v] per group."""
    q, k, v = parts
    rest = q.shape[1:]
    # (rows, ...) -> (groups, heads per group or 1, head_dim, ...), then [q..., k, v] per group
    grouped = np.concatenate([q.reshape(groups, -1, head_dim, *rest), k.reshape(groups, 1, head_dim, *rest),
                              v.reshape(groups, 1, head_dim, *rest)], axis=1)
    return grouped.reshape(-1, *rest)


def split_qkv(fused: np.ndarray, groups: int, head_dim: int, layout: str = "grouped") -> dict:
    """Megatron's fused qkv of `groups` KV groups (weight or bias, rows first) -> {q, k, v} in our row order.

    layout="separate" (all q rows, then k, then v) is the common mistake, kept so tests show --verify refuses it.
    """
    per_group = fused.shape[0] // (groups * head_dim) - 2  # query heads per KV group
    rest = fused.shape[1:]
    if layout == "separate":
        q, k, v = np.split(fused, [groups * per_group * head_dim, groups * (per_group + 1) * head_dim])
        return {"q": q, "k": k, "v": v}
    # (groups x (per_group + 2) x head_dim, ...) -> (groups, per_group + 2, head_dim, ...)
    grouped = fused.reshape(groups, per_group + 2, head_dim, *rest)
    return {"q": np.ascontiguousarray(grouped[:, :per_group].reshape(-1, *rest)),
            "k": np.ascontiguousarray(grouped[:, per_group].reshape(-1, *rest)),
            "v": np.ascontiguousarray(grouped[:, per_group + 1].reshape(-1, *rest))}


def split_halves(fused: np.ndarray, groups: int, head_dim: int, layout: str = "grouped") -> dict:
    """Megatron's fc1 [gate; up] -> {gate, up}."""
    gate, up = np.split(fused, 2, axis=0)
    return {"gate": np.ascontiguousarray(gate), "up": np.ascontiguousarray(up)}


FUSE = {  # name: (parts -> fused, fused -> {part: tensor})
    "qkv": (fuse_qkv, split_qkv),
    "gate_up": (lambda parts, groups, head_dim: np.concatenate(parts), split_halves),
}


# HuggingFace: our names are HF's (models/llama.py names its parameters after the HF checkpoint), Linear weights
# are (out, in) on both sides and rotary uses the same half-split layout, so every tensor maps to itself; the
# vocabulary tables gain padding rows (never predicted) on our side. A tensor added to models/shapes.py is a row.
HF_TABLE = table(*(Row(name, (name,), "pad_vocab_rows" if "vocab" in dims else "identity")
                   for name, dims, _ in TENSORS))


def renamed(rows: dict, names: dict) -> dict:
    """`rows` with the format names of some tensors replaced ({our template: their template})."""
    return {ours: Row(ours, (names[ours],), row.transform) if ours in names else row for ours, row in rows.items()}


def transformed(rows: dict, transforms: dict) -> dict:
    """`rows` with the transforms of some tensors replaced ({our template: TRANSFORMS name})."""
    return {ours: Row(ours, row.theirs, transforms[ours]) if ours in transforms else row for ours, row in rows.items()}


# Mixtral (transformers' modeling_mixtral.py): the MoE block is `block_sparse_moe`, each expert's SwiGLU is
# w1 (gate), w3 (up), w2 (down). Everything else is HF_TABLE's.
MIXTRAL_MOE = "model.layers.{n}.block_sparse_moe"
MIXTRAL_TABLE = renamed(HF_TABLE, {
    "model.layers.{n}.mlp.gate.weight": f"{MIXTRAL_MOE}.gate.weight",
    "model.layers.{n}.mlp.experts.{e}.gate_proj.weight": f"{MIXTRAL_MOE}.experts.{{e}}.w1.weight",
    "model.layers.{n}.mlp.experts.{e}.up_proj.weight": f"{MIXTRAL_MOE}.experts.{{e}}.w3.weight",
    "model.layers.{n}.mlp.experts.{e}.down_proj.weight": f"{MIXTRAL_MOE}.experts.{{e}}.w2.weight",
})

# DeepSeek-V3 (transformers' modeling_deepseek_v3.py): the MoE block's router keeps its correction bias as
# gate.e_score_correction_bias (a buffer, saved in the checkpoint), the shared expert is `shared_experts`; the
# attention's names are ours (models/mla.py). With rope_interleave (transformers' default and the released
# checkpoints' layout) the rotary rows of the queries and of the shared rotary key are stored interleaved.
DEEPSEEK_MOE = "model.layers.{n}.mlp"
DEEPSEEK_HALF_TABLE = renamed(HF_TABLE, {
    "model.layers.{n}.mlp.router.expert_bias": f"{DEEPSEEK_MOE}.gate.e_score_correction_bias",
    "model.layers.{n}.mlp.shared_expert.gate_proj.weight": f"{DEEPSEEK_MOE}.shared_experts.gate_proj.weight",
    "model.layers.{n}.mlp.shared_expert.up_proj.weight": f"{DEEPSEEK_MOE}.shared_experts.up_proj.weight",
    "model.layers.{n}.mlp.shared_expert.down_proj.weight": f"{DEEPSEEK_MOE}.shared_experts.down_proj.weight",
})
DEEPSEEK_TABLE = transformed(DEEPSEEK_HALF_TABLE, {
    "model.layers.{n}.self_attn.q_proj.weight": "q_rope_interleaved_to_half",
    "model.layers.{n}.self_attn.q_b_proj.weight": "q_rope_interleaved_to_half",
    "model.layers.{n}.self_attn.kv_a_proj_with_mqa.weight": "kv_rope_interleaved_to_half",
})

# Megatron-core (gpt_layer_specs.py, local and TransformerEngine specs). Layer names are per pipeline stage
# ({n} local) in legacy rank files and stacked (no number) in torch_dist. Norms TransformerEngine fuses into the
# next linear are read under their second name. Vocabulary rows are padded to make_vocab_size_divisible_by x TP.
QKV, FC1 = "decoder.layers.{n}.self_attention.linear_qkv.weight", "decoder.layers.{n}.mlp.linear_fc1.weight"
QKV_BIAS = "decoder.layers.{n}.self_attention.linear_qkv.bias"
# routed experts: SequentialMLP's local experts in legacy files, all experts on one axis in torch_dist
EXPERT_FC1 = ("decoder.layers.{n}.mlp.experts.local_experts.{e}.linear_fc1.weight",
              "decoder.layers.{n}.mlp.experts.experts.linear_fc1.weight")
EXPERT_FC2 = ("decoder.layers.{n}.mlp.experts.local_experts.{e}.linear_fc2.weight",
              "decoder.layers.{n}.mlp.experts.experts.linear_fc2.weight")
SHARED_FC1 = "decoder.layers.{n}.mlp.shared_experts.linear_fc1.weight"
MEGATRON_TABLE = table(
    Row("model.embed_tokens.weight", ("embedding.word_embeddings.weight",), "strip_vocab_rows", (0,), stage="first"),
    Row("model.layers.{n}.input_layernorm.weight", ("decoder.layers.{n}.input_layernorm.weight",
                                                    "decoder.layers.{n}.self_attention.linear_qkv.layer_norm_weight")),
    Row("model.layers.{n}.self_attn.q_proj.weight", (QKV,), split=(0,), fuse="qkv", part="q"),
    Row("model.layers.{n}.self_attn.q_proj.bias", (QKV_BIAS,), split=(0,), fuse="qkv", part="q"),
    Row("model.layers.{n}.self_attn.k_proj.weight", (QKV,), split=(0,), fuse="qkv", part="k"),
    Row("model.layers.{n}.self_attn.k_proj.bias", (QKV_BIAS,), split=(0,), fuse="qkv", part="k"),
    Row("model.layers.{n}.self_attn.v_proj.weight", (QKV,), split=(0,), fuse="qkv", part="v"),
    Row("model.layers.{n}.self_attn.v_proj.bias", (QKV_BIAS,), split=(0,), fuse="qkv", part="v"),
    Row("model.layers.{n}.self_attn.o_proj.weight", ("decoder.layers.{n}.self_attention.linear_proj.weight",),
        split=(1,)),
    Row("model.layers.{n}.post_attention_layernorm.weight", ("decoder.layers.{n}.pre_mlp_layernorm.weight",
                                                             "decoder.layers.{n}.mlp.linear_fc1.layer_norm_weight")),
    Row("model.layers.{n}.mlp.gate_proj.weight", (FC1,), split=(0,), fuse="gate_up", part="gate"),
    Row("model.layers.{n}.mlp.up_proj.weight", (FC1,), split=(0,), fuse="gate_up", part="up"),
    Row("model.layers.{n}.mlp.down_proj.weight", ("decoder.layers.{n}.mlp.linear_fc2.weight",), split=(1,)),
    # Qwen3's per-head norms, multi-latent attention (megatron/core/transformer/multi_latent_attention.py) and the MoE
    # layer (megatron/core/transformer/moe: router, SequentialMLP's local experts, SharedExpertMLP). Reader and writer
    # take the q/k norms and the MoE layer; multi-latent attention is refused (megatron.py). Legacy files number
    # local experts per expert-parallel rank ({e} is the local number there); torch_dist has them on one axis.
    Row("model.layers.{n}.self_attn.q_norm.weight", ("decoder.layers.{n}.self_attention.q_layernorm.weight",)),
    Row("model.layers.{n}.self_attn.k_norm.weight", ("decoder.layers.{n}.self_attention.k_layernorm.weight",)),
    Row("model.layers.{n}.self_attn.q_a_proj.weight", ("decoder.layers.{n}.self_attention.linear_q_down_proj.weight",)),
    Row("model.layers.{n}.self_attn.q_a_layernorm.weight", ("decoder.layers.{n}.self_attention.q_layernorm.weight",
                                                            "decoder.layers.{n}.self_attention.linear_q_up_proj."
                                                            "layer_norm_weight")),
    Row("model.layers.{n}.self_attn.q_b_proj.weight", ("decoder.layers.{n}.self_attention.linear_q_up_proj.weight",)),
    Row("model.layers.{n}.self_attn.kv_a_proj_with_mqa.weight",
        ("decoder.layers.{n}.self_attention.linear_kv_down_proj.weight",)),
    Row("model.layers.{n}.self_attn.kv_a_layernorm.weight", ("decoder.layers.{n}.self_attention.kv_layernorm.weight",
                                                             "decoder.layers.{n}.self_attention.linear_kv_up_proj."
                                                             "layer_norm_weight")),
    Row("model.layers.{n}.self_attn.kv_b_proj.weight", ("decoder.layers.{n}.self_attention.linear_kv_up_proj.weight",)),
    Row("model.layers.{n}.mlp.gate.weight", ("decoder.layers.{n}.mlp.router.weight",)),
    Row("model.layers.{n}.mlp.router.expert_bias", ("decoder.layers.{n}.mlp.router.expert_bias",)),
    Row("model.layers.{n}.mlp.experts.{e}.gate_proj.weight", EXPERT_FC1, split=(0,), fuse="gate_up", part="gate"),
    Row("model.layers.{n}.mlp.experts.{e}.up_proj.weight", EXPERT_FC1, split=(0,), fuse="gate_up", part="up"),
    Row("model.layers.{n}.mlp.experts.{e}.down_proj.weight", EXPERT_FC2, split=(1,)),
    Row("model.layers.{n}.mlp.shared_expert.gate_proj.weight", (SHARED_FC1,), split=(0,), fuse="gate_up",
        part="gate"),
    Row("model.layers.{n}.mlp.shared_expert.up_proj.weight", (SHARED_FC1,), split=(0,), fuse="gate_up", part="up"),
    Row("model.layers.{n}.mlp.shared_expert.down_proj.weight",
        ("decoder.layers.{n}.mlp.shared_experts.linear_fc2.weight",), split=(1,)),
    Row("model.layers.{n}.mlp.shared_expert_gate.weight", ("decoder.layers.{n}.mlp.shared_experts.gate_weight",)),
    Row("model.norm.weight", ("decoder.final_layernorm.weight",), stage="last"),
    Row("lm_head.weight", ("output_layer.weight",), "strip_vocab_rows", (0,), stage="last"),
)

# --moe-grouped-gemm without TransformerEngine: megatron-core's GroupedMLP (transformer/moe/experts.py) holds a rank's
# local experts of one layer in two tensors laid out for grouped_gemm's gmm, which reads weight1 (hidden, experts x
# 2 x ffn/TP) as (experts, hidden, [gate; up]) and weight2 (experts x ffn/TP, hidden) as (experts, ffn/TP, hidden):
# each expert's SequentialMLP weight transposed. Legacy files only: its sharded_state_dict writes SequentialMLP's
# per-expert torch_dist keys. TransformerEngine's TEGroupedMLP (linear_fc1.weight0..N) is refused in legacy files.
@dataclass(frozen=True)
class StackedExperts:
    """One tensor holding every local expert's weight of one SequentialMLP tensor (GroupedMLP's weight1/weight2)."""

    name: str         # its name template ({n}: the layer)
    hidden_axis: int  # the axis of size hidden: 0 in weight1, 1 in weight2


GROUPED_EXPERTS = {  # SequentialMLP's per-expert tensor (a MEGATRON_TENSORS key): GroupedMLP's tensor holding it
    EXPERT_FC1[0]: StackedExperts("decoder.layers.{n}.mlp.experts.weight1", 0),
    EXPERT_FC2[0]: StackedExperts("decoder.layers.{n}.mlp.experts.weight2", 1),
}
TE_GROUPED_EXPERTS = r"decoder\.layers\.\d+\.mlp\.experts\.linear_fc[12]\.weight\d+"  # TEGroupedMLP's names


def one_expert(stacked, experts: int, e: int, hidden_axis: int):
    """Local expert e's weight, as SequentialMLP holds it (out, in), from GroupedMLP's `stacked` of `experts` local
    experts (a numpy array, or a torch tensor: then a view, so that only that expert is copied out)."""
    # as gmm views them: (hidden, E x out) -> (E, hidden, out); (E x in, hidden) -> (E, in, hidden)
    shape = (experts, stacked.shape[0], -1) if hidden_axis == 0 else (experts, -1, stacked.shape[1])
    return stacked.reshape(shape)[e].T


def stack_experts(weights: list, hidden_axis: int) -> np.ndarray:
    """GroupedMLP's tensor from its local experts' SequentialMLP weights, in order: one_expert's inverse."""
    stacked = np.stack([w.T for w in weights])  # (experts, hidden, out) or (experts, in, hidden)
    return stacked.reshape(stacked.shape[1], -1) if hidden_axis == 0 else stacked.reshape(-1, stacked.shape[2])


def grouped_state(state: dict, layers: int, experts: int) -> dict:
    """A legacy rank file's model state with SequentialMLP's local experts (`experts` in each of `layers` layers)
    stacked into GroupedMLP's weight1/weight2, each in its first expert's place."""
    members = {}  # a per-expert name -> (GroupedMLP's name, the per-expert names it stacks, its hidden axis)
    for kind, stacked in GROUPED_EXPERTS.items():
        for local in range(layers):
            names = [layer_names(kind, local, e)[0] for e in range(experts)]
            members.update({name: (stacked.name.format(n=local), names, stacked.hidden_axis) for name in names})
    out = {}
    for name, tensor in state.items():
        if name not in members:
            out[name] = tensor
        elif name == members[name][1][0]:
            target, names, axis = members[name]
            out[target] = stack_experts([state[n] for n in names], axis)
    return out


# Meta's llama/model.py (consolidated.NN.pth): q/k rows in interleaved rotary order; model-parallel shards split
# tok_embeddings on the hidden dimension (Llama 1/2) or the vocabulary (Llama 3), so both are candidates.
META_TABLE = table(
    Row("model.embed_tokens.weight", ("tok_embeddings.weight",), split=(1, 0)),
    Row("model.layers.{n}.input_layernorm.weight", ("layers.{n}.attention_norm.weight",)),
    Row("model.layers.{n}.self_attn.q_proj.weight", ("layers.{n}.attention.wq.weight",), "interleaved_to_half", (0,)),
    Row("model.layers.{n}.self_attn.k_proj.weight", ("layers.{n}.attention.wk.weight",), "interleaved_to_half", (0,)),
    Row("model.layers.{n}.self_attn.v_proj.weight", ("layers.{n}.attention.wv.weight",), split=(0,)),
    Row("model.layers.{n}.self_attn.o_proj.weight", ("layers.{n}.attention.wo.weight",), split=(1,)),
    Row("model.layers.{n}.post_attention_layernorm.weight", ("layers.{n}.ffn_norm.weight",)),
    Row("model.layers.{n}.mlp.gate_proj.weight", ("layers.{n}.feed_forward.w1.weight",), split=(0,)),
    Row("model.layers.{n}.mlp.down_proj.weight", ("layers.{n}.feed_forward.w2.weight",), split=(1,)),
    Row("model.layers.{n}.mlp.up_proj.weight", ("layers.{n}.feed_forward.w3.weight",), split=(0,)),
    Row("model.norm.weight", ("norm.weight",)),
    Row("lm_head.weight", ("output.weight",), split=(0,)),
)


INDEXED = re.compile(r"\.(layers|experts)\.(\d+)\.")
PLACEHOLDERS = {"layers": "n", "experts": "e"}


def template_of(name: str) -> tuple:
    """(name template, {placeholder: number}) of a concrete name: model.layers.3.x -> (model.layers.{n}.x, {n: 3})."""
    numbers = {}

    def placeholder(match):
        numbers[PLACEHOLDERS[match.group(1)]] = int(match.group(2))
        return f".{match.group(1)}.{{{PLACEHOLDERS[match.group(1)]}}}."

    return INDEXED.sub(placeholder, name), numbers


def row_for(rows: dict, name: str, where: str) -> tuple:
    """(row, {placeholder: number}) of the concrete our-side `name` in a format's table."""
    template, numbers = template_of(name)
    if template not in rows:
        raise ConversionError(f"{where}: {name}: no row of this format's table (models/conversion/tables.py) "
                              "holds it", hint="a tensor of a new model family needs a row in each format's table")
    return rows[template], numbers


# Source tensors that hold no weights, consumed by being named here: (pattern, kind for the summary).
IGNORED_HF = (
    (r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq", "rotary frequencies (recomputed from rope_theta)"),
    (r"model\.rotary_emb\.inv_freq", "rotary frequencies (recomputed from rope_theta)"),
)
IGNORED_OURS = (
    (r"adam_[mv]\..+", "AdamW moments"),
    (r"global_step|epoch_num|step_num|loss_scale|scale_sense|global_batch_size", "training counters"),
    (r"current_iterator_step|last_overflow_iterator_step", "training counters"),
    (rf"model\.layers\.\d+\.mlp\.(router\.)?({'|'.join(STATISTICS)})", "MoE routing statistics"),
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


@dataclass(frozen=True)
class TensorPlan:
    hf: str
    ours: str
    hf_shape: tuple
    our_shape: tuple
    transform: str


def tensor_plan(cfg: ModelConfig, tensor_parallel: int = 1, rows: dict = None) -> list:
    """Every tensor of the model for `cfg` (models/shapes.py order): our name and the HuggingFace family's
    (`rows`: its table, HF_TABLE by default; MIXTRAL_TABLE), both shapes and the row's transform."""
    rows = HF_TABLE if rows is None else rows
    dims = dimensions(cfg, tensor_parallel)
    plan = []
    for pattern, name, names in tensor_dimensions(cfg):
        hf_shape = tuple(dims[d] for d in names)
        our_shape = tuple(dims["padded_vocab" if d == "vocab" else d] for d in names)
        row = rows[pattern]
        plan.append(TensorPlan(row.theirs[0].format(**template_of(name)[1]), name, hf_shape, our_shape, row.transform))
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
class FusedTensor:
    """One tensor of a format as its rows make it (generated from the table): the rows are its parts, in order."""

    names: tuple
    rows: tuple

    @property
    def split(self) -> int:
        """The dimension tensor-parallel ranks split (None: replicated)."""
        return self.rows[0].split[0] if self.rows[0].split else None

    @property
    def fuse(self) -> str:
        return self.rows[0].fuse

    @property
    def stage(self) -> str:
        return self.rows[0].stage


def fused_tensors(rows: dict) -> dict:
    """{their first name template: FusedTensor} in table order: the format's tensors, each with its parts.

    Unfused rows whose first names agree are alternatives, one tensor for whichever model has it (Megatron's
    q_layernorm is Qwen3's q_norm or multi-latent attention's q_a_layernorm): their names are pooled.
    """
    grouped: dict = {}
    for row in rows.values():
        names, parts = grouped.get(row.theirs[0], ((), []))
        grouped[row.theirs[0]] = (names + tuple(n for n in row.theirs if n not in names), parts + [row])
    return {key: FusedTensor(names, tuple(parts)) for key, (names, parts) in grouped.items()}


MEGATRON_TENSORS = fused_tensors(MEGATRON_TABLE)


def rank_share(tensor: FusedTensor, parts: list, t: int, tp: int, groups: int, head_dim: int) -> np.ndarray:
    """What tensor-parallel rank t of tp holds of `tensor`, from its whole parts (its rows' tensors, in order).

    Each part is split on the table's dimension and the rank's slices fused: so a rank holds whole KV groups
    and its own [gate; up] halves, as Megatron's ranks do. `groups`: the KV groups of the whole tensor.
    """
    pieces = [part if tensor.split is None else np.split(part, tp, tensor.split)[t] for part in parts]
    return pieces[0] if tensor.fuse is None else FUSE[tensor.fuse][0](pieces, groups // tp, head_dim)


def join_ranks(tensor: FusedTensor, shards: list, groups: int, head_dim: int) -> np.ndarray:
    """The whole tensor (fused over all parts) from what each tensor-parallel rank holds: rank_share's inverse."""
    if tensor.fuse is None:
        return np.concatenate(shards, axis=tensor.split)
    fuse, split = FUSE[tensor.fuse]
    local = [split(shard, groups // len(shards), head_dim) for shard in shards]
    return fuse([np.concatenate([parts[row.part] for parts in local], axis=tensor.split) for row in tensor.rows],
                groups, head_dim)


def megatron_name(ours: str) -> str:
    """The Megatron tensor (a key of MEGATRON_TENSORS) holding our tensor `ours` (a name template)."""
    return MEGATRON_TABLE[ours].theirs[0]


def present_tensors(tensors: dict, cfg, keep_output: bool = False) -> list:
    """The keys of `tensors` (fused_tensors) whose parts cfg's model has; keep_output: the output layer even if tied."""
    flags = {**tensor_flags(cfg), **({"untied": True} if keep_output else {})}
    have = {pattern for pattern, _, flag in TENSORS if flags[flag]}
    return [key for key, tensor in tensors.items() if any(row.ours in have for row in tensor.rows)]


def layer_names(kind: str, local: int = None, expert: int = None) -> tuple:
    """A Megatron tensor's candidate names: of layer `local` of a stage (and local expert `expert` of an
    expert-parallel rank), or stacked (torch_dist) with local=None."""
    names = MEGATRON_TENSORS[kind].names
    if local is None:
        return tuple(name.replace(".{n}.", ".") for name in names)
    return tuple(name.format(n=local, e=expert) for name in names)


def is_expert(kind: str) -> bool:
    """Whether a Megatron tensor is one routed expert's (numbered per expert-parallel rank)."""
    return "{e}" in kind
