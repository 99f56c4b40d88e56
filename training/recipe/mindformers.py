"""The one translation between a recipe and MindFormers 1.9: key tables, the exporters, MindFormers' quirks.

- `MODEL_KEYS`: our model_config keys <-> MindFormers' LlamaConfig arguments, stated once and read
  both ways (the importer, mindformers_import.py, reads the right column into the left; the exporters
  write the left into the right).
- `worker_config`: the recipe as MindFormers' Trainer reads it to train our model (training/worker/train.py).
- `to_mindformers`: the recipe as a MindFormers configuration training MindFormers' own model: its legacy
  LlamaForCausalLM (use_legacy: True) for a Llama, its 1.9 format (use_legacy: False) for Qwen3, Qwen3-MoE and
  DeepSeek-V3 models (mindformers_mcore_export.py).
- `model_layout`: the parallel layout models/llama.py applies, a typed value planned from the recipe
  (models/parallel.py LlamaLayout), handed to the model's constructor; never read back from the
  parallel config MindFormers attaches to the model config.

MindFormers defaults and behaviours below are those of the installed MindFormers 1.9 (file:line in
site-packages `mindformers/`); tests/test_convert_recipe.py checks the defaults against the installed classes.
"""

import copy
import os
from dataclasses import dataclass, field

import yaml

from ascend_llm_recipes.common.errors import RecipeError
from ascend_llm_recipes.common.files import write_atomic, write_new
from ascend_llm_recipes.common.schema import to_plain
from ascend_llm_recipes.models.arithmetic import param_count, round_up
from ascend_llm_recipes.models.parallel import RECOMPUTE_OPTIONS, LlamaLayout, plan_layout
from ascend_llm_recipes.training.recipe.loading import (deep_merge, load_recipe, prune_inherited, read_recipe_file,
                                                        read_yaml_file, recipe_from_dict)
from ascend_llm_recipes.training.recipe.schema import START_STEP_LR, Recipe, TrainerConfig

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BASES = {"CPU": os.path.join(REPO_ROOT, "recipes", "base", "cpu.yaml"),
         "Ascend": os.path.join(REPO_ROOT, "recipes", "base", "ascend.yaml")}
MF_CONFIG_TYPE = "LlamaConfig"
MF_MODEL_TYPE = "LlamaForCausalLM"

# Our model_config key <-> MindFormers' LlamaConfig argument (models/llama/llama_config.py:131-187), for every
# architecture key the two share. The importer carries the right column into the left, the exporters the left
# into the right.
MODEL_KEYS = (
    ("vocab_size", "vocab_size"), ("hidden_size", "hidden_size"), ("num_layers", "num_layers"),
    ("num_heads", "num_heads"), ("num_kv_heads", "n_kv_heads"), ("intermediate_size", "intermediate_size"),
    ("seq_length", "seq_length"), ("rms_norm_eps", "rms_norm_eps"), ("rope_theta", "theta"),
    ("qkv_bias", "qkv_has_bias"), ("tie_word_embeddings", "tie_word_embeddings"),
    ("initializer_range", "init_method_std"), ("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"),
    ("pad_token_id", "pad_token_id"), ("compute_dtype", "compute_dtype"), ("param_dtype", "param_init_type"),
    # Ascend kernel switches, with MindFormers' names and meanings (models/llama.py)
    ("use_flash_attention", "use_flash_attention"), ("use_attn_mask_compression", "use_attn_mask_compression"),
    ("fused_rms_norm", "fused_rms_norm"),
)
OURS = {theirs: ours for ours, theirs in MODEL_KEYS}
# MindFormers' LlamaConfig computes norms, softmax and rotary in these dtypes; ours always in float32.
FLOAT32_COMPUTE_KEYS = ("layernorm_compute_type", "softmax_compute_type", "rotary_dtype")

