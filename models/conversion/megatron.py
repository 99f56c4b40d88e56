"""Megatron-LM checkpoints -> ours, and ours -> Megatron-LM (legacy format).

    from_megatron(CKPT_DIR, OUT_DIR)  a Megatron save directory (latest_checkpointed_iteration.txt)
                                      or one iter_NNNNNNN directory, legacy or torch_dist
    to_megatron(CKPT, cfg, OUT_DIR, tp, pp, ep=1, grouped_gemm=False)
                                      legacy mp_rank_TT[_PPP][_EEE]/model_optim_rng.pt files (grouped_gemm:
                                      the experts as GroupedMLP's weight1/weight2, --moe-grouped-gemm)

training/tools/export.py resolves what a user names (a run directory, a recipe as --model-config) into
these functions' arguments and writes the recipe continuing a converted run (--write-recipe).

Output is what hf.py's from_hf writes (weights.safetensors, model_config.yaml,
conversion.json), through its write_ours: the Megatron tensors are presented under HuggingFace names
(MegatronWeights) and everything downstream is shared. to_megatron publishes through the same
write_conversion (hidden sibling directory, atomic rename, OSError reported by name).

Megatron's layouts (megatron-core transformer/attention.py and mlp.py, local or TransformerEngine
spec): `linear_qkv` rows are grouped per KV group, [q_1 .. q_{heads/groups}, k, v] x head_dim for
each group, and each tensor-parallel rank holds whole groups, so concatenating the ranks keeps that
layout; `linear_fc1` is [gate; up] per rank in legacy files and [gate of all ranks; up of all ranks]
in torch_dist; `linear_proj` and `linear_fc2` are split on their input dimension; the vocabulary
tables are split on rows and padded to make_vocab_size_divisible_by x TP. Rotary embeddings use
the same half-split layout as ours (rotary_interleaved False), so nothing is permuted.

Mixture of Experts (megatron-core transformer/moe): the router, expert_bias, SequentialMLP's local experts
(legacy files number them per expert-parallel rank, torch_dist puts all experts on one axis) and the shared
experts map to models/moe.py's tensors; so do GroupedMLP's (--moe-grouped-gemm without TransformerEngine: legacy
files stack a layer's local experts in weight1/weight2, tables.GROUPED_EXPERTS; its torch_dist keys are
SequentialMLP's, as are TEGroupedMLP's, whose legacy linear_fc1.weight<e> files are refused by name).
moe_fields translates the routing arguments (the expert capacity and its drop policy too) and refuses by name what
megatron-core computes differently (group-limited routing, sinkhorn).

Legacy files are pickles of argparse namespaces (Megatron loads them with weights_only=False, and so
must this reader): convert only checkpoints you trust.
"""

import argparse
import os
import time

import numpy as np

from ascend_llm_recipes.common.errors import ConversionError
from ascend_llm_recipes.models.arithmetic import round_up
from ascend_llm_recipes.models.config import ModelConfig
from ascend_llm_recipes.models.conversion.formats import HFWeights
from ascend_llm_recipes.models.conversion.megatron_files import (LATEST_FILE, LegacyCheckpoint, RANK_FILE, kv_groups,
                                                                 open_megatron)
from ascend_llm_recipes.models.conversion.ours import (FORMAT_VERSION, MOMENT_FILES, OPTIMIZER_DIR, PER_EXPERT,
                                                       OurCheckpoint, source_manifest)
from ascend_llm_recipes.models.conversion.tables import (FUSE, MEGATRON_TABLE, MEGATRON_TENSORS, TRANSFORMS,
                                                         grouped_state, is_expert, layer_names, present_tensors,
                                                         rank_share, row_for, tensor_plan)
from ascend_llm_recipes.models.conversion.megatron_reference import verify_against_megatron
from ascend_llm_recipes.models.conversion.write import progress_bar, write_conversion, write_ours
from ascend_llm_recipes.models.shapes import dimensions, tensor_dimensions


