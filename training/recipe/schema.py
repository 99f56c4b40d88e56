"""Recipes: MindFormers' YAML vocabulary as typed sections, with their cross-field rules.

Every unknown key, wrong type and broken cross-field rule is collected and reported together,
each with its dotted path. Keys that MindFormers 1.9 accepts but silently ignores or resets
(gradient accumulation outside semi-auto parallel, `runner_config.stop_step`, sink mode on CPU)
are either made to work here or refused with the reason. The machine's sections (context,
hardware, hccl) are in device.py; reading YAML, overrides and paths in loading.py.
"""

import os
from dataclasses import dataclass, field
from typing import Literal, Optional, Union

import yaml

from ascend_llm_recipes.common.schema import int_max, to_plain
from ascend_llm_recipes.models.config import ModelSection
from ascend_llm_recipes.models.parallel import layout_problems, recompute_mode
from ascend_llm_recipes.training.recipe.checks import at_least, callback_key, positive
from ascend_llm_recipes.training.recipe.device import ContextConfig, HardwareConfig, HcclConfig


@dataclass
class TrainerConfig:
    type: Literal["CausalLanguageModelingTrainer"] = "CausalLanguageModelingTrainer"
    model_name: str = "llama"


@dataclass
class RunnerConfig:
    batch_size: int  # per device, per step (the micro-batch)
    epochs: int = 1
    stop_step: int = 0  # > 0: stop after this many steps (and size the LR schedule to it)
    sink_mode: bool = False
    sink_size: int = -1
    gradient_accumulation_steps: int = 1

    def check(self, recipe: "Recipe") -> list:
        problems = at_least("runner_config", self, 1, "batch_size", "epochs", "gradient_accumulation_steps")
        if self.sink_size != -1 and self.sink_size < 1:
            problems.append(f"runner_config.sink_size: must be -1 (the whole dataset) or >= 1, got {self.sink_size}")
        if self.stop_step < 0:
            problems.append(f"runner_config.stop_step: must be >= 0 (0 = run all epochs), got {self.stop_step}")
        if self.sink_mode and recipe.runs_on_cpu:
            problems.append("runner_config.sink_mode: True on CPU silently multiplies the number of steps; use False")
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
        return (positive(p, self, "loss_scale_value") + at_least(p, self, 2, "scale_factor")
                + at_least(p, self, 1, "scale_window"))


@dataclass
class RunnerWrapperConfig:
    type: Literal["PortableTrainOneStepCell", "MFTrainOneStepCell"] = "PortableTrainOneStepCell"
    scale_sense: Union[float, DynamicLossScaleConfig] = 1.0
    use_clip_grad: bool = True
    max_grad_norm: float = 1.0

    def check(self, recipe: "Recipe") -> list:
        problems = positive("runner_wrapper", self, "max_grad_norm")
        if isinstance(self.scale_sense, DynamicLossScaleConfig):
            problems.extend(self.scale_sense.check(recipe))
        else:
            problems.extend(positive("runner_wrapper", self, "scale_sense"))
            if (self.scale_sense == 1.0 and recipe.model.model_config.compute_dtype == "float16"
                    and recipe.context.device_target != "CPU"):
                # float16's smallest normal number is 6.1e-5: small gradients flush to zero unscaled.
                # MindFormers' float16 configs all scale dynamically (configs/llama2/pretrain_llama2_7b.yaml).
                problems.append("runner_wrapper.scale_sense: 1.0 (no loss scaling) with model.model_config."
                                "compute_dtype float16: small gradients underflow to zero in float16; use "
                                "{type: DynamicLossScaleUpdateCell, loss_scale_value: 65536, scale_factor: 2, "
                                "scale_window: 1000} (or bfloat16 where the device has it)")
        if self.type == "MFTrainOneStepCell" and recipe.runs_on_cpu:
            problems.append("runner_wrapper.type: MFTrainOneStepCell checks overflow with an Ascend-only kernel and "
                            "does not compile on CPU; use PortableTrainOneStepCell (same behaviour, portable check)")
        return problems