# Arguments of MindFormers' LlamaConfig.__init__ (models/llama/llama_config.py:131-187). A key of
# model_config outside this list is swallowed by **kwargs and never read by the Llama model.
LLAMA_CONFIG_ARGS = (
    "batch_size", "seq_length", "hidden_size", "num_layers", "num_heads", "n_kv_heads", "max_position_embedding",
    "intermediate_size", "vocab_size", "multiple_of", "ffn_dim_multiplier", "rms_norm_eps", "bos_token_id",
    "eos_token_id", "pad_token_id", "ignore_token_id", "theta", "compute_dtype", "layernorm_compute_type",
    "softmax_compute_type", "rotary_dtype", "param_init_type", "residual_dtype", "embedding_init_type",
    "qkv_has_bias", "qkv_concat", "attn_proj_has_bias", "parallel_config", "moe_config", "use_past",
    "extend_method", "scaling_factor", "is_dynamic", "use_rope_slice", "use_flash_attention", "use_ring_attention",
    "use_attn_mask_compression", "use_eod_attn_mask_compression", "parallel_optimizer", "fine_grain_interleave",
    "pp_interleave_num", "offset", "init_method_std", "checkpoint_name_or_path", "repetition_penalty",
    "max_decode_length", "block_size", "num_blocks", "top_k", "top_p", "do_sample", "quant_config",
    "tie_word_embeddings", "llm_backend", "fused_rms_norm", "input_sliced_sig", "rmsnorm_compute_2d",
    "chunk_prefill", "calculate_per_token_loss", "pipeline_stage", "return_hidden_states",
)

# MindFormers' defaults for the keys we carry, each with where it is defined.
MF_DEFAULTS = {
    # models/llama/llama_config.py:131-187 (LlamaConfig.__init__)
    "model_config": dict(seq_length=2048, hidden_size=4096, num_layers=32, num_heads=32, n_kv_heads=None,
                         intermediate_size=None, vocab_size=32000, multiple_of=256, ffn_dim_multiplier=None,
                         rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, pad_token_id=0, theta=10000.0,
                         compute_dtype="float16", qkv_has_bias=False, tie_word_embeddings=False,
                         init_method_std=0.01),
    # core/optim/adamw.py:158 (AdamW.__init__)
    "AdamW": dict(betas=[0.9, 0.999], eps=1e-8, weight_decay=0.0),
    # mindspore/nn/optim/adam.py:975 (nn.AdamWeightDecay.__init__, FP32StateAdamWeightDecay's parent)
    "AdamWeightDecay": dict(beta1=0.9, beta2=0.999, eps=1e-6, weight_decay=0.0),
    # core/lr/lr_schedule.py:463 (CosineWithWarmUpLR.__init__); the other schedules share these names
    "lr_schedule": dict(lr_end=0.0, warmup_lr_init=0.0, num_cycles=0.5, decay_steps=None, decay_ratio=None),
    # wrapper/wrapper.py:235 (MFTrainOneStepCell.__init__)
    "runner_wrapper": dict(use_clip_grad=False, max_grad_norm=1.0, scale_sense=1.0),
    # core/callback/callback.py:1660 (CheckpointMonitor.__init__)
    "CheckpointMonitor": dict(prefix="CKP", save_checkpoint_steps=1, keep_checkpoint_max=5, integrated_save=True,
                              async_save=False),
    # modules/transformer/transformer.py:558 (TransformerOpParallelConfig.__init__)
    "parallel_config": dict(data_parallel=1, model_parallel=1, pipeline_stage=1, expert_parallel=1, micro_batch_num=1,
                            use_seq_parallel=False, vocab_emb_dp=True, gradient_aggregation_group=4),
}

NUMERIC_KEYS = ("model.model_config.hidden_size", "model.model_config.num_heads", "model.model_config.multiple_of",
                "model.model_config.ffn_dim_multiplier", "runner_config.batch_size",
                "runner_config.gradient_accumulation_steps", "micro_batch_interleave_num",
                "parallel_config.data_parallel", "parallel_config.model_parallel", "parallel_config.pipeline_stage",
                "parallel_config.micro_batch_num")
OUR_SCHEDULES = ("CosineWithWarmUpLR", "LinearWithWarmUpLR", "ConstantWarmUpLR")
ADAM_WEIGHT_DECAY_TYPES = ("FP32StateAdamWeightDecay", "AdamWeightDecay")
OURS_FP32 = "ours keeps float32 master weights and computes norms, softmax, rotary and the loss in float32 " \
            "(models/llama.py); only matmuls use compute_dtype"
SAME_MATH = "our model has no such switch (models/llama.py uses the same ops on every device): same math"

