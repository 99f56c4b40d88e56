"""What the tokens of one decoder layer cost per micro-batch: the activations kept for backward, the logits of the
loss, and in a Mixture-of-Experts layer the bytes expert parallel's AllToAll moves.

training/tools/planner.py adds these up per pipeline stage. Import-light: no MindSpore.
"""

import math

from ascend_llm_recipes.models.parallel import RECOMPUTE_MODES
from ascend_llm_recipes.models.shapes import dimensions

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
# The busiest device's share of the dispatched token copies, over the even share: an allowance, not a bound
# (MindFormers 1.9's MoE layer never drops, transformer/moe/router.py:259-296). 1.1 is the expert capacity factor
# MindFormers' own capacity-bound MoE defaults to (mindformers/modules/transformer/moe.py:130), the load above even
# it was built to carry.
MOE_LOAD_ALLOWANCE = 1.1


def _widths(cfg) -> tuple:
    """(q, k, v, attention output) widths of one layer: heads x the query/key head or the value head (MLA's differ;
    grouped-query attention has fewer key/value heads than query heads)."""
    kv_heads = cfg.num_heads if cfg.mla else cfg.kv_heads
    return (cfg.num_heads * cfg.qk_head_dim, kv_heads * cfg.qk_head_dim, kv_heads * cfg.value_head_dim,
            cfg.num_heads * cfg.value_head_dim)


