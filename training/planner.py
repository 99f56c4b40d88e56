"""Per-device memory and step time of a recipe, computed before any device is booked.

`plan(recipe)` sizes what one device holds while training: fp32 master weights, fp32
gradients, AdamW moments, the activations of the micro-batches in flight and the logits
of the last pipeline stage, on the heaviest pipeline stage, and compares the total with
the device's memory. It also turns FLOPs per step into a step time at a stated MFU.
`format_plan` prints it for `bash scripts/run_distributed.sh RECIPE --plan`.

GB means 2**30 bytes throughout, the unit of npu-smi's HBM figures and of MindSpore's
`context.max_device_memory`. Import-light: no MindSpore.

Counted as a bound: tensors of operators without a shard strategy are whole on every TP
rank, the layer being computed or recomputed adds its own activations, and the last stage
holds the full-vocabulary fp32 logits of the loss. Not counted (each small next to the rows
counted, or dependent on the compiler): the runtime's and HCCL's reserved memory (recipes cap
the budget with `context.max_device_memory`), communication buffers, kernel workspaces,
fragmentation, and the 16-bit weight copies that each Linear casts per use.
"""

import os
import re
from dataclasses import dataclass, field, replace
from typing import Optional

from ascend_llm_recipes.common.errors import PretrainError
from ascend_llm_recipes.models.arithmetic import flops_per_token, layer_matmul_params, layer_params, param_count
from ascend_llm_recipes.models.parallel import balanced_stages
from ascend_llm_recipes.models.shapes import dimensions

GB = 2 ** 30
BYTES_PER_PARAM = {"weights": 4, "gradients": 4, "optimizer": 8}  # fp32 master, fp32 grad, AdamW m + v (fp32)
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
RECOMPUTE_MODES = ("none", "selective", "full")
MINDSPORE_OPTIMIZER_PARALLEL = "https://www.mindspore.cn/docs/en/r2.9.0/features/parallel/optimizer_parallel.html"


@dataclass(frozen=True)
class DeviceSpec:
    name: str
    memory_bytes: Optional[int]        # HBM (RAM for CPU); the runtime keeps a share of it
    peak_flops_16bit: Optional[float]  # dense bf16/fp16 matmul peak, FLOP/s; None: no figure we trust
    peak_flops_fp32: Optional[float]   # dense fp32 peak, FLOP/s; None: no figure we trust
    bf16: bool = True
    source: str = ""


