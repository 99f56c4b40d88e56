"""Our checkpoints with their MoE layers as MindFormers 1.9's MoELayer holds them (models/expert_parallel.py, what a
MoE recipe runs on Ascend): `scripts/convert_checkpoint.py --expert-layout stacked` writes them (write.py), --verify,
--to-hf and --to-megatron read them back expert by expert (verify.py, ours.py OurCheckpoint), and the worker's load
check expects them for such a recipe (training/worker/train.py). One table, EXPERT_STACKS, and the functions that
apply it to tensors (stacked_tensor, unstacked_tensors, on dicts stack_moe_layers, unstack_moe_layers) and to
shapes (stacked_shapes, for plans and checks, tested against the arrays and MindFormers' real cells).
"""

import numpy as np

from ascend_llm_recipes.models.conversion.tables import one_expert, stack_experts, template_of
from ascend_llm_recipes.models.shapes import TENSORS, tensor_flags


# MindFormers 1.9's MoELayer holds a MoE layer in these tensors, as its converters write them from Hugging Face's
# (mindformers/checkpoint/converter/convert_op.py: ExpertsConvertOp 259-283, ConcatConvertOp 186-225, which
# tests/test_expert_parallel.py runs as the reference): {its tensor ({n} a layer): (how, our tensors it holds)}.
# "experts": as GroupedMLP holds weight2 (stack_experts, hidden axis last), expert e's weight (gate and up fused as
# [gate; up]) transposed to (in, out) in rows e*in..: weight1 (E*hidden, 2F) is GroupedMLP's weight1's memory shaped
# (E*hidden, 2F), weight2 (E*F, hidden) GroupedMLP's own. "interleave": the parts' rows alternating, as its
# SharedExpertMLPInterleaved reads gate and up (transformer/mlp.py:210-225; one tensor-parallel rank). "rename".
EXPERT_STACKS = {
    "model.layers.{n}.mlp.router.weight": ("rename", ("model.layers.{n}.mlp.gate.weight",)),
    "model.layers.{n}.mlp.experts.weight1": ("experts", ("model.layers.{n}.mlp.experts.{e}.gate_proj.weight",
                                                         "model.layers.{n}.mlp.experts.{e}.up_proj.weight")),
    "model.layers.{n}.mlp.experts.weight2": ("experts", ("model.layers.{n}.mlp.experts.{e}.down_proj.weight",)),
    "model.layers.{n}.mlp.shared_experts.linear_fc1.weight": (
        "interleave", ("model.layers.{n}.mlp.shared_expert.gate_proj.weight",
                       "model.layers.{n}.mlp.shared_expert.up_proj.weight")),
    "model.layers.{n}.mlp.shared_experts.linear_fc2.weight": (
        "rename", ("model.layers.{n}.mlp.shared_expert.down_proj.weight",)),
    "model.layers.{n}.mlp.shared_experts.shared_experts_gate.weight": (
        "rename", ("model.layers.{n}.mlp.shared_expert_gate.weight",)),
}
PER_EXPERT, STACKED = "per-expert", "stacked"  # our CPU model's (Hugging Face's names), MindFormers' MoELayer's


def stacked_names(cfg) -> dict:
    """{stacked tensor: [our tensors it holds, expert by expert]} of every MoE layer of cfg."""
    flag_of = {pattern: flag for pattern, _, flag in TENSORS}
    out = {}
    for n in range(cfg.num_layers):
        flags = tensor_flags(cfg, n)
        for stack, (how, parts) in EXPERT_STACKS.items():
            if flags[flag_of[parts[0]]]:  # the layer has them (a MoE layer; its shared expert, gate)
                out[stack.format(n=n)] = [part.format(n=n, e=e) for e in
                                          (range(cfg.num_experts) if how == "experts" else [None]) for part in parts]
    return out


def stacked_tensor(name: str, read, cfg) -> np.ndarray:
    """The stacked tensor `name` of one layer from our tensors, read(our name): that layer's experts in memory."""
    template, numbers = template_of(name)
    how, parts = EXPERT_STACKS[template]
    if how == "rename":
        return read(parts[0].format(**numbers))
    if how == "interleave":  # (rows, in) each -> (rows, parts, in) -> (parts x rows, in)
        pieces = [read(part.format(**numbers)) for part in parts]
        return np.stack(pieces, 1).reshape(-1, pieces[0].shape[1])
    return stack_experts([np.concatenate([read(part.format(e=e, **numbers)) for part in parts])
                          for e in range(cfg.num_experts)], hidden_axis=1)


def unstacked_tensors(name: str, tensor: np.ndarray, cfg) -> dict:
    """stacked_tensor backwards: {our name: a view of `tensor`}."""
    template, numbers = template_of(name)
    how, parts = EXPERT_STACKS[template]
    if how == "rename":
        return {parts[0].format(**numbers): tensor}
    if how == "interleave":
        rows = tensor.reshape(-1, len(parts), tensor.shape[1])
        return {part.format(**numbers): rows[:, i] for i, part in enumerate(parts)}
    return {part.format(e=e, **numbers): piece for e in range(cfg.num_experts)
            for part, piece in zip(parts, np.split(one_expert(tensor, cfg.num_experts, e, hidden_axis=1), len(parts)))}


def stack_moe_layers(tensors: dict, cfg) -> dict:
    """`tensors` (numpy, by our name) with every MoE layer in MindFormers' MoELayer's tensors (EXPERT_STACKS)."""
    out = dict(tensors)
    for name in stacked_names(cfg):
        out[name] = stacked_tensor(name, out.pop, cfg)
    return out


def unstack_moe_layers(tensors: dict, cfg) -> dict:
    """stack_moe_layers backwards."""
    out = dict(tensors)
    for name in stacked_names(cfg):
        out.update({part: np.ascontiguousarray(value)
                    for part, value in unstacked_tensors(name, out.pop(name), cfg).items()})
    return out


def stacked_shapes(shapes: dict, cfg) -> dict:
    """{name: shape} of our tensors (models/shapes.py parameter_shapes) in the stacked layout: each MoE layer's
    stacked tensors where their first part stood (stack_moe_layers's names and shapes, without data)."""
    owner = {part: stack for stack, parts in stacked_names(cfg).items() for part in parts}
    out = {}
    for name, shape in shapes.items():
        stack = owner.get(name)
        if stack is None or stack in out:
            out.update({} if stack else {name: tuple(shape)})
            continue
        how, parts = EXPERT_STACKS[template_of(stack)[0]]
        out[stack] = {"rename": tuple(shape), "interleave": (len(parts) * shape[0], shape[1]),
                      "experts": (cfg.num_experts * shape[1], len(parts) * shape[0])}[how]
    return out


def expert_layout(names, cfg) -> str:
    """The expert layout of a checkpoint holding tensors `names`: STACKED when any MoE layer is stacked."""
    return STACKED if cfg.moe and not set(stacked_names(cfg)).isdisjoint(names) else PER_EXPERT
