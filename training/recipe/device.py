"""Recipe sections about the machine: MindSpore's context (graph compiler, Ascend precision and
communication-overlap options), the hardware the recipe is meant for, and the HCCL settings the
launcher exports.
"""

import difflib
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, Optional

from ascend_llm_recipes.training.recipe.checks import at_least

if TYPE_CHECKING:
    from ascend_llm_recipes.training.recipe.schema import Recipe


@dataclass
class JitConfig:
    """MindSpore's graph compiler level, as MindFormers' context.jit_config (build_context.py:79, 316)."""

    jit_level: Literal["O0", "O1", "O2"] = "O1"


# MindSpore 2.9's operator precision modes (mindspore/device_context/ascend/op_precision.py:76-84).
PRECISION_MODES = ("force_fp16", "allow_fp32_to_fp16", "allow_mix_precision", "must_keep_origin_dtype", "force_fp32",
                   "allow_fp32_to_bf16", "allow_mix_precision_fp16", "allow_mix_precision_bf16")
KEEP_DTYPES = "must_keep_origin_dtype"
# The keys MindSpore 2.9 accepts in a parallel_speed_up JSON file and their value types
# (mindspore/context.py:852-888, _Context._set_speedup_config_path; it raises on any other key; a bool is also
# accepted for the two recompute overlap keys, context.py:912-913).
SPEED_UP_KEYS = {
    "recompute_comm_overlap": (str, bool), "recomputation_communication_overlap": (str, bool),
    "matmul_grad_comm_overlap": (bool, str), "grad_matmul_communication_overlap": (bool, str),
    "enable_task_opt": (bool,), "enable_communication_fusion": (bool,),
    "enable_grad_comm_opt": (bool,), "grad_computation_allreduce_overlap": (bool,),
    "recompute_allgather_overlap_fagrad": (bool,), "grad_fa_allgather_overlap": (bool,),
    "interleaved_matmul_comm": (bool,), "bias_add_comm_swap": (bool,), "allreduce_and_biasadd_swap": (bool,),
    "enable_opt_shard_comm_opt": (bool,), "computation_allgather_overlap": (bool,),
    "enable_begin_end_inline_opt": (bool,), "enable_concat_eliminate_opt": (bool,),
    "interleaved_layernorm_comm": (bool,), "enable_allreduce_slice_to_reducescatter": (bool,),
    "enable_interleave_split_concat_branch": (bool,), "enable_interleave_parallel_branch": (bool,),
    "enable_offloading_packed_experts": (bool,), "compute_communicate_fusion_level": (int,),
    "computation_communication_fusion_level": (int,), "enable_flash_attention_load_balance": (bool,),
    "pp_1f1b_overlap": (str,), "dataset_broadcast_opt_level": (int,),
}


@dataclass
class AscendConfig:
    """MindSpore's Ascend settings, MindFormers' context.ascend_config.

    The worker hands it to MindFormers' build_context, which passes it whole to MindSpore's
    set_context(ascend_config=...) (mindformers/core/context/build_context.py:277-318: "ascend_config"
    is routed to that handler, whose entry in the routing table comes last, lines 63-82), and MindSpore
    applies both keys (mindspore/context.py:303-360 set_ascend_config).

    MindSpore 2.9 documents two defaults for precision_mode: "must_keep_origin_dtype"
    (device_context/ascend/op_precision.py:32, "may change in the future") and "force_fp16"
    (context.py:1435). The model casts every operator's inputs to the dtype it must run in
    (models/llama.py: RMSNorm, softmax, rotary and the loss in float32, matmuls in
    compute_dtype), so the only mode that keeps that is pinned: any other lets CANN lower the
    float32 operators to 16 bits. Ascend recipes always carry it (recipes/base/ascend.yaml, and
    filled in for an Ascend context that omits it).
    """

    precision_mode: Literal[PRECISION_MODES] = KEEP_DTYPES
    # Communication overlap options for semi-auto parallel (a JSON file; MindFormers' 1.9 configs
    # configs/qwen3/pretrain_qwen3_32b_4k.yaml:84 and configs/general/*_template.yaml use it).
    parallel_speed_up_json_path: Optional[str] = None

    def check(self, recipe: "Recipe") -> list:
        p = "context.ascend_config"
        problems = []
        if self.precision_mode != KEEP_DTYPES:
            problems.append(f"{p}.precision_mode: {self.precision_mode!r} lets CANN change the dtype the model chose "
                            "for an operator (force_fp16 and the allow_* modes run float32 RMSNorm, softmax, rotary "
                            f"and loss in 16 bits); use {KEEP_DTYPES!r}")
        if self.parallel_speed_up_json_path is not None:
            problems.extend(speed_up_problems(self.parallel_speed_up_json_path, f"{p}.parallel_speed_up_json_path"))
        return problems


