"""The --verify reference of the Megatron reader (megatron.py from_megatron): a pure-torch forward of a Megatron-LM
checkpoint, computed from its own files and arguments, never from our model_config.

Each tensor-parallel rank computes with the shards it holds in Megatron's own layouts (grouped qkv, [gate; up]
fc1) and the partial outputs of linear_proj and linear_fc2 are summed, as their all-reduce does, so the merge into
our separate tensors is checked, not assumed. MoE layers route as megatron-core does (megatron_routing: its top k,
then its expert capacity) and read each expert from the expert-parallel rank file holding it.
"""

import math

import numpy as np

from ascend_llm_recipes.models.arithmetic import expert_capacity
from ascend_llm_recipes.models.config import ModelConfig
from ascend_llm_recipes.models.conversion.megatron_files import kv_groups
from ascend_llm_recipes.models.conversion.tables import megatron_name
from ascend_llm_recipes.models.conversion.verify import verify_against


# The Megatron tensors the reference forward reads, found through the table by our names.
EMBED, OUTPUT = megatron_name("model.embed_tokens.weight"), megatron_name("lm_head.weight")
INPUT_NORM = megatron_name("model.layers.{n}.input_layernorm.weight")
QKV, QKV_BIAS = (megatron_name(f"model.layers.{{n}}.self_attn.q_proj.{w}") for w in ("weight", "bias"))
PROJ = megatron_name("model.layers.{n}.self_attn.o_proj.weight")
MLP_NORM = megatron_name("model.layers.{n}.post_attention_layernorm.weight")
FC1 = megatron_name("model.layers.{n}.mlp.gate_proj.weight")
FC2 = megatron_name("model.layers.{n}.mlp.down_proj.weight")
FINAL_NORM = megatron_name("model.norm.weight")
Q_NORM, K_NORM = (megatron_name(f"model.layers.{{n}}.self_attn.{w}_norm.weight") for w in "qk")
ROUTER, EXPERT_BIAS = megatron_name("model.layers.{n}.mlp.gate.weight"), megatron_name(
    "model.layers.{n}.mlp.router.expert_bias")
EXPERT_FC1 = megatron_name("model.layers.{n}.mlp.experts.{e}.gate_proj.weight")
EXPERT_FC2 = megatron_name("model.layers.{n}.mlp.experts.{e}.down_proj.weight")
SHARED_FC1 = megatron_name("model.layers.{n}.mlp.shared_expert.gate_proj.weight")
SHARED_FC2 = megatron_name("model.layers.{n}.mlp.shared_expert.down_proj.weight")
SHARED_GATE = megatron_name("model.layers.{n}.mlp.shared_expert_gate.weight")


def megatron_routing(logits, args: dict, batch: int = 1):
    """(T, E) router logits of `batch` sequences -> (T, E) combine weights, zero outside each token's top k, as
    megatron-core's topk_routing_with_score_function computes them from Megatron-LM's arguments (`bias`: expert_bias
    or None), then its apply_router_token_dropping's expert capacity (moe_utils.py:800-863)."""
    import torch

    top_k, bias = args.get("moe_router_topk", 2), args.get("_expert_bias")
    if args.get("moe_router_score_function", "softmax") == "sigmoid":
        scores = torch.sigmoid(logits)
        _, chosen = torch.topk(scores if bias is None else scores + bias, top_k, dim=1)
        probs = scores.gather(1, chosen)
        probs = probs / (probs.sum(-1, keepdim=True) + 1e-20) if top_k > 1 else probs
    elif args.get("moe_router_pre_softmax", False):
        probs, chosen = torch.topk(torch.softmax(logits, -1), top_k, dim=1)
    else:
        top, chosen = torch.topk(logits, top_k, dim=1)
        probs = torch.softmax(top, -1)
    probs = probs * (args.get("moe_router_topk_scaling_factor") or 1.0)
    weights = torch.zeros_like(logits).scatter(1, chosen, probs)
    factor, (tokens, experts) = args.get("moe_expert_capacity_factor"), logits.shape
    capacity = expert_capacity(tokens, top_k, experts, factor) if factor is not None and factor >= 0 else tokens
    if capacity >= tokens:
        return weights
    if args.get("moe_token_drop_policy") == "position":  # the earliest in megatron's (S, B) token order
        # (B*S, E) -> (S*B, E): each expert's running count in that order; back to (B*S, E)
        taken = torch.zeros_like(logits).scatter(1, chosen, 1.0).reshape(batch, -1, experts).transpose(0, 1)
        room = (taken.reshape(tokens, experts).cumsum(0) <= capacity).float()
        return weights * room.reshape(-1, batch, experts).transpose(0, 1).reshape(tokens, experts)
    return weights * torch.zeros_like(logits).scatter(0, torch.topk(weights, capacity, dim=0).indices, 1.0)


