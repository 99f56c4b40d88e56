"""Per-device memory and step time of a recipe, computed before any device is booked.

`plan(recipe)` lists every buffer one device of the heaviest pipeline stage holds while training,
as Terms that each name the MindSpore/MindFormers line allocating it (SOURCES): the weights in their
dtype (models/shapes.py parameter_dtype), sliced under optimizer parallel, their gathered copies,
the float32 masters of 16-bit weights, MindFormers' accu_grads (per optimizer level), the AdamW
moments, the gradients, loss-scale and step state, the activations of the micro-batches in flight
and the logits of the last stage; it compares the total with the device's memory. The parameter
terms are read from the same table models/llama.py builds its Parameters from, and a CPU test checks
them against the real train-step cell. It also estimates the step time term by term and the
checkpoint size. In a Mixture-of-Experts model the routed experts are split over expert parallel, the bytes
AllToAll sends per step are counted (training/tools/activations.py alltoall_bytes) and the experts' memory is
tabled for each expert-parallel degree the layout allows (expert_memory). The devices and their figures are
training/tools/devices.py's (GB = 2**30 bytes, printed as GiB by common/units.py byte_size);
training/tools/plan_report.py `format_plan` prints a plan for `bash scripts/run_distributed.sh RECIPE --plan`.
Import-light: no MindSpore.

Counted as a bound: tensors of operators without a shard strategy are whole on every TP
rank, the layer being computed or recomputed adds its own activations, and the last stage
holds the full-vocabulary fp32 logits of the loss. Not counted (each small next to the rows
counted, or dependent on the compiler): the runtime's and HCCL's reserved memory (recipes cap
the budget with `context.max_device_memory`), communication buffers, kernel workspaces,
fragmentation, the 16-bit weight copies that each Linear casts per use of a float32 weight, and the
update step's own peak (scaled and clipped gradient copies while the activations are freed).
"""

import math
import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Optional

from ascend_llm_recipes.common.errors import PretrainError
from ascend_llm_recipes.common.units import byte_size
from ascend_llm_recipes.models.arithmetic import active_param_count, flops_per_token, param_count
from ascend_llm_recipes.models.parallel import RECOMPUTE_MODES, balanced_stages, expert_problems
from ascend_llm_recipes.models.shapes import parameter_dtype, parameter_shapes
from ascend_llm_recipes.training.recipe.mindformers import vocab_emb_dp
from ascend_llm_recipes.training.recipe.mindformers_mcore_export import moe_layer_refusals
from ascend_llm_recipes.training.tools.activations import (DTYPE_BYTES, layer_activation_bytes, logits_bytes,
                                                           moe_layer_count, recompute_working_bytes,
                                                           step_alltoall_bytes)
from ascend_llm_recipes.training.tools.devices import (DEFAULT_DEVICE, DEVICES, GB, HBM_BYTES_PER_S, DeviceSpec,
                                                       link_bytes_per_s, spans_nodes)
from ascend_llm_recipes.training.tools.levers import unused_levers, what_if

MINDSPORE_OPTIMIZER_PARALLEL = "https://www.mindspore.cn/docs/en/r2.9.0/features/parallel/optimizer_parallel.html"


@dataclass
class StageMemory:
    """What one device of a pipeline stage holds: its Terms for each recompute mode."""

    stage: int
    layers: int
    parameters: int
    in_flight: int
    terms: dict  # recompute mode -> [Term]
    first_layer: int = 0
    tensors: list = field(default_factory=list)  # stage_tensors

    def total(self, recompute: str) -> int:
        return sum(t.bytes for t in self.terms[recompute])

    def bytes_of(self, category: str, recompute: str = "none") -> int:
        return sum(t.bytes for t in self.terms[recompute] if t.category == category)