# Megatron-LM argument -> (the only supported value, why); checked before any tensor is read.
UNSUPPORTED_ARGS = (
    ("normalization", "RMSNorm", "the model uses RMSNorm, not LayerNorm"),
    ("swiglu", True, "the MLP is gated (SwiGLU); a non-gated MLP has no gate_proj"),
    ("position_embedding_type", "rope", "positions are rotary"),
    ("rotary_percent", 1.0, "rotary embeddings cover the whole head (rotary_percent < 1 rotates part of it)"),
    ("rotary_interleaved", False, "rotary pairs are half-split, not interleaved"),
    ("add_bias_linear", False, "the only biases the model has are q/k/v (add_qkv_bias)"),
    ("multi_latent_attention", False, "multi-latent attention (DeepSeek) is not read from Megatron checkpoints yet"),
    ("apply_layernorm_1p", False, "norm weights are used as stored (no 1 + weight)"),
    ("virtual_pipeline_model_parallel_size", None, "the reader expects one model chunk per pipeline stage"),
)
# What the Megatron writer does not write yet (the tables name these tensors; the reader refuses them by argument).
MEGATRON_NOT_YET = (
    ("kv_lora_rank", None, "multi-latent attention (Megatron's MLA) is not written yet"),
    ("n_group", 1, "group-limited routing: megatron-core scores a group by its top topk/group_topk experts, the "
                   "model by its top 2"),
)
# MoE arguments whose other values route or compute differently from models/moe.py (Megatron-LM's names).
UNSUPPORTED_MOE_ARGS = (
    ("moe_router_num_groups", 1, "group-limited routing scores a group by its top topk/group_topk experts, the "
                                    "model by its top 2"),
    ("moe_latent_size", None, "MoE latent projections are not in the model"),
    ("moe_router_padding_for_fp8", False, "the router pads its input: not read"),
)
MOE_ROUTER_TYPES = ("aux_loss", "seq_aux_loss", "global_aux_loss", "none")  # sinkhorn routes differently
# moe_router_load_balancing_type -> model_config.router_aux_loss_scope: which tokens f_e counts (megatron-core
# transformer/moe/router.py _apply_aux_loss: the micro-batch of the tensor x context parallel group, one data-parallel
# rank's; _apply_global_aux_loss: every data-parallel rank's and the step's micro-batches so far, :370-394)
AUX_LOSS_SCOPES = {"aux_loss": "micro_batch", "global_aux_loss": "global"}
BALANCING_TYPES = {scope: kind for kind, scope in AUX_LOSS_SCOPES.items()}
REQUIRED_ARGS = ("num_layers", "hidden_size", "num_attention_heads", "seq_length", "tensor_model_parallel_size",
                 "pipeline_model_parallel_size")


def model_config_from_args(args: dict, where: str, vocab_size: int = None) -> ModelConfig:
    """Megatron-LM arguments -> our model_config, refusing by name what the model cannot express."""
    problems = [f"{key}: missing" for key in REQUIRED_ARGS if args.get(key) is None]
    for key, supported, why in UNSUPPORTED_ARGS:
        value = args.get(key, supported)
        if key == "num_experts" and not value:
            continue
        if value != supported:
            problems.append(f"{key}: {value!r} is not supported ({supported!r} only): {why}")
    if problems:
        raise ConversionError(f"{where}: {len(problems)} unsupported or missing argument(s):\n" +
                              "\n".join(f"  - {p}" for p in problems),
                              hint="only Llama-style Megatron models convert: RMSNorm, rotary positions, SwiGLU, "
                                   "optional q/k/v bias")
    hidden, heads = args["hidden_size"], args["num_attention_heads"]
    groups, head_dim = kv_groups(args)
    tp = args["tensor_model_parallel_size"]
    if args.get("kv_channels") is None and hidden % heads:
        problems.append(f"kv_channels: not recorded and hidden_size {hidden} is not a multiple of {heads} heads")
    moe, problems = moe_fields(args, problems)
    if groups < tp:
        problems.append(f"num_query_groups: {groups} KV groups are fewer than tensor_model_parallel_size {tp} "
                        "(replicated KV heads are not supported)")
    padded = args.get("padded_vocab_size")
    vocab = vocab_size or args.get("vocab_size")
    if vocab is None:
        problems.append(f"vocab_size: not recorded in the arguments (padded_vocab_size {padded} includes padding "
                        "rows): pass --vocab-size with the tokenizer's vocabulary size")
    elif padded is not None and vocab > padded:
        problems.append(f"vocab_size: {vocab} exceeds the checkpoint's padded_vocab_size {padded}")
    if args.get("max_position_embeddings") and args["seq_length"] > args["max_position_embeddings"]:
        problems.append(f"seq_length: {args['seq_length']} exceeds max_position_embeddings "
                        f"{args['max_position_embeddings']}")
    if problems:
        raise ConversionError(f"{where}: {len(problems)} problem(s):\n" + "\n".join(f"  - {p}" for p in problems))
    return ModelConfig(vocab_size=vocab, hidden_size=hidden, num_layers=args["num_layers"], num_heads=heads,
                       num_kv_heads=groups, intermediate_size=args.get("ffn_hidden_size") or 4 * hidden,
                       seq_length=args["seq_length"], rms_norm_eps=float(args.get("norm_epsilon", 1e-5)),
                       rope_theta=float(args.get("rotary_base", 10000)),
                       initializer_range=float(args.get("init_method_std", 0.02)),
                       tie_word_embeddings=not args.get("untie_embeddings_and_output_weights", False),
                       qkv_bias=bool(args.get("add_qkv_bias", False)),
                       head_dim=head_dim if head_dim != hidden // heads else None,
                       qk_norm=bool(args.get("qk_layernorm", False)), **moe)


