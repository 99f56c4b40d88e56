"""MindFormers 1.9 configuration (`use_legacy: False`) -> recipe: Qwen3, Qwen3-MoE and DeepSeek-V3.

MindFormers 1.9's own format describes the model in Hugging Face keys (model_type, num_hidden_layers, ...)
plus MindFormers keys (qk_layernorm, moe_grouped_gemm, offset, params_dtype, ...), converted to its
Megatron-style TransformerConfig by a per-family table (mindformers/models/qwen3/config_converter_qwen3.py,
models/qwen3_moe/config_converter_qwen3_moe.py, models/deepseek3/config_converter_deepseek_v3.py); the router,
MoE-layer and multi-latent-attention keys are read in mindformers_moe.py. A template without model_type
(configs/general/llm_pretrain_*_template.yaml) is merged with pretrained_model_dir/config.json first, the
YAML winning (models/build_config.py:99-132). `McoreImporter` reads the model section the way those
classes read it and reuses the legacy importer (mindformers_import.py) for the sections both formats
share (runner, optimizer, schedule, parallel, callbacks, context). Every key is reported carried,
translated or dropped with the reason; anything our model would compute differently is refused by name.
File:line references are to the installed MindFormers 1.9 (site-packages `mindformers/`).
"""

import os

from ascend_llm_recipes.common.errors import ConversionError, RecipeError
from ascend_llm_recipes.models import LLAMA_CONFIG_TYPE, LLAMA_MODEL_TYPE
from ascend_llm_recipes.training.recipe.mindformers import OURS_FP32, SAME_MATH
from ascend_llm_recipes.training.recipe.mindformers_import import Importer
from ascend_llm_recipes.training.recipe.mindformers_moe import LOAD_BALANCING, MoEKeys

M = "model.model_config."
# model_type -> (architecture, Mixture of Experts) of the families ours implements; the classes are registered
# under these names (models/qwen3/configuration_qwen3.py:27, models/qwen3_moe/configuration_qwen3_moe.py).
# DeepseekV3ForCausalLM: models/deepseek3/configuration_deepseek_v3.py:135.
FAMILIES = {"qwen3": ("Qwen3ForCausalLM", False), "qwen3_moe": ("Qwen3MoeForCausalLM", True),
            "deepseek_v3": ("DeepseekV3ForCausalLM", True)}
# Families MindFormers 1.9 ships in this format that ours cannot express, with what it would lack.
REFUSED_FAMILIES = {
    "deepseek_mtp": "DeepSeek-V3's multi-token-prediction head",
    "glm4": "GLM-4: partial rotary embeddings and extra post-attention/post-MLP norms",
    "glm4_moe": "GLM-4-MoE: a sigmoid router with expert bias, partial rotary embeddings",
}
# What MindFormers' Qwen3Config / Qwen3MoeConfig fall back to when config.json and the YAML leave a key out:
# their __init__ defaults (models/qwen3/configuration_qwen3.py:163-185, configuration_qwen3_moe.py:183-211) and
# the MindFormers parameters they register (register_mf_model_parameter, configuration_qwen3.py:147-156).
DEFAULTS = {
    "qwen3": dict(vocab_size=151936, hidden_size=4096, intermediate_size=22016, num_hidden_layers=32,
                  num_attention_heads=32, num_key_value_heads=32, head_dim=128, rms_norm_eps=1e-6,
                  rope_theta=10000.0, tie_word_embeddings=False, initializer_range=0.02, seq_length=4096,
                  pad_token_id=151643, attention_bias=False),
    "qwen3_moe": dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=24,
                      num_attention_heads=32, num_key_value_heads=4, head_dim=None, rms_norm_eps=1e-6,
                      rope_theta=10000.0, tie_word_embeddings=False, initializer_range=0.02, seq_length=4096,
                      pad_token_id=151643, attention_bias=False, moe_intermediate_size=768, num_experts_per_tok=8,
                      num_experts=128, norm_topk_prob=False),
    # configuration_deepseek_v3.py:159-199 (MoE and MLA defaults: mindformers_moe.py FAMILY_DEFAULTS)
    "deepseek_v3": dict(vocab_size=129280, hidden_size=7168, intermediate_size=18432, num_hidden_layers=61,
                        num_attention_heads=128, num_key_value_heads=128, head_dim=None, rms_norm_eps=1e-6,
                        rope_theta=10000.0, tie_word_embeddings=False, initializer_range=0.02, seq_length=4096,
                        pad_token_id=0, attention_bias=False, moe_intermediate_size=2048, num_experts_per_tok=8,
                        n_routed_experts=256, norm_topk_prob=True),
}
# TransformerConfig's defaults for the MindFormers keys read here (parallel_core/transformer_config.py:146, 300,
# 1045, 1673, 1777).
TC_DEFAULTS = dict(compute_dtype="bfloat16", params_dtype="float32", use_flash_attention=True,
                   moe_router_load_balancing_type="sub_seq_aux_loss", moe_aux_loss_coeff=0.0)