def _mem_total_bytes() -> Optional[int]:
    """This machine's RAM: MemTotal from /proc/meminfo (Linux), else the page count."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024  # reported in kB
    except OSError:
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


# Capacities: npu-smi reports 32768 MB (910A, 910B4) and 65536 MB (910B1-B3) of HBM; HAMi's
# Ascend device table (Project-HAMi, vNPU memoryCapacity) lists the same.
ASCEND_910A = DeviceSpec(
    "Ascend910A", 32 * GB,
    # 256 TFLOPS fp16: Huawei's Ascend 910 launch figure (press release Aug 2019, Hot Chips 31).
    # No bf16 on this chip (fp16 only). Huawei published no fp32 figure.
    256e12, None, bf16=False,
    source="32 GB HBM; 256 TFLOPS fp16 (Huawei launch figure, 2019); no bf16; fp32 peak unpublished")

# Huawei publishes no per-bin datasheet for the 910B family. The 16-bit peaks below are the
# approximate figures commonly quoted for each bin, not vendor numbers: treat them as +-10%.
# A measured bf16 4096^3 matmul reaches ~315 TFLOP/s on a 910B2 (zzc0721/torch-performance-
# test-data issue 109), consistent with B2's figure. fp32: no vendor figure (the same
# measurement gives ~85 TFLOP/s for fp32 matmul, a lower bound only).
_910B_CAVEAT = "approximate third-party figure, not a Huawei datasheet (+-10%); fp32 peak unpublished"
ASCEND_910B1 = DeviceSpec(
    "Ascend910B1", 64 * GB, None, None,  # no peak figure we could confirm for this bin
    source="64 GB HBM; no 16-bit peak figure we could confirm for the B1 bin")
ASCEND_910B2 = DeviceSpec("Ascend910B2", 64 * GB, 376e12, None,
                          source=f"64 GB HBM; ~376 TFLOPS bf16/fp16, {_910B_CAVEAT}")
ASCEND_910B3 = DeviceSpec("Ascend910B3", 64 * GB, 313e12, None,
                          source=f"64 GB HBM; ~313 TFLOPS bf16/fp16, {_910B_CAVEAT}")
# 32 GB is the B4's difference from the other bins (vllm-ascend issue 129, HAMi's table).
ASCEND_910B4 = DeviceSpec("Ascend910B4", 32 * GB, 280e12, None,
                          source=f"32 GB HBM; ~280 TFLOPS bf16/fp16, {_910B_CAVEAT}")
# A 64 GB B4 variant exists: npu-smi names it 910B4-1 and shows 65536 MB (Project-HAMi/HAMi-WebUI
# issue 47); no peak figure for it.
ASCEND_910B4_1 = DeviceSpec("Ascend910B4-1", 64 * GB, None, None,
                            source="64 GB HBM (npu-smi: 65536 MB); no peak figure for this variant")


def _server(name: str, chip: DeviceSpec, what: str) -> DeviceSpec:
    return replace(chip, name=name, source=f"{what}, per device: {chip.source}")


DEVICES = {spec.name: spec for spec in (
    ASCEND_910A, ASCEND_910B1, ASCEND_910B2, ASCEND_910B3, ASCEND_910B4, ASCEND_910B4_1,
    # Servers, for people who know the box rather than the chip. An Atlas 800T A2 holds 8
    # devices of one 910B bin; `npu-smi info` names it (Name column: 910B1, 910B2, 910B3).
    _server("Atlas800T-A2-910B1", ASCEND_910B1, "Atlas 800T A2 training server, 8 x 910B1"),
    _server("Atlas800T-A2-910B2", ASCEND_910B2, "Atlas 800T A2 training server, 8 x 910B2"),
    _server("Atlas800T-A2-910B3", ASCEND_910B3, "Atlas 800T A2 training server, 8 x 910B3"),
    _server("Atlas800-9000", ASCEND_910A, "Atlas 800 training server (model 9000), 8 x 910A"),
    # This machine: its RAM; a CPU's peak FLOP/s depends on cores, clock and vector width.
    DeviceSpec("CPU", _mem_total_bytes(), None, None,
               source="this machine's MemTotal (/proc/meminfo); peak FLOP/s unknown"),
)}

DEFAULT_DEVICE = {"CPU": "CPU", "Ascend": "Ascend910B2"}


@dataclass
class StageMemory:
    """Bytes one device of a pipeline stage holds; activations for each recompute mode."""

    stage: int
    layers: int
    parameters: int
    in_flight: int
    weight_bytes: int
    gradient_bytes: int
    optimizer_bytes_unsharded: int
    optimizer_bytes_sharded: int
    activation_bytes: dict  # recompute mode -> bytes (layers x per layer x micro-batches in flight)
    logits_bytes: int

    def total(self, recompute: str, shard_optimizer: bool) -> int:
        optimizer = self.optimizer_bytes_sharded if shard_optimizer else self.optimizer_bytes_unsharded
        return (self.weight_bytes + self.gradient_bytes + optimizer + self.activation_bytes[recompute]
                + self.logits_bytes)


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
    stage: int                          # the reported (heaviest) stage
    stage_layers: list
    stage_parameters: int               # parameters one device of that stage holds
    in_flight: int                      # micro-batches whose activations that stage holds
    recompute: str                      # none | selective | full, from recompute_config
    optimizer_sharded: bool
    weight_bytes: int
    gradient_bytes: int
    optimizer_bytes: int                # as configured (sharded or not)
    optimizer_bytes_unsharded: int
    optimizer_bytes_sharded: int
    activation_bytes: int               # for the configured recompute mode
    activation_bytes_none: int
    activation_bytes_selective: int
    activation_bytes_full: int
    logits_bytes: int
    total_bytes: int
    stage_total_bytes: list             # every stage's total, configured as the recipe says
    fits: Optional[bool]                # None when the device memory is unknown
    headroom_bytes: Optional[int]       # budget - total; negative when short
    flops_per_token: int
    tokens_per_step: int
    step_time_s: Optional[float]        # None when the peak is unknown
    levers: list = field(default_factory=list)  # unused memory levers, in the order to try them
    notes: list = field(default_factory=list)
    attention: str = ""                 # which attention kernel the recipe runs
    sharding: str = ""                  # which operators tensor parallelism splits


def activation_terms(cfg, micro_batch: int, tensor_parallel: int = 1) -> dict:
    """Bytes of each tensor one decoder layer of models/llama.py holds, per micro-batch on one TP rank.

    name -> (bytes, kind). kind "kept": saved for backward; "score": saved for backward and
    recomputed under selective recompute (the S x S terms); "working": alive only while the
    layer computes (one layer at a time). e = bytes of the compute dtype, f = intermediate_size,
    a = heads, kv = KV width (kv heads x head_dim), t = tensor parallel.

    models/parallel.py gives every operator a strategy, as MindFormers' Llama does: from q/k/v to
    the attention output the heads are split by TP, the MLP width by TP; without sequence
    parallelism the hidden states at the norms stay whole on every TP rank. With FlashAttention
    (use_flash_attention) no S x S tensor exists: the kernel keeps two fp32 (B, heads, S, 8)
    softmax statistics instead. Korthikanti et al. 2022 (sec. 4) count the same kinds of tensors.
    """
    e = DTYPE_BYTES[getattr(cfg, "compute_dtype", "float32")]
    s, b, h, t, a = cfg.seq_length, micro_batch, cfg.hidden_size, tensor_parallel, cfg.num_heads
    kv = cfg.kv_heads * (h // a)
    sb, sbf, scores = s * b, s * b * cfg.intermediate_size, a * s * s * b
    flash = getattr(cfg, "use_flash_attention", False)
    terms = {
        "norm_inputs_fp32": (2 * 4 * sb * h, "kept"),             # RMSNorm computes in fp32 (both norms)
        "norm_outputs": (2 * e * sb * h, "kept"),                 # inputs of q/k/v and of gate/up
        "qkv_projections": (e * sb * (h + 2 * kv) // t, "kept"),   # column-split matmul outputs
        "rotary_fp32": (4 * sb * (h + kv) // t, "kept"),          # q and k rotated in fp32, split by heads
        "kv_broadcast": (2 * e * sb * h // t if kv < h and not flash else 0, "kept"),  # K, V tiled to every head
        "attention_qkv": (3 * e * sb * h // t, "kept"),           # Q, K, V at the attention
        "attention_output": (2 * e * sb * h // t, "kept"),        # attention output, then merged heads
        "swiglu_split": (2 * e * sbf // t, "kept"),               # gate and up (column-split)
        "swiglu_activation": (2 * e * sbf // t, "kept"),          # silu(gate) and silu x up, split by TP
    }
    if flash:
        terms["flash_softmax_stats"] = (2 * 4 * a * s * b * 8 // t, "score")  # softmax max and sum, fp32
    else:
        terms["softmax_fp32"] = (4 * scores // t, "score")
        terms["probs_cast"] = ((e * scores // t) if e != 4 else 0, "score")   # cast for the PV matmul
        terms["scores_at_mask_add"] = (4 * scores // t + e * scores // t, "working")  # QK^T, then + mask (fp32)
    return terms


def layer_activation_bytes(cfg, micro_batch: int, tensor_parallel: int = 1, recompute: str = "none") -> int:
    """Activation bytes one decoder layer keeps for backward, per micro-batch, on one TP rank.

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
    return sum(n for n, kind in activation_terms(cfg, micro_batch, tensor_parallel).values() if kind in kinds)