# Keys dropped whatever their value, with the reason (dotted paths; `*` is any callback index).
DROPPED = {
    "src_strategy_path_or_dir": "distributed-checkpoint strategy files: ours resumes by rerunning the same command, "
                                "and finds them in the run directory for a resume at another layout "
                                "(training/tools/relayout.py)",
    "auto_trans_ckpt": "re-slices load_checkpoint, which is not imported; ours sets auto_trans_ckpt to resume a run "
                       "at another layout (training/tools/relayout.py)",
    "only_save_strategy": "MindFormers' strategy-only dry run: not used by ours",
    "processor": "tokenizer/processor for inference: ours trains on token ids prepared by scripts/prepare_data.py",
    "metric": "evaluation metric class: ours reports held-out loss and perplexity (eval_dataset)",
    "eval_callbacks": "evaluation callbacks (OBS upload): not used by ours",
    "eval_dataset_task": "MindFormers' evaluation dataset task: ours evaluates eval_dataset itself",
    "eval_epoch_interval": "ours evaluates every eval_step_interval steps",
    "auto_tune": "MindFormers' hyper-parameter auto-tuning: not part of a training run",
    "filepath_prefix": "auto-tuning output: not part of a training run",
    "autotune_per_step": "auto-tuning: not part of a training run",
    "init_start_profile": "profiler option: ours records a trace only for the profile: window",
    "profile_communication": "profiler option: ours records MindSpore's default profile",
    "profile_memory": "profiler option: ours records MindSpore's default profile",
    "remote_save_url": "AICC/OBS upload address: not used by ours (run directory on local or shared disk)",
    "train_dataset.batch_size": "the micro-batch is runner_config.batch_size (train_dataset_block writes it into "
                                "the dataset block)",
    "train_dataset_task.dataset_config": "MindFormers' copy of train_dataset (a YAML alias): filled in from it",
    "parallel.enable_alltoall": "all-to-all communication for mixture-of-experts: the model is dense",
    "parallel.strategy_ckpt_save_file": "ours saves every rank's strategy file in RUN_DIR/strategy/ in semi-auto "
                                        "parallel, as MindFormers does (training/tools/relayout.py)",
    "parallel.strategy_ckpt_config": "ours saves every rank's strategy file in RUN_DIR/strategy/ in semi-auto "
                                     "parallel, all parameters, as MindFormers does (training/tools/relayout.py)",
    "parallel.parallel_optimizer_config.gradient_accumulation_shard": "MindFormers' accumulation-buffer "
                                                                      "sharding: memory only, not in our schema",
    "recompute_config.select_comm_recompute": "selective recompute of communication: memory only; ours "
                                              "recomputes whole layers (recompute_config.recompute)",
    "context.save_graphs_path": "graphs are not saved (context.save_graphs)",
    "context.memory_optimize_level": "device memory tuning: MindSpore's default applies",
    "context.enable_graph_kernel": "graph-kernel fusion: MindSpore's default (off) applies",
    "context.graph_kernel_flags": "graph-kernel fusion: MindSpore's default (off) applies",
    "context.runtime_num_threads": "host threads: MindSpore's default applies",
    "model.model_config.batch_size": "inference batch size (generation)",
    "model.model_config.use_past": "inference KV cache",
    "model.model_config.is_dynamic": "inference dynamic shapes",
    "model.model_config.block_size": "inference paged-attention block size",
    "model.model_config.num_blocks": "inference paged-attention blocks",
    "model.model_config.repetition_penalty": "inference sampling",
    "model.model_config.max_decode_length": "inference sampling",
    "model.model_config.top_k": "inference sampling",
    "model.model_config.top_p": "inference sampling",
    "model.model_config.do_sample": "inference sampling",
    "model.model_config.llm_backend": "inference backend",
    "model.model_config.chunk_prefill": "inference prefill",
    "model.model_config.return_hidden_states": "inference output",
    "model.model_config.max_position_embedding": "inference length limit: rotary tables cover seq_length",
    "model.model_config.checkpoint_name_or_path": "weights MindFormers downloads for inference/finetuning; ours "
                                                  "starts from load_checkpoint (empty: from scratch)",
    "model.model_config.ignore_token_id": "ours masks the loss at pad_token_id (labels are the shifted inputs)",
    "model.model_config.layernorm_compute_type": OURS_FP32,
    "model.model_config.softmax_compute_type": OURS_FP32,
    "model.model_config.rotary_dtype": OURS_FP32,
    "model.model_config.residual_dtype": OURS_FP32,
    "model.model_config.embedding_init_type": OURS_FP32,
    "model.model_config.qkv_concat": "q/k/v weights stored as one matrix: " + SAME_MATH,
    "model.model_config.fine_grain_interleave": "slices layers to overlap tensor-parallel communication: "
                                                + SAME_MATH,
    "model.model_config.use_rope_slice": "rotary-embedding kernel choice: " + SAME_MATH,
    "model.model_config.rmsnorm_compute_2d": "RmsNorm layout: " + SAME_MATH,
    "model.model_config.input_sliced_sig": "input layout: " + SAME_MATH,
    "model.model_config.parallel_optimizer": "optimizer parallel is parallel.enable_parallel_optimizer",
    "model.model_config.pp_interleave_num": "interleaved pipeline schedule: ours runs one chunk per stage "
                                            "(same math, different bubble)",
    "model.model_config.pipeline_stage": "MindFormers' per-process stage slice: ours builds every stage",
}


