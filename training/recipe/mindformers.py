"""MindFormers configurations <-> recipes: import a Llama-family MindFormers YAML, export a recipe.

`from_mindformers` reads a MindFormers training config (LlamaConfig / LlamaForCausalLM: Llama 2,
Llama 3, Qwen2-style with q/k/v bias) and returns a recipe of ours that trains the same model the
same way, with a report of every key of the source: carried over, translated (another spelling or
value in our schema), or dropped with the reason. Keys MindFormers leaves at its own defaults are
made explicit where our base recipe would differ. Anything that would change the model or the
training and that the recipe cannot express is refused by name. `to_mindformers` writes the
other direction, so both stacks can train one model on one cluster.

MindFormers defaults below are those of the installed MindFormers 1.9 (file:line in site-packages
`mindformers/`); tests/test_convert_recipe.py checks them against the installed classes.
"""

import copy
import os
from dataclasses import dataclass, field

import yaml

from ascend_llm_recipes.common.errors import RecipeError
from ascend_llm_recipes.common.files import write_atomic
from ascend_llm_recipes.models import LLAMA_CONFIG_TYPE, LLAMA_MODEL_TYPE
from ascend_llm_recipes.models.arithmetic import param_count, round_up
from ascend_llm_recipes.training.recipe.device import KEEP_DTYPES
from ascend_llm_recipes.training.recipe.loading import (deep_merge, load_recipe, read_recipe_file, read_yaml_file,
                                                        recipe_from_dict)
from ascend_llm_recipes.training.recipe.schema import Recipe

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BASES = {"CPU": os.path.join(REPO_ROOT, "recipes", "base", "cpu.yaml"),
         "Ascend": os.path.join(REPO_ROOT, "recipes", "base", "ascend.yaml")}
