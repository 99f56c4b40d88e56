"""A recipe's model in MindFormers 1.9's own format (`use_legacy: False`): Qwen3, Qwen3-MoE or DeepSeek-V3.

`to_mindformers` (mindformers.py) writes MindFormers' legacy LlamaForCausalLM for a plain Llama recipe and calls
this module for a model only MindFormers 1.9's own classes build: q/k norms (Qwen3Config), with experts
(Qwen3MoeConfig), or multi-head latent attention (DeepseekV3Config). The keys are those the importer
(mindformers_mcore.py, mindformers_moe.py) reads back into the same recipe, with the same file:line reasons.
What MindFormers would compute differently is refused by name: REFUSALS, one table of everything `--to-mindformers`
refuses (and, for the rows marked moe_layer, every launch of a MoE recipe on Ascend, whose MoE layers are
MindFormers' MoELayer: models/expert_parallel.py), each row the recipe key, when, and why with the MindFormers 1.9
file:line (site-packages mindformers/) that computes otherwise.
"""

from dataclasses import dataclass
from typing import Callable

from ascend_llm_recipes.models.config import ModelConfig
from ascend_llm_recipes.training.recipe.mindformers_moe import BIAS_UPDATED, LOAD_BALANCING

M = "model.model_config."
ARCHITECTURES = {"qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
                 "deepseek_v3": "DeepseekV3ForCausalLM"}
# trainer.model_name of the wheel's own configs (configs/qwen3/pretrain_qwen3_32b_4k.yaml:16,
# qwen3_moe/pretrain_qwen3_30b_a3b_4k.yaml:19, deepseek3/pretrain_deepseek3_671b.yaml:16)
MODEL_NAMES = {"qwen3": "Qwen3", "qwen3_moe": "qwen3_moe", "deepseek_v3": "deepseekV3"}


def mcore_family(cfg):
    """The MindFormers 1.9 family that builds the model, or None for a Llama (the legacy format)."""
    if cfg.mla:
        return "deepseek_v3"
    if cfg.qk_norm:
        return "qwen3_moe" if cfg.moe else "qwen3"
    return None


def common(cfg, family: str) -> dict:
    """The keys every family reads (Hugging Face names, as config.json carries them, plus MindFormers' own)."""
    return {
        "model_type": family, "architectures": [ARCHITECTURES[family]],
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.kv_heads, "seq_length": cfg.seq_length,
        "max_position_embeddings": cfg.seq_length, "rms_norm_eps": cfg.rms_norm_eps, "rope_theta": cfg.rope_theta,
        "initializer_range": cfg.initializer_range, "tie_word_embeddings": cfg.tie_word_embeddings,
        "attention_bias": cfg.qkv_bias, "hidden_act": "silu", "bos_token_id": cfg.bos_token_id,
        "eos_token_id": cfg.eos_token_id, "pad_token_id": cfg.pad_token_id, "compute_dtype": cfg.compute_dtype,
        "params_dtype": cfg.param_dtype, "layernorm_compute_dtype": "float32", "softmax_compute_dtype": "float32",
        "rotary_dtype": "float32", "qk_layernorm": True,
    }


def attention(cfg, family: str) -> dict:
    if family != "deepseek_v3":
        # both Qwen3 classes build q/k norms (modeling_qwen3_train.py:47); kv_channels is head_dim, whose default
        # is 128 in Qwen3Config (configuration_qwen3.py:163-185) and hidden_size / heads in Qwen3MoeConfig
        head = {"head_dim": cfg.head_size} if family == "qwen3" or cfg.head_dim is not None else {}
        return {**head, **flash_attention(cfg)}
    # mindformers_moe.py MoEKeys.mla: qk_layernorm builds the latent norms (gpt_layer_specs.py:154-155);
    # rotary_scaling_factor 1 keeps MLA's softmax scale at 1 / sqrt(d) (multi_latent_attention.py:137-138).
    return {"multi_latent_attention": True, "mla_qkv_concat": False, "q_lora_rank": cfg.q_lora_rank,
            "kv_lora_rank": cfg.kv_lora_rank, "qk_nope_head_dim": cfg.qk_nope_head_dim,
            "qk_rope_head_dim": cfg.qk_rope_head_dim, "v_head_dim": cfg.v_head_dim, "rotary_scaling_factor": 1.0,
            "num_nextn_predict_layers": 0, **flash_attention(cfg)}