def moe_fields(args: dict, problems: list) -> tuple:
    """(our MoE model_config fields, problems + the MoE arguments refused) from Megatron-LM's MoE arguments.

    Megatron-core's router (transformer/moe/moe_utils.py topk_routing_with_score_function): softmax without
    moe_router_pre_softmax takes the top k logits and softmaxes them (= our softmax, top k, renormalised:
    norm_topk_prob), with it the top k of the softmax as they are; sigmoid scores are chosen with expert_bias
    added and renormalised when k > 1; then x moe_router_topk_scaling_factor.
    """
    experts = args.get("num_experts")
    if not experts:
        return {}, problems
    problems = list(problems)
    for key, supported, why in UNSUPPORTED_MOE_ARGS:
        value = args.get(key, supported)
        if value not in (None, False, supported):
            problems.append(f"{key}: {value!r} is not supported ({supported!r} only): {why}")
    if args.get("moe_router_load_balancing_type", "aux_loss") not in MOE_ROUTER_TYPES:
        problems.append(f"moe_router_load_balancing_type: {args['moe_router_load_balancing_type']!r} routes tokens "
                        f"differently from the model's top-k router (supported: {', '.join(MOE_ROUTER_TYPES)})")
    tp = args["tensor_model_parallel_size"]
    if args.get("expert_tensor_parallel_size") not in (None, tp):
        problems.append(f"expert_tensor_parallel_size: {args['expert_tensor_parallel_size']} differs from "
                        f"tensor_model_parallel_size {tp} (experts split by their own TP are not read)")
    ep = args.get("expert_model_parallel_size") or 1
    if experts % ep:
        problems.append(f"expert_model_parallel_size: {ep} does not divide num_experts {experts}")
    score = args.get("moe_router_score_function", "softmax")
    top_k = args.get("moe_router_topk", 2)
    bias = bool(args.get("moe_router_enable_expert_bias", False))
    if score not in ("softmax", "sigmoid"):
        problems.append(f"moe_router_score_function: {score!r} (softmax or sigmoid only)")
    if bias and score != "sigmoid":
        problems.append("moe_router_enable_expert_bias: with the softmax score function megatron-core routes without "
                        "the bias, the model with it (sigmoid scores only)")
    freq = args.get("moe_layer_freq", 1)
    layers = args["num_layers"]
    if isinstance(freq, int) and freq > 0:
        dense = [n for n in range(layers) if n % freq]
    elif isinstance(freq, (list, tuple)) and len(freq) == layers and set(freq) <= {0, 1}:
        dense = [n for n, moe in enumerate(freq) if not moe]
    else:
        problems.append(f"moe_layer_freq: {freq!r} is neither a positive integer nor a list of {layers} 0/1 entries")
        dense = []
    # megatron-core reads a negative capacity factor as none (transformer_config.py:1105-1107)
    capacity = args.get("moe_expert_capacity_factor")
    capacity = None if capacity is not None and capacity < 0 else capacity
    policy = args.get("moe_token_drop_policy") or "probs"
    if capacity == 0:
        problems.append("moe_expert_capacity_factor: 0 makes megatron-core drop every assignment; ours is dropless")
    if capacity is not None and policy not in ("probs", "position"):
        problems.append(f"moe_token_drop_policy: {policy!r} (probs or position only)")
    if capacity is not None and args.get("moe_pad_expert_input_to_capacity") and bias:
        problems.append("moe_pad_expert_input_to_capacity: True with moe_router_enable_expert_bias: megatron-core "
                        "moves the bias by the padded map (router.py:629, moe_utils.py:855-857), ours by slots taken")
    normalize = (not args.get("moe_router_pre_softmax", False)) if score == "softmax" else top_k > 1
    coefficient = args.get("moe_aux_loss_coeff") or 0.0
    balancing = args.get("moe_router_load_balancing_type", "aux_loss")
    return dict(num_experts=experts, num_experts_per_tok=top_k,
                moe_intermediate_size=args.get("moe_ffn_hidden_size") or args.get("ffn_hidden_size"),
                norm_topk_prob=normalize,
                shared_expert_intermediate_size=args.get("moe_shared_expert_intermediate_size") or 0,
                shared_expert_gate=bool(args.get("moe_shared_expert_gate", False)), dense_layers=dense,
                router_score=score, expert_bias=bias,
                expert_bias_update_rate=float(args.get("moe_router_bias_update_rate") or 0.0) if bias else 0.0,
                routed_scaling_factor=float(args.get("moe_router_topk_scaling_factor") or 1.0),
                # Megatron's per-micro-batch (aux_loss) and global-batch (global_aux_loss) load-balancing losses are
                # ours (models/moe.py LoadBalancingLoss, router_aux_loss_scope); the per-sequence one is a training
                # term the model does not compute
                router_aux_loss_coef=float(coefficient) if balancing in AUX_LOSS_SCOPES and
                not isinstance(coefficient, list) else 0.0,
                router_aux_loss_scope=AUX_LOSS_SCOPES.get(balancing, "global"),
                router_z_loss_coef=float(args.get("moe_z_loss_coeff") or 0.0),
                # moe_pad_expert_input_to_capacity pads each expert's input with weight-0 tokens: the same numbers
                capacity_factor=float(capacity or 0.0), token_drop_policy=policy if capacity else "probs"), problems