@dataclass
class Plan:
    """Per-device memory of the heaviest pipeline stage, and the step time; bytes unless named."""

    device: str
    device_source: str                  # where the device's figures come from, with their caveats
    device_memory_bytes: Optional[int]  # the budget compared against (capped by context.max_device_memory)
    device_memory_note: str
    peak_flops: Optional[float]         # for the recipe's compute dtype
    mfu: float
    compute_dtype: str
    data_parallel: int
    tensor_parallel: int
    pipeline_stages: int
    world_size: int
    micro_batch: int
    seq_length: int
    parameters: int                     # whole model, vocabulary padded for TP
    active_parameters: int              # those one token passes through (MoE: top-k experts); = parameters if dense
    stage: int                          # the reported (heaviest) stage
    stage_layers: list
    stage_parameters: int               # parameters one device of that stage holds
    in_flight: int                      # micro-batches whose activations that stage holds
    recompute: str                      # none | selective | full, from recompute_config
    optimizer_sharded: bool
    terms: list                         # [Term] of the reported stage, as configured
    activation_bytes_none: int
    activation_bytes_selective: int
    activation_bytes_full: int
    total_bytes: int
    stage_total_bytes: list             # every stage's total, configured as the recipe says
    fits: Optional[bool]                # None when the device memory is unknown
    headroom_bytes: Optional[int]       # budget - total; negative when short
    flops_per_token: int
    tokens_per_step: int
    step_time_s: Optional[float]        # None when the peak is unknown
    checkpoint_rank_bytes: int = 0      # the largest rank's file per save
    checkpoint_total_bytes: int = 0     # all ranks' files per save
    speed: Optional["SpeedEstimate"] = None
    levers: list = field(default_factory=list)  # unused memory levers, in the order to try them
    notes: list = field(default_factory=list)
    refusals: list = field(default_factory=list)  # what the launch refuses although the plan fits (MoE on Ascend)
    attention: str = ""                 # which attention kernel the recipe runs
    sharding: str = ""                  # which operators tensor parallelism splits
    expert_parallel: int = 1
    moe_layers: int = 0                 # MoE layers of the reported stage
    alltoall_bytes: int = 0             # what one device sends per step through expert parallel's AllToAll
    expert_memory: list = field(default_factory=list)  # [(EP, routed experts' bytes, total bytes)] per device

    def bytes_of(self, category: str) -> int:
        """Bytes of one category of Term (weights, accu_grads, moments, ...) on the reported stage."""
        return sum(t.bytes for t in self.terms if t.category == category)


def stage_parameters(cfg, stage: int, layers: int, pipeline_stages: int, tensor_parallel: int = 1,
                     vocab_emb_dp: bool = True, expert_parallel: int = 1, first_layer: int = 0) -> int:
    """Parameters one device of pipeline stage `stage` holds: its `layers` layers from `first_layer` on.

    Layer matmul weights are split by TP (Megatron column/row split, models/parallel.py);
    norms are replicated. The embedding table sits on the first stage, replicated across TP when
    vocab_emb_dp (the recipe's default), else split by vocabulary; the last stage holds the final
    norm and the output projection (split by vocabulary). Tied embeddings with pipelining are
    refused (models/parallel.py layout_problems). Routed experts are split over expert parallel instead.
    """
    return sum(n for _, n, _ in stage_tensors(cfg, stage, layers, pipeline_stages, tensor_parallel, vocab_emb_dp,
                                              expert_parallel, first_layer))


def is_expert(name: str) -> bool:
    """Whether parameter `name` is a routed expert's (split over expert parallel, models/shapes.py names)."""
    return ".mlp.experts." in name