def flash_attention(cfg) -> dict:
    """FlashAttention and its compressed causal mask (TransformerConfig keys, transformer_config.py:2063-2081)."""
    return {"use_flash_attention": cfg.use_flash_attention, "use_attn_mask_compression": cfg.use_attn_mask_compression}


def moe_layer_family(cfg) -> str:
    """The MindFormers family whose config class makes our MoE layers' TransformerConfig (models/expert_parallel.py):
    any MoE model's, with or without q/k norms and dense layers (those layers are ours)."""
    return "deepseek_v3" if cfg.mla else "qwen3_moe"


# Architecture keys of ours that MindFormers' legacy LlamaForCausalLM cannot express: a Llama (no q/k norms, experts
# or latent attention) exports them only at their defaults.
NOT_EXPORTED_MODEL_FIELDS = ("head_dim", "qk_norm", "num_experts", "num_experts_per_tok", "moe_intermediate_size",
                             "norm_topk_prob", "shared_expert_intermediate_size", "shared_expert_gate",
                             "dense_layers", "router_aux_loss_coef", "router_z_loss_coef")
REQUIRED_MODEL_FIELDS = ("vocab_size", "hidden_size", "num_layers", "num_heads", "intermediate_size", "seq_length")
TG = "parallel_core/training_graph/"  # MindFormers 1.9's training graph, where its own classes' layers are


@dataclass(frozen=True)
class Refusal:
    """A recipe setting MindFormers 1.9 computes otherwise than ours, or has no key for."""

    key: str              # the recipe key, dotted
    when: Callable        # (recipe, family) -> bool; family: mcore_family's (None: legacy Llama) or the MoE layer's
    why: Callable         # (recipe, family) -> the problem after "key: "
    moe_layer: bool = False  # also refused when only the MoE layers are MindFormers' (a MoE recipe on Ascend)


def _cfg(recipe):
    return recipe.model.model_config


def _moe_family(recipe, family) -> bool:
    """A MoE model whose MoE layers a MindFormers 1.9 class builds (a Llama family None has no MoE class)."""
    return family is not None and _cfg(recipe).moe


def _bias_moved(recipe) -> bool:
    return _cfg(recipe).expert_bias and bool(_cfg(recipe).expert_bias_update_rate)


def _llama_field(name: str) -> Refusal:
    """An architecture field of ours that MindFormers' LlamaForCausalLM has no argument for."""
    def differs(recipe, family) -> bool:
        defaults = ModelConfig(**{n: getattr(_cfg(recipe), n) for n in REQUIRED_MODEL_FIELDS})
        return family is None and not _cfg(recipe).moe and getattr(_cfg(recipe), name) != getattr(defaults, name)
    return Refusal(M + name, differs, lambda r, f: (
        f"{getattr(_cfg(r), name)!r} has no MindFormers LlamaForCausalLM equivalent (MindFormers 1.9's own format is "
        "written for Qwen3 models (qk_norm: True, with experts: Qwen3-MoE) and DeepSeek-V3 ones (kv_lora_rank))"))