@dataclass
class Entry:
    key: str
    value: object
    status: str  # carried | translated | dropped | default
    ours: str = ""
    reason: str = ""


@dataclass
class Report:
    """Every key of a converted config: what happened to it and why."""

    source: str
    entries: list = field(default_factory=list)

    def add(self, key, value, status, ours="", reason=""):
        self.entries.append(Entry(key, value, status, ours, reason))

    def count(self, status: str) -> int:
        return sum(e.status == status for e in self.entries)

    def summary(self) -> str:
        return (f"{self.count('carried')} carried, {self.count('translated')} translated, "
                f"{self.count('dropped')} dropped, {self.count('default')} MindFormers defaults made explicit")

    def to_markdown(self, title: str) -> str:
        lines = [f"# {title}", "", f"Source: `{self.source}`. {self.summary()}.", "",
                 "| key | value | status | in ours | reason |", "| --- | --- | --- | --- | --- |"]
        for e in self.entries:
            value = yaml.safe_dump(e.value, default_flow_style=True, width=10 ** 6).strip().removesuffix("...")
            value = value.strip().replace("|", "\\|")
            lines.append(f"| `{e.key}` | `{value}` | {e.status} | {e.ours and f'`{e.ours}`'} | "
                         f"{e.reason.replace('|', '/')} |")
        return "\n".join(lines) + "\n"


def _leaves(data, prefix="") -> dict:
    """{dotted key: value} for every leaf; mappings are walked, lists are values (callbacks aside)."""
    out = {}
    for key, value in data.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out.update(_leaves(value, path + "."))
        elif path == "callbacks" and isinstance(value, list):
            for i, item in enumerate(value):
                out.update(_leaves(item, f"callbacks[{i}].") if isinstance(item, dict) else {f"{path}[{i}]": item})
        else:
            out[path] = value
    return out


def semi_auto(recipe: Recipe) -> bool:
    """MindSpore's semi-auto or auto parallel: the modes in which MindFormers shards and slices the global batch."""
    return recipe.use_parallel and recipe.parallel.parallel_mode in (1, 2)


def runs_mindformers_moe(recipe: Recipe) -> bool:
    """Whether the recipe's MoE layers are MindFormers' own MoELayer (models/expert_parallel.py: expert parallel on
    Ascend), whose parameters are its stacked experts (models/conversion/ours.py EXPERT_STACKS), or ours (CPU)."""
    return recipe.model.model_config.moe and recipe.context.device_target != "CPU"


def vocab_emb_dp(recipe: Recipe) -> bool:
    """Whether the embedding table is whole on each TP rank: MindFormers sets vocab_emb_dp False under pipeline
    stages whatever the config says (core/parallel_config.py:63-66)."""
    return recipe.parallel_config.vocab_emb_dp and recipe.parallel_config.pipeline_stage == 1


def model_layout(recipe: Recipe, source: str = "the recipe") -> LlamaLayout:
    """The layout models/llama.py applies: the recipe's degrees, stages and recompute, as MindFormers would apply them.

    Outside semi-auto/auto parallel MindFormers resets every degree of parallel_config to 1 before it builds
    the model (trainer/base_trainer.py:289-296), so the strategies are those of one device there (MindSpore
    ignores them in that mode, mindspore/ops/primitive.py:262-263); recompute applies in every mode. With
    pipeline stages it sets vocab_emb_dp False whatever the config says (core/parallel_config.py:63-66).
    """
    p, r = recipe.parallel_config, recipe.recompute_config
    options = {name: getattr(r, name) for name in RECOMPUTE_OPTIONS}
    degrees = (p.data_parallel, p.model_parallel, p.pipeline_stage, p.micro_batch_num, p.stage_layers)
    if not semi_auto(recipe):
        degrees = (1, 1, 1, 1, None)
    layout = plan_layout(recipe.model.model_config, *degrees, r.mode, vocab_emb_dp(recipe),
                         options, p.gradient_aggregation_group)
    if runs_mindformers_moe(recipe):
        from ascend_llm_recipes.training.recipe.mindformers_mcore_export import moe_transformer_config
        layout.experts = moe_transformer_config(recipe, source)
    return layout