def balancing_notes(args: dict) -> list:
    """What of Megatron's load-balancing loss model_config.yaml does not carry (moe_fields sets its coefficient 0)."""
    balancing, coefficient = args.get("moe_router_load_balancing_type", "aux_loss"), args.get("moe_aux_loss_coeff")
    if not coefficient or (balancing in AUX_LOSS_SCOPES and not isinstance(coefficient, list)):
        return []
    return [f"moe_router_load_balancing_type {balancing!r} with moe_aux_loss_coeff {coefficient}: ours computes one "
            "load-balancing loss per layer over the micro-batch or the step (aux_loss, global_aux_loss), not this, so "
            "model.model_config.router_aux_loss_coef is 0; set it (and router_aux_loss_scope) to train with one"]


def json_args(args: dict) -> dict:
    """The arguments that JSON can hold (for conversion.json and the way back to Megatron)."""
    scalar = (bool, int, float, str)
    return {k: v for k, v in args.items() if v is None or isinstance(v, scalar) or
            isinstance(v, list) and all(isinstance(x, scalar) for x in v)}


class MegatronWeights(HFWeights):
    """A Megatron checkpoint seen as HuggingFace-named tensors (by tables.MEGATRON_TABLE), so write.py consumes it.

    qkv_layout="grouped" is Megatron's; "separate" (all q rows, then k, then v) is the common mistake,
    kept so that tests can show the parity check rejects it.
    """

    def __init__(self, ckpt, cfg: ModelConfig, qkv_layout: str = "grouped", fc1_merge: str = "per_rank"):
        self.ckpt, self.cfg, self.qkv_layout, self.fc1_merge = ckpt, cfg, qkv_layout, fc1_merge
        self._cache = (None, None)  # the last merged tensor: q, k and v come from one qkv
        plan = tensor_plan(cfg)
        super().__init__(ckpt.format, ckpt.files, {p.hf: (self, "F32", p.hf_shape) for p in plan})
        self.sources = {p.hf: (*row_for(MEGATRON_TABLE, p.hf, ckpt.path), p.hf_shape) for p in plan}

    def read(self, name: str) -> np.ndarray:
        row, numbers, shape = self.sources[name]
        key = (row.theirs, numbers.get("n"), numbers.get("e"))
        if self._cache[0] != key:
            self._cache = (None, None)  # drop the previous one first: one merged tensor alive at a time
            expert = {"expert": numbers["e"]} if "e" in numbers else {}  # only the legacy reader has experts
            self._cache = (key, self.ckpt.merged(row.theirs[0], numbers.get("n"), self.fc1_merge, **expert))
        tensor = self._cache[1]
        if row.fuse is not None:
            tensor = FUSE[row.fuse][1](tensor, self.cfg.kv_heads, self.cfg.head_size, self.qkv_layout)[row.part]
        return TRANSFORMS[row.transform][0](tensor, shape, self.cfg)