def stage_tensors(cfg, stage: int, layers: int, pipeline_stages: int, tensor_parallel: int = 1,
                  vocab_emb_dp: bool = True, expert_parallel: int = 1, first_layer: int = 0) -> list:
    """[(name, elements on one device, dtype)] of the weights one device of `stage` (layers first_layer ..
    first_layer + layers - 1) holds.

    Read from models/shapes.py's table (names, shapes, parameter_dtype), the one models/llama.py
    builds its Parameters from. What TP splits: every 2-D layer weight and q/k/v bias (heads or
    MLP width), the output projection and, unless vocab_emb_dp, the embedding (vocabulary). The routed
    experts are split over expert parallel, not TP (MindFormers' FFNGroupedGEMM.shard lays its stacked expert
    weights out as ("ep", None): transformer/moe/ffn.py:185-219).
    """
    t = tensor_parallel
    last = pipeline_stages - 1
    out = []
    for name, shape in parameter_shapes(cfg, t, layers=range(first_layer, first_layer + layers)).items():
        if name.startswith("model.embed_tokens") and stage != 0:
            continue
        if name.startswith(("model.norm", "lm_head")) and stage != last:
            continue
        n = math.prod(shape)
        if is_expert(name):
            out.append((name, n // expert_parallel, parameter_dtype(cfg, name)))
            continue
        split = (".layers." in name and (len(shape) == 2 or name.endswith("_proj.bias"))) or \
            name.startswith("lm_head") or (name.startswith("model.embed_tokens") and not vocab_emb_dp)
        out.append((name, n // t if split else n, parameter_dtype(cfg, name)))
    return out


@dataclass
class Term:
    """One buffer one device holds: its bytes, what it is, and the source line that allocates it."""

    category: str   # weights | gathered_weights | master | accu_grads | moments | gradients | loss_scale |
    #                 optimizer_step | activations | logits
    label: str
    bytes: int
    source: str
    persistent: bool = True  # a Parameter (in the checkpoint unless NOT_SAVED) or a tensor of one step


# What allocates each buffer (MindSpore 2.9.0 / MindFormers 1.9.0 wheels; our files under the package root).
SOURCES = {
    "weights": "models/llama.py Linear/Embedding/RMSNorm (dtype: models/shapes.py parameter_dtype); optimizer "
               "parallel keeps a 1/DP slice of each parameter >= parallel_optimizer_threshold "
               "(mindspore/parallel/_auto_parallel_context.py:1022-1025)",
    "gathered_weights": "optimizer parallel all-gathers each sliced weight before use; level1/level2 keep the "
                        "gathered copy from forward to backward, level3 (zero3, _auto_parallel_context.py:1082-1083) "
                        f"re-gathers it ({MINDSPORE_OPTIMIZER_PARALLEL})",
    "master": "training/worker/optim.py FoldedAdamW._master_of: float32 master.* of each 16-bit weight, sliced like it",
    "accu_grads": "mindformers/wrapper/wrapper.py:849 accu_grads = weights.clone(init='zeros'), in the weights' "
                  "dtype, built by MFPipelineWithLossScaleCell (accumulation > 1 or pipeline stages, "
                  "training/worker/train_step.py train_step_wrapper); sliced over DP only with "
                  "gradient_accumulation_shard, which optimizer level2 turns on and level1 (default False) and level3 "
                  "leave off (mindspore/parallel/_auto_parallel_context.py:1078-1084)",
    "moments": "mindformers/core/optim/adamw.py:167-168, 179-181 adam_m/adam_v in float32 whatever the weight dtype, "
               "sliced like the weight under optimizer parallel (param_info cloned, adamw.py:183)",
    "gradients": "the backward's gradient of every weight (weights' dtype), alive together for the global-norm clip "
                 "(mindformers/wrapper/wrapper.py:336-338); reduce-scattered to 1/DP at level2/level3",
    "loss_scale": "mindspore/nn/wrap/loss_scale.py:400-404 scale_sense (float32); DynamicLossScaleUpdateCell "
                  "loss_scale.py:153-154 (two int32 counters)",
    "optimizer_step": "mindspore/nn/optim/optimizer.py global_step (int32); the learning rate is the recipe's "
                      "lr_schedule, a Cell without Parameters (also the wrapper's deepcopy of it, "
                      "mindformers/wrapper/wrapper.py:253, 883); training/worker/optim.py master_filled (float32) with "
                      "16-bit weights",
    "activations": "training/tools/activations.py activation_terms (models/llama.py's tensors kept for backward)",
    "logits": "training/tools/activations.py logits_bytes (the last stage's output projection and fp32 loss tensors)",
}


def parameter_terms(recipe, tensors: list, layers: int) -> list:
    """The Terms of the parameters `tensors` (stage_tensors' rows) on one device: the weights, their gathered
    copies, the float32 masters of 16-bit ones, accu_grads or the gradients, the AdamW moments.

    Optimizer parallel slices a parameter over the devices holding the same copy of it (MindSpore's optimizer
    shard group): the data-parallel ones for every weight but the routed experts, which expert parallel has
    split already, leaving DP x TP / EP devices with each slice (models/parallel.py expert_problems).
    """
    p = recipe.parallel_config
    dp, tp, ep = p.data_parallel, p.model_parallel, p.expert_parallel
    shard = optimizer_sharded(recipe)
    level = recipe.parallel.parallel_optimizer_config.optimizer_level if shard else None
    threshold = recipe.parallel.parallel_optimizer_config.parallel_optimizer_threshold * 1024
    rows = tensors
    # MindSpore weighs the threshold on the whole parameter, not on what TP leaves of it (opt_param_mgr.cc SplitParam;
    # the strategy files of a DryRun compile show it: tests/test_dryrun_readback.py)
    whole_shapes = parameter_shapes(recipe.model.model_config, tp)
    big = {name for name, _, d in rows if math.prod(whole_shapes[name]) * DTYPE_BYTES[d] >= threshold}
    # (routed expert?, elements, dtype, above the threshold?) -> how many such tensors: the bytes depend on nothing else
    tensors = Counter((is_expert(name), n, d, name in big) for name, n, d in rows)

    def local(expert: bool, n: int, dtype: str, above: bool, sliced: bool = True) -> int:
        """Bytes of a parameter (or a clone of it) this rank stores: a slice when optimizer parallel slices it."""
        size, copies = n * DTYPE_BYTES[dtype], dp * tp // ep if expert else dp
        return _ceil_div(size, copies) if sliced and shard and copies > 1 and above else size

    def total(bytes_of) -> int:
        return sum(count * bytes_of(*key) for key, count in tensors.items())

    whole = total(lambda _, n, d, __: n * DTYPE_BYTES[d])
    weights = total(local)
    sliced_whole = total(lambda x, n, d, a: n * DTYPE_BYTES[d] if local(x, n, d, a) < n * DTYPE_BYTES[d] else 0)
    experts = f", experts 1/EP {ep}" if ep > 1 and any(key[0] for key in tensors) else ""
    terms = [Term("weights", f"weights ({_dtypes(rows)}{', split by TP' if tp > 1 else ''}{experts}"
                             f"{f', 1/DP {dp} slices' if shard else ''})", weights, SOURCES["weights"])]
    if shard:
        if level == "level3":
            unit, gathered = largest_gather(rows, lambda name, n, d: local(is_expert(name), n, d, name in big))
            terms.append(Term("gathered_weights", f"gathered weights (level3: the largest gathered at once, {unit})",
                              gathered, SOURCES["gathered_weights"], persistent=False))
        else:
            terms.append(Term("gathered_weights", f"gathered weights ({level}: alive from forward to backward)",
                              sliced_whole, SOURCES["gathered_weights"], persistent=False))
    if any(d != "float32" for _, _, d in rows):
        terms.append(Term("master", "float32 master copies of the 16-bit weights (in the optimizer)",
                          total(lambda x, n, d, a: local(x, n, "float32", a) if d != "float32" else 0),
                          SOURCES["master"]))
    if uses_accu_grads(recipe):
        accu_shard = shard and level == "level2"
        accu = total(local) if accu_shard else whole
        how = "sliced over DP: level2" if accu_shard else "whole: no gradient_accumulation_shard"
        terms.append(Term("accu_grads", f"accu_grads ({_dtypes(rows)}, {how})", accu, SOURCES["accu_grads"]))
    terms.append(Term("moments", "AdamW m, v (float32" + (f", 1/DP {dp} slices)" if shard else ")"),
                      total(lambda x, n, _, a: 2 * local(x, n, "float32", a)), SOURCES["moments"]))
    if not uses_accu_grads(recipe):
        scattered = level in ("level2", "level3")
        terms.append(Term("gradients", f"gradients ({_dtypes(rows)})",
                          total(lambda x, n, d, a: local(x, n, d, a, scattered)), SOURCES["gradients"],
                          persistent=False))
    return terms


def largest_gather(tensors: list, local) -> tuple:
    """(what, bytes) of the most level-3 optimizer parallel holds gathered at once: the sliced weights of one decoder
    layer, or one weight outside the layers (the embedding, lm_head), whichever is larger: level3 (zero3,
    _auto_parallel_context.py:1082-1083) re-gathers each weight at its use, and an average over the layers would
    spread lm_head (DeepSeek-V3's: 1.85 GiB in bf16) thin."""
    units = Counter()
    for name, n, d in tensors:
        if local(name, n, d) < n * DTYPE_BYTES[d]:  # sliced, so gathered
            layer = re.match(r"model\.layers\.(\d+)\.", name)
            units[f"layer {layer.group(1)}" if layer else name] += n * DTYPE_BYTES[d]
    return units.most_common(1)[0] if units else ("nothing sliced", 0)


def stage_terms(recipe, stage: int, layers: int, recompute: str, in_flight: int, first_layer: int = 0,
                tensors: list = None) -> list:
    """Every buffer one device of pipeline stage `stage` (layers first_layer ..) holds at its peak, as Terms."""
    cfg = recipe.model.model_config
    p = recipe.parallel_config
    tp, pp = p.model_parallel, p.pipeline_stage
    if tensors is None:
        tensors = stage_tensors(cfg, stage, layers, pp, tp, vocab_emb_dp(recipe), p.expert_parallel, first_layer)
    terms = parameter_terms(recipe, tensors, layers)
    dynamic = not isinstance(recipe.runner_wrapper.scale_sense, (int, float))  # DynamicLossScaleConfig
    terms.append(Term("loss_scale", "loss scale" + (" and its update counters" if dynamic else ""),
                      4 + (8 if dynamic else 0), SOURCES["loss_scale"]))
    masters = any(d != "float32" for _, _, d in tensors)
    terms.append(Term("optimizer_step", "optimizer step", 4 + (4 if masters else 0),
                      SOURCES["optimizer_step"]))
    b = recipe.runner_config.batch_size
    moe = [cfg.is_moe_layer(i) for i in range(first_layer, first_layer + layers)]
    ep = p.expert_parallel
    activation = sum(moe.count(kind) * layer_activation_bytes(cfg, b, tp, recompute, kind, ep) * in_flight
                     for kind in set(moe))
    activation += max((recompute_working_bytes(cfg, b, tp, recompute, kind, ep) for kind in set(moe)), default=0)
    how = "no" if recompute == "none" else recompute
    terms.append(Term("activations", f"activations ({how} recompute, {in_flight} micro-batch"
                                     f"{'es' if in_flight > 1 else ''} in flight"
                                     f"{f', {sum(moe)} of them MoE' if any(moe) else ''})", activation,
                      SOURCES["activations"], persistent=False))
    if stage == pp - 1:
        terms.append(Term("logits", "logits and loss (vocabulary split by TP, fp32)", logits_bytes(cfg, b, tp),
                          SOURCES["logits"], persistent=False))
    return terms


def _dtypes(tensors) -> str:
    names = sorted({d for _, _, d in tensors}, key=lambda d: -DTYPE_BYTES[d])
    return " + ".join({"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}[d] for d in names)


def uses_accu_grads(recipe) -> bool:
    """Whether MindFormers builds MFPipelineWithLossScaleCell, the wrapper that allocates accu_grads."""
    summed = recipe.parallel_config.pipeline_stage > 1 or recipe.runner_config.gradient_accumulation_steps > 1
    return recipe.parallel.parallel_mode in (1, 2) and summed


def stage_memory(recipe) -> list:
    """A StageMemory per pipeline stage of the recipe: its terms for each recompute mode."""
    cfg = recipe.model.model_config
    p = recipe.parallel_config
    pp = p.pipeline_stage
    counts = stage_layer_counts(recipe)
    stages = []
    for stage, layers in enumerate(counts):
        # 1F1B: stage i holds the activations of pp - i micro-batches at its peak.
        in_flight = min(pp - stage, p.micro_batch_num) if pp > 1 else 1
        first = sum(counts[:stage])
        tensors = stage_tensors(cfg, stage, layers, pp, p.model_parallel, vocab_emb_dp(recipe), p.expert_parallel,
                                first)
        stages.append(StageMemory(
            stage=stage, layers=layers, parameters=sum(n for _, n, _ in tensors), in_flight=in_flight,
            terms={mode: stage_terms(recipe, stage, layers, mode, in_flight, first, tensors)
                   for mode in RECOMPUTE_MODES},
            first_layer=first, tensors=tensors))
    return stages


def stage_layer_counts(recipe) -> list:
    """Layers of each pipeline stage: parallel_config.stage_layers, else balanced."""
    p = recipe.parallel_config
    return list(p.stage_layers) if p.stage_layers else balanced_stages(recipe.model.model_config.num_layers,
                                                                       p.pipeline_stage)


def checkpoint_bytes(recipe, stages: list = None) -> tuple:
    """(bytes the largest rank saves, bytes all ranks save) per checkpoint: the persistent terms but accu_grads.

    training/checkpoint.py NOT_SAVED leaves accu_grads out (zeros at every save); each rank saves
    its own slices, so the total is every stage's rank bytes x DP x TP.
    """
    p = recipe.parallel_config
    per_stage = [sum(t.bytes for t in s.terms["none"] if t.persistent and t.category != "accu_grads")
                 for s in stages or stage_memory(recipe)]
    return max(per_stage), sum(per_stage) * p.data_parallel * p.model_parallel


def _ceil_div(n: int, d: int) -> int:
    return -(-n // d)


def optimizer_sharded(recipe) -> bool:
    """MindSpore >= 2.4 shards optimizer states over DP only in semi-auto/auto parallel."""
    return (recipe.parallel.enable_parallel_optimizer and recipe.parallel.parallel_mode in (1, 2)
            and recipe.parallel_config.data_parallel > 1)


def resolve_device(recipe, device: str = None) -> DeviceSpec:
    """`device`, else the recipe's hardware.device, else the default for context.device_target."""
    target = recipe.context.device_target
    if device is None:
        device = getattr(getattr(recipe, "hardware", None), "device", None)
        if device is None or (device == "CPU" and target != "CPU"):
            device = DEFAULT_DEVICE.get(target)
    by_name = {name.lower(): spec for name, spec in DEVICES.items()}
    if device is None or device.lower() not in by_name:
        raise PretrainError(f"planner: unknown device {device!r} (context.device_target {target})",
                            hint=f"pass one of: {', '.join(DEVICES)}")
    return by_name[device.lower()]


def _parse_gb(text: str) -> Optional[int]:
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*GB\s*", text or "")
    return int(float(match.group(1)) * GB) if match else None


def plan(recipe, device: str = None, mfu: float = 0.4) -> Plan:
    """Per-device memory (heaviest pipeline stage) and step time of `recipe` on `device`.

    device: a name of DEVICES; default the recipe's hardware.device (else Ascend910B2 for
    Ascend, CPU for CPU). mfu: model FLOPs utilisation assumed for the step time.
    """
    if not 0 < mfu <= 1:
        raise PretrainError(f"planner: mfu must be in (0, 1], got {mfu}")
    spec = resolve_device(recipe, device)
    cfg = recipe.model.model_config
    p = recipe.parallel_config
    mode, shard = recipe.recompute_config.mode, optimizer_sharded(recipe)
    notes = []

    stages = stage_memory(recipe)
    totals = [s.total(mode) for s in stages]
    worst = stages[totals.index(max(totals))]
    total = max(totals)

    budget, budget_note = spec.memory_bytes, "the whole device"
    cap = _parse_gb(recipe.context.max_device_memory) if spec.name != "CPU" else None
    if recipe.context.max_device_memory and spec.name != "CPU" and cap is None:
        notes.append(f"context.max_device_memory {recipe.context.max_device_memory!r} not understood "
                     "(expected e.g. '58GB'); planned against the whole device")
    if cap is not None and (budget is None or cap < budget):
        budget, budget_note = cap, (f"context.max_device_memory {recipe.context.max_device_memory} of "
                                    f"{byte_size(spec.memory_bytes)}")

    bf16_missing = cfg.compute_dtype == "bfloat16" and not spec.bf16
    peak = spec.peak_flops_fp32 if cfg.compute_dtype == "float32" else spec.peak_flops_16bit
    if bf16_missing:
        peak = None
        notes.append(f"{spec.name} has no bfloat16 support; use float16 with loss scaling")
    if recipe.parallel.enable_parallel_optimizer and recipe.parallel.parallel_mode not in (1, 2):
        notes.append("parallel.enable_parallel_optimizer: MindSpore shards optimizer states only in semi-auto/auto "
                     f"parallel (parallel_mode 1 or 2), so it is not counted ({MINDSPORE_OPTIMIZER_PARALLEL})")
    if cfg.param_dtype != "float32" and recipe.optimizer.type != "FoldedAdamW":
        notes.append(f"model.model_config.param_dtype {cfg.param_dtype} with optimizer.type {recipe.optimizer.type}: "
                     "no float32 master copy (MindFormers' AdamW updates 16-bit weights in place)")
    if cfg.param_dtype != "float32" and uses_accu_grads(recipe):
        notes.append(f"model.model_config.param_dtype {cfg.param_dtype} with accumulation: accu_grads clones the "
                     f"weights in their dtype (mindformers/wrapper/wrapper.py:849), so the micro-batches' gradients "
                     f"are summed in {cfg.param_dtype}; MindFormers' own "
                     "configs/qwen3_moe/pretrain_qwen3_30b_a3b_4k.yaml:170 keeps params_dtype float32")
    fpt = flops_per_token(cfg)
    tokens = recipe.tokens_per_step
    checkpoint = checkpoint_bytes(recipe, stages)
    step_time = tokens * fpt / (recipe.world_size * peak * mfu) if peak else None

    return Plan(
        device=spec.name, device_source=spec.source, device_memory_bytes=budget, device_memory_note=budget_note,
        peak_flops=peak, mfu=mfu,
        compute_dtype=cfg.compute_dtype, data_parallel=p.data_parallel, tensor_parallel=p.model_parallel,
        pipeline_stages=p.pipeline_stage, world_size=recipe.world_size, micro_batch=recipe.runner_config.batch_size,
        seq_length=cfg.seq_length, parameters=param_count(cfg, p.model_parallel),
        active_parameters=active_param_count(cfg, p.model_parallel),
        stage=worst.stage, stage_layers=[s.layers for s in stages], stage_parameters=worst.parameters,
        in_flight=worst.in_flight, recompute=mode, optimizer_sharded=shard,
        terms=worst.terms[mode],
        activation_bytes_none=worst.bytes_of("activations", "none"),
        activation_bytes_selective=worst.bytes_of("activations", "selective"),
        activation_bytes_full=worst.bytes_of("activations", "full"),
        total_bytes=total, stage_total_bytes=totals,
        fits=None if budget is None else total <= budget,
        headroom_bytes=None if budget is None else budget - total,
        flops_per_token=fpt, tokens_per_step=tokens, step_time_s=step_time,
        checkpoint_rank_bytes=checkpoint[0], checkpoint_total_bytes=checkpoint[1],
        speed=speed_estimate(recipe, spec, mfu, stages) if peak else None,
        levers=unused_levers(recipe, mode, shard, total), notes=notes, refusals=moe_layer_refusals(recipe),
        attention=("FlashAttention (FlashAttentionScore; no S x S scores kept)" if cfg.use_flash_attention
                   else "math path (fp32 S x S scores per layer)"),
        sharding=(f"every operator split by DP {p.data_parallel}; TP {p.model_parallel} splits heads from q/k/v to "
                  "the attention output, the MLP width and the vocabulary through the loss; norms and residual "
                  "adds stay whole on each TP rank (no sequence parallelism" +
                  ("; the MoE layers split the sequence over TP)" if cfg.moe else ")") if p.model_parallel > 1
                  else f"every operator split by DP {p.data_parallel}; no tensor parallelism")
        + (f"; the routed experts split over EP {p.expert_parallel} (AllToAll dispatch)" if p.expert_parallel > 1
           else ""),
        expert_parallel=p.expert_parallel, moe_layers=moe_layer_count(cfg, worst.first_layer, worst.layers),
        alltoall_bytes=step_alltoall_bytes(recipe, worst.first_layer, worst.layers),
        expert_memory=expert_memory(recipe, stages))


def expert_parallel_degrees(recipe) -> list:
    """The powers of two models/parallel.py expert_problems allows as expert_parallel (dividing num_experts and
    DP x TP), and the recipe's own."""
    cfg, p = recipe.model.model_config, recipe.parallel_config
    dp, tp = p.data_parallel, p.model_parallel
    return sorted({2 ** i for i in range((dp * tp).bit_length()) if not expert_problems(cfg, dp, tp, 2 ** i)}
                  | {p.expert_parallel})


def expert_memory(recipe, stages: list = None) -> list:
    """[(EP, bytes of the routed experts' parameters and their states, total bytes)] on one device of the heaviest
    stage, for every power of two the layout rules allow as expert_parallel (dividing num_experts and DP x TP) and
    the recipe's own: expert parallel's lever on memory."""
    cfg, p = recipe.model.model_config, recipe.parallel_config
    if not cfg.moe:
        return []
    stages = stages or stage_memory(recipe)
    rows, mode = [], recipe.recompute_config.mode
    for ep in expert_parallel_degrees(recipe):
        trial = what_if(recipe, expert_parallel=ep)
        worst = None
        for s in stages:
            # the stage's tensors at this degree: an expert's elements x the recipe's EP / this one
            tensors = [(name, n * p.expert_parallel // ep if is_expert(name) else n, d) for name, n, d in s.tensors]
            total = sum(t.bytes for t in stage_terms(trial, s.stage, s.layers, mode, s.in_flight, s.first_layer,
                                                     tensors))
            if worst is None or total > worst[1]:
                worst = (tensors, total, s.layers)
        tensors, total, layers = worst
        experts = sum(t.bytes for t in parameter_terms(trial, [t for t in tensors if is_expert(t[0])], layers))
        rows.append((ep, experts, total))
    return rows


@dataclass
class SpeedEstimate:
    """Seconds per step, term by term, for one device of the heaviest stage; assumptions stated in `notes`."""

    terms: list            # [(label, seconds)]
    step_time_s: float
    tokens_per_s_per_device: float
    notes: list = field(default_factory=list)


def speed_estimate(recipe, spec: DeviceSpec, mfu: float, stages: list = None) -> Optional[SpeedEstimate]:
    """Step time as the sum of its terms (the issue's "Speed" list), without overlap between them."""
    cfg = recipe.model.model_config
    p = recipe.parallel_config
    peak = spec.peak_flops_fp32 if cfg.compute_dtype == "float32" else spec.peak_flops_16bit
    if not peak:
        return None
    dp, tp, pp = p.data_parallel, p.model_parallel, p.pipeline_stage
    micro_batches = recipe.tokens_per_step // (dp * recipe.runner_config.batch_size * cfg.seq_length)
    tokens_device = recipe.tokens_per_step / recipe.world_size
    compute = tokens_device * flops_per_token(cfg) / (peak * mfu)
    terms = [(f"matmuls and attention at {mfu:.0%} MFU", compute)]
    mode = recipe.recompute_config.mode
    if mode == "full":
        terms.append(("full recompute: one more forward (1/3 of the compute)", compute / 3))
    if pp > 1:
        terms.append((f"pipeline bubble: (PP - 1) / micro-batches = {pp - 1}/{micro_batches}",
                      compute * (pp - 1) / micro_batches))
    stage = max(stages or stage_memory(recipe), key=lambda s: s.total(mode))
    dp_link, tp_link = link_bytes_per_s(recipe, spec, dp, tp), link_bytes_per_s(recipe, spec, tp)
    whole = sum(n * DTYPE_BYTES[d] for _, n, d in stage.tensors)
    elements = stage.parameters
    if cfg.param_dtype == "float32" and cfg.compute_dtype != "float32":
        # every Linear casts its float32 weight per use: read 4 B, write 2 B, per micro-batch (and in backward)
        terms.append(("fp32 weights cast to 16-bit per micro-batch", 2 * micro_batches * 6 * elements
                      / HBM_BYTES_PER_S))
    if optimizer_sharded(recipe):
        level = recipe.parallel.parallel_optimizer_config.optimizer_level
        gathers = 2 if level == "level3" else 1
        share = (dp - 1) / dp
        terms.append((f"optimizer parallel {level}: all-gather weights {gathers}x per micro-batch",
                      gathers * micro_batches * share * whole / dp_link))
        if level in ("level2", "level3"):
            terms.append((f"optimizer parallel {level}: reduce-scatter gradients per micro-batch",
                          micro_batches * share * whole / dp_link))
        else:
            terms.append(("gradients reduced across DP once per step", share * whole / dp_link))
    elif dp > 1:
        terms.append(("gradient all-reduce across DP once per step", 2 * (dp - 1) / dp * whole / dp_link))
    if tp > 1:
        e = DTYPE_BYTES[cfg.compute_dtype]
        sbh = recipe.runner_config.batch_size * cfg.seq_length * cfg.hidden_size * e
        terms.append((f"TP {tp}: 4 all-reduces of the hidden states per layer per micro-batch",
                      4 * stage.layers * micro_batches * 2 * (tp - 1) / tp * sbh / tp_link))
    if p.expert_parallel > 1:
        terms.append((f"expert parallel {p.expert_parallel}: AllToAll dispatch and combine, forward and backward",
                      step_alltoall_bytes(recipe, stage.first_layer, stage.layers)
                      / link_bytes_per_s(recipe, spec, p.expert_parallel)))
    # AdamW reads and writes m, v, the weight (and its master) and reads the gradient: memory-bound.
    local = elements / (dp if optimizer_sharded(recipe) else 1)
    per_element = 8 * 2 + (4 + 2 * 2 if cfg.param_dtype != "float32" else 4 * 2) + DTYPE_BYTES[cfg.param_dtype]
    terms.append(("AdamW update (memory-bound; one fused kernel per parameter)", local * per_element / HBM_BYTES_PER_S))
    step = sum(t for _, t in terms)
    links = {"DP": (dp, tp), "TP": (tp, 1), "EP": (p.expert_parallel, 1)}
    crossing = [name for name, (size, stride) in links.items() if size > 1 and spans_nodes(recipe, size, stride)]
    notes = [f"assumed: {mfu:.0%} MFU for the matmuls, HBM {HBM_BYTES_PER_S / 1e12:.1f} TB/s, collectives at "
             f"{spec.intra_node_bytes_per_s / 1e9:.0f} GB/s bus bandwidth within a node of "
             f"{recipe.hardware.devices_per_node} devices and {spec.inter_node_bytes_per_s / 1e9:.0f} GB/s across "
             f"nodes ({', '.join(crossing) + ' groups span nodes' if crossing else 'every group within a node'}), "
             "no overlap (approximate; no Huawei datasheet)"]
    return SpeedEstimate(terms, step, tokens_device / step, notes)