def activation_terms(cfg, micro_batch: int, tensor_parallel: int = 1, moe: bool = False,
                     expert_parallel: int = 1) -> dict:
    """Bytes of each tensor one decoder layer of models/llama.py holds, per micro-batch on one TP rank.

    name -> (bytes, kind). kind "kept": saved for backward; "score": saved for backward and
    recomputed under selective recompute (the S x S terms); "working": alive only while the
    layer computes (one layer at a time). e = bytes of the compute dtype, f = intermediate_size,
    a = heads, q/k/v/o = heads x query/key head, key/value heads x key and value head, heads x value head
    (_widths), t = tensor parallel.

    models/parallel.py gives every operator a strategy, as MindFormers' Llama does: from q/k/v to
    the attention output the heads are split by TP, the MLP width by TP; without sequence
    parallelism the hidden states at the norms stay whole on every TP rank. With FlashAttention
    (use_flash_attention) no S x S tensor exists: the kernel keeps two fp32 (B, heads, S, 8)
    softmax statistics instead. Korthikanti et al. 2022 (sec. 4) count the same kinds of tensors.

    moe=True: the layer's MLP is the MoE one. Each token's k = num_experts_per_tok copies go through experts of
    width moe_intermediate_size (and every token through the shared expert), so the SwiGLU terms are those of
    a width k x moe_intermediate_size + shared_expert_intermediate_size; the router's fp32 logits and
    probabilities (tokens x experts) and the k dispatched copies of each token with the experts' outputs before
    they are combined are kept too. Under expert parallel a device receives the copies routed to its experts, and
    AlltoAllV sizes that buffer from the token counts (mindformers token_dispatcher.py:528, 617-618): the even
    share is a lower bound, and routing without capacity has no upper one. With expert_parallel > 1 the copies
    are planned at MOE_LOAD_ALLOWANCE x the even share (at 1 every copy stays on its device: exact).
    With tensor parallel the MoE layer splits the tokens over the TP ranks (sequence parallel,
    models/expert_parallel.py), so these terms are 1/t per device as the column-split ones are.
    """
    e = DTYPE_BYTES[getattr(cfg, "compute_dtype", "float32")]
    s, b, h, t, a = cfg.seq_length, micro_batch, cfg.hidden_size, tensor_parallel, cfg.num_heads
    q, k, v, o = _widths(cfg)
    sb, scores = s * b, a * s * s * b
    width = cfg.num_experts_per_tok * cfg.expert_size + cfg.shared_expert_intermediate_size if moe else \
        cfg.intermediate_size
    sbf = sb * width
    flash = getattr(cfg, "use_flash_attention", False)
    terms = {
        "norm_inputs_fp32": (2 * 4 * sb * h, "kept"),             # RMSNorm computes in fp32 (both norms)
        "norm_outputs": (2 * e * sb * h, "kept"),                 # inputs of q/k/v and of gate/up
        "qkv_projections": (e * sb * (q + k + v) // t, "kept"),   # column-split matmul outputs
        "rotary_fp32": (4 * sb * (q + k) // t, "kept"),           # q and k rotated in fp32, split by heads
        "kv_broadcast": (e * sb * (q + o) // t if k < q and not flash else 0, "kept"),  # K, V tiled to every head
        "attention_qkv": (e * sb * (2 * q + o) // t, "kept"),     # Q, K, V at the attention
        "attention_output": (2 * e * sb * o // t, "kept"),        # attention output, then merged heads
        "swiglu_split": (2 * e * sbf // t, "kept"),               # gate and up (column-split)
        "swiglu_activation": (2 * e * sbf // t, "kept"),          # silu(gate) and silu x up, split by TP
    }
    if cfg.mla:  # the q and kv latents (q_lora_rank, kv_lora_rank + rotary key) and their fp32 norms
        latent = (cfg.q_lora_rank or 0) + cfg.kv_lora_rank + cfg.qk_rope_head_dim
        terms["mla_latents"] = ((e + 4) * sb * latent, "kept")
    if moe:  # with tensor parallel the MoE layer runs sequence parallel: each TP rank routes 1/t of the tokens
        terms["router_fp32"] = (2 * 4 * sb * cfg.num_experts // t, "kept")
        even = 2 * e * sb * cfg.num_experts_per_tok * h // t
        terms["dispatched_tokens"] = (math.ceil(even * MOE_LOAD_ALLOWANCE) if expert_parallel > 1 else even, "kept")
    if flash:
        terms["flash_softmax_stats"] = (2 * 4 * a * s * b * 8 // t, "score")  # softmax max and sum, fp32
    else:
        terms["softmax_fp32"] = (4 * scores // t, "score")
        terms["probs_cast"] = ((e * scores // t) if e != 4 else 0, "score")   # cast for the PV matmul
        terms["scores_at_mask_add"] = (4 * scores // t + e * scores // t, "working")  # QK^T, then + mask (fp32)
    return terms


def layer_activation_bytes(cfg, micro_batch: int, tensor_parallel: int = 1, recompute: str = "none",
                           moe: bool = False, expert_parallel: int = 1) -> int:
    """Activation bytes one decoder layer (moe: an MoE one) keeps for backward, per micro-batch, on one TP rank.

    none: every "kept" and "score" term of activation_terms; selective (core attention
    recomputed, as models/parallel.py marks it): without the "score" terms; full: only the
    layer input, e sbh, whole on every TP rank (no sequence parallelism). What a layer holds
    while it computes or is recomputed is recompute_working_bytes.
    """
    if recompute not in RECOMPUTE_MODES:
        raise ValueError(f"recompute: {recompute!r} is not one of {', '.join(RECOMPUTE_MODES)}")
    if recompute == "full":
        return DTYPE_BYTES[getattr(cfg, "compute_dtype", "float32")] * cfg.seq_length * micro_batch * cfg.hidden_size
    kinds = ("kept",) if recompute == "selective" else ("kept", "score")
    terms = activation_terms(cfg, micro_batch, tensor_parallel, moe, expert_parallel)
    return sum(n for n, kind in terms.values() if kind in kinds)


def recompute_working_bytes(cfg, micro_batch: int, tensor_parallel: int = 1, recompute: str = "none",
                            moe: bool = False, expert_parallel: int = 1) -> int:
    """Bytes one layer adds on top of what every layer keeps, at the peak of its forward or backward.

    Always the transient S x S scores; under full recompute also the layer's own activations,
    rebuilt for its backward; under selective recompute its core attention's.
    """
    terms = activation_terms(cfg, micro_batch, tensor_parallel, moe, expert_parallel)
    working = sum(n for n, kind in terms.values() if kind == "working")
    if recompute == "full":
        return working + layer_activation_bytes(cfg, micro_batch, tensor_parallel, "none", moe, expert_parallel)
    if recompute == "selective":
        return working + sum(n for n, kind in terms.values() if kind == "score")
    return working


def logits_bytes(cfg, micro_batch: int, tensor_parallel: int = 1) -> int:
    """What the last stage holds for the loss of one micro-batch (1F1B: one at a time there).

    The output projection's vocabulary-split output (compute dtype), then the vocabulary-parallel
    cross-entropy's fp32 tensors, each split by TP like the projection (models/parallel.py, as
    MindFormers' core/loss/loss.py): the fp32 logits, their log_softmax (kept for backward), the
    one-hot labels and, in backward, the gradient of the logits: four (B, S, vocab / TP) fp32 tensors.
    """
    e = DTYPE_BYTES[getattr(cfg, "compute_dtype", "float32")]
    sb, t = cfg.seq_length * micro_batch, tensor_parallel
    padded = dimensions(cfg, t)["padded_vocab"]
    return e * sb * padded // t + 4 * 4 * sb * padded // t


ALLTOALL_FORMULA = ("micro-batches x MoE layers x passes x tokens / TP x top_k x hidden x bytes x (EP - 1) / EP; "
                    "passes: dispatch and combine, forward and backward = 4 (+2 when full recompute reruns the "
                    "forward)")


def alltoall_bytes(cfg, micro_batch: int, micro_batches: int, moe_layers: int, expert_parallel: int,
                   recompute: str = "none", tensor_parallel: int = 1) -> int:
    """Bytes one device sends per step through expert parallel's AllToAll (ALLTOALL_FORMULA).

    MindFormers' MoELayer (transformer/moe/token_dispatcher.py, alltoall dispatcher) sends each of a micro-batch's
    tokens x top_k routed copies, hidden wide in the compute dtype, to the device holding its expert and the
    experts' outputs back (combine); backward runs both in reverse. A copy whose expert is on the same device
    stays there: at an even load (EP - 1) / EP of them leave it. With tensor parallel each TP rank dispatches its
    1/TP of the sequence (sequence parallel in the MoE layer, models/expert_parallel.py).
    """
    if expert_parallel <= 1 or not moe_layers:
        return 0
    e = DTYPE_BYTES[getattr(cfg, "compute_dtype", "float32")]
    passes = 4 + (2 if recompute == "full" else 0)
    copies = micro_batch * cfg.seq_length // tensor_parallel * cfg.num_experts_per_tok
    return micro_batches * moe_layers * passes * copies * cfg.hidden_size * e * (expert_parallel - 1) // expert_parallel


def moe_layer_count(cfg, first_layer: int, layers: int) -> int:
    """MoE layers among layers first_layer .. first_layer + layers - 1 (a pipeline stage's)."""
    return sum(cfg.is_moe_layer(i) for i in range(first_layer, first_layer + layers))


def step_alltoall_bytes(recipe, first_layer: int, layers: int) -> int:
    """Bytes one device of the stage holding those layers sends per step through AllToAll (ALLTOALL_FORMULA)."""
    cfg, p, b = recipe.model.model_config, recipe.parallel_config, recipe.runner_config.batch_size
    micro_batches = recipe.tokens_per_step // (p.data_parallel * b * cfg.seq_length)
    return alltoall_bytes(cfg, b, micro_batches, moe_layer_count(cfg, first_layer, layers), p.expert_parallel,
                          recipe.recompute_config.mode, p.model_parallel)