def from_megatron(ckpt_dir: str, out_dir: str, iteration: int = None, vocab_size: int = None,
                  verify: bool = False, show_progress: bool = True, qkv_layout: str = "grouped",
                  fc1_merge: str = "per_rank", expert_layout: str = PER_EXPERT) -> dict:
    """Convert a Megatron-LM checkpoint (legacy or torch_dist, any TP/PP) into OUT_DIR. Returns the manifest.

    With verify, our logits are compared with a pure-torch forward of the Megatron tensors as each
    tensor-parallel rank holds them (megatron_reference.py), before OUT_DIR is published. `expert_layout`:
    write.write_ours's.
    """
    with open_megatron(ckpt_dir, iteration) as ckpt:  # each rank file loaded once, released on return
        cfg = model_config_from_args(ckpt.args, f"{ckpt.path} (args)", vocab_size)
        unknown = ckpt.unknown_tensors(cfg)
        if unknown:
            raise ConversionError(f"{ckpt.path}: {len(unknown)} tensor(s) this converter does not know:\n" +
                                  "\n".join(f"  - {u}" for u in unknown[:20]),
                                  hint="only Llama-style models convert; _extra_state entries are ignored")
        weights = MegatronWeights(ckpt, cfg, qkv_layout, fc1_merge)
        source = {"path": ckpt.path, "format": ckpt.format, "iteration": ckpt.iteration,
                  "tensor_model_parallel_size": ckpt.tp, "pipeline_model_parallel_size": ckpt.pp,
                  **({"expert_model_parallel_size": ckpt.ep} if cfg.moe else {}),
                  "megatron_args": json_args(ckpt.args),
                  "files": [{"file": f, "bytes": os.path.getsize(os.path.join(ckpt.path, f))} for f in ckpt.files]}
        check = (lambda work_dir: verify_against_megatron(ckpt, cfg, work_dir)) if verify else None
        moments, optimizer = carried_moments(ckpt, cfg, qkv_layout, fc1_merge)
        return write_ours(weights, cfg, out_dir, "from-megatron", source,
                          f"Converted from {ckpt.path} (Megatron {ckpt.format}, iteration {ckpt.iteration}, "
                          f"TP {ckpt.tp} x PP {ckpt.pp})", verify=check, show_progress=show_progress,
                          moments=moments, optimizer=optimizer, expert_layout=expert_layout,
                          notes=balancing_notes(ckpt.args) if cfg.moe else ())


