"""Recipes: MindFormers' YAML vocabulary, loaded strictly into typed sections.

Precedence is defaults < YAML < `--set section.key=value`. Every unknown key, wrong type
and broken cross-field rule is collected and reported together, each with its dotted
path. Keys that MindFormers 1.9 accepts but silently ignores or resets (gradient
accumulation outside semi-auto parallel, `runner_config.stop_step`, sink mode on CPU)
are either made to work here or refused with the reason.
"""

import difflib
import io
import os
import re
import shlex
from dataclasses import dataclass, field
from typing import Literal, Optional, Union

import yaml

from ascend_llm_recipes.common.errors import RecipeError
from ascend_llm_recipes.common.schema import load_dataclass, to_plain
from ascend_llm_recipes.models import LLAMA_CONFIG_TYPE, LLAMA_MODEL_TYPE
from ascend_llm_recipes.models.config import ModelSection
from ascend_llm_recipes.models.parallel import layout_problems


def _at_least(prefix: str, section, low, *names) -> list:
    """A problem for each field of `section` in `names` that is below `low` (None means unset and is fine)."""
    return [f"{_key(prefix, name)}: must be >= {low}, got {getattr(section, name)}" for name in names
            if getattr(section, name) is not None and getattr(section, name) < low]


def _positive(prefix: str, section, *names) -> list:
    """A problem for each field of `section` in `names` that is not > 0."""
    return [f"{_key(prefix, name)}: must be > 0, got {getattr(section, name)}" for name in names
            if getattr(section, name) is not None and not getattr(section, name) > 0]