def full_batch(recipe: Recipe) -> bool:
    """Whether every rank reads the global batch: MindFormers' trainer passes dataset_strategy='full_batch'
    unless one is given (trainer/base_trainer.py:904, 924) and MindSpore then sets full_batch True
    (mindspore/parallel/_auto_parallel_context.py:581) in semi-auto/auto parallel, whatever the config says."""
    return semi_auto(recipe)


def data_parallel_layout(recipe: Recipe, rank: int) -> tuple:
    """(data-parallel rank, data-parallel ranks, samples per batch on this rank), as MindFormers shards data.

    Under full_batch (semi-auto/auto parallel, the mode in which model_layout keeps the recipe's degrees)
    every rank reads the whole global batch and the graph slices it by the layout's data_parallel;
    in data parallel each rank reads its own micro-batch.
    """
    if not recipe.use_parallel or recipe.world_size == 1:
        return 0, 1, recipe.runner_config.batch_size
    if full_batch(recipe):
        return 0, 1, recipe.global_batch_size
    return rank, recipe.world_size, recipe.runner_config.batch_size


def train_dataset_block(recipe: Recipe) -> dict:
    """train_dataset as MindFormers reads it: batched by its own batch_size (dataset/causal_language_model_dataset.py:
    147-148), which our runner_config.batch_size owns; blend is ours (data/loader.py reads it)."""
    block = to_plain(recipe.train_dataset)
    block.pop("blend", None)
    block["batch_size"] = recipe.runner_config.batch_size
    return block


def lr_schedule_block(recipe: Recipe) -> dict:
    """lr_schedule as MindFormers reads it: a total_steps of -1 becomes runner_config.stop_step when set, since
    MindFormers sizes -1 to epochs x dataset size (trainer/base_trainer.py:700-708) and never to stop_step."""
    schedule = to_plain(recipe.lr_schedule)
    if schedule["total_steps"] == -1 and recipe.runner_config.stop_step:
        schedule["total_steps"] = recipe.runner_config.stop_step
    return schedule


def worker_config(recipe: Recipe, run_dir: str) -> dict:
    """The recipe as MindFormers 1.9's Trainer reads it to train our model (all keys it reads, none it ignores).

    The model is ours (models/llama.py, registered under MindFormers' names) and gets its layout as
    `model.arch.layout`, which MindFormers passes to its constructor (models/build_model.py:71-75,
    tools/register/register.py:375-380). Checkpoint strategy keys are added by the worker
    (training/tools/relayout.py mindformers_keys).
    """
    cfg = recipe.to_dict()
    # Ours, handled by training/worker: data preparation, optimizer-state loading (optim.py LoadOptimizerState),
    # evaluation, monitoring and anomalies (callbacks.py): MindFormers' own evaluation needs metric classes our
    # model does not implement.
    for key in ("data_preparation", "load_optimizer_state", "monitoring", "eval_dataset", "eval_step_interval",
                "anomaly"):
        cfg.pop(key, None)
    cfg["output_dir"] = run_dir
    # Deterministic mode: MindFormers 1.9 drops context.deterministic (core/context/build_context.py:503-507) and
    # reads the top-level train_precision_sync instead (core/config_args.py:485), calling ms.set_deterministic(True)
    # (build_context.py:606-621, version_control.py:334-339) before it initialises communication (Context,
    # build_context.py:343 before 355); MindSpore then sets HCCL_DETERMINISTIC=true and TE_PARALLEL_COMPILER=1 for
    # HCCL and the kernel compiler (mindspore/device_manager.py:153-168). Left out when off: False would call
    # ms.set_deterministic(False), which unsets a HCCL_DETERMINISTIC the user exported (device_manager.py:169-174).
    if not recipe.train_precision_sync:
        cfg.pop("train_precision_sync")
    cfg["train_dataset"] = train_dataset_block(recipe)
    cfg["train_dataset_task"]["dataset_config"] = cfg["train_dataset"]
    # Our StepRecorder stops at stop_step (training/worker/callbacks.py); MindFormers would add its own
    # TrainCallBack for it (trainer/base_trainer.py:1344-1347).
    cfg["runner_config"].pop("stop_step")
    # data/loader.py builds the dataset with every pass (epochs x repeat) in it, each with its own shuffle.
    cfg["runner_config"]["epochs"] = 1
    cfg["parallel_config"].pop("stage_layers", None)  # ours: in the model's layout
    cfg["model"]["arch"]["layout"] = model_layout(recipe)
    schedule = lr_schedule_block(recipe)
    if schedule["start_step"] or schedule["type"] == "LinearWithWarmUpLR" and schedule["lr_end"]:
        # training/worker/optim.py StartStepLR: MindFormers' schedules start at step 0 and linear ignores lr_end
        schedule = {**schedule, "type": START_STEP_LR, "schedule": schedule["type"]}
    else:
        schedule.pop("start_step")
    cfg["lr_schedule"] = schedule
    # training/checkpoint.py saves (atomic files, manifests, full state) instead of CheckpointMonitor.
    cfg["callbacks"] = [c for c in cfg["callbacks"] if c["type"] != "CheckpointMonitor"]
    cfg["do_eval"] = False
    # Keys the 1.9 Trainer dereferences unconditionally.
    cfg["use_legacy_format"] = True  # .ckpt checkpoints; resume by checkpoint name needs this set
    cfg["micro_batch_interleave_num"] = 1
    cfg["monitor_config"] = {"monitor_on": False}
    cfg["profile"] = False  # MindFormers' profile is a boolean; ours is a window (callbacks.py)
    return cfg