def speed_up_problems(path: str, key: str) -> list:
    """What MindSpore 2.9 would refuse in a parallel_speed_up JSON file (context.py:842-922), said before launch.

    MindFormers reads the same file silently and treats an unreadable one as empty
    (core/context/build_context.py:253-262); MindSpore raises only once the context is set on each rank.
    """
    import json

    try:
        with open(path, encoding="utf-8") as f:
            options = json.load(f)
    except OSError as err:
        return [f"{key}: {path}: cannot be read ({err.strerror}); give the path of a JSON file (relative paths are "
                "relative to the working directory)"]
    except ValueError as err:
        return [f"{key}: {path}: not valid JSON ({err})"]
    if not isinstance(options, dict):
        return [f"{key}: {path}: must hold a JSON object of options, got {type(options).__name__}"]
    problems = []
    for name, value in options.items():
        if name not in SPEED_UP_KEYS:
            close = difflib.get_close_matches(name, list(SPEED_UP_KEYS), n=1)
            problems.append(f"{key}: {path}: {name!r} is not an option of MindSpore 2.9"
                            + (f"; did you mean {close[0]}?" if close else ""))
        elif not isinstance(value, SPEED_UP_KEYS[name]):
            wanted = " or ".join(t.__name__ for t in SPEED_UP_KEYS[name])
            problems.append(f"{key}: {path}: {name!r} must be {wanted}, got {value!r}")
    return problems


@dataclass
class ContextConfig:
    mode: Literal[0, 1] = 0  # 0 = graph mode (compiled), 1 = PyNative (eager, for debugging only)
    device_target: Literal["CPU", "Ascend", "GPU"] = "CPU"
    device_id: int = 0
    max_call_depth: int = 10000
    max_device_memory: Optional[str] = None
    save_graphs: bool = False
    jit_config: Optional[JitConfig] = None
    mempool_block_size: Optional[str] = None  # device memory pool growth step (build_context.py:184-192)
    ascend_config: Optional[AscendConfig] = None

    def __post_init__(self):
        if self.device_target == "Ascend" and self.ascend_config is None:
            self.ascend_config = AscendConfig()  # the precision mode is never left to MindSpore's default

    def check(self, recipe: "Recipe") -> list:
        problems = at_least("context", self, 0, "device_id") + at_least("context", self, 1, "max_call_depth")
        for name in ("max_device_memory", "mempool_block_size"):
            value = getattr(self, name)
            if value is not None and not re.fullmatch(r"\d+(\.\d+)?GB", value):
                problems.append(f"context.{name}: {value!r} is not a size like '58GB'")
        if recipe.runs_on_cpu:
            problems.extend(f"context.{name}: tunes the Ascend graph compiler and memory pool; remove it on CPU"
                            for name in ("jit_config", "mempool_block_size") if getattr(self, name) is not None)
        if self.ascend_config is not None:
            if self.device_target != "Ascend" and (recipe.runs_on_cpu or self.device_target == "GPU"):
                problems.append(f"context.ascend_config: sets Ascend operator precision and communication overlap; "
                                f"remove it for context.device_target {self.device_target}")
            else:
                problems.extend(self.ascend_config.check(recipe))
        return problems


# The first-generation Ascend 910 (no bf16, no FlashAttentionScore) in training/tools/planner.py's table: the chip and
# its Atlas 800 (model 9000) training server.
FIRST_GENERATION_910 = ("Ascend910A", "Atlas800-9000")