REFUSALS = (
    # the MoE layer (MindFormers' TopKRouter and MoELayer, parallel_core/training_graph/transformer/moe/)
    Refusal(M + "router_z_loss_coef", lambda r, f: _moe_family(r, f) and bool(_cfg(r).router_z_loss_coef),
            lambda r, f: f"{_cfg(r).router_z_loss_coef}: MindFormers 1.9's training graph has no router z-loss: "
            "TransformerConfig keeps moe_z_loss_coeff (parallel_core/transformer_config.py:1787, from z_loss_factor: "
            f"transformer_config_utils.py:359) but no module of {TG} reads it; set it 0", moe_layer=True),
    Refusal(M + "norm_topk_prob", lambda r, f: _moe_family(r, f) and _cfg(r).norm_topk_prob
            and _cfg(r).num_experts_per_tok == 1,
            lambda r, f: "True with one expert per token: MindFormers renormalises only when k > 1 "
            f"({TG}transformer/moe/router.py:290-294), ours makes the weight 1; set it False", moe_layer=True),
    Refusal(M + "capacity_factor", lambda r, f: _moe_family(r, f) and bool(_cfg(r).capacity_factor),
            lambda r, f: f"{_cfg(r).capacity_factor}: MindFormers 1.9's training graph never drops: "
            f"TopKRouter.routing keeps every token's top k ({TG}transformer/moe/router.py:259-296) and no dispatcher "
            "reads a capacity (moe_expert_capacity_factor is only validated, parallel_core/transformer_config.py:"
            "2123-2131); set it 0", moe_layer=True),
    Refusal(M + "topk_group", lambda r, f: _moe_family(r, f) and _cfg(r).n_group > 1
            and _cfg(r).num_experts_per_tok // _cfg(r).topk_group != 2,
            lambda r, f: f"{_cfg(r).topk_group}: MindFormers scores a group by its best num_experts_per_tok // "
            f"topk_group = {_cfg(r).num_experts_per_tok // _cfg(r).topk_group} scores ({TG}transformer/moe/router.py:"
            "336-338; it has no key for the group score's width), ours, as DeepSeek-V3, by its best two; the same "
            "only when num_experts_per_tok // topk_group is 2", moe_layer=True),
    # the whole model in MindFormers' own classes
    Refusal(M + "dense_layers", lambda r, f: f == "qwen3_moe" and bool(_cfg(r).dense_layers),
            lambda r, f: f"{_cfg(r).dense_layers}: MindFormers' Qwen3-MoE gives every layer experts: it builds each "
            "layer from one MoE layer spec (models/qwen3_moe/modeling_qwen3_moe_train.py:50-58, "
            f"{TG}transformer/transformer_block.py:72-77) and deletes mlp_only_layers and decoder_sparse_step as "
            "useless (models/qwen3_moe/configuration_qwen3_moe.py:175-177). Its keys for dense layers, "
            "first_k_dense_replace and moe_layer_freq (parallel_core/transformer_config.py:561, 1651), are read only "
            f"by get_gpt_decoder_block_spec ({TG}base_models/gpt/gpt_layer_specs.py:226-248), which only the "
            "DeepSeek-V3 class builds (models/deepseek3/modeling_deepseek_v3_train.py:35-36). Train it with this "
            "recipe (on Ascend its MoE layers are MindFormers' MoELayer), or set dense_layers: [] for a model "
            "MindFormers' Qwen3-MoE builds"),
    Refusal(M + "expert_bias_update_rate", lambda r, f: _moe_family(r, f) and _bias_moved(r)
            and f not in BIAS_UPDATED,
            lambda r, f: f"{_cfg(r).expert_bias_update_rate}: MindFormers' {f} never moves the expert bias (its "
            "training class has no update_topk_bias)"),
    Refusal("parallel_config.micro_batch_num", lambda r, f: _moe_family(r, f) and _bias_moved(r)
            and r.parallel_config.pipeline_stage == 1 and r.parallel_config.micro_batch_num != 1,
            lambda r, f: f"{r.parallel_config.micro_batch_num} without pipeline stages: MindFormers would move the "
            f"expert bias towards micro_batch_num / experts per pass ({TG}base_models/gpt/gpt_model.py:403-404, "
            "635); set it 1"),
    Refusal(M + "kv_lora_rank", lambda r, f: f == "deepseek_v3" and not _cfg(r).moe,
            lambda r, f: f"{_cfg(r).kv_lora_rank}: multi-head latent attention without experts: MindFormers' "
            "DeepSeek-V3 is written for MoE models only here; set num_experts"),
    Refusal(M + "document_attention", lambda r, f: _cfg(r).document_attention,
            lambda r, f: "True has no MindFormers equivalent that reads our packed data (MindFormers' EOD mask "
            "compression needs its own data columns)"),
    Refusal(M + "qk_norm", lambda r, f: f is None and _cfg(r).moe,
            lambda r, f: "False with experts (a Mixtral or Qwen2-MoE): MindFormers 1.9 has no model class for a MoE "
            "model without q/k norms (its 1.9 format builds Qwen3-MoE, whose layers always have them: "
            "models/qwen3_moe/modeling_qwen3_moe_train.py:56, and DeepSeek-V3), so no MindFormers config trains it; "
            "our recipe does, on Ascend with MindFormers' MoE layer inside our decoder (models/expert_parallel.py)"),
    *(_llama_field(name) for name in NOT_EXPORTED_MODEL_FIELDS),
    Refusal("parallel_config.stage_layers",
            lambda r, f: f is None and len(set(r.parallel_config.stage_layers or [])) > 1,
            lambda r, f: f"{r.parallel_config.stage_layers}: uneven stages; set MindFormers' model_config.offset by "
            "hand (the legacy importer refuses offsets, so such a config does not import back)"),
)


def refusals(recipe, family: str, moe_layer_only: bool = False) -> list:
    """The REFUSALS rows that hold for `recipe` written as MindFormers' `family` (None: the legacy Llama), each
    "key: why"; moe_layer_only: only the MoE layer's (our decoder around MindFormers' MoELayer)."""
    return [f"{row.key}: {row.why(recipe, family)}" for row in REFUSALS
            if (row.moe_layer or not moe_layer_only) and row.when(recipe, family)]