def _read_yaml(path: str) -> dict:
    return read_yaml_file(path, hint="give the path of a MindFormers YAML config")


def from_mindformers(config_path: str, output: str, pretrained_model_dir: str = None) -> tuple:
    """(recipe YAML text, Report) for the MindFormers config at `config_path`, to be written at `output`.

    A config with `use_legacy: False` is MindFormers 1.9's own format (mindformers_mcore.py), merged with
    `pretrained_model_dir`/config.json (this argument, else the config's own key) as MindFormers merges it.
    The recipe is validated by the strict loader (for planning, so Ascend layouts validate here)
    before anything is returned; a config that cannot be imported raises RecipeError naming its keys.
    """
    source = _read_yaml(config_path)
    name = os.path.splitext(os.path.basename(output))[0]
    # both import this module's tables
    from ascend_llm_recipes.training.recipe.mindformers_import import Importer
    from ascend_llm_recipes.training.recipe.mindformers_mcore import McoreImporter

    if source.get("use_legacy", True) is False:
        importer = McoreImporter(source, config_path, name, pretrained_model_dir)
    elif pretrained_model_dir:
        raise RecipeError(config_path, ["--pretrained-model-dir: only MindFormers 1.9's own format (use_legacy: "
                                        "False) reads config.json; this is a legacy (1.x) config"],
                          hint="drop --pretrained-model-dir")
    else:
        importer = Importer(source, config_path, name)
    recipe_data = importer.run()
    target = "CPU" if importer.on_cpu else "Ascend"
    base_path = BASES[target]
    base = read_recipe_file(base_path)
    recipe = recipe_from_dict(deep_merge(base, recipe_data), config_path, planning=True)
    body = prune_inherited(recipe_data, base)
    body = {"base": os.path.relpath(base_path, os.path.dirname(os.path.abspath(output))), **body}
    header = recipe_header(recipe, config_path, output, importer.report)
    return header + yaml.safe_dump(body, sort_keys=False, default_flow_style=None), importer.report