# HF key -> our model_config key, as MindFormers maps them to TransformerConfig (config_converter_qwen3.py:25-42,
# config_converter_qwen3_moe.py:26-33).
ARCHITECTURE = (("vocab_size", "vocab_size"), ("hidden_size", "hidden_size"),
                ("intermediate_size", "intermediate_size"), ("num_hidden_layers", "num_layers"),
                ("num_attention_heads", "num_heads"), ("num_key_value_heads", "num_kv_heads"),
                ("head_dim", "head_dim"), ("seq_length", "seq_length"), ("rms_norm_eps", "rms_norm_eps"),
                ("rope_theta", "rope_theta"), ("initializer_range", "initializer_range"),
                ("tie_word_embeddings", "tie_word_embeddings"), ("attention_bias", "qkv_bias"))
MLA_DROPPED = ("num_key_value_heads", "head_dim")  # mindformers_moe.py MoEKeys.mla says why
MOE_ARCHITECTURE = {"qwen3_moe": (("num_experts", "num_experts"), ("num_experts_per_tok", "num_experts_per_tok"),
                                  ("moe_intermediate_size", "moe_intermediate_size")),
                    "deepseek_v3": (("n_routed_experts", "num_experts"), ("num_experts_per_tok", "num_experts_per_tok"),
                                    ("moe_intermediate_size", "moe_intermediate_size"))}
