"""What a plan says: the table `--plan` prints, the verdict, and whether a recipe keeps its headroom.

`format_plan(plan(recipe))` is what `bash scripts/run_distributed.sh RECIPE --plan` prints: one line
per buffer (training/tools/planner.py Terms) with the source allocating it, the verdict, the step
time term by term and the checkpoint size. `has_headroom` and `lowest_fitting_optimizer_level` are
the rules the shipped Ascend recipes are held to.
"""

from typing import Optional

from ascend_llm_recipes.common.units import byte_size
from ascend_llm_recipes.training.tools.activations import ALLTOALL_FORMULA
from ascend_llm_recipes.training.tools.planner import SOURCES, Plan, plan

# Published Llama 2 7B pretraining speeds, seq 4096 on 8 x 910B, tokens/s per device: MindFormers' README
# (Llama 2 7B pretrain table) and MindSpeed-LLM's (Llama 2 7B, 69% MFU); the figures.
PUBLISHED_TOKENS_PER_S = {"MindFormers": 4160, "MindSpeed-LLM": 4672}
LLAMA2_7B_PARAMETERS = 6_738_415_616  # the model those figures are for (models/presets.py "llama2-7b")


OPTIMIZER_LEVELS = ("level1", "level2", "level3")
HEADROOM = 0.10  # share of the budget a shipped recipe leaves free: the plan is a model, not a measurement


def has_headroom(plan: "Plan", share: float = HEADROOM) -> bool:
    """Whether the plan fits with `share` of the budget to spare."""
    return bool(plan.fits) and plan.headroom_bytes >= share * plan.device_memory_bytes


def lowest_fitting_optimizer_level(recipe, device: str = None) -> Optional[str]:
    """The least-communicating optimizer-parallel level at which the recipe fits with HEADROOM, None if none does.

    level1 gathers the weights once per step, level2 also reduce-scatters gradients, level3
    re-gathers the fp32 weights for every micro-batch's backward; so the lowest level that fits wins.
    """
    from dataclasses import replace as copy_with
    config = recipe.parallel.parallel_optimizer_config
    for level in OPTIMIZER_LEVELS:
        trial = copy_with(recipe, parallel=copy_with(recipe.parallel, parallel_optimizer_config=copy_with(
            config, optimizer_level=level)))
        if has_headroom(plan(trial, device)):
            return level
    return None