def to_mindformers(recipe_path: str) -> tuple:
    """(MindFormers YAML text, Report) training the recipe's model with MindFormers' own classes: LlamaForCausalLM
    in the legacy format for a Llama; Qwen3 / Qwen3-MoE / DeepSeek-V3 in MindFormers 1.9's own format
    (use_legacy: False) for a model with q/k norms, experts or multi-head latent attention."""
    from ascend_llm_recipes.training.recipe.mindformers_mcore_export import (MODEL_NAMES, mcore_family, mcore_model,
                                                                             refusals)

    recipe = load_recipe(recipe_path, planning=True)
    cfg, report = recipe.model.model_config, Report(recipe_path)
    family = mcore_family(cfg)
    problems = refusals(recipe, family)  # mindformers_mcore_export.py REFUSALS: every refusal, in one table
    if problems:
        hint = ("MindFormers' LlamaForCausalLM has no such option" if family is None and not cfg.moe else
                "train it with this recipe instead" if family is None else
                f"MindFormers 1.9's {family} computes these differently; change them in the recipe")
        raise RecipeError(recipe_path, problems, hint=hint)
    model, extra_callbacks, model_notes = mcore_model(recipe, family) if family else (None, [], [])
    values = {**to_plain(cfg), "num_kv_heads": cfg.kv_heads}  # None in MindFormers means num_heads too
    model_config = {"type": MF_CONFIG_TYPE, **{theirs: values[ours] for ours, theirs in MODEL_KEYS},
                    **{key: "float32" for key in FLOAT32_COMPUTE_KEYS}}
    dataset = train_dataset_block(recipe)
    schedule = lr_schedule_block(recipe)
    wrapper = recipe.to_dict()["runner_wrapper"]
    wrapper["type"] = "MFTrainOneStepCell"
    parallel = recipe.to_dict()["parallel"]
    parallel["full_batch"] = full_batch(recipe)
    if semi_auto(recipe):
        # MindFormers' documented form (all parameters' layouts, so checkpoints re-slice and merge whole);
        # set_strategy_save_path makes it output/strategy/ckpt_strategy_rank_N.ckpt (utils/file_utils.py:53-65).
        parallel["strategy_ckpt_config"] = {"save_file": "./ckpt_strategy.ckpt", "only_trainable_params": False}
    degrees = {k: v for k, v in recipe.to_dict()["parallel_config"].items() if k != "stage_layers"}
    runner = {k: v for k, v in recipe.to_dict()["runner_config"].items() if k != "stop_step"}
    checkpoints = recipe.checkpointing
    config = {
        "seed": recipe.seed, "output_dir": "./output", "load_checkpoint": recipe.load_checkpoint,
        "resume_training": recipe.resume_training, "run_mode": "train", "use_parallel": recipe.use_parallel,
        "trainer": {"type": recipe.trainer.type, "model_name": recipe.trainer.model_name},
        "runner_config": runner,
        "runner_wrapper": wrapper,
        "optimizer": {"type": "AdamW", "betas": list(recipe.optimizer.betas), "eps": recipe.optimizer.eps,
                      "weight_decay": recipe.optimizer.weight_decay},
        "lr_schedule": schedule,
        "train_dataset": dataset,
        "train_dataset_task": {"type": recipe.train_dataset_task.type, "dataset_config": copy.deepcopy(dataset)},
        "parallel": parallel,
        "parallel_config": degrees,
        "micro_batch_interleave_num": 1,
        "recompute_config": recipe.to_dict()["recompute_config"],
        "callbacks": [{"type": "MFLossMonitor"}] + ([{
            "type": "CheckpointMonitor", "prefix": checkpoints.prefix,
            "save_checkpoint_steps": checkpoints.save_checkpoint_steps,
            "keep_checkpoint_max": checkpoints.keep_checkpoint_max,
            "integrated_save": checkpoints.integrated_save, "async_save": checkpoints.async_save}]
            if checkpoints else []) + extra_callbacks,
        "context": recipe.to_dict()["context"],
        "model": model or {"model_config": model_config, "arch": {"type": MF_MODEL_TYPE}},
        "profile": False,
        **({"train_precision_sync": True} if recipe.train_precision_sync else {}),  # as worker_config passes it
    }
    m = "model.model_config."
    if family is None:
        report.add(m + "type", cfg.type, "translated", m + "type", "MindFormers' Llama config class")
        for ours, theirs in MODEL_KEYS:
            if ours != theirs:
                report.add(m + ours, getattr(cfg, ours), "translated", m + theirs, "MindFormers' spelling")
    else:
        config = {"use_legacy": False, **config}
        if cfg.moe and recipe.parallel_config.model_parallel > 1:
            config["parallel_config"]["use_seq_parallel"] = True
            report.add("parallel_config.use_seq_parallel", False, "translated", "parallel_config.use_seq_parallel",
                       "MindFormers' MoE layer runs with tensor parallel only under sequence parallel "
                       "(moe_layer.py:143-147), as ours does in its MoE layers; its dense layers then split the "
                       "sequence too: the same numbers, less activation memory")
        if recipe.trainer.model_name == TrainerConfig().model_name:  # ours, "llama": name it as theirs do
            config["trainer"]["model_name"] = MODEL_NAMES[family]
            report.add("trainer.model_name", recipe.trainer.model_name, "translated", "trainer.model_name",
                       f"the name MindFormers 1.9's own {family} configs give the model")
        report.add(m + "type", cfg.type, "translated", m + "model_type",
                   f"MindFormers 1.9's {family} ({model['model_config']['architectures'][0]}), use_legacy: False; "
                   "the keys are those convert_recipe.py --from-mindformers reads back")
    report.add(m + "vocab_pad_multiple", cfg.vocab_pad_multiple, "dropped", "",
               "MindFormers does not pad the vocabulary tables")
    report.add("runner_wrapper.type", recipe.runner_wrapper.type, "translated", "runner_wrapper.type",
               "MindFormers' MFTrainOneStepCell (Ascend overflow check)")
    report.add("parallel.full_batch", recipe.parallel.full_batch, "translated", "parallel.full_batch",
               "MindFormers' trainer reads the global batch on every rank in semi-auto parallel")
    if recipe.optimizer.type == "FoldedAdamW":
        report.add("optimizer.type", "FoldedAdamW", "translated", "optimizer.type",
                   "MindFormers' AdamW: the same update (FoldedAdamW runs it on one fused CPU kernel)")
    notes = ["vocab_size is the real vocabulary: MindFormers does not pad the tables (ours pads them to a "
             f"multiple of {cfg.vocab_pad_multiple} x TP)",
             "runner_config.stop_step, data_preparation, blend, anomaly, monitoring, hardware, hccl, "
             "eval_dataset and profile windows are ours; MindFormers has no such keys",
             "the dataset directory must hold MindRecord samples of seq_length + 1 input_ids (as "
             "scripts/prepare_data.py writes them)"]
    notes += model_notes
    for note in notes:
        report.add("(ours)", "", "dropped", "", note)
    kind = ("MindFormers' LlamaForCausalLM (configs for MindFormers 1.x, use_legacy: True)" if family is None else
            f"MindFormers 1.9's own {family} (use_legacy: False)")
    header = (f"# MindFormers config written from {recipe_path} by scripts/convert_recipe.py --to-mindformers.\n"
              f"# {param_count(cfg, padded=False):,} parameters; {kind}.\n" + "".join(f"# - {n}\n" for n in notes))
    return header + yaml.safe_dump(config, sort_keys=False, default_flow_style=None), report


