"""Recipes: MindFormers' YAML vocabulary, loaded strictly into typed sections.

Precedence is defaults < YAML < `--set section.key=value`. Every unknown key, wrong type
and broken cross-field rule is collected and reported together, each with its dotted
path. Keys that MindFormers 1.9 accepts but silently ignores or resets (gradient
accumulation outside semi-auto parallel, `runner_config.stop_step`, sink mode on CPU)
are either made to work here or refused with the reason.
"""

import os
from dataclasses import dataclass, field
from typing import Literal, Optional, Union

import yaml

from models import LLAMA_CONFIG_TYPE, LLAMA_MODEL_TYPE
from models.parallel import layout_problems
from training.errors import RecipeError
from training.schema import load_dataclass, to_plain

SEQ_ALIGN = 16  # Ascend's Cube unit works on 16x16 tiles.


@dataclass
class TrainerConfig:
    type: Literal["CausalLanguageModelingTrainer"] = "CausalLanguageModelingTrainer"
    model_name: str = "llama"


@dataclass
class ContextConfig:
    mode: Literal[0, 1] = 0  # 0 = graph mode (compiled), 1 = PyNative (eager, for debugging only)
    device_target: Literal["CPU", "Ascend", "GPU"] = "CPU"
    device_id: int = 0
    max_call_depth: int = 10000
    max_device_memory: Optional[str] = None
    save_graphs: bool = False


@dataclass
class RunnerConfig:
    batch_size: int  # per device, per step (the micro-batch)
    epochs: int = 1
    stop_step: int = 0  # > 0: stop after this many steps (and size the LR schedule to it)
    sink_mode: bool = False
    sink_size: int = -1
    gradient_accumulation_steps: int = 1

    def check(self, recipe: "Recipe") -> list:
        problems = []
        if self.batch_size < 1:
            problems.append(f"runner_config.batch_size: must be >= 1, got {self.batch_size}")
        if self.epochs < 1:
            problems.append(f"runner_config.epochs: must be >= 1, got {self.epochs}")
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


@dataclass
class RunnerWrapperConfig:
    type: Literal["PortableTrainOneStepCell", "MFTrainOneStepCell"] = "PortableTrainOneStepCell"
    scale_sense: Union[float, DynamicLossScaleConfig] = 1.0
    use_clip_grad: bool = True
    max_grad_norm: float = 1.0

    def check(self, recipe: "Recipe") -> list:
        if self.type == "MFTrainOneStepCell" and recipe.runs_on_cpu:
            return ["runner_wrapper.type: MFTrainOneStepCell checks overflow with an Ascend-only kernel and "
                    "does not compile on CPU; use PortableTrainOneStepCell (same behaviour, portable check)"]
        return []


@dataclass
class OptimizerConfig:
    # FoldedAdamW (training/optim.py): AdamW's update on the fused AdamWeightDecay kernel (CPU recipes).
    type: Literal["AdamW", "FoldedAdamW"] = "AdamW"
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    eps: float = 1e-8
    weight_decay: float = 0.1

    def check(self, recipe: "Recipe") -> list:
        if len(self.betas) != 2 or not all(0.0 <= b < 1.0 for b in self.betas):
            return [f"optimizer.betas: expected two values in [0, 1), got {self.betas}"]
        return []


@dataclass
class LRScheduleConfig:
    learning_rate: float
    type: Literal["CosineWithWarmUpLR", "LinearWithWarmUpLR", "ConstantWarmUpLR"] = "CosineWithWarmUpLR"
    lr_end: float = 0.0
    warmup_ratio: Optional[float] = None
    warmup_steps: Optional[int] = None
    total_steps: int = -1  # -1: epochs x dataset size, or runner_config.stop_step when set

    def check(self, recipe: "Recipe") -> list:
        problems = []
        if self.learning_rate <= 0:
            problems.append(f"lr_schedule.learning_rate: must be > 0, got {self.learning_rate}")
        if self.warmup_ratio is not None and self.warmup_steps is not None:
            problems.append("lr_schedule.warmup_ratio, lr_schedule.warmup_steps: set one of them, not both")
        if self.warmup_ratio is not None and not 0.0 <= self.warmup_ratio < 1.0:
            problems.append(f"lr_schedule.warmup_ratio: must be in [0, 1), got {self.warmup_ratio}")
        return problems


