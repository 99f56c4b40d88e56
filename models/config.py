"""The model's configuration, defined once: the recipe's `model:` section and LlamaConfig's fields.

Import-light (no MindSpore): recipes are validated, converted and planned without building the
model. models/llama.py's LlamaConfig takes these fields and these defaults.
"""

from dataclasses import MISSING, dataclass, field, fields
from typing import List, Literal, Optional

from ascend_llm_recipes.models import LLAMA_CONFIG_TYPE, LLAMA_MODEL_TYPE
from ascend_llm_recipes.models.arithmetic import ALIGN, round_up

# The kinds of model some keys apply to alone, each with what switches it on. On a model of another kind such a key
# is refused unless it keeps its default (ModelConfig.stray_keys), so a new key marked with only() is refused too.
MOE, MLA, MHA = "moe", "mla", "mha"
KIND_SWITCH = {MOE: "num_experts is 0 (a dense model)", MLA: "kv_lora_rank is not (multi-head latent attention is off)",
               MHA: "kv_lora_rank is set (multi-head latent attention)"}


def only(kind: str, default):
    """A ModelConfig field that applies only to models of `kind` (MOE, MLA or MHA), with its default."""
    if isinstance(default, list):
        return field(default_factory=list, metadata={"only": kind})
    return field(default=default, metadata={"only": kind})