MF_CONFIG_TYPE = "LlamaConfig"
MF_MODEL_TYPE = "LlamaForCausalLM"
DEVICES_PER_NODE = 8  # an Atlas 800T A2 node

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
    "parallel_config": dict(data_parallel=1, model_parallel=1, pipeline_stage=1, micro_batch_num=1,
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
    "train_dataset.batch_size": "the micro-batch is runner_config.batch_size (training/worker/train.py writes it into "
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


class _Importer:
    """One conversion: takes keys from the source, fills the recipe, records each step in the report."""

    def __init__(self, source: dict, where: str, name: str):
        self.src = source
        self.leaves = _leaves(source)
        self.taken = set()
        self.where = where
        self.name = name
        self.out: dict = {}
        self.report = Report(where)
        self.problems: list = []

    # -- bookkeeping -------------------------------------------------------------------------
    def has(self, key: str) -> bool:
        return key in self.leaves

    def get(self, key: str, default=None):
        return self.leaves.get(key, default)

    def put(self, ours: str, value) -> None:
        node = self.out
        *parents, last = ours.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[last] = value

    def carry(self, key: str, ours: str = None, default=None, convert=None, reason: str = "") -> object:
        """Copy `key` (or MindFormers' `default` when absent) to `ours`; returns the value."""
        ours = ours or key
        if self.has(key):
            value = self.leaves[key]
            self.taken.add(key)
            new = convert(value) if convert else value
            status = "carried" if ours == key and new == value else "translated"
            self.report.add(key, value, status, ours, reason)
        else:
            new = default
            if new is None:
                return None
            self.report.add(key, "(absent)", "default", ours, reason or "MindFormers' default")
        self.put(ours, new)
        return new

    def drop(self, key: str, reason: str) -> None:
        """Drop `key`, or every key of the section `key`, with the reason."""
        for leaf in [k for k in self.leaves if k == key or k.startswith(key + ".")]:
            self.taken.add(leaf)
            self.report.add(leaf, self.leaves[leaf], "dropped", "", reason)

    def require(self, key: str, supported, why: str, default=None) -> None:
        """Drop `key` when it has the one value we implement, refuse it otherwise."""
        value = self.get(key, default)
        if value != supported and not (supported is None and value in ("None", None)):
            self.problems.append(f"{key}: {value!r} is not supported ({supported!r} only): {why}")
            self.taken.add(key)
        else:
            self.drop(key, f"{value!r}: {why.split(';')[0]}, as ours")

    # -- sections ----------------------------------------------------------------------------
    def run(self) -> dict:
        self.check_numbers()
        if self.problems:
            raise RecipeError(self.where, self.problems, hint="fix these values in the MindFormers file")
        self.model()
        if self.problems:  # another architecture or option: nothing else is worth reading
            raise RecipeError(self.where, self.problems, hint=self.hint())
        self.top_level()
        self.runner()
        self.optimizer()
        self.lr_schedule()
        self.datasets()
        self.parallel()
        self.callbacks()
        self.context()
        self.leftovers()
        if self.problems:
            raise RecipeError(self.where, self.problems, hint=self.hint())
        return self.out

    def check_numbers(self):
        """The values the conversion computes with must be numbers (the rest is checked by the strict loader)."""
        for key in NUMERIC_KEYS:
            value = self.get(key)
            wanted = (int, float) if key.endswith("ffn_dim_multiplier") else int
            if value is not None and (isinstance(value, bool) or not isinstance(value, wanted)):
                self.problems.append(f"{key}: expected a number, got {value!r}")
        for section in ("model", "model.model_config", "runner_config", "parallel_config", "optimizer",
                        "lr_schedule", "train_dataset", "parallel", "context", "runner_wrapper"):
            node = self.src
            for part in section.split("."):
                node = node.get(part, {}) if isinstance(node, dict) else node
            if not isinstance(node, dict):
                self.problems.append(f"{section}: expected a mapping, got {node!r}")
        if not isinstance(self.src.get("callbacks", []), (list, type(None))):
            self.problems.append(f"callbacks: expected a list, got {self.src['callbacks']!r}")

    @staticmethod
    def hint() -> str:
        return ("only MindFormers' Llama-family training configs (LlamaConfig / LlamaForCausalLM) import; change "
                "the refused keys in the MindFormers file, or write the recipe by hand from recipes/")

    @property
    def on_cpu(self) -> bool:
        return self.get("context.device_target", "Ascend") == "CPU"

    def model(self):
        m = "model.model_config."
        config_type, arch_type = self.get(m + "type"), self.get("model.arch.type")
        if config_type != MF_CONFIG_TYPE or arch_type != MF_MODEL_TYPE:
            self.problems.append(f"model.model_config.type: {config_type!r} with model.arch.type {arch_type!r} is "
                                 f"not a Llama-family model; only {MF_CONFIG_TYPE} / {MF_MODEL_TYPE} imports "
                                 "(Llama 2, Llama 3, Qwen2-style with qkv_has_bias)")
            return
        moe = self.src["model"]["model_config"].get("moe_config")
        if moe and (moe.get("expert_num") or 1) > 1:
            self.problems.append(f"{m}moe_config: {moe.get('expert_num')} experts; only dense models import")
        self.carry(m + "type", convert=lambda _: LLAMA_CONFIG_TYPE, reason="our Llama config class")
        self.carry("model.arch.type", convert=lambda _: LLAMA_MODEL_TYPE, reason="our Llama model (models/llama.py)")
        d = MF_DEFAULTS["model_config"]
        for key in ("vocab_size", "hidden_size", "num_layers", "num_heads", "seq_length", "rms_norm_eps",
                    "bos_token_id", "eos_token_id", "pad_token_id", "tie_word_embeddings"):
            self.carry(m + key, default=d[key])
        compute = self.carry(m + "compute_dtype", default=d["compute_dtype"])
        self.carry(m + "param_init_type", m + "param_dtype", default="float32",
                   convert=lambda v: v if v in ("float32", compute) else "float32",
                   reason="weights stored in this dtype (16-bit ones other than compute_dtype: float32); 16-bit "
                          "weights get float32 master copies in FoldedAdamW (training/worker/optim.py), which MindFormers' "
                          "AdamW does not keep")
        for key in ("use_flash_attention", "use_attn_mask_compression", "fused_rms_norm"):
            self.carry(m + key, reason="Ascend kernel switch with MindFormers' name and meaning (models/llama.py)")
        self.carry(m + "n_kv_heads", m + "num_kv_heads", default=self.get(m + "num_heads", d["num_heads"]),
                   reason="our spelling (None in MindFormers = num_heads)")
        self.carry(m + "theta", m + "rope_theta", default=d["theta"], convert=float, reason="our spelling")
        self.carry(m + "qkv_has_bias", m + "qkv_bias", default=d["qkv_has_bias"], reason="our spelling")
        self.carry(m + "init_method_std", m + "initializer_range", default=d["init_method_std"],
                   reason="our spelling (standard deviation of the normal initialiser)")
        self.intermediate_size()
        self.require(m + "extend_method", "None", "no RoPE scaling (position interpolation, NTK); our model "
                                                  "has none", default="None")
        self.require(m + "scaling_factor", 1.0, "no RoPE scaling; our model has none", default=1.0)
        self.require(m + "attn_proj_has_bias", False, "our output projection has no bias", default=False)
        self.require(m + "use_eod_attn_mask_compression", False, "document masking from MindFormers' EOD data "
                     "columns; ours has model_config.document_attention instead (set it by hand)", default=False)
        self.require(m + "use_ring_attention", False, "ring attention needs context parallelism, which ours "
                     "does not implement", default=False)
        self.require(m + "calculate_per_token_loss", False, "ours averages the loss over the tokens of each "
                     "micro-batch", default=False)
        if self.src["model"]["model_config"].get("quant_config"):
            self.problems.append(f"{m}quant_config: quantised training is not implemented by ours")
        offset = self.get(m + "offset", 0)
        if offset in (0, None) or (isinstance(offset, list) and not any(offset)):
            self.drop(m + "offset", "no pipeline-stage offset: layers split evenly, as ours")
        else:
            self.problems.append(f"{m}offset: {offset!r} moves layers between pipeline stages; set "
                                 "parallel_config.stage_layers (layers per stage) in the recipe by hand")
            self.taken.add(m + "offset")
        self.drop(m + "parallel_config", "MindFormers fills it from the top-level parallel_config")
        self.drop(m + "moe_config", "no experts: a dense model, as ours")
        self.drop(m + "quant_config", "no quantisation, as ours")

    def intermediate_size(self):
        """The SwiGLU width: MindFormers' rule when intermediate_size is not given.

        models/llama/llama_layer.py:302-309 (LlamaFeedForward) with hidden_dim = 4 x hidden_size
        (models/llama/llama_transformer.py:903): int((ffn_dim_multiplier + 0.01) x 4h) when a multiplier
        is set, then int(2/3 x that), rounded up to a multiple of multiple_of.
        """
        m = "model.model_config."
        d = MF_DEFAULTS["model_config"]
        hidden = self.get(m + "hidden_size", d["hidden_size"])
        multiple_of = self.get(m + "multiple_of", d["multiple_of"])
        multiplier = self.get(m + "ffn_dim_multiplier", d["ffn_dim_multiplier"])
        if self.has(m + "intermediate_size") and self.get(m + "intermediate_size") is not None:
            self.carry(m + "intermediate_size")
            for key in ("multiple_of", "ffn_dim_multiplier"):
                self.drop(m + key, "not used: intermediate_size is given")
            return
        width = mindformers_ffn_width(hidden, multiple_of, multiplier)
        rule = (f"int(2/3 x int(({multiplier} + 0.01) x 4 x {hidden}))" if multiplier is not None
                else f"int(2/3 x 4 x {hidden})") + f" rounded up to a multiple of {multiple_of} = {width}"
        self.put(m + "intermediate_size", width)
        for key in (m + "multiple_of", m + "ffn_dim_multiplier", m + "intermediate_size"):
            if self.has(key):
                self.taken.add(key)
                self.report.add(key, self.leaves[key], "translated", m + "intermediate_size",
                                "MindFormers' MLP width rule: " + rule)
        if not self.has(m + "multiple_of"):
            self.report.add(m + "multiple_of", "(absent)", "default", m + "intermediate_size",
                            f"MindFormers' default multiple_of {multiple_of}: " + rule)

    def top_level(self):
        self.carry("seed", default=0)
        self.put("output_dir", f"runs/{self.name}")
        self.drop("output_dir", f"ours writes each run to its own directory: runs/{self.name}")
        mode = self.get("run_mode", "train")
        if mode in ("train", "finetune"):
            self.carry("run_mode", convert=lambda _: "train",
                       reason="finetune is training from load_checkpoint" if mode == "finetune" else "")
        else:
            self.problems.append(f"run_mode: {mode!r} is not a training run; only train/finetune configs import")
        if self.get("trainer.type", "CausalLanguageModelingTrainer") != "CausalLanguageModelingTrainer":
            self.problems.append(f"trainer.type: {self.get('trainer.type')!r}; only CausalLanguageModelingTrainer "
                                 "(causal LM pretraining/finetuning) imports")
        self.carry("trainer.type")
        self.carry("trainer.model_name")
        self.carry("use_parallel", default=False)
        checkpoint = self.get("load_checkpoint", "")
        self.drop("load_checkpoint", "empty: training starts from scratch, as ours does" if not checkpoint else
                  "differs: a MindFormers checkpoint's parameter names are not ours; convert the weights to "
                  "HuggingFace format (MindFormers' convert_reversed.py), then scripts/convert_checkpoint.py "
                  "--from-hf, and set load_checkpoint to its output")
        if self.get("resume_training") in (False, None):
            self.carry("resume_training")
        else:
            self.drop("resume_training", "ours resumes by rerunning the same command (newest valid checkpoint)")
        for key in ("layer_scale", "lr_scale"):
            if self.get(key):
                self.problems.append(f"{key}: True (layer-wise / batch-size learning-rate scaling) is not "
                                     "implemented by ours; set it False in the MindFormers file")
                self.taken.add(key)
            else:
                self.drop(key, "off")
        self.drop("layer_decay", "used only with layer_scale: True (off)")
        self.drop("lr_scale_factor", "used only with lr_scale: True (off)")
        if self.get("profile"):
            self.carry("profile_start_step", "profile.start_step", reason="ours: a profile: window")
            self.carry("profile_stop_step", "profile.stop_step", reason="ours: a profile: window")
            self.drop("profile", "True: ours records the profile: window")
        else:
            self.drop("profile", "off")
            for key in ("profile_start_step", "profile_stop_step"):
                self.drop(key, "profile is off")
        for key, reason in DROPPED.items():
            self.drop(key, reason)

    def runner(self):
        r = "runner_config."
        pipeline = self.get("parallel_config.pipeline_stage", 1) > 1
        interleave = self.get("micro_batch_interleave_num", 1) or 1
        batch = self.get(r + "batch_size", 1)
        if interleave > 1:
            # base_trainer.py:201-240: the global batch is batch_size x data_parallel x micro_batch_interleave_num
            # (x accumulation or micro-batches); each device computes interleave halves of that batch.
            self.carry(r + "batch_size", convert=lambda b: b * interleave,
                       reason=f"x micro_batch_interleave_num {interleave}: MindFormers' per-device batch "
                              "(trainer/base_trainer.py:201-240)")
            self.taken.add("micro_batch_interleave_num")
            self.report.add("micro_batch_interleave_num", interleave, "translated", r + "batch_size",
                            f"folded into the batch ({batch} x {interleave}); ours does not split micro-batches "
                            "to overlap communication (same math)")
        else:
            self.carry(r + "batch_size", default=1)
            self.drop("micro_batch_interleave_num", "1: no interleaving")
        self.carry(r + "epochs", default=1)
        if self.on_cpu and self.get(r + "sink_mode"):
            self.put(r + "sink_mode", False)
            self.drop(r + "sink_mode", "True on CPU silently multiplies the number of steps; ours runs False")
            self.drop(r + "sink_size", "sink_mode is off on CPU")
        else:
            self.carry(r + "sink_mode", default=False)
            self.carry(r + "sink_size", default=-1)
        accumulation = self.get(r + "gradient_accumulation_steps", 1)
        if pipeline and accumulation > 1:
            self.put(r + "gradient_accumulation_steps", 1)
            self.drop(r + "gradient_accumulation_steps", "MindFormers ignores it under pipeline parallelism "
                      "(micro_batch_num accumulates; trainer/base_trainer.py:225-235)")
        else:
            self.carry(r + "gradient_accumulation_steps", default=1)
        w = "runner_wrapper."
        d = MF_DEFAULTS["runner_wrapper"]
        wrapper = self.get(w + "type", "MFTrainOneStepCell")
        if wrapper != "MFTrainOneStepCell":
            self.problems.append(f"{w}type: {wrapper!r}; only MFTrainOneStepCell imports")
        if self.on_cpu:
            self.carry(w + "type", convert=lambda _: "PortableTrainOneStepCell",
                       reason="MFTrainOneStepCell's overflow check is Ascend-only; same wrapper, portable check")
        else:
            self.carry(w + "type", default=wrapper)
        self.carry(w + "use_clip_grad", default=d["use_clip_grad"])
        self.carry(w + "max_grad_norm", default=d["max_grad_norm"])
        scale = self.src.get("runner_wrapper", {}).get("scale_sense", d["scale_sense"])
        if isinstance(scale, dict):
            kind = scale.get("type")
            if kind == "DynamicLossScaleUpdateCell":
                for key in ("type", "loss_scale_value", "scale_factor", "scale_window"):
                    self.carry(f"{w}scale_sense.{key}", convert=float if key == "loss_scale_value" else None)
            elif kind == "FixedLossScaleUpdateCell":
                self.carry(w + "scale_sense.loss_scale_value", w + "scale_sense", convert=float,
                           reason="a fixed loss scale is a number in ours")
                self.drop(w + "scale_sense.type", "a fixed loss scale is a number in ours")
            else:
                self.problems.append(f"{w}scale_sense.type: {kind!r}; DynamicLossScaleUpdateCell, "
                                     "FixedLossScaleUpdateCell or a number import")
        else:
            self.carry(w + "scale_sense", default=float(scale), convert=float)

    def optimizer(self):
        o = "optimizer."
        kind = self.get(o + "type", "AdamW")
        ours = "FoldedAdamW"
        cpu_note = ("; FoldedAdamW is AdamW's update on one fused kernel, with float32 master copies of 16-bit "
                    "weights (training/worker/optim.py)")
        if kind == "AdamW":
            d = MF_DEFAULTS["AdamW"]
            self.carry(o + "type", convert=lambda _: ours, reason=cpu_note.lstrip("; "))
            self.carry(o + "betas", default=d["betas"], convert=lambda b: [float(x) for x in b])
        elif kind in ADAM_WEIGHT_DECAY_TYPES:
            d = MF_DEFAULTS["AdamWeightDecay"]
            self.carry(o + "type", convert=lambda _: ours,
                       reason="differs in the first steps: MindSpore's AdamWeightDecay (parent of "
                              "FP32StateAdamWeightDecay) has no bias correction of m and v, AdamW does; both keep "
                              "float32 moments" + cpu_note)
            betas = [float(self.get(o + "beta1", d["beta1"])), float(self.get(o + "beta2", d["beta2"]))]
            self.put(o + "betas", betas)
            for key in ("beta1", "beta2"):
                if self.has(o + key):
                    self.taken.add(o + key)
                    self.report.add(o + key, self.leaves[o + key], "translated", o + "betas", "our spelling")
                else:
                    self.report.add(o + key, "(absent)", "default", o + "betas", "MindSpore's default")
        else:
            self.problems.append(f"{o}type: {kind!r}; AdamW, FP32StateAdamWeightDecay or AdamWeightDecay import")
            return
        self.carry(o + "eps", default=d["eps"], convert=float)
        self.carry(o + "weight_decay", default=d["weight_decay"], convert=float)
        self.drop(o + "learning_rate", "lr_schedule sets the learning rate")
        self.drop(o + "swap", "optimizer-state swapping to host: memory only, not in our schema")

    def lr_schedule(self):
        s = "lr_schedule."
        if "lr_schedule" not in self.src:
            rate = self.get("optimizer.learning_rate", 1e-3)
            self.put("lr_schedule", {"type": "ConstantWarmUpLR", "learning_rate": float(rate), "warmup_steps": 0})
            self.report.add("lr_schedule", "(absent)", "default", "lr_schedule",
                            "a constant optimizer.learning_rate: ConstantWarmUpLR without warm-up")
            return
        kind = self.get(s + "type")
        if kind not in OUR_SCHEDULES:
            self.problems.append(f"{s}type: {kind!r} is not one of {', '.join(OUR_SCHEDULES)}")
            return
        d = MF_DEFAULTS["lr_schedule"]
        self.carry(s + "type")
        self.carry(s + "learning_rate", convert=float)
        if kind == "CosineWithWarmUpLR":
            self.carry(s + "lr_end", default=d["lr_end"], convert=float)
            self.require(s + "num_cycles", d["num_cycles"], "half a cosine period", default=d["num_cycles"])
        for key in ("decay_steps", "decay_ratio"):
            self.require(s + key, None, "decay over the whole run", default=None)
        self.require(s + "warmup_lr_init", d["warmup_lr_init"], "warm-up starts at 0",
                     default=d["warmup_lr_init"])
        self.carry(s + "warmup_ratio", convert=float)
        self.carry(s + "warmup_steps")
        total = self.get(s + "total_steps")
        self.carry(s + "total_steps", default=-1, convert=lambda t: -1 if t is None else t,
                   reason="-1: epochs x dataset size (or runner_config.stop_step)" if total in (-1, None) else "")

    def datasets(self):
        t = "train_dataset."
        self.carry(t + "data_loader.type")
        directory = self.get(t + "data_loader.dataset_dir") or ""
        placeholder = f"datasets/{self.name}"
        self.carry(t + "data_loader.dataset_dir", convert=lambda d: d or placeholder,
                   reason="our launcher needs the manifest.json written by scripts/prepare_data.py: prepare "
                          "the dataset with it" + ("" if directory else f" (empty in the source: {placeholder})"))
        self.carry(t + "data_loader.shuffle")
        columns = self.get(t + "input_columns", ["input_ids"])
        if columns == ["input_ids"]:
            self.carry(t + "input_columns")
        else:
            self.put(t + "input_columns", ["input_ids"])
            self.drop(t + "input_columns", "differs: ours reads packed input_ids only (labels are the inputs "
                      "shifted, pad_token_id masked); MindFormers' finetuning columns (labels, masks) are not "
                      "read, prepare the data with scripts/prepare_data.py")
        for key in ("num_parallel_workers", "python_multiprocessing", "drop_remainder", "repeat", "numa_enable",
                    "prefetch_size"):
            self.carry(t + key)
        self.carry("train_dataset_task.type")
        if self.get("do_eval") and self.get("eval_dataset.data_loader.dataset_dir"):
            self.carry("do_eval")
            self.carry("eval_step_interval")
            self.carry("eval_dataset.data_loader.type")
            self.carry("eval_dataset.data_loader.dataset_dir")
            self.carry("eval_dataset.data_loader.shuffle")
        else:
            self.carry("do_eval", convert=lambda _: False)
            self.drop("eval_step_interval", "do_eval is off")
        for key in [k for k in self.leaves if k.startswith("eval_dataset.")]:
            self.drop(key, "do_eval is off" if not self.out.get("do_eval") else
                      "ours evaluates held-out loss with its own loader (training/worker/callbacks.py)")

    def parallel(self):
        p = "parallel."
        for key in ("parallel_mode", "gradients_mean", "search_mode", "enable_parallel_optimizer",
                    "parallel_optimizer_config.parallel_optimizer_threshold"):
            self.carry(p + key)
        if self.get(p + "enable_parallel_optimizer"):
            # MindSpore's default optimizer_level; our Ascend base recipe sets level3.
            self.carry(p + "parallel_optimizer_config.optimizer_level", default="level1",
                       reason="MindSpore's default (level1)")
        if self.has(p + "full_batch"):
            # MindFormers sets full_batch True in semi-auto parallel whatever the config says
            # (trainer/base_trainer.py:904,924); data/loader.py then gives every rank the global batch.
            self.carry(p + "full_batch", convert=lambda _: self.get(p + "parallel_mode", 0) in (1, 2),
                       reason="True in semi-auto/auto parallel (every rank reads the global batch), else False")
        c = "parallel_config."
        d = MF_DEFAULTS["parallel_config"]
        pipeline = self.get(c + "pipeline_stage", 1) > 1
        for key in ("data_parallel", "model_parallel", "pipeline_stage", "vocab_emb_dp", "gradient_aggregation_group"):
            self.carry(c + key, default=d[key])
        if self.get(c + "use_seq_parallel"):
            self.drop(c + "use_seq_parallel", "sequence parallelism is not implemented by models/parallel.py: memory "
                                              "only (same math), check --plan")
        else:
            self.carry(c + "use_seq_parallel", default=d["use_seq_parallel"])
        if not pipeline and self.get(c + "micro_batch_num", 1) > 1:
            self.put(c + "micro_batch_num", 1)
            self.drop(c + "micro_batch_num",
                      "MindFormers resets it to 1 without pipeline stages (trainer/base_trainer.py:215-218)")
        else:
            self.carry(c + "micro_batch_num", default=d["micro_batch_num"])
        for key in ("context_parallel", "expert_parallel", "seq_split_num", "ulysses_degree_in_cp"):
            self.require(c + key, 1, "ours has data, tensor and pipeline parallelism only", default=1)
        self.drop(c + "optimizer_shard", "deprecated in MindFormers; optimizer parallel is "
                                         "parallel.enable_parallel_optimizer")
        r = "recompute_config."
        flash = self.out.get("model", {}).get("model_config", {}).get("use_flash_attention")
        for key in ("recompute", "select_recompute"):
            value = self.get(r + key, False)
            if key == "select_recompute" and value is True and (flash or self.out["recompute_config"]["recompute"]):
                self.put(r + key, False)
                # MindFormers ignores it in both cases (models/llama/llama_transformer.py:405,
                # parallel_core/training_graph/transformer/utils.py:383-402); our recipe check refuses it.
                self.drop(r + key, "no effect with " + ("use_flash_attention: True" if flash else "recompute: True"))
            elif isinstance(value, bool):
                self.carry(r + key, default=False)
            else:
                self.put(r + key, False)
                self.drop(r + key, f"per-stage layer counts {value}: memory only (same math); ours recomputes "
                                   "all layers or none, check --plan")
        recomputing = any(self.out["recompute_config"].values())  # full or selective: Cell.recompute takes them
        for key in ("parallel_optimizer_comm_recompute", "mp_comm_recompute", "recompute_slice_activation"):
            if key == "parallel_optimizer_comm_recompute" and self.get(r + key):
                self.drop(r + key, "MindSpore 2.9 ignores it (mindspore/nn/cell.py:3687-3690)")
            elif recomputing:
                self.carry(r + key)
            elif self.has(r + key):
                self.drop(r + key, "acts only on recomputed layers and recompute is off")

    def callbacks(self):
        items = []
        for i, item in enumerate(self.src.get("callbacks") or []):
            c = f"callbacks[{i}]."
            kind = item.get("type") if isinstance(item, dict) else None
            if kind == "MFLossMonitor":
                ours = {"type": kind}
                self.taken.add(c + "type")
                self.report.add(c + "type", kind, "carried", c + "type")
                if self.has(c + "per_print_times"):
                    ours["per_print_times"] = self.get(c + "per_print_times")
                    self.taken.add(c + "per_print_times")
                    self.report.add(c + "per_print_times", ours["per_print_times"], "carried", c + "per_print_times")
            elif kind == "CheckpointMonitor":
                ours = {}
                for key, default in MF_DEFAULTS["CheckpointMonitor"].items():
                    ours[key] = self.get(c + key, default)
                    if self.has(c + key):
                        self.taken.add(c + key)
                        self.report.add(c + key, ours[key], "carried", c + key)
                    else:
                        self.report.add(c + key, "(absent)", "default", c + key, "MindFormers' default")
                ours = {"type": kind, **ours}
                self.taken.add(c + "type")
                self.report.add(c + "type", kind, "carried", c + "type")
            else:
                reason = ("uploads to OBS (AICC/ModelArts storage): ours keeps the run directory on local or "
                          "shared disk" if kind == "ObsMonitor" else "not a callback of ours")
                for key in [k for k in self.leaves if k.startswith(c)]:
                    self.drop(key, reason)
                continue
            items.append(ours)
            for key in [k for k in self.leaves if k.startswith(c) and k not in self.taken]:
                self.drop(key, "CheckpointMonitor option not in our schema (ours saves with manifests, "
                               "training/checkpoint.py)")
        self.out["callbacks"] = items

    def context(self):
        x = "context."
        for key in ("mode", "device_target", "max_call_depth", "max_device_memory", "save_graphs", "device_id"):
            self.carry(x + key)
        ascend_only = ("context.jit_config", "context.mempool_block_size", "context.ascend_config")
        if self.on_cpu:
            for key in ascend_only:
                self.drop(key, "Ascend compiler, memory-pool and operator settings: ours refuses them on CPU")
        else:
            self.carry(x + "jit_config.jit_level", reason="MindSpore's graph compiler level, passed as MindFormers "
                                                          "passes it (core/context/build_context.py:316)")
            self.carry(x + "mempool_block_size", reason="device memory pool growth step, passed as MindFormers "
                                                        "passes it (core/context/build_context.py:184-192)")
            self.ascend_config()
        world = 1
        for key in ("data_parallel", "model_parallel", "pipeline_stage"):
            world *= self.out.get("parallel_config", {}).get(key, 1)
        if not self.on_cpu:
            per_node = DEVICES_PER_NODE if world % DEVICES_PER_NODE == 0 else world
            self.put("hardware.devices_per_node", per_node)

    def ascend_config(self):
        """precision_mode pinned to what our float32 operators need; the speed-up file carried where it is found."""
        a = "context.ascend_config."
        mode = self.get(a + "precision_mode")
        self.carry(a + "precision_mode", default=KEEP_DTYPES, convert=lambda _: KEEP_DTYPES,
                   reason=("" if mode == KEEP_DTYPES else
                           f"ours pins {KEEP_DTYPES}: the model keeps RMSNorm, softmax, rotary and the loss in "
                           f"float32 (models/llama.py), which {mode!r} would let CANN lower to 16 bits"))
        key = a + "parallel_speed_up_json_path"
        path = self.get(key)
        if not self.has(key):
            return
        if not path:
            self.drop(key, "empty: no communication-overlap options")
            return
        # MindFormers resolves it against its working directory (usually its repository root); try ours, then the
        # config file's directory.
        found = next((os.path.abspath(p) for p in (path, os.path.join(os.path.dirname(self.where), path))
                      if os.path.isfile(p)), None)
        if found is None:
            self.drop(key, f"{path} is not found here (neither relative to the working directory nor to the config "
                           f"file); copy it and set {key} in the recipe")
            return
        self.carry(key, convert=lambda _: found,
                   reason="communication-overlap options, checked against MindSpore's list at load (training/"
                          "recipe/device.py SPEED_UP_KEYS) and passed as MindFormers passes them")

    def leftovers(self):
        m = "model.model_config."
        for key in sorted(set(self.leaves) - self.taken):
            if key.startswith(m):
                name = key[len(m):].split(".")[0]
                if name in LLAMA_CONFIG_ARGS:
                    self.problems.append(f"{key}: {self.leaves[key]!r}: a LlamaConfig option this importer does "
                                         "not know; it may change the model, so nothing was written")
                    continue
                self.drop(key, "not an argument of MindFormers' LlamaConfig (models/llama/llama_config.py:131), "
                               "which ignores it")
            else:
                self.drop(key, "not read by this importer (unknown key): check it by hand")


def mindformers_ffn_width(hidden_size: int, multiple_of: int = 256, ffn_dim_multiplier: float = None) -> int:
    """MindFormers' SwiGLU width when intermediate_size is unset (models/llama/llama_layer.py:302-309)."""
    width = 4 * hidden_size
    if ffn_dim_multiplier is not None:
        width = int((ffn_dim_multiplier + 0.01) * width)
    width = int(2 * width / 3)
    return round_up(width, multiple_of)


def _read_yaml(path: str) -> dict:
    return read_yaml_file(path, hint="give the path of a MindFormers YAML config")


def _prune(data: dict, base: dict) -> dict:
    """`data` without the values `base` already has (the recipe inherits them)."""
    out = {}
    for key, value in data.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            inner = _prune(value, base[key])
            if inner:
                out[key] = inner
        elif key not in base or base[key] != value:
            out[key] = value
    return out


def from_mindformers(config_path: str, output: str) -> tuple:
    """(recipe YAML text, Report) for the MindFormers config at `config_path`, to be written at `output`.

    The recipe is validated by the strict loader (for planning, so Ascend layouts validate here)
    before anything is returned; a config that cannot be imported raises RecipeError naming its keys.
    """
    source = _read_yaml(config_path)
    name = os.path.splitext(os.path.basename(output))[0]
    importer = _Importer(source, config_path, name)
    recipe_data = importer.run()
    target = "CPU" if importer.on_cpu else "Ascend"
    base_path = BASES[target]
    base = read_recipe_file(base_path)
    recipe = recipe_from_dict(deep_merge(base, recipe_data), config_path, planning=True)
    body = _prune(recipe_data, base)
    body = {"base": os.path.relpath(base_path, os.path.dirname(os.path.abspath(output))), **body}
    header = _recipe_header(recipe, config_path, output, importer.report)
    return header + yaml.safe_dump(body, sort_keys=False, default_flow_style=None), importer.report


def _recipe_header(recipe: Recipe, config_path: str, output: str, report: Report) -> str:
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


def to_mindformers(recipe_path: str) -> tuple:
    """(MindFormers YAML text, Report) training the recipe's model with MindFormers' own Llama."""
    recipe = load_recipe(recipe_path, planning=True)
    cfg, report, problems = recipe.model.model_config, Report(recipe_path), []
    if cfg.document_attention:
        problems.append("model.model_config.document_attention: True has no LlamaForCausalLM equivalent that "
                        "reads our packed data (MindFormers' EOD mask compression needs its own data columns)")
    stage_layers = recipe.parallel_config.stage_layers
    if stage_layers and len(set(stage_layers)) > 1:
        problems.append(f"parallel_config.stage_layers: {stage_layers}: uneven stages; set MindFormers' "
                        "model_config.offset by hand")
    if problems:
        raise RecipeError(recipe_path, problems, hint="MindFormers' LlamaForCausalLM has no such option")
    model_config = {
        "type": MF_CONFIG_TYPE, "seq_length": cfg.seq_length, "hidden_size": cfg.hidden_size,
        "num_layers": cfg.num_layers, "num_heads": cfg.num_heads, "n_kv_heads": cfg.kv_heads,
        "vocab_size": cfg.vocab_size, "intermediate_size": cfg.intermediate_size, "rms_norm_eps": cfg.rms_norm_eps,
        "theta": cfg.rope_theta, "qkv_has_bias": cfg.qkv_bias, "tie_word_embeddings": cfg.tie_word_embeddings,
        "init_method_std": cfg.initializer_range, "bos_token_id": cfg.bos_token_id,
        "eos_token_id": cfg.eos_token_id, "pad_token_id": cfg.pad_token_id, "compute_dtype": cfg.compute_dtype,
        "layernorm_compute_type": "float32", "softmax_compute_type": "float32", "rotary_dtype": "float32",
        "param_init_type": cfg.param_dtype,
        "use_flash_attention": cfg.use_flash_attention, "use_attn_mask_compression": cfg.use_attn_mask_compression,
        "fused_rms_norm": cfg.fused_rms_norm,
    }
    dataset = {
        "data_loader": {"type": "MindDataset", "dataset_dir": recipe.dataset_dir,
                        "shuffle": recipe.train_dataset.data_loader.shuffle},
        "input_columns": ["input_ids"], "num_parallel_workers": recipe.train_dataset.num_parallel_workers,
        "python_multiprocessing": recipe.train_dataset.python_multiprocessing, "drop_remainder": True,
        "batch_size": recipe.runner_config.batch_size, "repeat": recipe.train_dataset.repeat,
        "numa_enable": recipe.train_dataset.numa_enable, "prefetch_size": recipe.train_dataset.prefetch_size,
    }
    schedule = {k: v for k, v in recipe.to_dict()["lr_schedule"].items()}
    if schedule["total_steps"] == -1 and recipe.runner_config.stop_step:
        schedule["total_steps"] = recipe.runner_config.stop_step  # MindFormers 1.9 ignores stop_step
    wrapper = recipe.to_dict()["runner_wrapper"]
    wrapper["type"] = "MFTrainOneStepCell"
    semi_auto = recipe.parallel.parallel_mode in (1, 2)
    parallel = recipe.to_dict()["parallel"]
    # MindFormers' trainer reads the global batch on every rank and slices it in semi-auto parallel.
    parallel["full_batch"] = semi_auto
    if semi_auto:
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
            if checkpoints else []),
        "context": recipe.to_dict()["context"],
        "model": {"model_config": model_config, "arch": {"type": MF_MODEL_TYPE}},
        "profile": False,
    }
    m = "model.model_config."
    for ours, theirs in (("num_kv_heads", "n_kv_heads"), ("rope_theta", "theta"), ("qkv_bias", "qkv_has_bias"),
                         ("initializer_range", "init_method_std"), ("type", "type")):
        report.add(m + ours, getattr(cfg, ours), "translated", m + theirs, "MindFormers' spelling")
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
    for note in notes:
        report.add("(ours)", "", "dropped", "", note)
    header = (f"# MindFormers config written from {recipe_path} by scripts/convert_recipe.py --to-mindformers.\n"
              f"# {param_count(cfg, padded=False):,} parameters; MindFormers' LlamaForCausalLM "
              "(configs for MindFormers 1.x, use_legacy: True).\n" + "".join(f"# - {n}\n" for n in notes))
    return header + yaml.safe_dump(config, sort_keys=False, default_flow_style=None), report


def write_output(path: str, text: str, force: bool = False) -> None:
    """Write `text` at `path` in one step; an existing file is kept unless `force`."""
    if os.path.exists(path) and not force:
        raise RecipeError(path, ["already exists; nothing was written"], hint="pass --force to replace it")
    try:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        write_atomic(path, text)
    except OSError as err:
        raise RecipeError(path, [f"cannot be written: {err.strerror or err}"],
                          hint="choose an --output in a directory you can write") from None