def recipe_header(recipe: Recipe, config_path: str, output: str, report: Report) -> str:
    cfg, p = recipe.model.model_config, recipe.parallel_config
    lines = [
        f"Imported from the MindFormers config {os.path.basename(config_path)} by scripts/convert_recipe.py",
        f"({report.summary()}; the per-key report says why).",
        f"  bash scripts/run_distributed.sh {output} --plan",
        "",
        f"Arithmetic: {param_count(cfg, p.model_parallel):,} parameters (models/arithmetic.py). "
        f"{recipe.world_size} devices = DP {p.data_parallel} x TP {p.model_parallel} x PP {p.pipeline_stage}.",
        f"Tokens per step: {recipe.global_batch_size} sequences x seq_length {cfg.seq_length} = "
        f"{recipe.tokens_per_step:,}. Memory per device: see --plan.",
    ]
    return "".join(f"# {line}\n" if line else "#\n" for line in lines)


def mindformers_ffn_width(hidden_size: int, multiple_of: int = 256, ffn_dim_multiplier: float = None) -> int:
    """MindFormers' SwiGLU width when intermediate_size is unset (models/llama/llama_layer.py:302-309)."""
    width = 4 * hidden_size
    if ffn_dim_multiplier is not None:
        width = int((ffn_dim_multiplier + 0.01) * width)
    width = int(2 * width / 3)
    return round_up(width, multiple_of)


def write_output(path: str, text: str, force: bool = False) -> None:
    """Write `text` at `path` in one step; an existing file is kept unless `force`."""
    exists = RecipeError(path, ["already exists; nothing was written"], hint="pass --force to replace it")
    if os.path.exists(path) and not force:
        raise exists
    try:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        if force:
            write_atomic(path, text)
        else:
            try:
                write_new(path, text)
            except FileExistsError:  # another conversion created it meanwhile: it stays theirs
                raise exists from None
    except OSError as err:
        raise RecipeError(path, [f"cannot be written: {err.strerror or err}"],
                          hint="choose an --output in a directory you can write") from None