def _key(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _callback_key(recipe: "Recipe", callback) -> str:
    """`callbacks[N]` of this callback (by identity: two callbacks may be equal)."""
    return f"callbacks[{next(i for i, c in enumerate(recipe.callbacks) if c is callback)}]"


@dataclass
class TrainerConfig:
    type: Literal["CausalLanguageModelingTrainer"] = "CausalLanguageModelingTrainer"
    model_name: str = "llama"


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
        problems = _at_least("context", self, 0, "device_id") + _at_least("context", self, 1, "max_call_depth")
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


@dataclass
class RunnerConfig:
    batch_size: int  # per device, per step (the micro-batch)
    epochs: int = 1
    stop_step: int = 0  # > 0: stop after this many steps (and size the LR schedule to it)
    sink_mode: bool = False
    sink_size: int = -1
    gradient_accumulation_steps: int = 1

    def check(self, recipe: "Recipe") -> list:
        problems = _at_least("runner_config", self, 1, "batch_size", "epochs", "gradient_accumulation_steps")
        if self.sink_size != -1 and self.sink_size < 1:
            problems.append(f"runner_config.sink_size: must be -1 (the whole dataset) or >= 1, got {self.sink_size}")
        if self.stop_step < 0:
            problems.append(f"runner_config.stop_step: must be >= 0 (0 = run all epochs), got {self.stop_step}")
        if self.sink_mode and recipe.runs_on_cpu:
            problems.append("runner_config.sink_mode: True on CPU silently multiplies the number of steps; "
                            "set it to False")
        if self.gradient_accumulation_steps > 1 and recipe.parallel.parallel_mode not in (1, 2):
            problems.append("runner_config.gradient_accumulation_steps: > 1 is silently reset to 1 by "
                            "MindFormers outside semi-auto/auto parallel (parallel.parallel_mode 1 or 2); "
                            "raise runner_config.batch_size instead")
        return problems


@dataclass
class DynamicLossScaleConfig:
    type: Literal["DynamicLossScaleUpdateCell"] = "DynamicLossScaleUpdateCell"
    loss_scale_value: float = 65536.0
    scale_factor: int = 2
    scale_window: int = 1000

    def check(self, recipe: "Recipe") -> list:
        p = "runner_wrapper.scale_sense"
        return (_positive(p, self, "loss_scale_value") + _at_least(p, self, 2, "scale_factor")
                + _at_least(p, self, 1, "scale_window"))


@dataclass
class RunnerWrapperConfig:
    type: Literal["PortableTrainOneStepCell", "MFTrainOneStepCell"] = "PortableTrainOneStepCell"
    scale_sense: Union[float, DynamicLossScaleConfig] = 1.0
    use_clip_grad: bool = True
    max_grad_norm: float = 1.0

    def check(self, recipe: "Recipe") -> list:
        problems = _positive("runner_wrapper", self, "max_grad_norm")
        if isinstance(self.scale_sense, DynamicLossScaleConfig):
            problems.extend(self.scale_sense.check(recipe))
        else:
            problems.extend(_positive("runner_wrapper", self, "scale_sense"))
            if (self.scale_sense == 1.0 and recipe.model.model_config.compute_dtype == "float16"
                    and recipe.context.device_target != "CPU"):
                # float16's smallest normal number is 6.1e-5: small gradients flush to zero unscaled.
                # MindFormers' float16 configs all scale dynamically (configs/llama2/pretrain_llama2_7b.yaml).
                problems.append("runner_wrapper.scale_sense: 1.0 (no loss scaling) with model.model_config."
                                "compute_dtype float16: small gradients underflow to zero in float16; use "
                                "{type: DynamicLossScaleUpdateCell, loss_scale_value: 65536, scale_factor: 2, "
                                "scale_window: 1000} (or bfloat16 where the device has it)")
        if self.type == "MFTrainOneStepCell" and recipe.runs_on_cpu:
            problems.append("runner_wrapper.type: MFTrainOneStepCell checks overflow with an Ascend-only kernel "
                            "and does not compile on CPU; use PortableTrainOneStepCell (same behaviour, portable "
                            "check)")
        return problems


@dataclass
class OptimizerConfig:
    # FoldedAdamW (training/worker/optim.py): AdamW's update on the fused AdamWeightDecay kernel (CPU recipes).
    type: Literal["AdamW", "FoldedAdamW"] = "AdamW"
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    eps: float = 1e-8
    weight_decay: float = 0.1

    def check(self, recipe: "Recipe") -> list:
        problems = _positive("optimizer", self, "eps") + _at_least("optimizer", self, 0, "weight_decay")
        if len(self.betas) != 2 or not all(0.0 <= b < 1.0 for b in self.betas):
            problems.append(f"optimizer.betas: expected two values in [0, 1), got {self.betas}")
        param_dtype = recipe.model.model_config.param_dtype
        if param_dtype != "float32" and self.type != "FoldedAdamW":
            # MindFormers' AdamW updates 16-bit weights in place through a float32 temporary
            # (mindformers/core/optim/adamw.py:38-66): updates below half an ulp of the weight are lost.
            problems.append(f"optimizer.type: {self.type} keeps no float32 master copy of the {param_dtype} weights "
                            f"(model.model_config.param_dtype), so small updates are rounded away; use FoldedAdamW, "
                            "or param_dtype: float32")
        return problems


START_STEP_LR = "StartStepLR"  # training/worker/optim.py: the MindFormers schedule entered at lr_schedule.start_step


@dataclass
class LRScheduleConfig:
    learning_rate: float
    type: Literal["CosineWithWarmUpLR", "LinearWithWarmUpLR", "ConstantWarmUpLR"] = "CosineWithWarmUpLR"
    lr_end: float = 0.0
    warmup_ratio: Optional[float] = None
    warmup_steps: Optional[int] = None
    total_steps: int = -1  # -1: epochs x dataset size, or runner_config.stop_step when set
    # the schedule's step at optimizer step 0 (warmup_steps and total_steps count from the schedule's
    # step 0): a run continued from another run's iteration N enters that run's schedule at N
    start_step: int = 0

    def check(self, recipe: "Recipe") -> list:
        p = "lr_schedule"
        problems = _positive(p, self, "learning_rate")
        problems += _at_least(p, self, 0, "lr_end", "warmup_steps", "start_step")
        if self.lr_end > self.learning_rate > 0:
            problems.append(f"{p}.lr_end: {self.lr_end} is above learning_rate {self.learning_rate}; the schedule "
                            "decays from learning_rate to lr_end")
        if self.total_steps != -1 and self.total_steps < 1:
            problems.append(f"{p}.total_steps: must be -1 (runner_config.stop_step, or the whole run) or >= 1, "
                            f"got {self.total_steps}")
        total = self.total_steps if self.total_steps > 0 else recipe.runner_config.stop_step
        if self.warmup_steps is not None and total > 0 and self.warmup_steps > total:
            problems.append(f"{p}.warmup_steps: {self.warmup_steps} exceeds the {total} steps of the schedule "
                            "(lr_schedule.total_steps, else runner_config.stop_step)")
        if self.warmup_ratio is not None and self.warmup_steps is not None:
            problems.append("lr_schedule.warmup_ratio, lr_schedule.warmup_steps: set one of them, not both")
        if self.warmup_ratio is not None and not 0.0 <= self.warmup_ratio < 1.0:
            problems.append(f"lr_schedule.warmup_ratio: must be in [0, 1), got {self.warmup_ratio}")
        return problems


@dataclass
class DataLoaderConfig:
    dataset_dir: str
    type: Literal["MindDataset"] = "MindDataset"
    shuffle: bool = True


@dataclass
class BlendSourceConfig:
    """One dataset of a blend (ours): training draws from it in proportion to `weight`."""

    dataset_dir: str
    weight: float = 1.0


@dataclass
class TrainDatasetConfig:
    data_loader: DataLoaderConfig
    input_columns: list[str] = field(default_factory=lambda: ["input_ids"])
    num_parallel_workers: int = 1
    python_multiprocessing: bool = False
    drop_remainder: bool = True
    repeat: int = 1
    numa_enable: bool = False
    prefetch_size: int = 1
    blend: Optional[list[BlendSourceConfig]] = None  # ours: several datasets mixed by weight (data/loader.py)

    def check(self, recipe: "Recipe") -> list:
        problems = _at_least("train_dataset", self, 1, "num_parallel_workers", "repeat", "prefetch_size")
        if self.blend is not None:
            problems.extend(self._blend_problems())
        if self.input_columns != ["input_ids"]:
            problems.append(f"train_dataset.input_columns: must be ['input_ids'] (packed samples of "
                            f"seq_length + 1 tokens), got {self.input_columns}")
        if not self.drop_remainder:
            problems.append("train_dataset.drop_remainder: must be True; a short last batch changes the "
                            "input shape and forces a graph recompile")
        return problems

    def _blend_problems(self) -> list:
        if not self.blend:
            return ["train_dataset.blend: empty; list {dataset_dir, weight} entries or remove the key"]
        problems = [f"train_dataset.blend[{i}].weight: must be > 0, got {b.weight}"
                    for i, b in enumerate(self.blend) if b.weight <= 0]
        # Paths are resolved at load (resolve_paths), so two spellings of one directory compare equal.
        dirs = [b.dataset_dir for b in self.blend]
        for i, d in enumerate(dirs):
            if d in dirs[:i]:
                problems.append(f"train_dataset.blend[{i}].dataset_dir: {d} is already listed as "
                                f"train_dataset.blend[{dirs.index(d)}]; give each dataset one entry and one weight")
        if self.data_loader.dataset_dir not in dirs:
            problems.append(f"train_dataset.blend: does not list train_dataset.data_loader.dataset_dir "
                            f"({self.data_loader.dataset_dir}); list it with its weight (it is the dataset "
                            "data_preparation builds)")
        return problems


@dataclass
class TrainDatasetTaskConfig:
    type: Literal["CausalLanguageModelDataset"] = "CausalLanguageModelDataset"
    # MindFormers recipes repeat the dataset block here (`dataset_config: *train_dataset`);
    # it is filled in from train_dataset, and a block that differs from it is refused.
    dataset_config: Optional[dict] = None


@dataclass
class ParallelOptimizerConfig:
    """MindSpore's optimizer parallel (semi-auto/auto parallel with enable_parallel_optimizer).

    level1 slices weights and optimizer states over data parallel (the gathered weights live
    from forward to backward), level2 also slices gradients, level3 also re-gathers weights
    before backward so the forward copies are freed.
    """

    optimizer_level: Literal["level1", "level2", "level3"] = "level1"
    parallel_optimizer_threshold: int = 64  # KB; smaller parameters are not sliced

    def check(self, recipe: "Recipe") -> list:
        return _at_least("parallel.parallel_optimizer_config", self, 0, "parallel_optimizer_threshold")


@dataclass
class ParallelConfig:
    parallel_mode: Literal[0, 1, 2, 3] = 0  # 0 data, 1 semi-auto, 2 auto, 3 hybrid parallel
    gradients_mean: bool = True
    full_batch: bool = False
    enable_parallel_optimizer: bool = False
    parallel_optimizer_config: ParallelOptimizerConfig = field(default_factory=lambda: ParallelOptimizerConfig())
    search_mode: Literal["sharding_propagation", "recursive_programming", "dynamic_programming"] = \
        "sharding_propagation"

    def check(self, recipe: "Recipe") -> list:
        if self.parallel_mode not in (1, 2):
            return []
        problems = []
        # MindFormers' trainer passes dataset_strategy='full_batch' unless one is given
        # (mindformers/trainer/base_trainer.py:904,924) and MindSpore then sets full_batch True
        # (mindspore/parallel/_auto_parallel_context.py:581): every rank reads the global batch.
        if not self.full_batch:
            problems.append("parallel.full_batch: False is reset to True by MindFormers in semi-auto/auto parallel "
                            "(every rank reads the global batch and the graph slices it); set it to True")
        # The semi-auto graph computes the global-batch mean loss, so its gradients are already
        # means; MindFormers' own configs all set gradients_mean: False.
        if self.gradients_mean:
            problems.append("parallel.gradients_mean: True divides semi-auto parallel gradients by the data-parallel "
                            "degree a second time; set it to False (as MindFormers' configs do)")
        return problems


@dataclass
class ParallelDegreesConfig:
    data_parallel: int = 1
    model_parallel: int = 1
    pipeline_stage: int = 1
    micro_batch_num: int = 1
    use_seq_parallel: bool = False
    vocab_emb_dp: bool = True
    gradient_aggregation_group: int = 4
    stage_layers: Optional[list[int]] = None  # ours: explicit layers per pipeline stage (default balanced)

    def check(self, recipe: "Recipe") -> list:
        p = "parallel_config"
        problems = _at_least(p, self, 1, "data_parallel", "model_parallel", "pipeline_stage", "micro_batch_num",
                             "gradient_aggregation_group")
        if self.use_seq_parallel:
            problems.append(f"{p}.use_seq_parallel: sequence parallelism is not implemented by models/parallel.py "
                            "(MindFormers applies it inside its own layers); set it to False")
        if problems:
            return problems
        problems.extend(layout_problems(recipe.model.model_config, self.data_parallel, self.model_parallel,
                                        self.pipeline_stage, self.micro_batch_num, self.stage_layers))
        if recipe.world_size > 1 and not recipe.use_parallel:
            problems.append(f"use_parallel: must be True when {p}.data_parallel x model_parallel x "
                            f"pipeline_stage = {recipe.world_size} devices")
        if recipe.runs_on_cpu:
            for name in ("model_parallel", "pipeline_stage"):
                if getattr(self, name) > 1:
                    problems.append(f"{p}.{name}: {getattr(self, name)} needs Ascend (or GPU); shard() and "
                                    "pipeline stages have no CPU backend. Only data_parallel runs on CPU")
            if recipe.parallel.parallel_mode in (1, 2):
                problems.append("parallel.parallel_mode: semi-auto/auto parallel needs Ascend (or GPU); "
                                "use 0 (data parallel) on CPU")
        return problems


@dataclass
class RecomputeConfig:
    recompute: bool = False  # full recompute of every decoder layer
    select_recompute: bool = False  # recompute core attention (the S x S scores) of every layer
    parallel_optimizer_comm_recompute: bool = False
    mp_comm_recompute: bool = True
    # MindFormers' default (mindformers/modules/transformer/transformer.py:386); models/parallel.py
    # passes these three to Cell.recompute per layer, as MindFormers does.
    recompute_slice_activation: bool = False

    def check(self, recipe: "Recipe") -> list:
        if not self.recompute and not self.select_recompute:
            # Cell.recompute's options act only on recomputed cells: without recompute they are ignored.
            changed = [f"recompute_config.{name}" for name, default in (
                ("parallel_optimizer_comm_recompute", False), ("mp_comm_recompute", True),
                ("recompute_slice_activation", False)) if getattr(self, name) != default]
            if changed:
                return [f"{', '.join(changed)}: has no effect without recompute_config.recompute; remove it or "
                        "set recompute: True"]
        if self.parallel_optimizer_comm_recompute:
            # MindSpore 2.9's Cell.recompute only logs a warning for it (mindspore/nn/cell.py:3687-3690).
            return ["recompute_config.parallel_optimizer_comm_recompute: True is ignored by MindSpore 2.9 (optimizer "
                    "parallel level3 re-gathers weights instead); set it to False"]
        # select_recompute is a bool, as MindFormers' legacy TransformerRecomputeConfig checks it
        # (mindformers/modules/transformer/transformer.py:417-420; the schema refuses other types). Its
        # per-stage list form belongs to MindFormers' mcore path (tools/check_rules.py:293-313), not ours.
        if self.select_recompute and self.recompute:
            # Full recompute wins, as in MindFormers (parallel_core/training_graph/transformer/utils.py:383-402).
            return ["recompute_config.select_recompute: has no effect with recompute_config.recompute: True (the "
                    "whole layer is recomputed already); set one of them"]
        if self.select_recompute and recipe.model.model_config.use_flash_attention:
            # FlashAttentionScore stores no S x S scores, so there is nothing to rebuild; MindFormers'
            # Llama skips selective recompute under flash attention (models/llama/llama_transformer.py:405).
            return ["recompute_config.select_recompute: has no effect with model.model_config.use_flash_attention: "
                    "True (no S x S scores are kept); set it to False, or use recompute: True to save more"]
        return []


@dataclass
class LossMonitorConfig:
    type: Literal["MFLossMonitor"] = "MFLossMonitor"
    per_print_times: int = 1

    def check(self, recipe: "Recipe") -> list:
        return _at_least(_callback_key(recipe, self), self, 1, "per_print_times")


@dataclass
class CheckpointMonitorConfig:
    type: Literal["CheckpointMonitor"] = "CheckpointMonitor"
    prefix: str = "llama"
    save_checkpoint_steps: int = 100
    keep_checkpoint_max: int = 3   # the newest N steps are kept
    keep_every: int = 0            # ours: also keep every step divisible by this (0: none)
    integrated_save: bool = False
    async_save: bool = False       # copy to host, then write files in the background

    def check(self, recipe: "Recipe") -> list:
        p = _callback_key(recipe, self)
        problems = (_at_least(p, self, 0, "save_checkpoint_steps", "keep_every")
                    + _at_least(p, self, 1, "keep_checkpoint_max"))
        if not self.prefix or os.sep in self.prefix:
            problems.append(f"{p}.prefix: {self.prefix!r} must be a non-empty file name prefix (no {os.sep})")
        return problems


@dataclass
class DataPreparationConfig:
    """How to build the recipe's own dataset, `output_dir`, when it does not exist yet (ours).

    Only a missing dataset directory equal to `output_dir` is built; any other missing
    dataset (a typo, an override) is an error naming the prepare_data command to run.
    """

    output_dir: str
    source: Literal["python_stdlib"] = "python_stdlib"
    vocab_size: int = 2048
    max_documents: int = 0  # 0 = every document of the source

    def check(self, recipe: "Recipe") -> list:
        p = "data_preparation"
        problems = _at_least(p, self, 1, "vocab_size") + _at_least(p, self, 0, "max_documents")
        if not self.output_dir:
            problems.append(f"{p}.output_dir: must name the dataset directory it builds")
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
            problems.append(f"parallel_config.model_parallel: {tp} must fit within one node "
                            f"(hardware.devices_per_node {n}); tensor parallelism across nodes is too slow")
        return problems

    def nodes(self, world_size: int) -> int:
        return world_size // self.devices_per_node if self.devices_per_node else 1

    def device_problems(self, recipe: "Recipe") -> list:
        """What the named device cannot run: an unknown name, and the first-generation 910's missing kernels."""
        from ascend_llm_recipes.training.tools.planner import DEVICES  # import-light; the planner does not import recipes

        known = {name.lower(): name for name in DEVICES}
        if self.device.lower() not in known:
            return [f"hardware.device: {self.device!r} is not a device of training/tools/planner.py's table; use one of "
                    f"{', '.join(DEVICES)}"]
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

    None keeps training/launcher/preflight.py's documented default. Changing them after HCCL has
    initialised hangs silently, so they are never read from a rank's own environment.
    """

    connect_timeout: Optional[int] = None  # HCCL_CONNECT_TIMEOUT, seconds
    exec_timeout: Optional[int] = None     # HCCL_EXEC_TIMEOUT, seconds
    buffsize: Optional[int] = None         # HCCL_BUFFSIZE, MB

    def check(self, recipe: "Recipe") -> list:
        return _at_least("hccl", self, 1, "connect_timeout", "exec_timeout", "buffsize")


@dataclass
class EvalDatasetConfig:
    """Held-out data evaluated during training (MindFormers' eval_dataset block, read by our callback)."""

    data_loader: DataLoaderConfig
    input_columns: list[str] = field(default_factory=lambda: ["input_ids"])
    max_batches: int = 0  # ours: evaluate at most this many batches (0 = the whole dataset)

    def check(self, recipe: "Recipe") -> list:
        return _at_least("eval_dataset", self, 0, "max_batches")


@dataclass
class ProfileConfig:
    """Record a MindSpore Profiler trace for steps [start_step, stop_step] only."""

    start_step: int
    stop_step: int

    def check(self, recipe: "Recipe") -> list:
        if not 1 <= self.start_step <= self.stop_step:
            return [f"profile.start_step, profile.stop_step: need 1 <= start_step <= stop_step, got "
                    f"{self.start_step}..{self.stop_step}"]
        last = recipe.runner_config.stop_step
        if last and self.stop_step > last:
            return [f"profile.stop_step, runner_config.stop_step: the profile window "
                    f"{self.start_step}..{self.stop_step} ends after the run's last step {last}; those steps would "
                    "never be traced"]
        return []


@dataclass
class AnomalyConfig:
    """What to do about non-finite losses and loss spikes (ours)."""

    on_nan: Literal["stop", "skip"] = "stop"  # stop: save the state for post-mortem and stop; skip: log, go on
    spike_factor: float = 0.0                 # > 0: a loss above factor x the moving mean is a spike
    spike_window: int = 20
    spike_snapshot: bool = True               # save a snapshot at each spike (checkpoints/spike_<step>)
    on_spike: Literal["log", "rollback"] = "log"  # rollback: resume from the last checkpoint before the spike,
    #                                               without the samples of the spike step (and the steps before
    #                                               it given by rollback_skip_steps)
    rollback_skip_steps: int = 1              # steps of samples to skip, ending with the spike step
    max_rollbacks: int = 3                    # after this many rollbacks a spike is only logged

    def check(self, recipe: "Recipe") -> list:
        problems = []
        if self.spike_factor < 0 or 0 < self.spike_factor <= 1 or self.spike_window < 1:
            problems.append(f"anomaly.spike_factor, anomaly.spike_window: need spike_factor 0 (off) or > 1 (a loss "
                            f"above that multiple of the moving mean) and spike_window >= 1, got "
                            f"{self.spike_factor}, {self.spike_window}")
        if self.on_spike == "rollback":
            if not self.spike_factor:
                problems.append("anomaly.on_spike: rollback needs anomaly.spike_factor > 0 (what a spike is)")
            if recipe.checkpointing is None or not recipe.checkpointing.save_checkpoint_steps:
                problems.append("anomaly.on_spike: rollback needs checkpoints to roll back to (a CheckpointMonitor "
                                "callback with save_checkpoint_steps)")
        if self.rollback_skip_steps < 1 or self.max_rollbacks < 0:
            problems.append("anomaly.rollback_skip_steps must be >= 1 and anomaly.max_rollbacks >= 0")
        return problems


@dataclass
class MonitoringConfig:
    """What a run reports about itself (ours)."""

    tensorboard: bool = True
    hang_timeout: int = 900  # seconds without a heartbeat before the launcher names the stalled rank and stops

    def check(self, recipe: "Recipe") -> list:
        return _at_least("monitoring", self, 1, "hang_timeout")


def _default_callbacks():
    return [LossMonitorConfig(), CheckpointMonitorConfig()]


@dataclass
class Recipe:
    output_dir: str
    model: ModelSection
    runner_config: RunnerConfig
    lr_schedule: LRScheduleConfig
    train_dataset: TrainDatasetConfig
    seed: int = 0
    run_mode: Literal["train"] = "train"
    load_checkpoint: str = ""
    # format of the files in load_checkpoint; scripts/convert_checkpoint.py writes safetensors
    load_ckpt_format: Literal["ckpt", "safetensors"] = "ckpt"
    resume_training: Union[bool, str] = False  # True: newest in load_checkpoint; a name: that checkpoint
    # a conversion directory whose optimizer/ holds AdamW moments (--from-megatron): the run starts with
    # them and with the optimizer step they were saved at
    load_optimizer_state: str = ""
    # MindFormers' key: a resume at another DP/TP/PP layout re-slices the checkpoint at load with the
    # strategy files the run saved (training/tools/relayout.py); refused on CPU, where no strategy file can exist
    auto_trans_ckpt: bool = False
    use_parallel: bool = False
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    context: ContextConfig = field(default_factory=ContextConfig)
    runner_wrapper: RunnerWrapperConfig = field(default_factory=RunnerWrapperConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    train_dataset_task: TrainDatasetTaskConfig = field(default_factory=TrainDatasetTaskConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    parallel_config: ParallelDegreesConfig = field(default_factory=ParallelDegreesConfig)
    recompute_config: RecomputeConfig = field(default_factory=RecomputeConfig)
    callbacks: list[Union[LossMonitorConfig, CheckpointMonitorConfig]] = field(default_factory=_default_callbacks)
    data_preparation: Optional[DataPreparationConfig] = None
    hardware: HardwareConfig = field(default_factory=HardwareConfig)
    hccl: HcclConfig = field(default_factory=HcclConfig)
    do_eval: bool = False
    eval_step_interval: int = 100
    eval_dataset: Optional[EvalDatasetConfig] = None
    profile: Optional[ProfileConfig] = None
    monitoring: MonitoringConfig = field(default_factory=MonitoringConfig)
    anomaly: AnomalyConfig = field(default_factory=AnomalyConfig)

    @property
    def runs_on_cpu(self) -> bool:
        """True when the recipe will execute on CPU; planning (--plan) skips the CPU-only refusals."""
        return self.context.device_target == "CPU" and not getattr(self, "planning", False)

    @property
    def world_size(self) -> int:
        """Devices the recipe asks for: data x tensor x pipeline parallel."""
        p = self.parallel_config
        return p.data_parallel * p.model_parallel * p.pipeline_stage

    @property
    def checkpointing(self) -> Optional["CheckpointMonitorConfig"]:
        return next((c for c in self.callbacks if c.type == "CheckpointMonitor"), None)

    @property
    def dataset_dir(self) -> str:
        return self.train_dataset.data_loader.dataset_dir

    @property
    def global_batch_size(self) -> int:
        """Sequences per optimizer step: micro-batch x data parallel x accumulation (pipeline micro-batches)."""
        p = self.parallel_config
        accumulation = self.runner_config.gradient_accumulation_steps * (p.micro_batch_num if p.pipeline_stage > 1
                                                                         else 1)
        return self.runner_config.batch_size * p.data_parallel * accumulation

    @property
    def tokens_per_step(self) -> int:
        """Tokens in one optimizer step across all data-parallel ranks."""
        return self.global_batch_size * self.model.model_config.seq_length

    def check(self) -> list:
        problems = _at_least("", self, 0, "seed") + _at_least("", self, 1, "eval_step_interval")
        for section in (self.context, self.runner_config, self.runner_wrapper, self.optimizer, self.lr_schedule,
                        self.model.model_config, self.train_dataset, self.parallel,
                        self.parallel.parallel_optimizer_config,
                        self.parallel_config, self.recompute_config, *self.callbacks, self.data_preparation,
                        self.hardware, self.hccl, self.eval_dataset, self.profile, self.monitoring, self.anomaly):
            if section is not None:
                problems.extend(section.check(self))
        task_block = self.train_dataset_task.dataset_config
        if task_block is not None and not _is_subset(task_block, to_plain(self.train_dataset)):
            problems.append("train_dataset_task.dataset_config: differs from train_dataset; omit it or write "
                            "`dataset_config: *train_dataset` (it is filled in from train_dataset)")
        if not self.output_dir:
            problems.append("output_dir: must name the run directory")
        if self.load_optimizer_state and (self.resume_training or not self.load_checkpoint):
            problems.append("load_optimizer_state: starts a new run from converted weights; it needs load_checkpoint "
                            "(the same conversion) and no resume_training (a resume restores its own optimizer)")
        if self.load_optimizer_state and (self.parallel_config.model_parallel > 1 or
                                          self.parallel_config.pipeline_stage > 1):
            problems.append("load_optimizer_state: the moments are whole tensors, loaded under data parallelism "
                            "only (parallel_config.model_parallel and pipeline_stage 1); drop it to restart the "
                            "optimizer")
        if self.auto_trans_ckpt and self.runs_on_cpu:
            problems.append("auto_trans_ckpt: re-slices a checkpoint with the parallel strategy files of the run that "
                            "saved it; those are written only by a semi-auto-parallel compile, which does not run on "
                            "CPU, so none can exist here (resume at the checkpoint's layout)")
        if self.do_eval and self.eval_dataset is None:
            problems.append("do_eval: True needs an eval_dataset section (data_loader.dataset_dir of a held-out "
                            "dataset, e.g. one written by scripts/prepare_data.py --val-fraction)")
        return problems

    def to_dict(self) -> dict:
        """The resolved recipe, in the same vocabulary it was written in."""
        data = to_plain(self)
        data["train_dataset_task"].pop("dataset_config", None)
        return data

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False, default_flow_style=None)


def _is_subset(small: dict, big: dict) -> bool:
    """True when every key of `small` is in `big` with an equal value (recursively)."""
    for key, value in small.items():
        if key not in big:
            return False
        if isinstance(value, dict) and isinstance(big[key], dict):
            if not _is_subset(value, big[key]):
                return False
        elif value != big[key]:
            return False
    return True


def parse_override(text: str) -> tuple:
    """'a.b.c=value' -> (['a', 'b', 'c'], value parsed as YAML)."""
    if "=" not in text:
        raise RecipeError("--set", [f"{text!r}: expected key.path=value"],
                          hint="e.g. --set runner_config.batch_size=4")
    key, raw = text.split("=", 1)
    parts = [p for p in key.strip().split(".") if p]
    if not parts:
        raise RecipeError("--set", [f"{text!r}: empty key path"])
    if not raw.strip():
        return parts, ""
    try:
        return parts, yaml.load(raw, Loader=StrictLoader)
    except yaml.YAMLError as err:
        raise RecipeError("--set", [f"{text!r}: the value is not valid YAML ({_one_line(err)})"],
                          hint="quote the whole argument for the shell, e.g. --set 'lr_schedule={lr_end: 0.0}'") \
            from None


def apply_override(data: dict, parts: list, value, problems: list) -> None:
    """Set data[parts...] = value; list items are addressed by index (callbacks.1.prefix).

    A mapping given for a key that holds a mapping is merged into it key by key, as a recipe
    is merged over its base (`--set 'runner_config={batch_size: 2}'` keeps stop_step); any
    other value replaces what was there (`data_preparation=null` removes the section).
    """
    node = data
    for depth, part in enumerate(parts[:-1]):
        where = ".".join(parts[:depth + 1])
        if isinstance(node, list):
            if not part.isdigit() or int(part) >= len(node):
                problems.append(f"--set {'.'.join(parts)}: {where} is not an index of a {len(node)}-item list")
                return
            node = node[int(part)]
        else:
            if node.get(part) is None:
                node[part] = {}
            node = node[part]
        if not isinstance(node, (dict, list)):
            problems.append(f"--set {'.'.join(parts)}: {where} is a value, not a section")
            return
    last = parts[-1]
    if isinstance(node, list):
        if not last.isdigit() or int(last) >= len(node):
            problems.append(f"--set {'.'.join(parts)}: {last} is not an index of a {len(node)}-item list")
            return
        last = int(last)
    elif last not in node:
        node[last] = value
        return
    if isinstance(value, dict) and isinstance(node[last], dict):
        node[last] = deep_merge(node[last], value)
    else:
        node[last] = value


def deep_merge(base: dict, override: dict) -> dict:
    """`override` on top of `base`: mappings merge key by key, anything else is replaced."""
    merged = dict(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = deep_merge(merged[key], value)
        else:
            merged[key] = value
    return merged


class DuplicateKeyError(yaml.YAMLError):
    """A mapping of a YAML document gives one key twice."""


class StrictLoader(yaml.SafeLoader):
    """PyYAML's safe loader, except that a key given twice in one mapping is an error (PyYAML keeps the last)."""

    def construct_mapping(self, node, deep=False):
        seen = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue  # `<<: *anchor` keys may be overridden by the mapping's own keys
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            try:
                if key in seen:
                    raise DuplicateKeyError(f"duplicate key {key!r} on line {line} (first on line {seen[key]}); "
                                            "the last one would silently win, give it once")
                seen[key] = line
            except TypeError:
                continue  # an unhashable key: the base class reports it
        return super().construct_mapping(node, deep)


def _one_line(err: yaml.YAMLError) -> str:
    return " ".join(str(err).split())


def read_yaml_file(path: str, hint: str = "recipes live in recipes/, e.g. recipes/demo_cpu.yaml") -> dict:
    """The top-level mapping of a UTF-8 YAML file, read strictly (duplicate keys refused); RecipeError otherwise."""
    if not os.path.isfile(path):
        raise RecipeError(path, ["file not found" if not os.path.isdir(path) else "a directory, not a file"],
                          hint=hint)
    try:
        with open(path, "rb") as f:
            raw = f.read()
        text = io.StringIO(raw.decode("utf-8-sig"))
        text.name = path  # YAML errors then name the file
        data = yaml.load(text, Loader=StrictLoader)
    except OSError as err:
        raise RecipeError(path, [f"cannot be read: {err.strerror}"]) from None
    except UnicodeDecodeError as err:
        line = raw[:err.start].count(b"\n") + 1
        raise RecipeError(path, [f"not UTF-8 text: byte {raw[err.start]:#04x} on line {line}"],
                          hint=f"save it as UTF-8, e.g. iconv -f latin1 -t utf-8 {path} > NEW.yaml") from None
    except yaml.YAMLError as err:
        raise RecipeError(path, [f"not valid YAML: {_one_line(err)}"]) from None
    if not isinstance(data, dict):
        raise RecipeError(path, ["the top level must be a mapping of sections"])
    return data


def read_recipe_file(path: str, chain: tuple = ()) -> dict:
    """The YAML mapping of `path`, with its `base:` file(s) (relative to it) merged underneath."""
    if not os.path.exists(path):
        where = f" (base of {chain[-1]})" if chain else ""
        raise RecipeError(path, [f"file not found{where}"],
                          hint="recipes live in recipes/, e.g. recipes/demo_cpu.yaml")
    if os.path.abspath(path) in chain:
        raise RecipeError(path, [f"base: circular inheritance through {' -> '.join(chain)}"])
    data = read_yaml_file(path)
    bases = data.pop("base", [])
    if isinstance(bases, str):
        bases = [bases]
    if not isinstance(bases, list) or not all(isinstance(b, str) and b for b in bases):
        raise RecipeError(path, [f"base: expected a file name or a list of file names (relative to the recipe), "
                                 f"got {bases!r}"], hint="e.g. base: base/cpu.yaml")
    merged: dict = {}
    for base in bases:
        base_path = os.path.join(os.path.dirname(path), base)
        merged = deep_merge(merged, read_recipe_file(base_path, chain + (os.path.abspath(path),)))
    return deep_merge(merged, data)


def load_recipe(path: str, overrides: tuple = (), planning: bool = False) -> Recipe:
    """Read (with bases), override, validate. Raises RecipeError listing every problem found.

    planning=True validates everything except what only matters when executing on this
    machine's CPU (bf16, tensor/pipeline parallel), so Ascend layouts can be planned here.
    """
    data = read_recipe_file(path)
    problems: list = []
    for text in overrides:
        apply_override(data, *parse_override(text), problems)
    return recipe_from_dict(data, path, problems, planning)


def recipe_from_dict(data: dict, source: str = "<dict>", problems: list = None, planning: bool = False) -> Recipe:
    """Validate an already-parsed recipe; `problems` carries earlier findings (e.g. from --set).

    The launcher (load_recipe) and every worker (RUN_DIR/recipe.yaml) validate through here,
    on paths resolved the same way, so they cannot disagree about a recipe.
    """
    problems = list(problems or [])
    refuse_mindformers_config(data, source)
    recipe = load_dataclass(Recipe, data, "", problems)
    recipe.planning = planning
    if not problems:
        resolve_paths(recipe)
        problems.extend(recipe.check())
    if problems:
        raise RecipeError(source, problems)
    return recipe


def resolve_path(path: str) -> str:
    """A recipe path made absolute against the current working directory, symlinks followed ('' stays '')."""
    return os.path.realpath(os.path.expanduser(path)) if path else path


def resolve_paths(recipe: Recipe) -> None:
    """Every path of the recipe resolved once, at load: relative paths are relative to the working directory."""
    recipe.output_dir = resolve_path(recipe.output_dir)
    recipe.load_checkpoint = resolve_path(recipe.load_checkpoint)
    recipe.load_optimizer_state = resolve_path(recipe.load_optimizer_state)
    ascend = recipe.context.ascend_config
    if ascend is not None and ascend.parallel_speed_up_json_path:
        ascend.parallel_speed_up_json_path = resolve_path(ascend.parallel_speed_up_json_path)
    loaders = [recipe.train_dataset.data_loader, *(recipe.train_dataset.blend or [])]
    if recipe.eval_dataset is not None:
        loaders.append(recipe.eval_dataset.data_loader)
    for loader in loaders:
        loader.dataset_dir = resolve_path(loader.dataset_dir)
    if recipe.data_preparation is not None:
        recipe.data_preparation.output_dir = resolve_path(recipe.data_preparation.output_dir)
    task = recipe.train_dataset_task
    loader = (task.dataset_config or {}).get("data_loader")
    if isinstance(loader, dict) and isinstance(loader.get("dataset_dir"), str):
        # The `dataset_config: *train_dataset` copy must keep comparing equal to train_dataset.
        loader = dict(loader, dataset_dir=resolve_path(loader["dataset_dir"]))
        task.dataset_config = dict(task.dataset_config, data_loader=loader)


# What only a MindFormers configuration has: sections and keys of MindFormers that recipes do not
# use, and MindFormers' own model classes (recipes train models/llama.py's).
MINDFORMERS_KEYS = ("processor", "metric", "eval_callbacks", "eval_dataset_task", "src_strategy_path_or_dir",
                    "only_save_strategy", "micro_batch_interleave_num", "moe_config",
                    "auto_tune", "filepath_prefix", "autotune_per_step", "profile_start_step", "profile_stop_step",
                    "profile_communication", "profile_memory", "init_start_profile", "layer_scale", "layer_decay",
                    "lr_scale_factor", "remote_save_url", "use_past", "monitor_config")


def mindformers_markers(data: dict) -> list:
    """The keys and model types of `data` that only a MindFormers configuration has."""
    found = []
    model = data.get("model")
    if isinstance(model, dict):
        for section, ours in (("model_config", LLAMA_CONFIG_TYPE), ("arch", LLAMA_MODEL_TYPE)):
            block = model.get(section)
            kind = block.get("type") if isinstance(block, dict) else None
            if isinstance(kind, str) and kind != ours and (kind.endswith("Config") or "For" in kind):
                found.append(f"model.{section}.type {kind}")
    found.extend(key for key in MINDFORMERS_KEYS if key in data)
    if isinstance(data.get("profile"), bool):
        found.append("profile: " + str(data["profile"]))
    return found


def refuse_mindformers_config(data: dict, source: str) -> None:
    """A MindFormers configuration gets one message saying so and how to import it, not a list of key errors."""
    markers = mindformers_markers(data)
    if len(markers) >= 2:
        raise RecipeError(source, [f"this is a MindFormers configuration, not a recipe of this repository (it has "
                                   f"{', '.join(markers[:6])}{', ...' if len(markers) > 6 else ''})"],
                          hint="convert it with: python scripts/convert_recipe.py --from-mindformers "
                               f"{shlex.quote(source)} --output recipes/NAME.yaml")