@dataclass
class OptimizerConfig:
    # FoldedAdamW (training/worker/optim.py): AdamW's update on the fused AdamWeightDecay kernel (CPU recipes).
    type: Literal["AdamW", "FoldedAdamW"] = "AdamW"
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    eps: float = 1e-8
    weight_decay: float = 0.1

    def check(self, recipe: "Recipe") -> list:
        problems = positive("optimizer", self, "eps") + at_least("optimizer", self, 0, "weight_decay")
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
        problems = positive(p, self, "learning_rate")
        problems += at_least(p, self, 0, "lr_end", "warmup_steps", "start_step")
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
        problems = at_least("train_dataset", self, 1, "num_parallel_workers", "repeat", "prefetch_size")
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
    """MindSpore's optimizer parallel (semi-auto/auto parallel with enable_parallel_optimizer): level1 slices weights
    and optimizer states over data parallel (the gathered weights live from forward to backward), level2 also
    slices gradients, level3 also re-gathers weights before backward so the forward copies are freed."""

    optimizer_level: Literal["level1", "level2", "level3"] = "level1"
    parallel_optimizer_threshold: int = 64  # KB; smaller parameters are not sliced

    def check(self, recipe: "Recipe") -> list:
        return at_least("parallel.parallel_optimizer_config", self, 0, "parallel_optimizer_threshold")


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
        if self.enable_parallel_optimizer and recipe.runs_on_cpu:  # mindspore/nn/optim/optimizer.py:285-296
            return ["parallel.enable_parallel_optimizer: True on CPU: MindSpore's optimizer parallel runs on Ascend "
                    "only in data-parallel mode (the optimizer raises at setup); set it to False on CPU"]
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
    expert_parallel: int = 1  # MindFormers' key: routed experts split over devices of data x model parallel
    micro_batch_num: int = 1
    use_seq_parallel: bool = False
    vocab_emb_dp: bool = True
    gradient_aggregation_group: int = 4
    stage_layers: Optional[list[int]] = None  # ours: explicit layers per pipeline stage (default balanced)

    def check(self, recipe: "Recipe") -> list:
        p = "parallel_config"
        problems = at_least(p, self, 1, "data_parallel", "model_parallel", "pipeline_stage", "expert_parallel",
                            "micro_batch_num", "gradient_aggregation_group")
        if self.use_seq_parallel:
            problems.append(f"{p}.use_seq_parallel: sequence parallelism is not implemented by models/parallel.py "
                            "(MindFormers applies it inside its own layers); set it to False")
        if problems:
            return problems
        problems.extend(layout_problems(recipe.model.model_config, self.data_parallel, self.model_parallel,
                                        self.pipeline_stage, self.micro_batch_num, self.stage_layers,
                                        ep=self.expert_parallel, cpu=recipe.runs_on_cpu))
        if self.pipeline_stage > 1 and recipe.runner_config.gradient_accumulation_steps > 1:
            problems.append(f"runner_config.gradient_accumulation_steps: MindFormers resets it to 1 under pipeline "
                            f"stages (trainer/base_trainer.py:313-319); accumulate with {p}.micro_batch_num")
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

    @property
    def mode(self) -> str:
        """models/parallel.py's recompute mode of these two flags (full wins over selective, as in MindFormers
        utils.py:383-402)."""
        return recompute_mode(self.recompute, self.select_recompute)

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
        return at_least(callback_key(recipe, self), self, 1, "per_print_times")


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
        p = callback_key(recipe, self)
        problems = (at_least(p, self, 0, "save_checkpoint_steps", "keep_every")
                    + at_least(p, self, 1, "keep_checkpoint_max"))
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
        problems = at_least(p, self, 1, "vocab_size") + at_least(p, self, 0, "max_documents")
        if not self.output_dir:
            problems.append(f"{p}.output_dir: must name the dataset directory it builds")
        return problems


@dataclass
class EvalDatasetConfig:
    """Held-out data evaluated during training (MindFormers' eval_dataset block, read by our callback)."""

    data_loader: DataLoaderConfig
    input_columns: list[str] = field(default_factory=lambda: ["input_ids"])
    max_batches: int = 0  # ours: evaluate at most this many batches (0 = the whole dataset)

    def check(self, recipe: "Recipe") -> list:
        return at_least("eval_dataset", self, 0, "max_batches")


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
    # Mixture of Experts: warn of a router collapse when a layer's num_experts_per_tok busiest experts took more than
    # this multiple of their even share of the routing slots over the last 10 steps (capped at 90% of the way from a
    # uniform router's to the most, num_experts / num_experts_per_tok: training/worker/router_stats.py
    # CollapseWatch); 0: off
    collapse_factor: float = 3.0

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
        if self.collapse_factor < 0 or 0 < self.collapse_factor <= 1:
            problems.append(f"anomaly.collapse_factor: {self.collapse_factor} must be 0 (off) or > 1 (a multiple of "
                            "the mean expert load)")
        if self.rollback_skip_steps < 1 or self.max_rollbacks < 0:
            problems.append("anomaly.rollback_skip_steps must be >= 1 and anomaly.max_rollbacks >= 0")
        return problems


@dataclass
class MonitoringConfig:
    """What a run reports about itself (ours)."""

    tensorboard: bool = True
    hang_timeout: int = 900  # seconds without a heartbeat before the launcher names the stalled rank and stops
    # The same for a rank still starting (imports, setup, graph compile: until its first step ends), which can take
    # far longer than a step; unset: hang_timeout.
    startup_timeout: Optional[int] = None

    def check(self, recipe: "Recipe") -> list:
        return at_least("monitoring", self, 1, "hang_timeout", "startup_timeout")


def _default_callbacks():
    return [LossMonitorConfig(), CheckpointMonitorConfig()]


@dataclass
class Recipe:
    output_dir: str
    model: ModelSection
    runner_config: RunnerConfig
    lr_schedule: LRScheduleConfig
    train_dataset: TrainDatasetConfig
    seed: int = field(default=0, metadata=int_max(2**32 - 1))  # MindSpore's seeds are unsigned 32-bit integers
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
    # MindFormers' key: True = deterministic kernels and collectives (training/recipe/mindformers.py worker_config)
    train_precision_sync: bool = False
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
        problems = at_least("", self, 0, "seed") + at_least("", self, 1, "eval_step_interval")
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
    return all(key in big and (_is_subset(value, big[key]) if isinstance(value, dict) and isinstance(big[key], dict)
                               else value == big[key]) for key, value in small.items())
