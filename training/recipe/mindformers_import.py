"""MindFormers configuration -> recipe: import a Llama-family MindFormers YAML (the reverse of mindformers.py).

`Importer` (called by mindformers.py from_mindformers) reads a MindFormers training config
(LlamaConfig / LlamaForCausalLM: Llama 2, Llama 3, Qwen2-style with q/k/v bias) and returns a recipe
of ours that trains the same model the same way, with a report of every key of the source: carried
over, translated (another spelling or value in our schema), or dropped with the reason. Keys
MindFormers leaves at its own defaults are made explicit where our base recipe would differ.
Anything that would change the model or the training and that the recipe cannot express is refused
by name. Key names, MindFormers' defaults and the keys dropped come from the tables of
training/recipe/mindformers.py.
"""

import os

from ascend_llm_recipes.common.errors import RecipeError
from ascend_llm_recipes.models import LLAMA_CONFIG_TYPE, LLAMA_MODEL_TYPE
from ascend_llm_recipes.training.recipe.device import KEEP_DTYPES
from ascend_llm_recipes.training.recipe.mindformers import (ADAM_WEIGHT_DECAY_TYPES, DROPPED, LLAMA_CONFIG_ARGS,
                                                            MF_CONFIG_TYPE, MF_DEFAULTS, MF_MODEL_TYPE, NUMERIC_KEYS,
                                                            OUR_SCHEDULES, OURS, Report, _leaves,
                                                            mindformers_ffn_width)

DEVICES_PER_NODE = 8  # an Atlas 800T A2 node


class Importer:
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

    def carry_model(self, theirs: str, **how) -> object:
        """carry() for a LlamaConfig argument, to our model_config key (mindformers.py MODEL_KEYS)."""
        return self.carry("model.model_config." + theirs, "model.model_config." + OURS[theirs], **how)

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
        # MindFormers builds the model with the top-level moe_config (trainer/base_trainer.py:1250-1258) and calls a
        # network with expert_num > 1 an MoE network (tools/check_rules.py:171); model_config's own is read too.
        for where, moe in ((m + "moe_config", self.src["model"]["model_config"].get("moe_config")),
                           ("moe_config", self.src.get("moe_config"))):
            if isinstance(moe, dict) and (moe.get("expert_num") or 1) > 1:
                self.problems.append(f"{where}: expert_num {moe.get('expert_num')}: a Mixture-of-Experts model; only "
                                     "dense models import from MindFormers configs so far")
        self.carry(m + "type", convert=lambda _: LLAMA_CONFIG_TYPE, reason="our Llama config class")
        self.carry("model.arch.type", convert=lambda _: LLAMA_MODEL_TYPE, reason="our Llama model (models/llama.py)")
        d = MF_DEFAULTS["model_config"]
        for key in ("vocab_size", "hidden_size", "num_layers", "num_heads", "seq_length", "rms_norm_eps",
                    "bos_token_id", "eos_token_id", "pad_token_id", "tie_word_embeddings"):
            self.carry_model(key, default=d[key])
        compute = self.carry_model("compute_dtype", default=d["compute_dtype"])
        self.carry_model("param_init_type", default="float32", convert=lambda v: v if v in ("float32", compute)
                         else "float32",
                         reason="weights stored in this dtype (16-bit ones other than compute_dtype: float32); 16-bit "
                                "weights get float32 master copies in FoldedAdamW (training/worker/optim.py), which "
                                "MindFormers' AdamW does not keep")
        for key in ("use_flash_attention", "use_attn_mask_compression", "fused_rms_norm"):
            self.carry_model(key, reason="Ascend kernel switch with MindFormers' name and meaning (models/llama.py)")
        self.carry_model("n_kv_heads", default=self.get(m + "num_heads", d["num_heads"]),
                         reason="our spelling (None in MindFormers = num_heads)")
        self.carry_model("theta", default=d["theta"], convert=float, reason="our spelling")
        self.carry_model("qkv_has_bias", default=d["qkv_has_bias"], reason="our spelling")
        self.carry_model("init_method_std", default=d["init_method_std"],
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
        if self.has(s + "warmup_steps") and not self.has(s + "warmup_ratio"):
            self.put(s + "warmup_ratio", None)  # the base recipe's warmup_ratio (Ascend: 0.01) would conflict
        total = self.get(s + "total_steps")
        self.carry(s + "total_steps", default=-1, convert=lambda t: -1 if t is None else t,
                   reason="-1: epochs x dataset size (or runner_config.stop_step)" if total in (-1, None) else "")

    def data_loader(self):
        t = "train_dataset."
        self.carry(t + "data_loader.type")
        directory = self.get(t + "data_loader.dataset_dir") or ""
        placeholder = f"datasets/{self.name}"
        self.carry(t + "data_loader.dataset_dir", convert=lambda d: d or placeholder,
                   reason="our launcher needs the manifest.json written by scripts/prepare_data.py: prepare "
                          "the dataset with it" + ("" if directory else f" (empty in the source: {placeholder})"))
        self.carry(t + "data_loader.shuffle")

    def datasets(self):
        t = "train_dataset."
        self.data_loader()
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
            self.drop(c + "use_seq_parallel", "sequence parallelism is not implemented by models/parallel.py (ours "
                                              "runs it in MoE layers only, with tensor parallel: "
                                              "models/expert_parallel.py): memory only (same math), check --plan")
        else:
            self.carry(c + "use_seq_parallel", default=d["use_seq_parallel"])
        if not pipeline and self.get(c + "micro_batch_num", 1) > 1:
            self.put(c + "micro_batch_num", 1)
            self.drop(c + "micro_batch_num",
                      "MindFormers resets it to 1 without pipeline stages (trainer/base_trainer.py:215-218)")
        else:
            self.carry(c + "micro_batch_num", default=d["micro_batch_num"])
        self.carry(c + "expert_parallel", default=d["expert_parallel"])  # the recipe check holds MindFormers' rules
        for key in ("context_parallel", "seq_split_num", "ulysses_degree_in_cp"):
            self.require(c + key, 1, "ours has data, tensor, pipeline and expert parallelism only", default=1)
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