def recompute_working_bytes(cfg, micro_batch: int, tensor_parallel: int = 1, recompute: str = "none") -> int:
    """Bytes one layer adds on top of what every layer keeps, at the peak of its forward or backward.

    Always the transient S x S scores; under full recompute also the layer's own activations,
    rebuilt for its backward; under selective recompute its core attention's.
    """
    terms = activation_terms(cfg, micro_batch, tensor_parallel)
    working = sum(n for n, kind in terms.values() if kind == "working")
    if recompute == "full":
        return working + layer_activation_bytes(cfg, micro_batch, tensor_parallel, "none")
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


def stage_parameters(cfg, stage: int, layers: int, pipeline_stages: int, tensor_parallel: int = 1,
                     vocab_emb_dp: bool = True) -> int:
    """Parameters one device of pipeline stage `stage` holds.

    Layer matmul weights are split by TP (Megatron column/row split, models/parallel.py);
    norms and q/k/v biases are replicated. The embedding table sits on the first stage,
    replicated across TP when vocab_emb_dp (the recipe's default), else split by vocabulary;
    the last stage holds the final norm and the output projection (split by vocabulary).
    Tied embeddings with pipelining are refused (models/parallel.py layout_problems).
    """
    t, h = tensor_parallel, cfg.hidden_size
    vocab = dimensions(cfg, t)["padded_vocab"]
    table = vocab * h
    matmul = layer_matmul_params(cfg)
    count = layers * (matmul // t + layer_params(cfg) - matmul)
    last = pipeline_stages - 1
    if stage == 0:
        count += table if vocab_emb_dp else table // t
    if stage == last:
        count += h
        if not getattr(cfg, "tie_word_embeddings", False):
            count += table // t
    return count


def stage_memory(recipe) -> list:
    """A StageMemory per pipeline stage of the recipe."""
    cfg = recipe.model.model_config
    p = recipe.parallel_config
    dp, tp, pp = p.data_parallel, p.model_parallel, p.pipeline_stage
    b = recipe.runner_config.batch_size
    counts = list(p.stage_layers) if p.stage_layers else balanced_stages(cfg.num_layers, pp)
    per_layer = {mode: layer_activation_bytes(cfg, b, tp, mode) for mode in RECOMPUTE_MODES}
    working = {mode: recompute_working_bytes(cfg, b, tp, mode) for mode in RECOMPUTE_MODES}
    stages = []
    for stage, layers in enumerate(counts):
        params = stage_parameters(cfg, stage, layers, pp, tp, p.vocab_emb_dp)
        # 1F1B: stage i holds the activations of pp - i micro-batches at its peak.
        in_flight = min(pp - stage, p.micro_batch_num) if pp > 1 else 1
        optimizer = BYTES_PER_PARAM["optimizer"] * params
        weights, gradients = BYTES_PER_PARAM["weights"] * params, BYTES_PER_PARAM["gradients"] * params
        if optimizer_sharded(recipe):
            # Optimizer parallel slices the stored fp32 weights over DP at every level; at level1
            # and level2 the all-gathered copy stays alive from forward to backward, at level3 it is
            # re-gathered for backward, leaving roughly one layer's gathered weights at a time.
            level = recipe.parallel.parallel_optimizer_config.optimizer_level
            gathered = weights if level in ("level1", "level2") else _ceil_div(weights, max(layers, 1))
            weights = _ceil_div(weights, dp) + gathered
            if level in ("level2", "level3"):
                gradients = _ceil_div(gradients, dp)
        stages.append(StageMemory(
            stage=stage, layers=layers, parameters=params, in_flight=in_flight,
            weight_bytes=weights,
            gradient_bytes=gradients,
            optimizer_bytes_unsharded=optimizer,
            optimizer_bytes_sharded=_ceil_div(optimizer, dp),
            activation_bytes={mode: layers * per_layer[mode] * in_flight + working[mode] for mode in RECOMPUTE_MODES},
            logits_bytes=logits_bytes(cfg, b, tp) if stage == pp - 1 else 0))
    return stages


def _ceil_div(n: int, d: int) -> int:
    return -(-n // d)


def recompute_mode(recipe) -> str:
    r = recipe.recompute_config
    return "full" if r.recompute else "selective" if r.select_recompute else "none"


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
    mode, shard = recompute_mode(recipe), optimizer_sharded(recipe)
    notes = []

    stages = stage_memory(recipe)
    totals = [s.total(mode, shard) for s in stages]
    worst = stages[totals.index(max(totals))]
    total = max(totals)

    budget, budget_note = spec.memory_bytes, "the whole device"
    cap = _parse_gb(recipe.context.max_device_memory) if spec.name != "CPU" else None
    if recipe.context.max_device_memory and spec.name != "CPU" and cap is None:
        notes.append(f"context.max_device_memory {recipe.context.max_device_memory!r} not understood "
                     "(expected e.g. '58GB'); planned against the whole device")
    if cap is not None and (budget is None or cap < budget):
        budget, budget_note = cap, (f"context.max_device_memory {recipe.context.max_device_memory} of "
                                    f"{spec.memory_bytes / GB:.0f} GB")

    bf16_missing = cfg.compute_dtype == "bfloat16" and not spec.bf16
    peak = spec.peak_flops_fp32 if cfg.compute_dtype == "float32" else spec.peak_flops_16bit
    if bf16_missing:
        peak = None
        notes.append(f"{spec.name} has no bfloat16 support; use float16 with loss scaling")
    if recipe.parallel.enable_parallel_optimizer and recipe.parallel.parallel_mode not in (1, 2):
        notes.append("parallel.enable_parallel_optimizer: MindSpore shards optimizer states only in semi-auto/auto "
                     f"parallel (parallel_mode 1 or 2), so it is not counted ({MINDSPORE_OPTIMIZER_PARALLEL})")
    if shard:
        level = recipe.parallel.parallel_optimizer_config.optimizer_level
        notes.append(f"optimizer parallel {level} over DP {p.data_parallel}: weights = 1/DP fp32 slice + the "
                     + ("all-gathered copy, alive from forward to backward" if level != "level3"
                        else "gathered weights of about one layer at a time")
                     + ("; gradients sliced over DP" if level != "level1" else "; gradients whole")
                     + f" ({MINDSPORE_OPTIMIZER_PARALLEL})")

    fpt = flops_per_token(cfg)
    tokens = recipe.tokens_per_step
    step_time = tokens * fpt / (recipe.world_size * peak * mfu) if peak else None

    return Plan(
        device=spec.name, device_source=spec.source, device_memory_bytes=budget, device_memory_note=budget_note,
        peak_flops=peak, mfu=mfu,
        compute_dtype=cfg.compute_dtype, data_parallel=p.data_parallel, tensor_parallel=p.model_parallel,
        pipeline_stages=p.pipeline_stage, world_size=recipe.world_size, micro_batch=recipe.runner_config.batch_size,
        seq_length=cfg.seq_length, parameters=param_count(cfg, p.model_parallel),
        stage=worst.stage, stage_layers=[s.layers for s in stages], stage_parameters=worst.parameters,
        in_flight=worst.in_flight, recompute=mode, optimizer_sharded=shard,
        weight_bytes=worst.weight_bytes, gradient_bytes=worst.gradient_bytes,
        optimizer_bytes=worst.optimizer_bytes_sharded if shard else worst.optimizer_bytes_unsharded,
        optimizer_bytes_unsharded=worst.optimizer_bytes_unsharded,
        optimizer_bytes_sharded=worst.optimizer_bytes_sharded,
        activation_bytes=worst.activation_bytes[mode],
        activation_bytes_none=worst.activation_bytes["none"],
        activation_bytes_selective=worst.activation_bytes["selective"],
        activation_bytes_full=worst.activation_bytes["full"],
        logits_bytes=worst.logits_bytes, total_bytes=total, stage_total_bytes=totals,
        fits=None if budget is None else total <= budget,
        headroom_bytes=None if budget is None else budget - total,
        flops_per_token=fpt, tokens_per_step=tokens, step_time_s=step_time,
        levers=_unused_levers(recipe, stages, mode, shard, total), notes=notes,
        attention=("FlashAttention (FlashAttentionScore; no S x S scores kept)" if cfg.use_flash_attention
                   else "math path (fp32 S x S scores per layer)"),
        sharding=(f"every operator split by DP {p.data_parallel}; TP {p.model_parallel} splits heads from q/k/v to "
                  "the attention output, the MLP width and the vocabulary through the loss; norms and residual "
                  "adds stay whole on each TP rank (no sequence parallelism)" if p.model_parallel > 1
                  else f"every operator split by DP {p.data_parallel}; no tensor parallelism"))


OPTIMIZER_LEVELS = ("level1", "level2", "level3")


def lowest_fitting_optimizer_level(recipe, device: str = None) -> Optional[str]:
    """The least-communicating optimizer-parallel level at which the recipe fits, None if none does.

    level1 gathers the weights once per step, level2 also reduce-scatters gradients, level3
    re-gathers the fp32 weights for every micro-batch's backward; so the lowest level that fits wins.
    """
    from dataclasses import replace as copy_with
    config = recipe.parallel.parallel_optimizer_config
    for level in OPTIMIZER_LEVELS:
        trial = copy_with(recipe, parallel=copy_with(recipe.parallel, parallel_optimizer_config=copy_with(
            config, optimizer_level=level)))
        if plan(trial, device).fits:
            return level
    return None


def _unused_levers(recipe, stages, mode, shard, total) -> list:
    """FIELD_NOTES section 4's memory levers the recipe does not use yet, in order, with savings."""
    p = recipe.parallel_config
    levers = []
    if mode != "full":
        full = max(s.total("full", shard) for s in stages)
        levers.append(f"{'full ' if mode == 'selective' else ''}recompute "
                      f"(full: -{(total - full) / GB:.2f} GB, ~20-40% more compute)")
    if not shard:
        if p.data_parallel > 1:
            sharded = max(s.total(mode, True) for s in stages)
            needs = "" if recipe.parallel.parallel_mode in (1, 2) else "; needs parallel.parallel_mode 1"
            levers.append(f"optimizer-state sharding (-{(total - sharded) / GB:.2f} GB at DP {p.data_parallel}{needs})")
        else:
            levers.append("optimizer-state sharding (needs data_parallel > 1)")
    if p.pipeline_stage == 1:
        levers.append("pipeline")
    if p.model_parallel == 1:
        levers.append("tensor parallel")
    return levers


def _gb(n: int) -> str:
    return f"{n / GB:.2f}"


def format_plan(plan: Plan) -> str:
    """A readable table: one line per component (GB), the verdict, the step time."""
    tp, pp = plan.tensor_parallel, plan.pipeline_stages
    budget = "unknown" if plan.device_memory_bytes is None else f"{_gb(plan.device_memory_bytes)} GB"
    opt_label = (f"optimizer states (AdamW m, v; fp32; sharded over DP {plan.data_parallel})" if plan.optimizer_sharded
                 else "optimizer states (AdamW m, v; fp32)")
    stage_desc = (f"stage {plan.stage} of {pp} ({plan.stage_layers[plan.stage]} layers"
                  f"{', embedding' if plan.stage == 0 else ''}{', output projection' if plan.stage == pp - 1 else ''})"
                  if pp > 1 else f"all {plan.stage_layers[0]} layers")
    devices = f"{plan.world_size} device{'s' if plan.world_size > 1 else ''}"
    lines = [
        f"plan: {plan.parameters:,} parameters on DP {plan.data_parallel} x TP {tp} x PP {pp} = {devices}",
        f"attention: {plan.attention}",
        f"sharding: {plan.sharding}",
        f"device: {plan.device} ({plan.device_source})",
        f"memory budget: {budget} ({plan.device_memory_note})",
        f"per device: {stage_desc}, {plan.stage_parameters:,} parameters; micro-batch {plan.micro_batch} x seq "
        f"{plan.seq_length}, {plan.compute_dtype} compute, {plan.in_flight} micro-batch"
        f"{'es' if plan.in_flight > 1 else ''} in flight",
        "",
        f"{'component':<58}{'GB':>9}",
    ]

    def row(label, n, mark=""):
        lines.append(f"{label:<58}{_gb(n):>9}{mark}")

    row(f"weights (fp32 master{', split by TP' if tp > 1 else ''})", plan.weight_bytes)
    row("gradients (fp32)", plan.gradient_bytes)
    row(opt_label, plan.optimizer_bytes)
    other = plan.optimizer_bytes_unsharded if plan.optimizer_sharded else plan.optimizer_bytes_sharded
    if plan.data_parallel > 1:
        lines.append(f"  ({'without' if plan.optimizer_sharded else 'with'} sharding over DP {plan.data_parallel}: "
                     f"{_gb(other)} GB)")
    for mode, label in (("none", "no recompute"), ("selective", "selective recompute (core attention)"),
                        ("full", "full recompute (layer inputs + one layer rebuilt)")):
        chosen = mode == plan.recompute
        row(f"activations, {label}", getattr(plan, f"activation_bytes_{mode}"),
            "  <- recipe" if chosen else "")
    if plan.logits_bytes:
        row("logits and loss (vocabulary split by TP, fp32, last stage)", plan.logits_bytes)
    lines.append("-" * 67)
    row("total", plan.total_bytes)
    if pp > 1:
        lines.append("  per stage: " + ", ".join(_gb(t) for t in plan.stage_total_bytes) + " GB")
    lines.append("")
    lines.append(verdict(plan))
    peak = "unknown" if plan.peak_flops is None else f"{plan.peak_flops / 1e12:.0f} TFLOP/s peak"
    dtype = "fp32" if plan.compute_dtype == "float32" else plan.compute_dtype
    step = (f"step time: not estimated (no {dtype} peak FLOP/s for {plan.device})" if plan.step_time_s is None else
            f"step time at {plan.mfu:.0%} MFU of {peak}: {plan.step_time_s:.2f} s "
            f"({plan.tokens_per_step / plan.step_time_s:,.0f} tokens/s)")
    lines.append(f"compute: {plan.flops_per_token / 1e9:,.3f} GFLOP/token x {plan.tokens_per_step:,} tokens/step; "
                 + step)
    lines.extend(f"note: {n}" for n in plan.notes)
    return "\n".join(lines)


def verdict(plan: Plan) -> str:
    if plan.fits is None:
        return f"fits: unknown (needs {plan.total_bytes / GB:.1f} GB; the device memory is unknown)"
    need, have = plan.total_bytes / GB, plan.device_memory_bytes / GB
    if plan.fits:
        headroom = plan.headroom_bytes / plan.device_memory_bytes
        return f"fits: {need:.1f} GB of {have:.1f} GB ({headroom:.0%} headroom)"
    levers = ("levers in order: " + ", ".join(plan.levers) if plan.levers
              else "every lever is in use: add devices (or offload, the last resort)")
    return (f"WILL NOT FIT: needs {need:.1f} GB, device has {have:.1f} GB (short by "
            f"{-plan.headroom_bytes / GB:.1f} GB); {levers}")