# Keys with exactly one value ours implements: key -> (that value, MindFormers' default, what the value means).
ONLY = {
    "hidden_dropout": (0.0, 0.0, "no dropout; ours has none"),
    "attention_dropout": (0.0, 0.0, "no attention dropout; ours has none"),
    "add_bias_linear": (False, False, "no bias on the output projection and MLP; ours has none"),
    "gated_linear_unit": (True, True, "SwiGLU MLP"),
    "normalization": ("RMSNorm", "RMSNorm", "RMSNorm"),
    "position_embedding_type": ("rope", "rope", "rotary embeddings"),
    "rope_scaling": (None, None, "no RoPE scaling (YaRN, linear, ...); ours has none"),
    "moe_router_force_expert_balance": (False, False, "real routing; forced round-robin routing (a benchmark "
                                                      "mode) is not implemented by ours"),
    "first_k_dense_replace": (None, None, "MindFormers' Qwen3-MoE gives every layer experts whatever it says "
                                          "(models/qwen3_moe/modeling_qwen3_moe_train.py:50-58 passes one layer "
                                          "spec); remove it"),
    "moe_layer_freq": (1, 1, "MindFormers' Qwen3-MoE gives every layer experts whatever it says "
                             "(modeling_qwen3_moe_train.py:50-58); remove it"),
    "mlp_only_layers": ([], [], "Qwen3MoeConfig deletes it (configuration_qwen3_moe.py:177), so MindFormers "
                                "would give these layers experts, unlike the checkpoint; set them by hand"),
    "decoder_sparse_step": (1, 1, "Qwen3MoeConfig deletes it (configuration_qwen3_moe.py:175): every layer "
                                  "has experts in MindFormers, unlike the checkpoint"),
    "moe_expert_capacity_factor": (None, None, "MindFormers 1.9's training graph never reads it, so its run is "
                                               "dropless: TopKRouter.routing keeps every token's top k "
                                               "(parallel_core/training_graph/transformer/moe/router.py:259-296), "
                                               "no dispatcher drops (token_dispatcher.py), only "
                                               "parallel_core/transformer_config.py:2123-2131 validates it. Remove "
                                               "it for what MindFormers trains, or set ours "
                                               "model.model_config.capacity_factor for what it asks"),
}
# Keys of ONLY that apply to one family: Qwen3-MoE builds every layer with experts, DeepSeek-V3 honours them.
QWEN3_MOE_ONLY = ("first_k_dense_replace", "moe_layer_freq", "mlp_only_layers", "decoder_sparse_step")
# Keys read by MindFormers for speed or memory only, or not at all in training, dropped whatever their value.
INERT = {
    "max_position_embeddings": "rotary-table length for inference; ours computes rotary for seq_length",
    "use_cache": "inference KV cache",
    "transformers_version": "Hugging Face bookkeeping",
    "torch_dtype": "Hugging Face bookkeeping (MindFormers: compute_dtype)",
    "dtype": "Hugging Face bookkeeping (MindFormers: compute_dtype)",
    "_name_or_path": "Hugging Face bookkeeping",
    "tokenizer_class": "tokenizer for inference: ours trains on prepared token ids",
    "output_router_logits": "Hugging Face inference output",
    "layer_types": "every layer full attention (use_sliding_window is False)",
    "max_window_layers": "sliding-window layers: MindFormers deletes it (configuration_qwen3.py:158)",
    "sliding_window": "MindFormers deletes it (configuration_qwen3.py:159); full attention, as ours",
    "use_sliding_window": "MindFormers deletes it (configuration_qwen3.py:160); full attention, as ours",
    "layernorm_compute_dtype": OURS_FP32,
    "softmax_compute_dtype": OURS_FP32,
    "rotary_dtype": OURS_FP32,
    "fp32_residual_connection": "residual-stream precision: ours adds the residual in compute_dtype "
                                "(models/llama.py); True keeps it in float32 in MindFormers (rounding only)",
    "router_dense_type": "ours routes in float32 (models/moe.py Router)",
    "qkv_concat": "q/k/v weights stored as one matrix: " + SAME_MATH,
    "input_sliced_sig": "input layout: " + SAME_MATH,
    "use_contiguous_weight_layout_attention": "weight layout of the fused q/k/v matrix: " + SAME_MATH,
    "use_interleaved_weight_layout_mlp": "weight layout of the fused MLP matrix: " + SAME_MATH,
    "moe_router_fusion": "fused router kernel on Ascend (registered by DeepseekV3Config): " + SAME_MATH,
    "use_fused_ops_topkrouter": "fused top-k router kernel on Ascend: " + SAME_MATH,
    "apply_rope_fusion": "fused rotary kernel on Ascend: " + SAME_MATH,
    "bias_swiglu_fusion": "fused SwiGLU kernel on Ascend: " + SAME_MATH,
    "use_pad_tokens": "expert-parallel dispatch padding: on Ascend ours dispatches as MindFormers' MoE layer, built "
                      "by models/expert_parallel.py, does; on CPU every expert computes on the local device",
    "moe_token_dispatcher_type": "expert-parallel dispatch: on Ascend ours is MindFormers' MoE layer and its AllToAll "
                                 "dispatcher (models/expert_parallel.py); on CPU every expert is local",
    "ep_size": "DeepseekV3Config deletes it (configuration_deepseek_v3.py:156)",
    "moe_grouped_gemm": "grouped-matmul kernel for the experts: same math; on Ascend ours is MindFormers' "
                        "(models/expert_parallel.py, which sets it), on CPU models/moe.py's dispatch",
    "moe_router_pre_softmax": "not read by MindFormers' training router, which always takes the softmax over "
                              "all experts before top-k (transformer/moe/router.py:272-288), as ours",
    "moe_z_loss_coeff": "not read by MindFormers' training graph (no router z-loss in transformer/moe/); ours "
                        "keeps router_z_loss_coef 0",
    "router_aux_loss_coef": "Qwen3MoeConfig deletes it (configuration_qwen3_moe.py:179); the coefficient "
                            "MindFormers uses is moe_aux_loss_coeff",
    "moe_token_drop_policy": "which tokens an expert capacity would drop; moe_expert_capacity_factor is unset "
                             "(dropless) and MindFormers 1.9's training graph reads neither (transformer/moe/"
                             "router.py:259-296)",
}


def read_pretrained_config(directory: str, where: str) -> dict:
    """pretrained_model_dir/config.json, as MindFormers merges it under model_config (models/build_config.py:124),
    read as the checkpoint converter reads it (models/conversion/hf.py read_hf_config)."""
    from ascend_llm_recipes.models.conversion.hf import read_hf_config

    try:
        return read_hf_config(directory)[0]
    except ConversionError as err:
        raise RecipeError(where, [f"pretrained_model_dir: {os.path.join(directory, 'config.json')} cannot be read: "
                                  f"{err.message}"],
                          hint="give --pretrained-model-dir a Hugging Face model directory holding config.json") \
            from None