def experts(recipe, family: str, layers_ours: bool = False) -> tuple:
    """(MoE keys, extra callbacks) for the router and the MoE layers; what is refused is REFUSALS'. layers_ours: our
    decoder decides which layers have experts (models/expert_parallel.py), so MindFormers' per-family layer pattern is
    not asked for."""
    cfg = recipe.model.model_config
    keys = {"num_experts" if family == "qwen3_moe" else "n_routed_experts": cfg.num_experts,
            "num_experts_per_tok": cfg.num_experts_per_tok, "moe_intermediate_size": cfg.expert_size,
            "norm_topk_prob": cfg.norm_topk_prob, "routed_scaling_factor": cfg.routed_scaling_factor,
            "moe_aux_loss_coeff": cfg.router_aux_loss_coef,
            "moe_router_load_balancing_type": LOAD_BALANCING[cfg.router_aux_loss_scope],
            "moe_router_score_function": cfg.router_score, "moe_router_enable_expert_bias": cfg.expert_bias,
            # MindFormers' training graph builds MoE layers only with grouped matmul: get_moe_module_spec raises
            # NotImplementedError otherwise (base_models/gpt/moe_module_specs.py:37-38)
            "moe_grouped_gemm": True}
    if cfg.num_experts_per_tok == 1 and cfg.router_score == "softmax":
        # TransformerConfig refuses top-1 softmax routing unless the softmax comes before the top-k
        # (parallel_core/transformer_config.py:2161-2169). It does, in MindFormers' training router whatever this key
        # says (transformer/moe/router.py:272-288, which never reads it) and in ours (models/moe.py:97-103).
        keys["moe_router_pre_softmax"] = True
    names = ("moe_router_num_groups", "moe_router_group_topk") if family == "qwen3_moe" else ("n_group", "topk_group")
    if cfg.n_group > 1 or family == "deepseek_v3":
        keys.update({names[0]: cfg.n_group, names[1]: cfg.topk_group})
    if cfg.shared_expert_intermediate_size:
        keys["moe_shared_expert_intermediate_size"] = cfg.shared_expert_intermediate_size
        keys["use_shared_expert_gating"] = cfg.shared_expert_gate
    if family == "deepseek_v3":
        keys["n_shared_experts"] = (max(1, cfg.shared_expert_intermediate_size // cfg.expert_size)
                                    if cfg.shared_expert_intermediate_size else 0)
    if family == "deepseek_v3" and not layers_ours:
        dense = sorted(cfg.dense_layers)
        if dense == list(range(len(dense))):
            keys["first_k_dense_replace"] = len(dense)
        else:  # gpt_layer_specs.py:229-248: 0 marks a dense layer
            keys.update(first_k_dense_replace=0, moe_layer_freq=[int(cfg.is_moe_layer(i)) for i in
                                                                  range(cfg.num_layers)])
    elif family == "deepseek_v3":
        # our decoder places the MoE layers, but MindFormers still checks first_k_dense_replace (its default 3)
        # against num_layers (a model shallower than 3 layers is refused): the leading dense layers, as ours has them
        keys["first_k_dense_replace"] = next((i for i in range(cfg.num_layers) if cfg.is_moe_layer(i)), cfg.num_layers)
    callbacks = []
    if cfg.expert_bias and cfg.expert_bias_update_rate and layers_ours:
        # moved by training/worker/router_stats.py from the router's counts, whatever the passes per step
        keys["moe_router_bias_update_rate"] = cfg.expert_bias_update_rate
    elif cfg.expert_bias and cfg.expert_bias_update_rate:
        p = recipe.parallel_config
        keys["moe_router_bias_update_rate"] = cfg.expert_bias_update_rate
        # a step's forward passes: micro_batch_num with pipeline stages, else the accumulation steps
        accumulation = 1 if p.pipeline_stage > 1 else recipe.runner_config.gradient_accumulation_steps
        callbacks.append({"type": "TopkBiasBalanceCallback", "gradient_accumulation_steps": accumulation})
    return keys, callbacks


def mcore_model(recipe, family: str) -> tuple:
    """(model section, extra callbacks, report notes) of MindFormers 1.9's own format for `family` (a recipe that
    refusals(recipe, family) passes)."""
    cfg = recipe.model.model_config
    model_config = {**common(cfg, family), **attention(cfg, family)}
    notes = []
    if family == "deepseek_v3":
        # TransformerConfig fused_norm (transformer_config.py:242, default True; transformer_config_utils.py:259): the
        # RMSNorm class of DeepSeek-V3's layer specs (gpt_layer_specs.py:205, 218, 254)
        model_config["fused_norm"] = cfg.fused_rms_norm
    elif not cfg.fused_rms_norm:
        notes.append("fused_rms_norm: False: MindFormers 1.9's Qwen3 classes always build the fused RMSNorm kernel "
                     "(they pass no fused_norm to get_gpt_layer_local_spec, whose default is True: "
                     f"{TG}base_models/gpt/gpt_layer_specs.py:92): the same math up to rounding")
    callbacks = []
    if cfg.moe:
        keys, callbacks = experts(recipe, family)
        model_config.update(keys)
    stages, layers = recipe.parallel_config.pipeline_stage, cfg.num_layers
    stage_layers = recipe.parallel_config.stage_layers
    if stage_layers and stages > 1:
        # parallel_core/training_graph/transformer/utils.py:160-165: num_layers // pp + offset[i] on stage i
        model_config["offset"] = [n - layers // stages for n in stage_layers]
    return {"model_config": model_config}, callbacks, notes


def moe_layer_problems(recipe) -> list:
    """What MindFormers' MoELayer (the MoE layers of a recipe on Ascend, models/expert_parallel.py) would compute
    otherwise than the recipe says, each naming its key; [] when nothing. Imports nothing of MindFormers, so that
    --plan and --check can ask it."""
    return refusals(recipe, moe_layer_family(recipe.model.model_config), moe_layer_only=True)


def moe_layer_refusals(recipe) -> list:
    """--plan's notes of what the launch refuses for a MoE recipe on Ascend (its MoE layers MindFormers')."""
    from ascend_llm_recipes.training.recipe.mindformers import runs_mindformers_moe

    if not runs_mindformers_moe(recipe):
        return []
    return [f"refused at launch (on Ascend the MoE layers are MindFormers' MoELayer): {problem}"
            for problem in moe_layer_problems(recipe)]


def moe_transformer_config(recipe, source: str):
    """MindFormers' TransformerConfig for the recipe's MoE layers run as its MoELayer (models/expert_parallel.py):
    the keys `--to-mindformers` writes, read by MindFormers' own config class and converter as its trainer reads
    such a YAML (core/parallel_config.py:61-74, models/qwen3_moe/configuration_qwen3_moe.py:256), so a key that
    MindFormers would compute differently from ours is refused by name here too (RecipeError naming `source`).
    Outside semi-auto parallel MindFormers runs every degree at 1 (trainer/base_trainer.py:289-296): so do we."""
    from mindformers.models.deepseek3 import DeepseekV3Config
    from mindformers.models.qwen3_moe import Qwen3MoeConfig
    from mindformers.modules.transformer import TransformerOpParallelConfig

    from ascend_llm_recipes.common.errors import RecipeError
    from ascend_llm_recipes.training.recipe.mindformers import semi_auto

    cfg, p, problems = recipe.model.model_config, recipe.parallel_config, moe_layer_problems(recipe)
    family = moe_layer_family(cfg)
    keys, _ = experts(recipe, family, layers_ours=True)
    if problems:
        raise RecipeError(source, problems, hint="on Ascend the MoE layers are MindFormers 1.9's MoELayer, which "
                                                 "computes these differently; change them in the recipe")
    # with tensor parallel, MindFormers' MoE layer runs sequence parallel (moe_layer.py:143-147): its tokens split
    # over TP (models/expert_parallel.py); our dense layers keep the sequence whole
    degrees = dict(data_parallel=p.data_parallel, model_parallel=p.model_parallel, pipeline_stage=p.pipeline_stage,
                   micro_batch_num=p.micro_batch_num, expert_parallel=getattr(p, "expert_parallel", 1),
                   use_seq_parallel=p.model_parallel > 1)
    if not semi_auto(recipe):
        degrees = dict(data_parallel=1, model_parallel=1, pipeline_stage=1, micro_batch_num=1, expert_parallel=1)
    config_class = DeepseekV3Config if family == "deepseek_v3" else Qwen3MoeConfig
    model = config_class(**common(cfg, family), **attention(cfg, family), **keys,
                         parallel_config=TransformerOpParallelConfig(**degrees))
    return model.convert_to_transformer_config(is_mla_model=family == "deepseek_v3")