@dataclass
class ModelConfig:
    """The recipe's model.model_config: architecture of the Llama-style decoder (models/llama.py) and its kernels."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int
    seq_length: int
    type: Literal[LLAMA_CONFIG_TYPE] = LLAMA_CONFIG_TYPE
    num_kv_heads: Optional[int] = None
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    initializer_range: float = 0.02
    tie_word_embeddings: bool = False
    qkv_bias: bool = only(MHA, False)          # bias on q/k/v projections (Qwen2-style checkpoints)
    head_dim: Optional[int] = only(MHA, None)  # per-head width when not hidden_size / num_heads (Qwen3)
    qk_norm: bool = only(MHA, False)           # RMSNorm of each head's q and k before rotary (Qwen3)
    # Mixture of Experts (models/moe.py): num_experts 0 is a dense model. Each MoE layer's MLP is a softmax top-k
    # router over num_experts SwiGLU experts of width moe_intermediate_size (+ an always-on shared expert of width
    # shared_expert_intermediate_size, optionally scaled by its own sigmoid gate: Qwen2-MoE); layers listed in
    # dense_layers keep the dense MLP of width intermediate_size (Qwen's mlp_only_layers / decoder_sparse_step,
    # DeepSeek's first_k_dense_replace). Routing is dropless (every token reaches its top-k experts) unless
    # capacity_factor is set.
    num_experts: int = 0
    num_experts_per_tok: int = only(MOE, 2)
    moe_intermediate_size: Optional[int] = only(MOE, None)
    norm_topk_prob: bool = only(MOE, True)       # renormalise the top-k weights to sum to 1 (Mixtral, Qwen3-MoE)
    shared_expert_intermediate_size: int = only(MOE, 0)
    shared_expert_gate: bool = only(MOE, False)  # sigmoid(x w) scales the shared expert (Qwen2-MoE)
    dense_layers: List[int] = only(MOE, [])
    # Training terms of each MoE layer, summed over layers into the loss (models/moe.py): the load-balancing loss
    # E * sum_e f_e P_e (Switch Transformer; Megatron-core's and MindFormers' per-layer normalisation) and the router
    # z-loss mean(logsumexp(router logits)^2) (ST-MoE).
    router_aux_loss_coef: float = only(MOE, 0.0)
    # Which tokens f_e counts: "global", all of the step's (every data-parallel rank's, and the micro-batches so far:
    # megatron-core's global_aux_loss, MindFormers' gbs_aux_loss), or "micro_batch", each data-parallel rank's
    # micro-batch alone (megatron-core's aux_loss, MindFormers' seq_aux_loss).
    router_aux_loss_scope: Literal["global", "micro_batch"] = only(MOE, "global")
    router_z_loss_coef: float = only(MOE, 0.0)
    # DeepSeek-V3's router (models/moe.py): sigmoid scores, the top k chosen among the topk_group best of n_group
    # expert groups, by scores plus a non-trained correction bias (expert_bias) that each step moves by
    # expert_bias_update_rate towards an even load (auxiliary-loss-free balancing); weights x routed_scaling_factor.
    router_score: Literal["softmax", "sigmoid"] = only(MOE, "softmax")
    n_group: int = only(MOE, 1)
    topk_group: int = only(MOE, 1)
    routed_scaling_factor: float = only(MOE, 1.0)
    expert_bias: bool = only(MOE, False)
    expert_bias_update_rate: float = only(MOE, 0.0)
    # Expert capacity (megatron-core's moe_expert_capacity_factor and moe_token_drop_policy, models/moe.py
    # ExpertCapacity): each expert takes at most ceil(T * num_experts_per_tok / num_experts * capacity_factor) of a
    # forward pass's T tokens' routing assignments; the assignments past that are dropped: that expert's output is
    # not added for the token (its other experts' still are, unrenormalised, and the residual carries it on). 0 is
    # dropless. token_drop_policy picks, per expert, which assignments are dropped: "probs" those with the lowest
    # combine weight, "position" those latest in Megatron's token order (sequence position, then batch row).
    capacity_factor: float = only(MOE, 0.0)
    token_drop_policy: Literal["probs", "position"] = only(MOE, "probs")
    # Multi-head latent attention (DeepSeek-V2/V3, models/mla.py) when kv_lora_rank is set: keys and values from a
    # kv_lora_rank-wide latent, queries through a q_lora_rank-wide one (or a full projection when None), heads of
    # qk_nope_head_dim + qk_rope_head_dim (the rotary part's key shared by all heads) and values of v_head_dim.
    q_lora_rank: Optional[int] = only(MLA, None)
    kv_lora_rank: Optional[int] = None
    qk_nope_head_dim: Optional[int] = only(MLA, None)
    qk_rope_head_dim: Optional[int] = only(MLA, None)
    v_head_dim: Optional[int] = only(MLA, None)
    vocab_pad_multiple: int = ALIGN        # tables padded to a multiple of this x model_parallel
    document_attention: bool = False       # packed documents: reset positions, block attention at EOD
    bos_token_id: int = 1
    eos_token_id: int = 2
    pad_token_id: int = 3
    compute_dtype: Literal["float32", "float16", "bfloat16"] = "float32"
    # dtype the matmul weights and tables are stored in (MindFormers' param_init_type / params_dtype). float32:
    # they are their own master copy (the CPU reference). 16-bit: half the weight, gathered-weight and accu_grads
    # bytes; the fp32 master copy then lives in the optimizer (training/worker/optim.py FoldedAdamW), sliced over DP
    # with the moments. Norm weights stay float32 (models/shapes.py parameter_dtype).
    param_dtype: Literal["float32", "float16", "bfloat16"] = "float32"
    # Ascend kernels, MindFormers' keys and meanings (mindformers/models/llama/llama_config.py:165-186);
    # the math path (all False) is the CPU default and the reference. None changes a parameter.
    use_flash_attention: bool = False
    use_attn_mask_compression: bool = False      # FlashAttention's 2048 x 2048 causal band (sparse_mode 2)
    use_eod_attn_mask_compression: bool = False  # FlashAttention per document (TND, sparse_mode 8)
    fused_rms_norm: bool = False                 # MindFormers' default is True (on Ascend)

    @property
    def kv_heads(self) -> int:
        """Key/value heads: num_kv_heads, or one per query head when unset (no grouped-query attention)."""
        return self.num_kv_heads if self.num_kv_heads is not None else self.num_heads

    @property
    def head_size(self) -> int:
        """Width of one attention head: head_dim when given, else hidden_size / num_heads."""
        return self.head_dim if self.head_dim is not None else self.hidden_size // self.num_heads

    @property
    def mla(self) -> bool:
        """Multi-head latent attention (DeepSeek-V2/V3) instead of q/k/v projections."""
        return self.kv_lora_rank is not None

    @property
    def qk_head_dim(self) -> int:
        """Width of a query/key head: qk_nope_head_dim + qk_rope_head_dim under MLA, else head_size."""
        return (self.qk_nope_head_dim or 0) + (self.qk_rope_head_dim or 0) if self.mla else self.head_size

    @property
    def value_head_dim(self) -> int:
        return (self.v_head_dim or 0) if self.mla else self.head_size

    @property
    def rotary_dim(self) -> int:
        """Width the rotary embedding rotates: the whole head, or MLA's qk_rope_head_dim."""
        return self.qk_rope_head_dim if self.mla else self.head_size

    @property
    def moe(self) -> bool:
        return self.num_experts > 0

    def is_moe_layer(self, index: int) -> bool:
        """Whether layer `index` has the MoE MLP (else the dense one)."""
        return self.moe and index not in self.dense_layers

    @property
    def expert_size(self) -> int:
        """Width of one routed expert's SwiGLU: moe_intermediate_size, else intermediate_size."""
        return self.moe_intermediate_size if self.moe_intermediate_size is not None else self.intermediate_size

    def stray_keys(self, kind: str) -> list:
        """Problems of the keys that apply only to models of `kind` (only()) and differ from their default here."""
        p = "model.model_config"
        problems = []
        for f in (f for f in fields(self) if f.metadata.get("only") == kind):
            default = f.default_factory() if f.default is MISSING else f.default
            if getattr(self, f.name) != default:
                problems.append(f"{p}.{f.name}: is set, but {p}.{KIND_SWITCH[kind]}; remove the key (its default "
                                f"is {default!r})")
        return problems

    def kernel_problems(self, recipe) -> list:
        """Ascend-kernel keys that cannot apply, each named."""
        p = "model.model_config"
        kernels = ("use_flash_attention", "use_attn_mask_compression", "use_eod_attn_mask_compression",
                   "fused_rms_norm")
        if recipe.runs_on_cpu:
            return [f"{p}.{name}: selects an Ascend kernel that has no CPU implementation; set it to False on CPU "
                    "(the math path computes the same)" for name in kernels if getattr(self, name)]
        problems = []
        # MindFormers' own rules (mindformers/models/llama/llama.py:115-116; modules/transformer/transformer.py:820).
        for name in ("use_attn_mask_compression", "use_eod_attn_mask_compression"):
            if getattr(self, name) and not self.use_flash_attention:
                problems.append(f"{p}.{name}: needs {p}.use_flash_attention: True")
        if self.use_eod_attn_mask_compression and not self.document_attention:
            problems.append(f"{p}.use_eod_attn_mask_compression: is FlashAttention's document mode; it needs "
                            f"{p}.document_attention: True")
        if self.use_flash_attention and self.compute_dtype == "float32":
            # mindspore.ops.flash_attention_score: query, key and value float16 or bfloat16
            problems.append(f"{p}.use_flash_attention: FlashAttentionScore takes float16 or bfloat16 inputs, and "
                            f"{p}.compute_dtype is float32; set compute_dtype: bfloat16, or use_flash_attention: False")
        heads = {"query/key head": self.qk_head_dim, "value head": self.value_head_dim} if self.mla else \
            {"head": self.head_size}
        problems += [f"{p}.use_flash_attention: the {what} is {width} wide; FlashAttentionScore takes a multiple of "
                     "16 up to 512 (mindspore.ops.flash_attention_score); set use_flash_attention: False"
                     for what, width in heads.items() if self.use_flash_attention and (width % 16 or width > 512)]
        if (self.use_attn_mask_compression or self.use_eod_attn_mask_compression) and self.seq_length < 2048:
            problems.append(f"{p}.use_attn_mask_compression: the compressed mask is 2048 x 2048; seq_length "
                            f"{self.seq_length} is below 2048 (use the full mask: set it to False)")
        return problems

    def check(self, recipe) -> list:
        """Problems of this section, each naming its key; `recipe` is the Recipe (its runs_on_cpu)."""
        p = "model.model_config"
        problems = [f"{p}.{name}: must be >= 1, got {getattr(self, name)}"
                    for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "intermediate_size",
                                 "seq_length") if getattr(self, name) < 1]
        if problems:
            return problems
        problems.extend(f"{p}.{name}: must be > 0, got {getattr(self, name)}"
                        for name in ("rms_norm_eps", "rope_theta", "initializer_range")
                        if getattr(self, name) is not None and not getattr(self, name) > 0)
        for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
            if name == "pad_token_id" and self.pad_token_id == -1:
                continue  # no pad token: data prepared with such a tokenizer pads with -1, masked from the loss
            if name == "bos_token_id" and self.bos_token_id == -1:
                continue  # no begin-of-text token (Qwen's config.json may leave it null): training never reads it
            if not 0 <= getattr(self, name) < self.vocab_size:
                problems.append(f"{p}.{name}: {getattr(self, name)} is not a token id of the vocabulary "
                                f"(0..{self.vocab_size - 1})")
        if self.seq_length % ALIGN:
            problems.append(f"{p}.seq_length: {self.seq_length} is not a multiple of {ALIGN}; Ascend pads "
                            f"such shapes inside every matmul. Use {round_up(self.seq_length, ALIGN)}")
        if self.vocab_pad_multiple < 1 or self.vocab_pad_multiple % ALIGN:
            problems.append(f"{p}.vocab_pad_multiple: {self.vocab_pad_multiple} must be a positive multiple of "
                            f"{ALIGN}")
        for name in ("hidden_size", "intermediate_size"):
            if getattr(self, name) % ALIGN:
                problems.append(f"{p}.{name}: {getattr(self, name)} is not a multiple of {ALIGN} (the Cube "
                                f"unit's tile); use {round_up(getattr(self, name), ALIGN)}")
        if self.mla:
            pass  # heads of qk_nope_head_dim + qk_rope_head_dim and values of v_head_dim: mla_problems checks them
        elif self.head_dim is not None:
            if self.head_dim < 1 or self.head_dim % 2:
                problems.append(f"{p}.head_dim: {self.head_dim} must be a positive even number (rotary embeddings "
                                "rotate pairs)")
            elif self.head_dim % ALIGN:
                problems.append(f"{p}.head_dim: {self.head_dim} is not a multiple of {ALIGN}; attention matmuls "
                                "would be padded on Ascend")
        else:
            if not self.hidden_size % self.num_heads and (self.hidden_size // self.num_heads) % ALIGN:
                problems.append(f"{p}.hidden_size, {p}.num_heads: head size {self.hidden_size // self.num_heads} is "
                                f"not a multiple of {ALIGN}; attention matmuls would be padded on Ascend")
            if self.hidden_size % self.num_heads:
                problems.append(f"{p}.hidden_size, {p}.num_heads: hidden_size {self.hidden_size} is not "
                                f"divisible by num_heads {self.num_heads} (or give {p}.head_dim)")
            elif (self.hidden_size // self.num_heads) % 2:
                problems.append(f"{p}.hidden_size, {p}.num_heads: head size {self.hidden_size // self.num_heads} "
                                "must be even for rotary embeddings")
        if self.kv_heads < 1 or self.num_heads % self.kv_heads:
            problems.append(f"{p}.num_kv_heads: {self.kv_heads} must divide num_heads {self.num_heads}")
        if self.compute_dtype == "bfloat16" and recipe.runs_on_cpu:
            problems.append(f"{p}.compute_dtype: bfloat16 kernels exist only on Ascend/GPU; "
                            "use float32 (or float16) on CPU")
        if self.param_dtype == "bfloat16" and recipe.runs_on_cpu:
            problems.append(f"{p}.param_dtype: bfloat16 kernels exist only on Ascend/GPU; "
                            "use float32 (or float16) on CPU")
        if self.param_dtype != "float32" and self.param_dtype != self.compute_dtype:
            problems.append(f"{p}.param_dtype: {self.param_dtype} weights are cast to compute_dtype "
                            f"{self.compute_dtype} at every use; store them in the compute dtype or in float32")
        return problems + self.moe_problems(recipe) + self.mla_problems(recipe) + self.kernel_problems(recipe)

    def mla_problems(self, recipe) -> list:
        """Problems of the multi-head latent attention keys, each named."""
        p = "model.model_config"
        names = ("q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
        if not self.mla:
            return self.stray_keys(MLA)
        problems = [f"{p}.{name}: must be set (>= 1) with {p}.kv_lora_rank" for name in names[1:]
                    if getattr(self, name) is None or getattr(self, name) < 1]
        problems += [f"{p}.{name}: must be >= 1, got {getattr(self, name)}" for name in ("kv_lora_rank", "q_lora_rank")
                     if getattr(self, name) is not None and getattr(self, name) < 1]
        if problems:
            return problems
        if self.qk_rope_head_dim % 2:
            problems.append(f"{p}.qk_rope_head_dim: {self.qk_rope_head_dim} must be even (rotary pairs)")
        problems += [f"{p}.{name}: {getattr(self, name)} is not a multiple of {ALIGN}; attention matmuls would be "
                     "padded on Ascend" for name in ("kv_lora_rank", "q_lora_rank", "qk_nope_head_dim",
                                                     "qk_rope_head_dim", "v_head_dim")
                     if getattr(self, name) is not None and getattr(self, name) % ALIGN]
        problems += self.stray_keys(MHA)
        if self.use_flash_attention and self.v_head_dim > self.qk_head_dim:
            # MindFormers 1.9's MLA refuses it (parallel_core/training_graph/transformer/multi_latent_attention.py:
            # 133-135); its FlashAttention is called with values no wider than queries and keys
            problems.append(f"{p}.v_head_dim: {self.v_head_dim} is wider than the query/key head (qk_nope_head_dim + "
                            f"qk_rope_head_dim = {self.qk_head_dim}), which FlashAttention does not take as "
                            f"MindFormers calls it; narrow it or set {p}.use_flash_attention: False")
        if self.num_kv_heads not in (None, self.num_heads):
            problems.append(f"{p}.num_kv_heads: multi-head latent attention has one key/value head per query head: "
                            f"set num_kv_heads to num_heads ({self.num_heads}) or leave it unset")
        return problems

    def moe_problems(self, recipe) -> list:
        """Problems of the Mixture-of-Experts keys, each named."""
        p = "model.model_config"
        problems = [f"{p}.{name}: must be >= {low}, got {getattr(self, name)}"
                    for name, low in (("num_experts", 0), ("num_experts_per_tok", 1), ("router_aux_loss_coef", 0),
                                      ("router_z_loss_coef", 0), ("shared_expert_intermediate_size", 0),
                                      ("n_group", 1), ("topk_group", 1), ("expert_bias_update_rate", 0),
                                      ("capacity_factor", 0))
                    if not getattr(self, name) >= low]
        if not self.routed_scaling_factor > 0:
            problems.append(f"{p}.routed_scaling_factor: must be > 0, got {self.routed_scaling_factor}")
        if self.moe_intermediate_size is not None and self.moe_intermediate_size < 1:
            problems.append(f"{p}.moe_intermediate_size: must be >= 1, got {self.moe_intermediate_size}")
        outside = sorted({n for n in self.dense_layers if not 0 <= n < self.num_layers})
        if outside or len(set(self.dense_layers)) != len(self.dense_layers):
            problems.append(f"{p}.dense_layers: {self.dense_layers} must list distinct layer indices within "
                            f"0..{self.num_layers - 1}")
        if problems:
            return problems
        if not self.moe:
            return self.stray_keys(MOE)
        if self.num_experts_per_tok > self.num_experts:
            problems.append(f"{p}.num_experts_per_tok: {self.num_experts_per_tok} exceeds num_experts "
                            f"{self.num_experts}")
        for name in ("moe_intermediate_size", "shared_expert_intermediate_size"):
            if getattr(self, name) and getattr(self, name) % ALIGN:
                problems.append(f"{p}.{name}: {getattr(self, name)} is not a multiple of {ALIGN} (the Cube unit's "
                                f"tile); use {round_up(getattr(self, name), ALIGN)}")
        if self.shared_expert_gate and not self.shared_expert_intermediate_size:
            problems.append(f"{p}.shared_expert_gate: gates a shared expert, but "
                            f"{p}.shared_expert_intermediate_size is 0")
        if self.num_experts % self.n_group or self.topk_group > self.n_group:
            problems.append(f"{p}.n_group, {p}.topk_group: {self.n_group} groups must divide num_experts "
                            f"({self.num_experts}) and topk_group ({self.topk_group}) lie within 1..n_group")
        elif self.n_group > 1 and self.topk_group * (self.num_experts // self.n_group) < self.num_experts_per_tok:
            problems.append(f"{p}.topk_group: {self.topk_group} group(s) of {self.num_experts // self.n_group} "
                            f"experts hold fewer than num_experts_per_tok ({self.num_experts_per_tok})")
        if self.expert_bias_update_rate and not self.expert_bias:
            problems.append(f"{p}.expert_bias_update_rate: {self.expert_bias_update_rate} needs {p}.expert_bias: True")
        if self.n_group > 1 and self.router_score != "sigmoid":
            problems.append(f"{p}.n_group: group-limited routing is DeepSeek-V3's, over sigmoid scores (a group scored "
                            f"by its best two); set {p}.router_score: sigmoid, or n_group: 1")
        if self.expert_bias and self.router_score != "sigmoid":
            problems.append(f"{p}.expert_bias: the correction bias applies to sigmoid scores (DeepSeek-V3); set "
                            f"{p}.router_score: sigmoid")
        if self.token_drop_policy != "probs" and not self.capacity_factor:
            problems.append(f"{p}.token_drop_policy: {self.token_drop_policy!r} picks the assignments an expert "
                            f"capacity drops, but {p}.capacity_factor is 0 (dropless): set both, or neither")
        if len(self.dense_layers) == self.num_layers:
            problems.append(f"{p}.dense_layers: lists every layer, so no layer has experts; set num_experts: 0")
        return problems


@dataclass
class ArchConfig:
    type: Literal[LLAMA_MODEL_TYPE] = LLAMA_MODEL_TYPE


@dataclass
class ModelSection:
    model_config: ModelConfig
    arch: ArchConfig = field(default_factory=ArchConfig)
