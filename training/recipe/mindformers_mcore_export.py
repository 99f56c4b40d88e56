"""A recipe's model in MindFormers 1.9's own format (`use_legacy: False`): Qwen3, Qwen3-MoE or DeepSeek-V3.

`to_mindformers` (mindformers.py) writes MindFormers' legacy LlamaForCausalLM for a plain Llama recipe and calls
this module for a model only MindFormers 1.9's own classes build: q/k norms (Qwen3Config), with experts
(Qwen3MoeConfig), or multi-head latent attention (DeepseekV3Config). The keys are those the importer
(mindformers_mcore.py, mindformers_moe.py) reads back into the same recipe, with the same file:line reasons;
what MindFormers would compute differently is refused by name.
"""

from ascend_llm_recipes.training.recipe.mindformers_moe import BIAS_UPDATED, LOAD_BALANCING

M = "model.model_config."
ARCHITECTURES = {"qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
                 "deepseek_v3": "DeepseekV3ForCausalLM"}
# trainer.model_name of the wheel's own configs (configs/qwen3/pretrain_qwen3_32b_4k.yaml:16,
# qwen3_moe/pretrain_qwen3_30b_a3b_4k.yaml:19, deepseek3/pretrain_deepseek3_671b.yaml:16)
MODEL_NAMES = {"qwen3": "Qwen3", "qwen3_moe": "qwen3_moe", "deepseek_v3": "deepseekV3"}
# Our kernel switch MindFormers 1.9's own classes set themselves (TransformerConfig fused_norm): not written.
KERNELS = ("fused_rms_norm",)


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


def experts(recipe, family: str, problems: list, layers_ours: bool = False) -> tuple:
    """(MoE keys, extra callbacks) for the router and the MoE layers. layers_ours: our decoder decides which layers
    have experts (models/expert_parallel.py), so MindFormers' per-family layer pattern is not asked for."""
    cfg = recipe.model.model_config
    if cfg.router_z_loss_coef:
        problems.append(f"{M}router_z_loss_coef: {cfg.router_z_loss_coef}: MindFormers 1.9's training graph has no "
                        "router z-loss (transformer/moe/); set it 0")
    if cfg.norm_topk_prob and cfg.num_experts_per_tok == 1:
        problems.append(f"{M}norm_topk_prob: True with one expert per token: MindFormers renormalises only when k > 1 "
                        "(transformer/moe/router.py:290-294), ours makes the weight 1; set it False")
    if cfg.capacity_factor:
        problems.append(f"{M}capacity_factor: {cfg.capacity_factor}: MindFormers 1.9's training graph never drops: "
                        "TopKRouter.routing keeps every token's top k (transformer/moe/router.py:259-296) and no "
                        "dispatcher reads a capacity (moe_expert_capacity_factor is only validated, "
                        "parallel_core/transformer_config.py:2123-2131); set it 0")
    if cfg.n_group > 1 and cfg.num_experts_per_tok // cfg.topk_group != 2:
        problems.append(f"{M}topk_group: {cfg.topk_group}: MindFormers scores a group by its best num_experts_per_tok "
                        f"// topk_group = {cfg.num_experts_per_tok // cfg.topk_group} scores (router.py:336-338), ours "
                        "by its best two")
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
    elif cfg.dense_layers and not layers_ours:
        problems.append(f"{M}dense_layers: {cfg.dense_layers}: MindFormers' Qwen3-MoE gives every layer experts "
                        "(models/qwen3_moe/modeling_qwen3_moe_train.py:50-58)")
    callbacks = []
    if cfg.expert_bias and cfg.expert_bias_update_rate and layers_ours:
        # moved by training/worker/router_stats.py from the router's counts, whatever the passes per step
        keys["moe_router_bias_update_rate"] = cfg.expert_bias_update_rate
    elif cfg.expert_bias and cfg.expert_bias_update_rate:
        if family not in BIAS_UPDATED:
            problems.append(f"{M}expert_bias_update_rate: {cfg.expert_bias_update_rate}: MindFormers' {family} "
                            "never moves the expert bias (its training class has no update_topk_bias)")
        p = recipe.parallel_config
        if p.pipeline_stage == 1 and p.micro_batch_num != 1:
            problems.append(f"parallel_config.micro_batch_num: {p.micro_batch_num} without pipeline stages: "
                            "MindFormers would move the expert bias towards micro_batch_num / experts per pass "
                            "(gpt_model.py:403-404, 635); set it 1")
        keys["moe_router_bias_update_rate"] = cfg.expert_bias_update_rate
        # a step's forward passes: micro_batch_num with pipeline stages, else the accumulation steps
        accumulation = 1 if p.pipeline_stage > 1 else recipe.runner_config.gradient_accumulation_steps
        callbacks.append({"type": "TopkBiasBalanceCallback", "gradient_accumulation_steps": accumulation})
    return keys, callbacks


def mcore_model(recipe, family: str, problems: list) -> tuple:
    """(model section, extra callbacks, report notes) of MindFormers 1.9's own format for `family`."""
    cfg = recipe.model.model_config
    model_config = {**common(cfg, family), **attention(cfg, family)}
    callbacks = []
    if cfg.moe:
        keys, callbacks = experts(recipe, family, problems)
        model_config.update(keys)
    elif family == "deepseek_v3":
        problems.append(f"{M}kv_lora_rank: multi-head latent attention without experts: MindFormers' DeepSeek-V3 "
                        "is written for MoE models only here; set num_experts")
    stages, layers = recipe.parallel_config.pipeline_stage, cfg.num_layers
    stage_layers = recipe.parallel_config.stage_layers
    if stage_layers and stages > 1:
        # parallel_core/training_graph/transformer/utils.py:160-165: num_layers // pp + offset[i] on stage i
        model_config["offset"] = [n - layers // stages for n in stage_layers]
    notes = [f"{key}: {getattr(cfg, key)}: Ascend kernel switch MindFormers 1.9's own classes set themselves"
             for key in KERNELS if getattr(cfg, key)]
    return {"model_config": model_config}, callbacks, notes


def moe_layer_problems(recipe) -> list:
    """What MindFormers' MoELayer (the MoE layers of a recipe on Ascend, models/expert_parallel.py) would compute
    otherwise than the recipe says, each naming its key; [] when nothing. Imports nothing of MindFormers, so that
    --plan and --check can ask it."""
    problems = []
    experts(recipe, moe_layer_family(recipe.model.model_config), problems, layers_ours=True)
    return problems


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

    cfg, p, problems = recipe.model.model_config, recipe.parallel_config, []
    family = moe_layer_family(cfg)
    keys, _ = experts(recipe, family, problems, layers_ours=True)
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