def format_plan(plan: Plan) -> str:
    """A readable table: one line per component (its size in GiB, MiB when small), the verdict, the step time."""
    tp, pp = plan.tensor_parallel, plan.pipeline_stages
    budget = "unknown" if plan.device_memory_bytes is None else byte_size(plan.device_memory_bytes)
    stage_desc = (f"stage {plan.stage} of {pp} ({plan.stage_layers[plan.stage]} layers"
                  f"{', embedding' if plan.stage == 0 else ''}{', output projection' if plan.stage == pp - 1 else ''})"
                  if pp > 1 else f"all {plan.stage_layers[0]} layers")
    devices = f"{plan.world_size} device{'s' if plan.world_size > 1 else ''}"
    lines = [
        f"plan: {plan.parameters:,} parameters"
        f"{f' ({plan.active_parameters:,} active per token)' if plan.active_parameters != plan.parameters else ''}"
        f" on DP {plan.data_parallel} x TP {tp} x PP {pp} = {devices}",
        f"attention: {plan.attention}",
        f"sharding: {plan.sharding}",
        f"device: {plan.device} ({plan.device_source})",
        f"memory budget: {budget} ({plan.device_memory_note})",
        f"per device: {stage_desc}, {plan.stage_parameters:,} parameters; micro-batch {plan.micro_batch} x seq "
        f"{plan.seq_length}, {plan.compute_dtype} compute, {plan.in_flight} micro-batch"
        f"{'es' if plan.in_flight > 1 else ''} in flight",
        "",
        f"{'buffer (what allocates each: sources, below)':<72}{'size':>12}",
    ]

    def row(label, n, mark=""):
        lines.append(f"{label:<72}{byte_size(n):>12}{mark}")

    for term in plan.terms:
        row(term.label, term.bytes)
    for mode, label in (("none", "no recompute"), ("selective", "selective recompute (core attention)"),
                        ("full", "full recompute (layer inputs + one layer rebuilt)")):
        if mode != plan.recompute:
            lines.append(f"  (activations with {label}: {byte_size(getattr(plan, f'activation_bytes_{mode}'))})")
    lines.append("-" * 84)
    row("total", plan.total_bytes)
    if pp > 1:
        lines.append("  per stage: " + ", ".join(byte_size(t) for t in plan.stage_total_bytes))
    lines.extend(expert_lines(plan))
    lines.append("")
    lines.append(verdict(plan))
    lines.extend(f"but {refusal}" for refusal in plan.refusals)
    peak = "unknown" if plan.peak_flops is None else f"{plan.peak_flops / 1e12:.0f} TFLOP/s peak"
    dtype = "fp32" if plan.compute_dtype == "float32" else plan.compute_dtype
    step = (f"step time: not estimated (no {dtype} peak FLOP/s for {plan.device})" if plan.step_time_s is None else
            f"step time at {plan.mfu:.0%} MFU of {peak}: {plan.step_time_s:.2f} s "
            f"({plan.tokens_per_step / plan.step_time_s:,.0f} tokens/s)")
    lines.append(f"compute: {plan.flops_per_token / 1e9:,.3f} GFLOP/token x {plan.tokens_per_step:,} tokens/step; "
                 + step)
    if plan.speed is not None:
        lines.append("step time, term by term (one device):")
        for label, seconds in plan.speed.terms:
            lines.append(f"  {label:<70}{seconds:>9.3f} s")
        lines.append(f"  {'estimated step':<70}{plan.speed.step_time_s:>9.3f} s")
        lines.append(f"  => {plan.speed.tokens_per_s_per_device:,.0f} tokens/s/device")
        if plan.parameters == LLAMA2_7B_PARAMETERS and plan.device.startswith("Ascend910B"):
            # The published figures are for this model on 910B only: other models and devices are not compared.
            published = ", ".join(f"{name} {value:,}" for name, value in PUBLISHED_TOKENS_PER_S.items())
            ratio = plan.speed.tokens_per_s_per_device / PUBLISHED_TOKENS_PER_S["MindSpeed-LLM"]
            lines[-1] += f"; published for Llama 2 7B, seq 4096, 8 x 910B: {published} ({ratio:.0%} of MindSpeed-LLM's)"
        lines.extend(f"  {n}" for n in plan.speed.notes)
    lines.append(f"checkpoint per save: {byte_size(plan.checkpoint_rank_bytes)} per rank, "
                 f"{byte_size(plan.checkpoint_total_bytes)} in all (weights, masters, moments, step; not accu_grads)")
    lines.append("sources:")
    for category in dict.fromkeys(t.category for t in plan.terms):
        lines.append(f"  [{category}] {SOURCES[category]}")
    lines.extend(f"note: {n}" for n in plan.notes)
    return "\n".join(lines)


def expert_lines(plan: Plan) -> list:
    """Expert parallel's figures: the AllToAll per step and the memory of the routed experts at each EP degree."""
    if not plan.expert_memory:
        return []
    layers = f"{plan.moe_layers} MoE layer{'s' if plan.moe_layers != 1 else ''}"
    lines = [f"expert parallel {plan.expert_parallel}: {byte_size(plan.alltoall_bytes)} sent per step per device "
             f"through AllToAll ({layers} on it)", f"  = {ALLTOALL_FORMULA}",
             "routed experts per device (weights and their states) by parallel_config.expert_parallel:"]
    for ep, experts, total in plan.expert_memory:
        mark = "  <- this recipe" if ep == plan.expert_parallel else ""
        lines.append(f"  EP {ep:<4} experts {byte_size(experts):>12}, total {byte_size(total):>12}{mark}")
    return lines


def verdict(plan: Plan) -> str:
    if plan.fits is None:
        return f"fits: unknown (needs {byte_size(plan.total_bytes)}; the device memory is unknown)"
    need, have = byte_size(plan.total_bytes), byte_size(plan.device_memory_bytes)
    if plan.fits:
        headroom = plan.headroom_bytes / plan.device_memory_bytes
        return f"fits: {need} of {have} ({headroom:.0%} headroom)"
    levers = ("levers in order: " + ", ".join(plan.levers) if plan.levers
              else "every lever is in use: add devices (or offload, the last resort)")
    return (f"WILL NOT FIT: needs {need}, device has {have} (short by {byte_size(-plan.headroom_bytes)}); "
            f"{levers}")