@dataclass
class ModelConfig:
    """Architecture of the Llama-style decoder (see models/llama.py)."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int
    seq_length: int
    type: Literal[LLAMA_CONFIG_TYPE] = LLAMA_CONFIG_TYPE
    num_kv_heads: Optional[int] = None
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    initializer_range: float = 0.02
    tie_word_embeddings: bool = False
    qkv_bias: bool = False                 # bias on q/k/v projections (Qwen2-style checkpoints)
    vocab_pad_multiple: int = 16           # tables padded to a multiple of this x model_parallel
    document_attention: bool = False       # packed documents: reset positions, block attention at EOD
    bos_token_id: int = 1
    eos_token_id: int = 2
    pad_token_id: int = 3
    compute_dtype: Literal["float32", "float16", "bfloat16"] = "float32"

    def check(self, recipe: "Recipe") -> list:
        p = "model.model_config"
        problems = [f"{p}.{name}: must be >= 1, got {getattr(self, name)}"
                    for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "intermediate_size",
                                 "seq_length") if getattr(self, name) < 1]
        if problems:
            return problems
        if self.seq_length % SEQ_ALIGN:
            problems.append(f"{p}.seq_length: {self.seq_length} is not a multiple of {SEQ_ALIGN}; Ascend pads "
                            f"such shapes inside every matmul. Use {_round_up(self.seq_length, SEQ_ALIGN)}")
        if self.vocab_pad_multiple < 1 or self.vocab_pad_multiple % SEQ_ALIGN:
            problems.append(f"{p}.vocab_pad_multiple: {self.vocab_pad_multiple} must be a positive multiple of "
                            f"{SEQ_ALIGN}")
        for name in ("hidden_size", "intermediate_size"):
            if getattr(self, name) % SEQ_ALIGN:
                problems.append(f"{p}.{name}: {getattr(self, name)} is not a multiple of {SEQ_ALIGN} (the Cube "
                                f"unit's tile); use {_round_up(getattr(self, name), SEQ_ALIGN)}")
        if not self.hidden_size % self.num_heads and (self.hidden_size // self.num_heads) % SEQ_ALIGN:
            problems.append(f"{p}.hidden_size, {p}.num_heads: head size {self.hidden_size // self.num_heads} is not "
                            f"a multiple of {SEQ_ALIGN}; attention matmuls would be padded on Ascend")
        if self.hidden_size % self.num_heads:
            problems.append(f"{p}.hidden_size, {p}.num_heads: hidden_size {self.hidden_size} is not "
                            f"divisible by num_heads {self.num_heads}")
        elif (self.hidden_size // self.num_heads) % 2:
            problems.append(f"{p}.hidden_size, {p}.num_heads: head size {self.hidden_size // self.num_heads} "
                            "must be even for rotary embeddings")
        kv = self.num_kv_heads if self.num_kv_heads is not None else self.num_heads
        if kv < 1 or self.num_heads % kv:
            problems.append(f"{p}.num_kv_heads: {kv} must divide num_heads {self.num_heads}")
        if self.compute_dtype == "bfloat16" and recipe.runs_on_cpu:
            problems.append(f"{p}.compute_dtype: bfloat16 kernels exist only on Ascend/GPU; "
                            "use float32 (or float16) on CPU")
        return problems


@dataclass
class ArchConfig:
    type: Literal[LLAMA_MODEL_TYPE] = LLAMA_MODEL_TYPE


@dataclass
class ModelSection:
    model_config: ModelConfig
    arch: ArchConfig = field(default_factory=ArchConfig)


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
        problems = []
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
        dirs = [os.path.normpath(b.dataset_dir) for b in self.blend]
        if len(set(dirs)) != len(dirs):
            problems.append("train_dataset.blend: lists a dataset_dir more than once; give it one weight")
        if os.path.normpath(self.data_loader.dataset_dir) not in dirs:
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
        problems = [f"{p}.{n}: must be >= 1, got {getattr(self, n)}"
                    for n in ("data_parallel", "model_parallel", "pipeline_stage", "micro_batch_num",
                              "gradient_aggregation_group")
                    if getattr(self, n) < 1]
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
    select_recompute: bool = False
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
        if self.select_recompute:
            return ["recompute_config.select_recompute: selective recompute is not implemented by "
                    "models/llama.py yet; use recompute: True (full recompute per layer)"]
        return []


@dataclass
class LossMonitorConfig:
    type: Literal["MFLossMonitor"] = "MFLossMonitor"
    per_print_times: int = 1


@dataclass
class CheckpointMonitorConfig:
    type: Literal["CheckpointMonitor"] = "CheckpointMonitor"
    prefix: str = "llama"
    save_checkpoint_steps: int = 100
    keep_checkpoint_max: int = 3   # the newest N steps are kept
    keep_every: int = 0            # ours: also keep every step divisible by this (0: none)
    integrated_save: bool = False
    async_save: bool = False       # copy to host, then write files in the background


@dataclass
class DataPreparationConfig:
    """How to build `train_dataset.data_loader.dataset_dir` when it does not exist yet (ours)."""

    source: Literal["python_stdlib"] = "python_stdlib"
    vocab_size: int = 2048
    max_documents: int = 0  # 0 = every document of the source


@dataclass
class HardwareConfig:
    """Where the recipe is meant to run (ours; MindFormers has no such section)."""

    device: str = "CPU"         # a device of training/planner.py's table, e.g. Ascend910B2
    devices_per_node: int = 0   # 0: every worker on one node

    def check(self, recipe: "Recipe") -> list:
        n, tp = self.devices_per_node, recipe.parallel_config.model_parallel
        if n < 0:
            return [f"hardware.devices_per_node: must be >= 0, got {n}"]
        if n == 0:
            return []
        problems = []
        if recipe.world_size % n:
            problems.append(f"hardware.devices_per_node: {n} does not divide the {recipe.world_size} devices of "
                            "parallel_config (data_parallel x model_parallel x pipeline_stage)")
        if tp > n or n % tp:
            problems.append(f"parallel_config.model_parallel: {tp} must fit within one node "
                            f"(hardware.devices_per_node {n}); tensor parallelism across nodes is too slow")
        return problems

    def nodes(self, world_size: int) -> int:
        return world_size // self.devices_per_node if self.devices_per_node else 1


@dataclass
class HcclConfig:
    """HCCL settings the launcher exports to every rank before communication starts (ours).

    None keeps training/preflight.py's documented default. Changing them after HCCL has
    initialised hangs silently, so they are never read from a rank's own environment.
    """

    connect_timeout: Optional[int] = None  # HCCL_CONNECT_TIMEOUT, seconds
    exec_timeout: Optional[int] = None     # HCCL_EXEC_TIMEOUT, seconds
    buffsize: Optional[int] = None         # HCCL_BUFFSIZE, MB


@dataclass
class EvalDatasetConfig:
    """Held-out data evaluated during training (MindFormers' eval_dataset block, read by our callback)."""

    data_loader: DataLoaderConfig
    input_columns: list[str] = field(default_factory=lambda: ["input_ids"])
    max_batches: int = 0  # ours: evaluate at most this many batches (0 = the whole dataset)


@dataclass
class ProfileConfig:
    """Record a MindSpore Profiler trace for steps [start_step, stop_step] only."""

    start_step: int
    stop_step: int


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
        if self.spike_factor < 0 or self.spike_window < 1:
            problems.append("anomaly.spike_factor must be >= 0 and anomaly.spike_window >= 1")
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
        problems = []
        for section in (self.runner_config, self.runner_wrapper, self.optimizer, self.lr_schedule,
                        self.model.model_config, self.train_dataset, self.parallel, self.parallel_config,
                        self.recompute_config, self.hardware, self.anomaly):
            problems.extend(section.check(self))
        task_block = self.train_dataset_task.dataset_config
        if task_block is not None and not _is_subset(task_block, to_plain(self.train_dataset)):
            problems.append("train_dataset_task.dataset_config: differs from train_dataset; omit it or write "
                            "`dataset_config: *train_dataset` (it is filled in from train_dataset)")
        if not self.output_dir:
            problems.append("output_dir: must name the run directory")
        if self.do_eval and self.eval_dataset is None:
            problems.append("do_eval: True needs an eval_dataset section (data_loader.dataset_dir of a held-out "
                            "dataset, e.g. one written by scripts/prepare_data.py --val-fraction)")
        if self.eval_step_interval < 1:
            problems.append(f"eval_step_interval: must be >= 1, got {self.eval_step_interval}")
        if self.profile is not None and not 1 <= self.profile.start_step <= self.profile.stop_step:
            problems.append(f"profile.start_step, profile.stop_step: need 1 <= start_step <= stop_step, got "
                            f"{self.profile.start_step}..{self.profile.stop_step}")
        if self.monitoring.hang_timeout < 1:
            problems.append(f"monitoring.hang_timeout: must be >= 1 second, got {self.monitoring.hang_timeout}")
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


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def parse_override(text: str) -> tuple:
    """'a.b.c=value' -> (['a', 'b', 'c'], value parsed as YAML)."""
    if "=" not in text:
        raise RecipeError("--set", [f"{text!r}: expected key.path=value"],
                          hint="e.g. --set runner_config.batch_size=4")
    key, raw = text.split("=", 1)
    parts = [p for p in key.strip().split(".") if p]
    if not parts:
        raise RecipeError("--set", [f"{text!r}: empty key path"])
    return parts, yaml.safe_load(raw) if raw.strip() else ""


def apply_override(data: dict, parts: list, value, problems: list) -> None:
    """Set data[parts...] = value; list items are addressed by index (callbacks.1.prefix)."""
    node = data
    for depth, part in enumerate(parts[:-1]):
        where = ".".join(parts[:depth + 1])
        if isinstance(node, list):
            if not part.isdigit() or int(part) >= len(node):
                problems.append(f"--set {'.'.join(parts)}: {where} is not an index of a {len(node)}-item list")
                return
            node = node[int(part)]
        else:
            node = node.setdefault(part, {})
        if not isinstance(node, (dict, list)):
            problems.append(f"--set {'.'.join(parts)}: {where} is a value, not a section")
            return
    last = parts[-1]
    if isinstance(node, list):
        if not last.isdigit() or int(last) >= len(node):
            problems.append(f"--set {'.'.join(parts)}: {last} is not an index of a {len(node)}-item list")
            return
        node[int(last)] = value
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


def read_recipe_file(path: str, chain: tuple = ()) -> dict:
    """The YAML mapping of `path`, with its `base:` file(s) (relative to it) merged underneath."""
    if not os.path.isfile(path):
        where = f" (base of {chain[-1]})" if chain else ""
        raise RecipeError(path, [f"file not found{where}"],
                          hint="recipes live in recipes/, e.g. recipes/demo_cpu.yaml")
    if os.path.abspath(path) in chain:
        raise RecipeError(path, [f"base: circular inheritance through {' -> '.join(chain)}"])
    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f)
    except yaml.YAMLError as err:
        raise RecipeError(path, [f"not valid YAML: {err}"]) from None
    if not isinstance(data, dict):
        raise RecipeError(path, ["the top level must be a mapping of sections"])
    bases = data.pop("base", [])
    merged: dict = {}
    for base in [bases] if isinstance(bases, str) else bases:
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
    """Validate an already-parsed recipe; `problems` carries earlier findings (e.g. from --set)."""
    problems = list(problems or [])
    recipe = load_dataclass(Recipe, data, "", problems)
    recipe.planning = planning
    if not problems:
        problems.extend(recipe.check())
    if problems:
        raise RecipeError(source, problems)
    return recipe