def carried_moments(ckpt, cfg: ModelConfig, qkv_layout: str = "grouped", fc1_merge: str = "per_rank") -> tuple:
    """({our moment prefix: HF-named moments}, manifest "optimizer" entry) for the Adam state a checkpoint holds.

    Only legacy files of a non-distributed optimizer hold it per parameter; otherwise the entry says
    why the optimizer restarts.
    """
    restarts = "training restarts the optimizer (AdamW moments start at zero)"
    if not isinstance(ckpt, LegacyCheckpoint):
        return {}, {"carried": False, "note": f"{restarts}: optimizer state is read from legacy files only"}
    if cfg.moe:  # megatron-core keeps expert parameters in their own groups (and optimizer, under EP)
        return {}, {"carried": False, "note": f"{restarts}: the Adam moments of MoE checkpoints are not read yet"}
    try:
        step = ckpt.optimizer_step()
    except ConversionError as err:
        return {}, {"carried": False, "note": f"{restarts}: {err.message}"}
    moments = {prefix: MegatronWeights(ckpt.moments(key), cfg, qkv_layout, fc1_merge)
               for prefix, key in MOMENT_FILES.items()}
    return moments, {"carried": True, "directory": OPTIMIZER_DIR, "global_step": step,
                     "note": f"Adam moments and step {step} carried over into {OPTIMIZER_DIR}/ (recipe key "
                             "load_optimizer_state)"}