@dataclass
class HardwareConfig:
    """Where the recipe is meant to run (ours; MindFormers has no such section)."""

    device: str = "CPU"         # a device of training/tools/planner.py's table, e.g. Ascend910B2
    devices_per_node: int = 0   # 0: every worker on one node

    def check(self, recipe: "Recipe") -> list:
        n, tp = self.devices_per_node, recipe.parallel_config.model_parallel
        problems = self.device_problems(recipe)
        if n < 0:
            return problems + [f"hardware.devices_per_node: must be >= 0, got {n}"]
        if n == 0:
            return problems
        if recipe.world_size % n:
            problems.append(f"hardware.devices_per_node: {n} does not divide the {recipe.world_size} devices of "
                            "parallel_config (data_parallel x model_parallel x pipeline_stage)")
        if tp > n or n % tp:
            problems.append(f"parallel_config.model_parallel: {tp} must divide hardware.devices_per_node ({n}): a "
                            "tensor-parallel group stays within one node (tensor parallelism across nodes is too slow)")
        return problems

    def nodes(self, world_size: int) -> int:
        return world_size // self.devices_per_node if self.devices_per_node else 1

    def device_problems(self, recipe: "Recipe") -> list:
        """What the named device cannot run: an unknown name, and the first-generation 910's missing kernels."""
        # import-light; the planner does not import recipes
        from ascend_llm_recipes.training.tools.devices import DEVICES

        known = {name.lower(): name for name in DEVICES}
        if self.device.lower() not in known:
            return [f"hardware.device: {self.device!r} is not a device of training/tools/devices.py's table; "
                    f"use one of {', '.join(DEVICES)}"]
        if known[self.device.lower()] not in FIRST_GENERATION_910:
            return []
        cfg, m, where = recipe.model.model_config, "model.model_config", f"hardware.device {self.device}"
        problems = []
        if cfg.compute_dtype == "bfloat16":
            problems.append(f"{m}.compute_dtype: bfloat16 has no kernels on the 910A ({where}); use float16 with "
                            "runner_wrapper.scale_sense: {type: DynamicLossScaleUpdateCell}")
        if cfg.use_flash_attention:
            # CANN: aclnnFlashAttentionScore is supported on Atlas A2 training products, not on the Atlas
            # training series (910A) (CANN 7.0 aclcppdevg_03_0183, "Atlas 训练系列产品不支持该算子").
            problems.append(f"{m}.use_flash_attention: FlashAttentionScore is not available on the 910A ({where}; "
                            "CANN supports it on Atlas A2 devices only); set it to False (the math path)")
        if cfg.fused_rms_norm:
            # MindFormers' own Llama falls back to the math path there (models/llama/llama_layer.py:184,
            # version_control.py:209-213 check_rmsnorm_big_kernel_valid: False on 910A).
            problems.append(f"{m}.fused_rms_norm: MindFormers does not use the RmsNorm kernel on the 910A ({where}); "
                            "set it to False")
        return problems


@dataclass
class HcclConfig:
    """HCCL settings the launcher exports to every rank before communication starts (ours).

    HCCL reads them once, when communication initialises; values changed later are ignored and
    ranks that disagree hang, so they are never read from a rank's own environment
    (training/launcher/preflight.py hccl_env, check_hccl). Defaults and ranges from the CANN 9.0.0
    environment-variable reference (hiascend.com, canncommercial/900, envref_07_0077/78/80):
      HCCL_CONNECT_TIMEOUT: CANN default 120 s, accepted [120, 7200]; MindSpore 2.9.0 sets 600 at import
        when unset (mindspore/context.py). 1200 here: on multi-node jobs ranks reach HCCL init minutes
        apart (container start, data checks), and a short timeout turns that into a failed launch.
      HCCL_EXEC_TIMEOUT: CANN default 1836 s (Atlas A2/A3: [0, 2^31-1], 0 = never; Atlas training series
        round it down to a multiple of 68 s, and 1836 = 27 x 68 is the same everywhere).
      HCCL_BUFFSIZE: CANN default 200 MB per communication domain (each domain takes 2x: send + receive).
    """

    connect_timeout: int = 1200  # HCCL_CONNECT_TIMEOUT, seconds
    exec_timeout: int = 1836     # HCCL_EXEC_TIMEOUT, seconds
    buffsize: int = 200          # HCCL_BUFFSIZE, MB

    def check(self, recipe: "Recipe") -> list:
        return at_least("hccl", self, 1, "connect_timeout", "exec_timeout", "buffsize")