def merged_source(source: dict, where: str, pretrained_model_dir: str = None) -> tuple:
    """(the config with config.json under model_config, the directory used or None).

    MindFormers reads pretrained_model_dir/config.json and updates it with the YAML's model_config, the YAML
    winning (models/build_config.py:99-132); --pretrained-model-dir replaces the YAML's directory.
    """
    directory = pretrained_model_dir or source.get("pretrained_model_dir") or None
    if directory is None or (not pretrained_model_dir and not os.path.isfile(os.path.join(directory, "config.json"))):
        return source, None
    hf = read_pretrained_config(directory, where)
    model = dict(source.get("model") or {})
    model["model_config"] = {**hf, **(model.get("model_config") or {})}
    return {**source, "model": model}, directory


class McoreImporter(MoEKeys, Importer):
    """Importer for MindFormers 1.9's own format: the model section read as Qwen3Config/Qwen3MoeConfig read it."""

    def __init__(self, source: dict, where: str, name: str, pretrained_model_dir: str = None):
        merged, self.pretrained_dir = merged_source(source, where, pretrained_model_dir)
        super().__init__(merged, where, name)
        self.given_dir = source.get("pretrained_model_dir")
        self.family = self.get(M + "model_type")
        self.defaults = DEFAULTS.get(self.family, {})

    @staticmethod
    def hint() -> str:
        return ("only MindFormers 1.9 Qwen3, Qwen3-MoE and DeepSeek-V3 training configs import (model_type qwen3 / "
                "qwen3_moe / deepseek_v3); "
                "change the refused keys in the MindFormers file, or write the recipe by hand from recipes/")

    def check_numbers(self):
        super().check_numbers()
        for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                    "num_key_value_heads", "head_dim", "seq_length", "num_experts", "num_experts_per_tok",
                    "moe_intermediate_size", "n_routed_experts", "n_group", "topk_group", "n_shared_experts",
                    "first_k_dense_replace", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                    "v_head_dim", "moe_router_num_groups", "moe_router_group_topk",
                    "moe_shared_expert_intermediate_size"):
            value = self.get(M + key)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
                self.problems.append(f"{M}{key}: expected a whole number, got {value!r}")

    def value(self, key: str):
        """The value MindFormers' config class ends up with: the merged config's, else the class default."""
        return self.get(M + key, self.defaults.get(key))

    def drop(self, key: str, reason: str) -> None:
        """Drop `key` (or its section) where not handled yet: the legacy tables also name keys read here first."""
        for leaf in [k for k in self.leaves if (k == key or k.startswith(key + ".")) and k not in self.taken]:
            self.taken.add(leaf)
            self.report.add(leaf, self.leaves[leaf], "dropped", "", reason)

    # -- the model ---------------------------------------------------------------------------
    def model(self):
        if not self.known_family():
            return
        architecture, moe = FAMILIES[self.family]
        mla = self.family == "deepseek_v3"
        self.carry(M + "model_type", M + "type", convert=lambda _: LLAMA_CONFIG_TYPE,
                   reason=f"{self.family}: our Llama-style decoder" + (" with multi-latent attention" if mla else
                                                                       " with Qwen3's q/k norms") +
                   (" and MoE MLPs" if moe else ""))
        self.put("model.arch.type", LLAMA_MODEL_TYPE)
        self.carry(M + "architectures", "model.arch.type", convert=lambda _: LLAMA_MODEL_TYPE,
                   reason=f"{architecture} is built as our model (models/llama.py)")
        self.drop(M + "pretrained_model_dir", "MindFormers' copy of pretrained_model_dir")
        for theirs, ours in ARCHITECTURE + MOE_ARCHITECTURE.get(self.family, ()):
            if not (mla and theirs in MLA_DROPPED):
                self.carry(M + theirs, M + ours, default=self.defaults.get(theirs),
                           convert=float if ours == "rope_theta" else None,
                           reason="" if theirs == ours else "our spelling")
        if mla:
            self.mla()
        else:
            self.qwen3_attention()
        self.kernels()
        self.embeddings()
        self.dtypes()
        self.activation()
        self.only_keys(moe, mla)
        if moe:
            self.moe()
        else:
            self.drop(M + "router_dense_type", "no router: a dense model")
        self.tokens()
        self.offset()
        for key, why in INERT.items():
            self.drop(M + key, why)
        if self.get(M + "quantization_config") or self.get(M + "quantization"):
            self.problems.append(f"{M}quantization_config: quantised training is not implemented by ours")

    def qwen3_attention(self):
        if self.value("head_dim") is None:
            # TransformerConfig.kv_channels = hidden_size // num_attention_heads when unset (transformer_config.py:2044)
            self.report.add(M + "head_dim", "(absent)", "default", M + "head_dim", "hidden_size / num_heads")
        # Both Qwen3 classes build q/k RMSNorms whatever qk_layernorm says (modeling_qwen3_train.py:47,
        # modeling_qwen3_moe_train.py:56).
        self.put(M + "qk_norm", True)
        self.carry(M + "qk_layernorm", M + "qk_norm", default=True, convert=lambda _: True,
                   reason="MindFormers' Qwen3 builds q/k norms whatever this key says (modeling_qwen3_train.py:47)")

    def kernels(self):
        """FlashAttention and its compressed causal mask, for grouped-query and latent attention alike
        (models/layers.py FlashAttention)."""
        self.carry(M + "use_flash_attention", default=None if self.on_cpu else TC_DEFAULTS["use_flash_attention"],
                   reason="Ascend kernel switch with MindFormers' name and meaning")
        self.carry(M + "use_attn_mask_compression", reason="Ascend kernel switch with MindFormers' name and meaning "
                                                           "(FlashAttention's 2048 x 2048 causal band)")
        if self.family == "deepseek_v3":
            # TransformerConfig fused_norm (transformer_config.py:242, default True): the RMSNorm class of DeepSeek-V3's
            # layer specs (gpt_layer_specs.py:205, 218, 254); the Qwen3 classes never pass it (always fused)
            self.carry(M + "fused_norm", M + "fused_rms_norm", default=None if self.on_cpu else True,
                       reason="Ascend fused RMSNorm kernel switch: ours is fused_rms_norm")
        else:
            self.drop(M + "fused_norm", "not read by MindFormers' Qwen3 classes, which always build the fused "
                                        "RMSNorm (gpt_layer_specs.py:92)")

    def only_keys(self, moe: bool, mla: bool):
        """Keys with one value ours implements; multi_latent_attention: True for DeepSeek-V3 only."""
        raw = self.src["model"]["model_config"]
        mla_default = self.family == "deepseek_v3"  # registered by DeepseekV3Config (configuration_deepseek_v3.py:152)
        if raw.get("multi_latent_attention", mla_default) != mla:
            self.problems.append(f"{M}multi_latent_attention: {raw.get('multi_latent_attention')!r} is not supported "
                                 f"for {self.family} ({mla!r} only): ours builds "
                                 + ("multi-latent attention for DeepSeek-V3" if mla else "grouped-query attention"))
            self.taken.add(M + "multi_latent_attention")
        else:
            self.drop(M + "multi_latent_attention", "multi-latent attention (models/mla.py)" if mla
                      else "grouped-query attention")
        for key, (only, default, why) in ONLY.items():
            if key in QWEN3_MOE_ONLY and self.family != "qwen3_moe":
                continue
            if moe or not key.startswith(("moe_", "first_k", "mlp_only", "decoder_sparse")):
                value = raw.get(key, default)  # whole value: rope_scaling is a mapping
                if key == "moe_expert_capacity_factor" and isinstance(value, (int, float)) and value < 0:
                    value = None  # TransformerConfig reads a negative capacity as none (transformer_config.py:2124)
                if value == only:
                    self.drop(M + key, f"{value!r}: {why.split(';')[0]}")
                else:
                    self.problems.append(f"{M}{key}: {value!r} is not supported ({only!r} only): {why}")
                    self.taken.update(k for k in self.leaves if k == M + key or k.startswith(M + key + "."))

    def known_family(self) -> bool:
        if self.family in FAMILIES:
            return True
        if self.family in REFUSED_FAMILIES:
            self.problems.append(f"{M}model_type: {self.family!r} ({REFUSED_FAMILIES[self.family]}) is a family ours "
                                 f"does not implement; only {' and '.join(FAMILIES)} import")
        elif self.family is None:
            self.problems.append(self.missing_model_type())
        else:
            self.problems.append(f"{M}model_type: {self.family!r} is not a family ours implements; only "
                                 f"{' and '.join(FAMILIES)} import")
        return False

    def missing_model_type(self) -> str:
        """Which keys a template lacks, and how to supply them."""
        absent = [k for k in ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                              "num_attention_heads", "num_key_value_heads") if not self.has(M + k)]
        where = (f"pretrained_model_dir {self.given_dir!r} has no config.json here" if self.given_dir
                 else "no pretrained_model_dir is given")
        return (f"{M}model_type: absent, and {where}; MindFormers takes the model from "
                "pretrained_model_dir/config.json merged under model_config (models/build_config.py:99-132). "
                f"Missing: {', '.join(absent)}. Pass --pretrained-model-dir DIR (a Hugging Face model directory "
                "with config.json), or add these keys to model.model_config")

    def embeddings(self):
        tie = self.value("tie_word_embeddings")
        untie = self.get(M + "untie_embeddings_and_output_weights")
        # GPTModel shares the tables by tie_word_embeddings alone (modeling_qwen3_train.py:54).
        self.drop(M + "untie_embeddings_and_output_weights", "not read: MindFormers ties the tables by "
                  "tie_word_embeddings (modeling_qwen3_train.py:54)" +
                  (f"; it contradicts tie_word_embeddings {tie}, which wins" if untie is not None and untie == tie
                   else ""))

    def dtypes(self):
        compute = self.carry(M + "compute_dtype", default=TC_DEFAULTS["compute_dtype"])
        self.carry(M + "params_dtype", M + "param_dtype", default=TC_DEFAULTS["params_dtype"],
                   convert=lambda v: v if v in ("float32", compute) else "float32",
                   reason="weights stored in this dtype (16-bit ones other than compute_dtype: float32); 16-bit "
                          "weights get float32 master copies in FoldedAdamW (training/worker/optim.py)")

    def activation(self):
        # With gated_linear_unit, 'swiglu' and 'silu' both compute silu(x0) * x1 (transformer/mlp.py:145-152,
        # activation.py:83-86).
        act = self.get(M + "hidden_act", "silu")
        if act in ("silu", "swiglu"):
            self.drop(M + "hidden_act", "silu(gate) x up (SwiGLU), as ours")
        else:
            self.problems.append(f"{M}hidden_act: {act!r} is not supported (silu/swiglu only): ours has a SwiGLU MLP")
            self.taken.add(M + "hidden_act")

    def moe(self):
        k = self.value("num_experts_per_tok")
        norm = self.value("norm_topk_prob")
        # MindFormers renormalises the top-k weights only when k > 1 (transformer/moe/router.py:290-294).
        self.carry(M + "norm_topk_prob", default=norm, convert=lambda v: bool(v) and k > 1,
                   reason="" if k > 1 else "k = 1: MindFormers never renormalises a single weight")
        coef = self.carry(M + "moe_aux_loss_coeff", M + "router_aux_loss_coef",
                          default=TC_DEFAULTS["moe_aux_loss_coeff"], convert=float,
                          reason="the load-balancing coefficient MindFormers' router uses (router.py:198, 435; "
                                 "TransformerConfig default 0)")
        self.put(M + "router_z_loss_coef", 0.0)
        self.balancing(coef)
        self.router(k)
        self.shared_experts()
        if self.family == "deepseek_v3":
            self.dense_layers(self.value("num_hidden_layers"))
            self.multi_token_prediction()

    def balancing(self, coef: float):
        """moe_router_load_balancing_type -> model_config.router_aux_loss_scope, where its token groups are ours.

        Ours (models/moe.py LoadBalancingLoss) takes f_e over the step's tokens so far ("global") or over each
        data-parallel rank's micro-batch ("micro_batch"). MindFormers (transformer/moe/router.py:388-425) takes f
        over all blocks and the step's micro-batches so far (gbs_aux_loss; reset each step,
        core/callback/callback.py:531): global; per data x context parallel block, averaged over its model-parallel
        parts, each micro-batch alone (seq_aux_loss): micro_batch without context parallel; per data x model x
        context parallel block (sub_seq_aux_loss): micro_batch without model or context parallel.
        """
        key = M + "moe_router_load_balancing_type"
        kind = self.get(key, TC_DEFAULTS["moe_router_load_balancing_type"])
        c = "parallel_config."
        mp, cp = self.get(c + "model_parallel", 1), self.get(c + "context_parallel", 1)
        scopes = {kind: scope for scope, kind in LOAD_BALANCING.items()}  # gbs_aux_loss global, seq_aux_loss ...
        scopes["seq_aux_loss"] = cp == 1 and scopes["seq_aux_loss"]
        scopes["sub_seq_aux_loss"] = mp * cp == 1 and "micro_batch"
        if not coef:
            self.drop(key, "no load-balancing loss (moe_aux_loss_coeff is 0)")
        elif kind not in scopes:
            self.problems.append(f"{key}: {kind!r} is not one of MindFormers' {', '.join(scopes)}")
            self.taken.add(key)
        elif not scopes[kind]:
            self.problems.append(f"{key}: {kind!r} computes the load-balancing loss per "
                                 + ("data x model x context parallel block" if kind == "sub_seq_aux_loss" else
                                    "data x context parallel block") +
                                 f" (model_parallel {mp}, context_parallel {cp}); ours over the step's tokens "
                                 "(gbs_aux_loss) or each data-parallel rank's micro-batch (seq_aux_loss without "
                                 "context parallel): use one of those")
            self.taken.add(key)
        else:
            self.carry(key, M + "router_aux_loss_scope", convert=lambda _: scopes[kind],
                       reason="the tokens the load-balancing loss counts: " +
                       ("the step's, over every data-parallel block and micro-batch so far" if scopes[kind] == "global"
                        else "each data-parallel rank's micro-batch"))

    def tokens(self):
        for key in ("bos_token_id", "eos_token_id"):
            value = self.get(M + key)
            if isinstance(value, list):
                self.carry(M + key, convert=lambda v: v[0], reason="the first of the list")
            elif value is not None:
                self.carry(M + key)
            else:
                self.report.add(M + key, "(absent)", "default", M + key, "not read by MindFormers' training; "
                                "ours keeps its default")
        pad = self.get("train_dataset.data_loader.config.pad")
        if self.get("train_dataset.data_loader.type") == "BlendedMegatronDatasetDataLoader" and pad is not None:
            # GPTDataset masks the loss where labels == the dataset's pad (dataset/blended_datasets/
            # gpt_dataset.py:111-114, 217), not at the model's pad_token_id.
            self.put(M + "pad_token_id", pad)
            self.drop(M + "pad_token_id", f"MindFormers masks the loss at the dataset's pad id {pad} "
                                          "(train_dataset.data_loader.config.pad), not at this id")
        else:
            self.carry(M + "pad_token_id", default=self.defaults["pad_token_id"])

    def offset(self):
        """offset -> parallel_config.stage_layers: num_layers // pp + offset[i] layers on stage i
        (parallel_core/training_graph/transformer/utils.py:160-165, checked at 569-600)."""
        offset = self.get(M + "offset", 0)
        stages = self.get("parallel_config.pipeline_stage", 1)
        layers = self.value("num_hidden_layers")
        if offset in (0, None) or (isinstance(offset, list) and not any(offset)) or stages <= 1:
            self.drop(M + "offset", "no pipeline-stage offset: layers split evenly, as ours" if stages > 1
                      else "no pipeline stages")
            return
        if isinstance(offset, int):
            offset = [offset] * stages
        if not (isinstance(offset, list) and len(offset) == stages and all(isinstance(o, int) for o in offset)):
            self.problems.append(f"{M}offset: {offset!r}: one whole number per pipeline stage ({stages}) imports "
                                 "(interleaved stages are not implemented by ours)")
            self.taken.add(M + "offset")
            return
        stage_layers = [layers // stages + o for o in offset]
        if sum(stage_layers) != layers or min(stage_layers) < 1:
            self.problems.append(f"{M}offset: {offset!r} gives {stage_layers} layers per stage, not {layers} in all "
                                 "with at least one per stage")
            self.taken.add(M + "offset")
            return
        self.carry(M + "offset", "parallel_config.stage_layers", convert=lambda _: stage_layers,
                   reason=f"num_layers // pipeline_stage + offset: {stage_layers} layers per stage")

    # -- sections the legacy format lacks --------------------------------------------------
    def top_level(self):
        if FAMILIES[self.family][1]:
            self.drop("parallel.enable_alltoall", "AllToAll dispatch to expert-parallel devices: on Ascend ours "
                                                  "runs MindFormers' MoE layer, which dispatches so whenever "
                                                  "parallel_config.expert_parallel > 1 (models/expert_parallel.py)")
        super().top_level()
        self.drop("use_legacy", "False: MindFormers 1.9's own format, read by this importer")
        self.drop("pretrained_model_dir", f"config.json merged from {self.pretrained_dir}" if self.pretrained_dir
                  else "no config.json read (the model keys are in model_config)")
        fmt = self.get("load_ckpt_format", "ckpt")
        self.carry("load_ckpt_format", reason="format of load_checkpoint's files")
        if fmt not in ("ckpt", "safetensors"):
            self.problems.append(f"load_ckpt_format: {fmt!r}; ckpt or safetensors")
        self.drop("print_separate_loss", "log option: ours logs the loss and each MoE layer's router loss sum")

    def data_loader(self):
        t = "train_dataset."
        if self.get(t + "data_loader.type") != "BlendedMegatronDatasetDataLoader":
            return super().data_loader()
        c = t + "data_loader.config."
        placeholder = f"datasets/{self.name}"
        paths = self.get(c + "data_path") or []
        prefixes, weights = paths[1::2], paths[0::2]
        command = (f"python scripts/prepare_data.py --from-megatron-indexed {' '.join(map(str, prefixes))} "
                   f"--weights {' '.join(map(str, weights))} --eod-id {self.get(c + 'eod', 0)} "
                   f"--pad-id {self.get(c + 'pad', -1)} --seq-length {self.value('seq_length')} "
                   f"--output {placeholder}")
        self.put(t + "data_loader.dataset_dir", placeholder)
        self.carry(t + "data_loader.type", convert=lambda _: "MindDataset",
                   reason="ours reads packed MindRecord samples with a manifest: " + command)
        self.drop(c + "data_path", f"Megatron .bin/.idx corpora, packed into {placeholder} by: {command}")
        for key in ("eod", "pad", "seed", "split"):
            self.drop(c + key, "used when packing (prepare_data.py) / ours samples train only")
        self.drop(t + "data_loader.datasets_type", "GPTDataset: packed causal-LM samples, as ours")
        self.drop(t + "data_loader.sizes", "sample counts: ours trains on every packed sample for "
                                           "runner_config.epochs")
        seq = self.get(c + "seq_length")
        if seq is not None and seq != self.value("seq_length"):
            self.problems.append(f"{c}seq_length: {seq} differs from {M}seq_length {self.value('seq_length')}")
        self.drop(c + "seq_length", "equal to model_config.seq_length")
        for key in ("eod_mask_loss", "reset_position_ids", "reset_attention_mask", "create_compressed_eod_mask"):
            self.require(c + key, False, "causal attention across packed documents, loss on EOD tokens; "
                         "set model_config.document_attention by hand for per-document masks", default=False)
        self.drop(c + "create_attention_mask", "ours builds the causal mask in the model")
        self.drop(c + "eod_pad_length", "compressed EOD masks are off")
        self.drop(t + "construct_args_key", "MindFormers' column-to-argument order: ours reads input_ids")
        self.drop(t + "seed", "ours shuffles with the recipe's seed")
        self.put(t + "data_loader.shuffle", True)
        self.report.add(t + "data_loader.shuffle", "(absent)", "default", t + "data_loader.shuffle",
                        "GPTDataset shuffles its samples")

    def lr_schedule(self):
        super().lr_schedule()
        schedule = self.out.get("lr_schedule", {})
        if schedule.get("type") == "ConstantWarmUpLR" and "lr_end" not in schedule:
            # the base recipe's lr_end (a cosine's) would exceed a small constant rate and fail validation
            self.put("lr_schedule.lr_end", 0.0)
            self.report.add("lr_schedule.lr_end", "(absent)", "default", "lr_schedule.lr_end",
                            "ConstantWarmUpLR has no end rate (not read)")

    def parallel(self):
        super().parallel()
        self.drop("parallel.dataset_strategy", "per-column batch split: ours gives every rank the global batch "
                                               "(full_batch) in semi-auto parallel")

    def leftovers(self):
        for key in sorted(set(self.leaves) - self.taken):
            if key.startswith(M):
                self.problems.append(f"{key}: {self.leaves[key]!r}: a model key this importer does not know; it may "
                                     "change the model (MindFormers maps unknown keys of TransformerConfig's names "
                                     "onto it, parallel_core/config_converter.py:157-168), so nothing was written")
                self.taken.add(key)
        super().leftovers()