def to_megatron(ckpt_path: str, cfg: ModelConfig, out_dir: str, tp: int = 1, pp: int = 1, iteration: int = None,
                source: str = None, section_path: str = None, show_progress: bool = True, ep: int = 1,
                grouped_gemm: bool = False) -> dict:
    """Write Megatron-LM legacy files (mp_rank_TT[_PPP][_EEE]/model_optim_rng.pt) for TP x PP (x EP: a MoE
    model's experts split over `ep` expert-parallel ranks), one rank file at a time; grouped_gemm: the experts in
    GroupedMLP's weight1/weight2 (for --moe-grouped-gemm without TransformerEngine) instead of SequentialMLP's.

    `source`: the converted directory whose conversion.json may hold the original Megatron arguments;
    `section_path`: where cfg was read, for the manifest. training/tools/export.py's to_megatron finds both.
    """
    import torch

    start = time.perf_counter()
    numbers = [f"--{name} {value}: must be a positive integer" for name, value in (("tp", tp), ("pp", pp), ("ep", ep))
               if type(value) is not int or value < 1]
    if iteration is not None and (type(iteration) is not int or iteration < 0):
        numbers.append(f"--iteration {iteration}: must be 0 or more (Megatron names iter_NNNNNNN directories by it)")
    if numbers:
        raise ConversionError(f"{ckpt_path}: " + "; ".join(numbers))
    ckpt = OurCheckpoint(ckpt_path, cfg)  # either expert layout, read expert by expert
    plan = {p.hf: p for p in tensor_plan(cfg)}
    problems = [f"{p.ours}: missing" for p in plan.values() if p.ours not in ckpt]
    groups = cfg.kv_heads
    for what, value in (("num_heads", cfg.num_heads), ("num_kv_heads", groups),
                        ("intermediate_size", cfg.intermediate_size),
                        ("moe_intermediate_size", cfg.expert_size if cfg.moe else 0),
                        ("shared_expert_intermediate_size", cfg.shared_expert_intermediate_size)):
        if value % tp:
            problems.append(f"--tp {tp} does not divide {what} ({value})")
    if ep > 1 and (not cfg.moe or cfg.num_experts % ep):
        problems.append(f"--ep {ep} does not divide num_experts ({cfg.num_experts})")
    if grouped_gemm and not cfg.moe:
        problems.append("--grouped-gemm: the model has no experts (num_experts 0)")
    problems += moe_args_for(cfg)[1]
    if cfg.num_layers % pp:
        problems.append(f"--pp {pp} does not divide num_layers ({cfg.num_layers})")
    problems += [f"model_config.{name}: {getattr(cfg, name)!r}: {why}" for name, value, why in MEGATRON_NOT_YET
                 if getattr(cfg, name) != value]
    if problems:
        raise ConversionError(f"{ckpt_path}: cannot write TP {tp} x PP {pp}:\n" +
                              "\n".join(f"  - {p}" for p in problems))
    args = _megatron_args_for(cfg, tp, pp, source or os.path.dirname(ckpt_path), iteration, ep, grouped_gemm)
    iteration = args["iteration"]
    padded = args["padded_vocab_size"]
    if os.path.exists(out_dir) and os.listdir(out_dir):
        raise ConversionError(f"output {out_dir} exists and is not empty", hint="choose another --output")
    iter_name = f"iter_{iteration:07d}" if iteration else "release"

    kinds = present_tensors(MEGATRON_TENSORS, cfg)
    dims = {**dimensions(cfg), "vocab": padded}  # Megatron's shapes: vocabulary rows padded
    their_shapes = {pattern: tuple(dims[d] for d in names) for pattern, _, names in tensor_dimensions(cfg)}

    per_rank = cfg.num_experts // ep

    def rank_state(p: int, t: int, e: int) -> dict:
        """Rank (t, p, e)'s tensors, generated from MEGATRON_TABLE.

        In the order Megatron's model holds them: the embedding (first stage), each layer, the final norm and
        output layer (last stage). A layer has the rows whose tensors it has (dense or MoE MLP, per layer);
        expert-parallel rank e holds global experts e x E/EP .. (e + 1) x E/EP - 1 under local numbers.
        """
        first = cfg.num_layers // pp * p
        layers = [(n, n - first) for n in range(first, first + cfg.num_layers // pp)]
        state = {}
        for group in ("first", None, "last"):
            if group == "first" and p != 0 or group == "last" and p != pp - 1:
                continue
            for n, local in layers if group is None else [(None, None)]:
                for kind in (k for k in kinds if MEGATRON_TENSORS[k].stage == group):
                    experts = range(per_rank) if is_expert(kind) else (None,)
                    for local_e, g in ((le, None if le is None else e * per_rank + le) for le in experts):
                        rows = [row for row in MEGATRON_TENSORS[kind].rows if row.ours.format(n=n, e=g) in plan]
                        if not rows:  # a dense layer's router, a MoE layer's dense MLP, MLA's q_a_layernorm
                            continue
                        parts = [their_tensor(row, n, g) for row in rows]
                        state[layer_names(kind, local, local_e)[0]] = rank_share(
                            MEGATRON_TENSORS[kind], parts, t, tp, cfg.kv_heads, cfg.head_size)
        return state

    def their_tensor(row, n, e=None):
        """Our tensor of `row` at layer n (expert e), in Megatron's layout (vocabulary rows padded)."""
        item = plan[row.ours.format(n=n, e=e)]
        hf = TRANSFORMS[item.transform][1](ckpt.read(item.ours), item.hf_shape)
        return TRANSFORMS[row.transform][1](hf, their_shapes[row.ours], cfg)

    def write_files(work_dir: str) -> dict:
        with progress_bar(tp * pp * ep, "write rank files", show_progress) as bar:
            for p, e, t in ((p, e, t) for p in range(pp) for e in range(ep) for t in range(tp)):
                state = rank_state(p, t, e)
                state = grouped_state(state, cfg.num_layers // pp, per_rank) if grouped_gemm else state
                # Megatron-LM's get_checkpoint_name: _PPP with pipeline stages, _EEE with expert parallelism
                name = f"mp_rank_{t:02d}" + (f"_{p:03d}" if pp > 1 else "") + (f"_{e:03d}" if ep > 1 else "")
                os.makedirs(os.path.join(work_dir, iter_name, name))
                torch.save({"args": argparse.Namespace(**args), "checkpoint_version": 3.0, "iteration": iteration,
                            "model": {k: torch.from_numpy(np.array(v)) for k, v in state.items()}},
                           os.path.join(work_dir, iter_name, name, RANK_FILE))
                del state
                bar.update()
        with open(os.path.join(work_dir, LATEST_FILE), "w", encoding="utf-8") as f:
            f.write(str(iteration) if iteration else "release")
        return {"format_version": FORMAT_VERSION, "direction": "to-megatron",
                "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                "source": {"path": ckpt_path, "model_section": section_path}, "checkpoint": iter_name,
                "tensor_model_parallel_size": tp, "pipeline_model_parallel_size": pp,
                **({"expert_model_parallel_size": ep} if cfg.moe else {}),
                "model": json_args(args), "tensors": [], "ignored": []}

    return write_conversion(out_dir, write_files, start=start)


def _megatron_args_for(cfg: ModelConfig, tp: int, pp: int, source: str, iteration: int = None, ep: int = 1,
                       grouped_gemm: bool = False) -> dict:
    """Megatron-LM arguments for cfg at TP x PP, starting from the original run's when it came from Megatron."""
    original = source_manifest(source).get("source", {})
    args = dict(original.get("megatron_args") or {})
    divisible = args.get("make_vocab_size_divisible_by", 128)
    groups = cfg.kv_heads
    args.update(num_layers=cfg.num_layers, hidden_size=cfg.hidden_size, num_attention_heads=cfg.num_heads,
                group_query_attention=groups != cfg.num_heads, num_query_groups=groups,
                kv_channels=cfg.head_size, qk_layernorm=cfg.qk_norm, ffn_hidden_size=cfg.intermediate_size,
                seq_length=cfg.seq_length, max_position_embeddings=max(cfg.seq_length,
                                                                       args.get("max_position_embeddings") or 0),
                position_embedding_type="rope", rotary_base=cfg.rope_theta, rotary_percent=1.0,
                rotary_interleaved=False, normalization="RMSNorm", norm_epsilon=cfg.rms_norm_eps, swiglu=True,
                add_bias_linear=False, add_qkv_bias=cfg.qkv_bias,
                untie_embeddings_and_output_weights=not cfg.tie_word_embeddings,
                vocab_size=cfg.vocab_size, make_vocab_size_divisible_by=divisible,
                padded_vocab_size=round_up(cfg.vocab_size, divisible * tp),
                tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                iteration=iteration if iteration is not None else original.get("iteration", 0),
                init_method_std=cfg.initializer_range, **moe_args_for(cfg, ep, tp, grouped_gemm)[0])
    return args


def moe_args_for(cfg: ModelConfig, ep: int = 1, tp: int = 1, grouped_gemm: bool = False) -> tuple:
    """(Megatron-LM's MoE arguments for cfg, what megatron-core cannot compute as the model does).

    moe_fields' inverse."""
    if not cfg.moe:
        return dict(num_experts=None), []
    problems = []
    sigmoid = cfg.router_score == "sigmoid"
    if sigmoid and cfg.norm_topk_prob != (cfg.num_experts_per_tok > 1):
        problems.append(f"model_config.norm_topk_prob: {cfg.norm_topk_prob!r} with sigmoid scores and "
                        f"{cfg.num_experts_per_tok} experts per token: megatron-core renormalises sigmoid weights "
                        "exactly when k > 1")
    if cfg.expert_bias and not sigmoid:
        problems.append("model_config.expert_bias: with softmax scores megatron-core routes without the bias")
    layers = [0 if n in cfg.dense_layers else 1 for n in range(cfg.num_layers)]
    return dict(num_experts=cfg.num_experts, moe_router_topk=cfg.num_experts_per_tok,
                moe_ffn_hidden_size=cfg.expert_size, moe_layer_freq=1 if all(layers) else layers,
                moe_shared_expert_intermediate_size=cfg.shared_expert_intermediate_size or None,
                moe_shared_expert_gate=cfg.shared_expert_gate, moe_router_score_function=cfg.router_score,
                moe_router_pre_softmax=not sigmoid and not cfg.norm_topk_prob,
                moe_router_enable_expert_bias=cfg.expert_bias, moe_router_bias_update_rate=cfg.expert_bias_update_rate,
                moe_router_topk_scaling_factor=None if cfg.routed_scaling_factor == 1.0 else cfg.routed_scaling_factor,
                moe_grouped_gemm=grouped_gemm,
                moe_router_load_balancing_type=BALANCING_TYPES[cfg.router_aux_loss_scope],
                moe_aux_loss_coeff=cfg.router_aux_loss_coef, moe_z_loss_coeff=cfg.router_z_loss_coef or None,
                moe_expert_capacity_factor=cfg.capacity_factor or None, moe_token_drop_policy=cfg.token_drop_policy,
                moe_pad_expert_input_to_capacity=False,
                expert_model_parallel_size=ep, expert_tensor_parallel_size=tp), problems