def megatron_reference_logits(ckpt, cfg: ModelConfig, tokens: np.ndarray) -> np.ndarray:
    """Logits (batch, seq, vocab) of a pure-torch Megatron forward, tensor-parallel ranks simulated.

    Each rank computes with the shards it holds in Megatron's own layouts (grouped qkv, [gate; up]
    fc1) and the partial outputs of linear_proj and linear_fc2 are summed, as their all-reduce does;
    so the merge into our separate tensors is checked, not assumed. MoE layers route as megatron-core does
    (megatron_routing, from the checkpoint's arguments, not from our model_config) and read each expert from
    the expert-parallel rank file holding it.
    """
    import torch
    import torch.nn.functional as F

    def t(array):
        return torch.from_numpy(array).double()

    def rms(x, weight):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + cfg.rms_norm_eps) * weight

    groups, head_dim = kv_groups(ckpt.args)
    tp = ckpt.tp
    per_group = cfg.num_heads // groups
    batch, seq = tokens.shape
    ids = torch.from_numpy(tokens).long()
    x = torch.cat([t(ckpt.shard(EMBED, None, r)) for r in range(tp)])[ids]  # (B, S, H)
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    angles = torch.outer(torch.arange(seq, dtype=torch.float64), inv_freq)
    cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()

    def rotate(v):  # (B, heads, S, head_dim), half-split pairs
        half = v.shape[-1] // 2
        return v * cos + torch.cat([-v[..., half:], v[..., :half]], -1) * sin

    mask = torch.triu(torch.ones(seq, seq, dtype=torch.bool), 1)

    def swiglu(h, fc1, fc2, layer, expert=None):
        """A SwiGLU MLP over the tensor-parallel ranks' [gate; up] and linear_fc2 shards (summed: all-reduce)."""
        out = 0
        for r in range(tp):
            gate, up = (h @ t(ckpt.shard(fc1, layer, r, **experts(expert))).T).chunk(2, -1)
            out = out + (F.silu(gate) * up) @ t(ckpt.shard(fc2, layer, r, **experts(expert))).T
        return out

    def experts(expert):
        return {} if expert is None else {"expert": expert}

    for layer in range(cfg.num_layers):
        h = rms(x, t(ckpt.merged(INPUT_NORM, layer)))
        attn = 0
        for r in range(tp):
            qkv = h @ t(ckpt.shard(QKV, layer, r)).T
            if cfg.qkv_bias:
                qkv = qkv + t(ckpt.shard(QKV_BIAS, layer, r))
            # (B, S, local groups x (per_group + 2) x head_dim) -> (B, S, local groups, per_group + 2, head_dim)
            qkv = qkv.view(batch, seq, groups // tp, per_group + 2, head_dim)
            q = qkv[:, :, :, :per_group].reshape(batch, seq, -1, head_dim).transpose(1, 2)
            k = qkv[:, :, :, per_group].transpose(1, 2).repeat_interleave(per_group, 1)
            if ckpt.args.get("qk_layernorm"):  # per head, before rotary (megatron-core attention.py)
                q, k = rms(q, t(ckpt.merged(Q_NORM, layer))), rms(k, t(ckpt.merged(K_NORM, layer)))
            v = qkv[:, :, :, per_group + 1].transpose(1, 2).repeat_interleave(per_group, 1)
            scores = rotate(q) @ rotate(k).transpose(-1, -2) / math.sqrt(head_dim)
            context = scores.masked_fill(mask, float("-inf")).softmax(-1) @ v  # (B, local heads, S, head_dim)
            attn = attn + context.transpose(1, 2).reshape(batch, seq, -1) @ t(ckpt.shard(PROJ, layer, r)).T
        x = x + attn
        h = rms(x, t(ckpt.merged(MLP_NORM, layer)))
        if ckpt.find(ROUTER, layer)[1] is None:  # a dense layer (moe_layer_freq)
            x = x + swiglu(h, FC1, FC2, layer)
            continue
        # MoE layer (megatron-core moe_layer.py): routed experts weighted by the router, plus the shared expert
        logits = h @ t(ckpt.merged(ROUTER, layer)).T                                    # (B, S, E)
        bias = t(ckpt.merged(EXPERT_BIAS, layer)) if ckpt.args.get("moe_router_enable_expert_bias") else None
        weights = megatron_routing(logits.reshape(batch * seq, -1), {**ckpt.args, "_expert_bias": bias}, batch)
        weights = weights.reshape(batch, seq, -1)
        for e in range(ckpt.args["num_experts"]):
            x = x + swiglu(h, EXPERT_FC1, EXPERT_FC2, layer, e) * weights[..., e:e + 1]
        if ckpt.args.get("moe_shared_expert_intermediate_size"):
            shared = swiglu(h, SHARED_FC1, SHARED_FC2, layer)
            if ckpt.args.get("moe_shared_expert_gate"):
                shared = shared * torch.sigmoid(h @ t(ckpt.merged(SHARED_GATE, layer)).T)
            x = x + shared
    x = rms(x, t(ckpt.merged(FINAL_NORM)))
    head = EMBED if cfg.tie_word_embeddings else OUTPUT
    weight = torch.cat([t(ckpt.shard(head, None, r)) for r in range(tp)])
    return (x @ weight.T)[..., :cfg.vocab_size].numpy()


def verify_against_megatron(ckpt, cfg: ModelConfig, converted_dir: str) -> dict:
    """Our logits against megatron_reference_logits on random tokens (convert.verify_against's rule)."""
    return verify_against(lambda tokens: megatron_reference_logits(ckpt, cfg, tokens), converted_dir, ckpt.path,
                          name="a pure-torch Megatron forward", label="the Megatron reference forward",
                          hint="nothing was written; the tensor layouts (qkv groups, fc1 halves) do not match this "
                               "checkpoint: report its args", max_tokens=64)
