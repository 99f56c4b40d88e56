"""scripts/convert_recipe.py on MindFormers 1.9's own configs (use_legacy: False), read from the installed wheel.

The oracle is MindFormers itself: its Qwen3Config / Qwen3MoeConfig built from the same keys (merged with
config.json by its own merge_model_config) and converted to its TransformerConfig, whose numbers give the
parameter count our imported recipe must have. config.json files are written by transformers' save_pretrained.
"""

import importlib.metadata
import os
import subprocess
import sys

import pytest
import yaml

from conftest import REPO_ROOT
from ascend_llm_recipes.common.errors import RecipeError
from ascend_llm_recipes.models.arithmetic import param_count
from ascend_llm_recipes.training.launcher.preflight import check_model
from ascend_llm_recipes.training.recipe.loading import load_recipe
from ascend_llm_recipes.training.recipe.mindformers import _leaves, from_mindformers
from ascend_llm_recipes.training.recipe.mindformers_mcore import DEFAULTS, TC_DEFAULTS

FAMILY_DIRS = ("qwen3", "qwen3_moe", "deepseek3", "glm4", "glm4_moe")


def wheel_configs() -> dict:
    """{'qwen3/pretrain_qwen3_32b_4k.yaml': path} for the pretraining configs the mindformers wheel installs."""
    found = {}
    for f in importlib.metadata.files("mindformers"):
        parts = f.parts
        if len(parts) == 3 and parts[0] == "configs" and parts[2].endswith(".yaml") and (
                parts[1] in FAMILY_DIRS and parts[2].startswith("pretrain")
                or parts[1] == "general" and parts[2].startswith("llm_pretrain_")):
            found[f"{parts[1]}/{parts[2]}"] = str(f.locate())
    return found


WHEEL = wheel_configs()
# What each wheel pretraining config does, by name; a config the wheel adds fails test_every_wheel_config_is_covered.
IMPORTS = ["qwen3/pretrain_qwen3_32b_4k.yaml", "qwen3_moe/pretrain_qwen3_30b_a3b_4k.yaml"]
REFUSED = {
    # its seq_aux_loss at DP 4 is ours ("micro_batch")
    "deepseek3/pretrain_deepseek3_671b.yaml": [
        "3 problem(s)", "= 1.5896 / sqrt",
        "rotary_scaling_factor 40.0 (MLATransformerConfig's default) and mscale 0.707 (MLATransformerConfig's default)",
        "num_nextn_predict_layers: 1: multi-token prediction",
        "offset: [[1, 1, 1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 1, -2]]"],
    "deepseek3/pretrain_deepseek3_12b_16p_pp16.yaml": [
        "3 problem(s)", "rotary_scaling_factor 40.0 (MLATransformerConfig's default) and mscale 1:", "= 1.8739 / sqrt",
        "position_embedding_type: 'yarn' is not supported", "num_nextn_predict_layers: 1: multi-token prediction"],
    "general/llm_pretrain_dense_template.yaml": ["model_type: absent", "--pretrained-model-dir"],
    "general/llm_pretrain_moe_template.yaml": ["model_type: absent", "--pretrained-model-dir"],
}


def read(path: str) -> dict:
    with open(path, encoding="utf-8") as f:
        return yaml.safe_load(f)


def write_config(data: dict, tmp_path, name: str) -> str:
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return str(path)


def import_to(config: str, tmp_path, name: str, pretrained_model_dir: str = None) -> tuple:
    out = tmp_path / "recipes" / f"{name}.yaml"
    text, report = from_mindformers(config, str(out), pretrained_model_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    return load_recipe(str(out), planning=True), report


def mindformers_transformer_config(source: dict, pretrained_model_dir: str = None):
    """MindFormers' own TransformerConfig for a config: merged with config.json, built, converted."""
    from mindformers.models.build_config import merge_model_config
    from mindformers.models.qwen3.configuration_qwen3 import Qwen3Config
    from mindformers.models.qwen3_moe.configuration_qwen3_moe import Qwen3MoeConfig
    from mindformers.models.deepseek3.configuration_deepseek_v3 import DeepseekV3Config

    model_config = dict(source["model"]["model_config"])
    if pretrained_model_dir:
        model_config = merge_model_config(pretrained_model_dir, model_config)
    classes = {"qwen3": Qwen3Config, "qwen3_moe": Qwen3MoeConfig, "deepseek_v3": DeepseekV3Config}
    config = classes[model_config["model_type"]](**model_config)
    return config.convert_to_transformer_config(), config.tie_word_embeddings


def mindformers_parameters(tc, tie: bool) -> int:
    """Parameters of MindFormers' Qwen3 / Qwen3-MoE GPTModel from its TransformerConfig (test oracle).

    Attention: q and o (hidden x heads*kv_channels), k and v (hidden x groups*kv_channels), q/k bias with
    add_qkv_bias, the q/k RMSNorms of kv_channels both classes build; MLP: SwiGLU of ffn_hidden_size, or per
    expert of moe_ffn_hidden_size plus the router (experts x hidden) and its expert_bias (router.py:96, 170), the
    shared expert and its gate (moe/shared_experts.py:57, 67); two norms per layer, a final norm, embedding and
    (untied) output table.
    """
    h, d = tc.hidden_size, tc.kv_channels
    q, kv = tc.num_attention_heads * d, tc.num_query_groups * d
    attention = 2 * h * q + 2 * h * kv + (q + 2 * kv if tc.add_qkv_bias else 0) + 2 * d
    if tc.num_moe_experts:
        mlp = tc.num_moe_experts * (3 * h * tc.moe_ffn_hidden_size + h + bool(tc.moe_router_enable_expert_bias)) + \
            3 * h * (tc.moe_shared_expert_intermediate_size or 0) + h * bool(tc.use_shared_expert_gating)
    else:
        mlp = 3 * h * tc.ffn_hidden_size
    return tc.num_layers * (attention + mlp + 2 * h) + h + tc.vocab_size * h * (1 if tie else 2)


def assert_same_model(recipe, tc, tie):
    cfg = recipe.model.model_config
    assert param_count(cfg, padded=False) == mindformers_parameters(tc, tie)
    assert (cfg.num_layers, cfg.hidden_size, cfg.intermediate_size, cfg.head_size, cfg.kv_heads, cfg.num_heads) == \
        (tc.num_layers, tc.hidden_size, tc.ffn_hidden_size, tc.kv_channels, tc.num_query_groups,
         tc.num_attention_heads)
    assert (cfg.rope_theta, cfg.rms_norm_eps, cfg.qkv_bias, cfg.tie_word_embeddings, cfg.qk_norm) == \
        (float(tc.rotary_base), tc.layernorm_epsilon, tc.add_qkv_bias, tie, True)
    if tc.num_moe_experts:
        assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size, cfg.norm_topk_prob,
                cfg.router_aux_loss_coef, cfg.dense_layers) == \
            (tc.num_moe_experts, tc.moe_router_topk, tc.moe_ffn_hidden_size, tc.norm_topk_prob,
             tc.moe_aux_loss_coeff, [])


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    """Hugging Face model directories (config.json by save_pretrained) of the families a template can name."""
    from transformers import Glm4Config, Qwen3Config, Qwen3MoeConfig

    dirs = {}
    for name, config in (("qwen3", Qwen3Config(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                                              num_attention_heads=16, num_key_value_heads=8,
                                              rope_theta=1e6)),
                         ("qwen3_moe", Qwen3MoeConfig()), ("glm4", Glm4Config())):
        directory = tmp_path_factory.mktemp(name)
        config.save_pretrained(directory)
        dirs[name] = str(directory)
    return dirs


def test_every_wheel_config_is_covered():
    assert sorted(WHEEL) == sorted(IMPORTS + list(REFUSED))


def test_qwen3_32b_imports_with_mindformers_own_numbers(tmp_path):
    path = WHEEL["qwen3/pretrain_qwen3_32b_4k.yaml"]
    source = read(path)
    recipe, report = import_to(path, tmp_path, "qwen3_32b")
    tc, tie = mindformers_transformer_config(source)
    assert_same_model(recipe, tc, tie)
    assert param_count(recipe.model.model_config, padded=False) == 32_762_123_264  # Qwen3-32B's 32.8B
    p = recipe.parallel_config
    assert (p.model_parallel, p.pipeline_stage, p.stage_layers) == (4, 4, [15, 15, 17, 17])  # offset [-1,-1,1,1]
    cfg = recipe.model.model_config
    assert (cfg.compute_dtype, cfg.param_dtype, cfg.pad_token_id) == ("bfloat16", "float32", -1)
    assert recipe.dataset_dir.endswith("datasets/qwen3_32b") and recipe.context.device_target == "Ascend"
    assert set(_leaves(source)) <= {e.key for e in report.entries}  # every key accounted for
    by_key = {e.key: e for e in report.entries}
    assert "--from-megatron-indexed /path/to/wiki103-megatron_text_document" in \
        by_key["train_dataset.data_loader.type"].reason
    assert by_key["model.model_config.qk_layernorm"].ours == "model.model_config.qk_norm"


def test_qwen3_30b_a3b_imports_as_shipped_at_mindformers_layout(tmp_path):
    """TP 4 with sequence parallel (ours: in the MoE layers), PP 4 of 16 micro-batches balanced by gbs_aux_loss
    (router_aux_loss_scope global), EP 4: the wheel's Qwen3-30B-A3B config imports unchanged, and plans."""
    from ascend_llm_recipes.training.tools.planner import plan

    recipe, report = import_to(WHEEL["qwen3_moe/pretrain_qwen3_30b_a3b_4k.yaml"], tmp_path, "a3b")
    p, cfg = recipe.parallel_config, recipe.model.model_config
    assert (p.data_parallel, p.model_parallel, p.pipeline_stage, p.expert_parallel, p.micro_batch_num) == \
        (1, 4, 4, 4, 16)
    assert (cfg.router_aux_loss_scope, cfg.num_experts) == ("global", 128) and check_model(recipe) == []
    by_key = {e.key: e for e in report.entries}
    assert by_key["model.model_config.moe_router_load_balancing_type"].ours == \
        "model.model_config.router_aux_loss_scope"
    assert plan(recipe).fits


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_refused_wheel_configs_name_what_is_refused(name):
    with pytest.raises(RecipeError) as err:
        from_mindformers(WHEEL[name], "/nonexistent/out.yaml")
    for fragment in REFUSED[name]:
        assert fragment in str(err.value)


def qwen3_moe_as_the_error_says(device: str) -> dict:
    """The wheel's Qwen3-30B-A3B config with its refused key's cause changed: one micro-batch, no model parallel."""
    source = read(WHEEL["qwen3_moe/pretrain_qwen3_30b_a3b_4k.yaml"])
    source["parallel_config"].update(model_parallel=1, pipeline_stage=1, micro_batch_num=1, expert_parallel=1,
                                     use_seq_parallel=False)
    source["context"]["device_target"] = device
    return source


def test_qwen3_moe_imports_on_cpu_and_on_ascend(tmp_path):
    source = qwen3_moe_as_the_error_says("CPU")
    recipe, report = import_to(write_config(source, tmp_path, "a3b_cpu"), tmp_path, "a3b_cpu")
    tc, tie = mindformers_transformer_config(source)
    assert_same_model(recipe, tc, tie)
    cfg = recipe.model.model_config
    assert (cfg.norm_topk_prob, cfg.router_aux_loss_coef, cfg.router_z_loss_coef) == (False, 0.001, 0.0)
    assert (cfg.routed_scaling_factor, tc.moe_router_topk_scaling_factor) == (1.5, 1.5)  # router.py:295
    assert param_count(cfg, padded=False) == 30_532_122_624  # Qwen3-30B-A3B's 30.5B
    assert set(_leaves(source)) <= {e.key for e in report.entries}
    by_key = {e.key: e for e in report.entries}
    assert by_key["model.model_config.router_aux_loss_coef"].status == "dropped"  # Qwen3MoeConfig deletes it
    assert "expert" in by_key["parallel.enable_alltoall"].reason
    assert by_key["model.model_config.moe_aux_loss_coeff"].ours == "model.model_config.router_aux_loss_coef"
    ascend, _ = import_to(write_config(qwen3_moe_as_the_error_says("Ascend"), tmp_path, "a3b"), tmp_path, "a3b")
    assert ascend.model.model_config.num_experts == 128 and check_model(ascend) == []  # MindFormers' MoELayer


@pytest.mark.parametrize("key, value, message", [
    ("moe_router_score_function", "sigmoid", None),
    ("moe_router_score_function", "sqrtsoftplus", "moe_router_score_function: 'sqrtsoftplus': softmax or sigmoid"),
    ("moe_router_enable_expert_bias", True, "moe_router_enable_expert_bias: True: an expert bias on softmax scores"),
    ("moe_router_num_groups", 8, "moe_router_group_topk: None (MindFormers default): MindFormers scores each group"),
    ("moe_router_group_topk", 2, None),  # no groups: unread
    ("moe_expert_capacity_factor", 1.25, "moe_expert_capacity_factor: 1.25 is not supported (None only): "
                                         "MindFormers 1.9's training graph never reads it"),
    ("moe_expert_capacity_factor", -1.0, None),  # TransformerConfig reads a negative capacity as none: dropless
    ("moe_router_load_balancing_type", "seq_aux_loss", None),
    ("multi_latent_attention", True, "multi_latent_attention: True is not supported for qwen3_moe"),
    ("routed_scaling_factor", 1.0, None),
    ("moe_shared_expert_intermediate_size", 768, None),
    ("first_k_dense_replace", 2, "first_k_dense_replace: 2 is not supported (None only): MindFormers' Qwen3-MoE"),
    ("rope_scaling", {"rope_type": "yarn", "factor": 4.0}, "rope_scaling: {'rope_type': 'yarn'"),
    ("hidden_act", "gelu", "hidden_act: 'gelu' is not supported"),
    ("moe_router_topk_scaling_factor_typo", 2.0, "moe_router_topk_scaling_factor_typo: 2.0: a model key this "
                                                 "importer does not know"),
])
def test_moe_options_ours_computes_differently_are_refused_by_name(key, value, message, tmp_path):
    source = qwen3_moe_as_the_error_says("CPU")
    source["model"]["model_config"][key] = value
    config = write_config(source, tmp_path, "a3b")
    if message is None:  # the same math as ours in this layout: imports
        import_to(config, tmp_path, "a3b")
        return
    with pytest.raises(RecipeError) as err:
        from_mindformers(config, str(tmp_path / "out.yaml"))
    assert message in str(err.value)


def qwen3_moe_router(tmp_path, **keys):
    source = qwen3_moe_as_the_error_says("CPU")
    source["model"]["model_config"].update(keys)
    return source, write_config(source, tmp_path, "a3b_router")


def test_deepseek_router_keys_import_as_mindformers_reads_them(tmp_path):
    """Sigmoid scores, an expert bias, 8 groups with the best 4 and a shared expert on Qwen3-30B-A3B's config."""
    source, config = qwen3_moe_router(tmp_path, moe_router_score_function="sigmoid",
                                      moe_router_enable_expert_bias=True, moe_router_bias_update_rate=0.01,
                                      moe_router_num_groups=8, moe_router_group_topk=4,
                                      moe_shared_expert_intermediate_size=768, use_shared_expert_gating=True)
    recipe, report = import_to(config, tmp_path, "a3b_router")
    tc, _ = mindformers_transformer_config(source)
    cfg = recipe.model.model_config
    assert (cfg.router_score, cfg.expert_bias, cfg.n_group, cfg.topk_group, cfg.shared_expert_intermediate_size,
            cfg.shared_expert_gate, cfg.routed_scaling_factor) == \
        (tc.moe_router_score_function, tc.moe_router_enable_expert_bias, tc.moe_router_num_groups,
         tc.moe_router_group_topk, tc.moe_shared_expert_intermediate_size, tc.use_shared_expert_gating,
         tc.moe_router_topk_scaling_factor)
    # Qwen3-MoE's training class has no update_topk_bias: TopkBiasBalanceCallback never moves the bias
    assert cfg.expert_bias_update_rate == 0.0
    assert "no TopkBiasBalanceCallback" in {e.key: e for e in report.entries}[
        "model.model_config.moe_router_bias_update_rate"].reason


def test_group_scores_other_than_the_best_two_are_refused(tmp_path):
    _, config = qwen3_moe_router(tmp_path, moe_router_score_function="sigmoid", moe_router_num_groups=8,
                                 moe_router_group_topk=2)
    with pytest.raises(RecipeError, match=r"best num_experts_per_tok // group_topk = 4 scores .*\(here 8 // 2\)"):
        from_mindformers(config, str(tmp_path / "out.yaml"))


def deepseek_as_the_errors_say(device: str, micro_batch_num: int = 16) -> dict:
    """The wheel's DeepSeek-V3 12B config with what is refused changed: plain rotary embeddings with MLA's softmax
    scale 1 / sqrt(d) (rotary_scaling_factor 1), no multi-token prediction, full_batch."""
    source = read(WHEEL["deepseek3/pretrain_deepseek3_12b_16p_pp16.yaml"])
    mc = source["model"]["model_config"]
    for key in ("scaling_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "position_embedding_type"):
        del mc[key]
    mc.update(rotary_scaling_factor=1.0, num_nextn_predict_layers=0)
    source["parallel"]["full_batch"] = True
    source["parallel_config"]["micro_batch_num"] = micro_batch_num
    source["context"]["device_target"] = device
    return source


def deepseek_parameters(tc) -> int:
    """Parameters of MindFormers' DeepSeek-V3 GPTModel from its MLATransformerConfig (test oracle): MLA's q
    down/up projections with the q latent norm, kv down (latent + rotary key) and up projections with the kv latent
    norm, output projection; dense SwiGLU layers where moe_layer_freq is 0, else the experts, the router and its
    expert_bias (router.py:96, 170), the shared expert; two norms per layer, final norm, untied tables."""
    h, n = tc.hidden_size, tc.num_attention_heads
    qk, rope, v, q_rank, kv_rank = tc.qk_head_dim, tc.qk_pos_emb_head_dim, tc.v_head_dim, tc.q_lora_rank, \
        tc.kv_lora_rank
    attention = (h * q_rank + q_rank + q_rank * n * (qk + rope) + h * (kv_rank + rope) + kv_rank +
                 kv_rank * n * (qk + v) + n * v * h)
    experts = tc.num_moe_experts * (3 * h * tc.moe_ffn_hidden_size + h + bool(tc.moe_router_enable_expert_bias)) + \
        3 * h * (tc.moe_shared_expert_intermediate_size or 0) + h * bool(tc.use_shared_expert_gating)
    mlps = sum(experts if moe else 3 * h * tc.ffn_hidden_size for moe in tc.moe_layer_freq)
    return tc.num_layers * (attention + 2 * h) + mlps + h + 2 * tc.vocab_size * h


def test_deepseek_v3_imports_on_cpu_and_on_ascend_with_flash_attention(tmp_path):
    source = deepseek_as_the_errors_say("CPU")
    recipe, report = import_to(write_config(source, tmp_path, "ds_cpu"), tmp_path, "ds_cpu")
    tc, tie = mindformers_transformer_config(source)
    cfg = recipe.model.model_config
    assert param_count(cfg, padded=False) == deepseek_parameters(tc) == 11_379_780_288
    assert (cfg.num_layers, cfg.hidden_size, cfg.intermediate_size, cfg.num_heads, cfg.q_lora_rank, cfg.kv_lora_rank,
            cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.rope_theta, cfg.rms_norm_eps) == \
        (tc.num_layers, tc.hidden_size, tc.ffn_hidden_size, tc.num_attention_heads, tc.q_lora_rank, tc.kv_lora_rank,
         tc.qk_head_dim, tc.qk_pos_emb_head_dim, tc.v_head_dim, float(tc.rotary_base), tc.layernorm_epsilon)
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size, cfg.norm_topk_prob,
            cfg.router_score, cfg.expert_bias, cfg.expert_bias_update_rate, cfg.n_group, cfg.topk_group,
            cfg.routed_scaling_factor, cfg.shared_expert_intermediate_size, cfg.router_aux_loss_coef) == \
        (tc.num_moe_experts, tc.moe_router_topk, tc.moe_ffn_hidden_size, tc.norm_topk_prob,
         tc.moe_router_score_function, True, tc.moe_router_bias_update_rate, tc.moe_router_num_groups,
         tc.moe_router_group_topk, tc.moe_router_topk_scaling_factor, tc.moe_shared_expert_intermediate_size,
         tc.moe_aux_loss_coeff)
    assert cfg.dense_layers == [i for i, moe in enumerate(tc.moe_layer_freq) if not moe] == [0]
    assert not tie and set(_leaves(source)) <= {e.key for e in report.entries}
    ascend, _ = import_to(write_config(deepseek_as_the_errors_say("Ascend"), tmp_path, "ds"), tmp_path, "ds")
    assert [f.message for f in check_model(ascend) if f.level == "error"] == []
    assert ascend.model.model_config.use_flash_attention is True  # carried: models/mla.py runs FlashAttention


def test_deepseek_bias_target_without_pipeline_stages_is_refused(tmp_path):
    source = deepseek_as_the_errors_say("CPU")
    source["parallel_config"]["pipeline_stage"] = 1
    source["model"]["model_config"]["offset"] = 0
    with pytest.raises(RecipeError, match=r"micro_batch_num, callbacks\[1\].gradient_accumulation_steps: 16 x 1: "
                                          "MindFormers moves the expert bias towards 16 / experts"):
        from_mindformers(write_config(source, tmp_path, "ds"), str(tmp_path / "out.yaml"))


def test_expert_parallel_is_carried_both_ways_and_its_layout_rules_hold(tmp_path):
    from ascend_llm_recipes.training.recipe.mindformers import to_mindformers

    source = qwen3_moe_as_the_error_says("Ascend")
    source["parallel_config"].update(data_parallel=4, expert_parallel=4)
    source["model"]["model_config"]["moe_aux_loss_coeff"] = 0.0  # its gbs_aux_loss differs from ours under DP 4
    recipe, report = import_to(write_config(source, tmp_path, "a3b"), tmp_path, "a3b")
    assert recipe.parallel_config.expert_parallel == 4
    assert {e.key: e.status for e in report.entries}["parallel_config.expert_parallel"] == "carried"
    exported = yaml.safe_load(to_mindformers(str(tmp_path / "recipes" / "a3b.yaml"))[0])
    assert exported["parallel_config"]["expert_parallel"] == 4
    # MindFormers reads it as expert_model_parallel_size (parallel_core/transformer_config_utils.py:213)
    from mindformers.modules.transformer.transformer import TransformerOpParallelConfig

    parallel = TransformerOpParallelConfig(**exported["parallel_config"])
    model = {**exported["model"]["model_config"], "parallel_config": parallel}
    tc, _ = mindformers_transformer_config({"model": {"model_config": model}})
    assert (tc.expert_model_parallel_size, tc.data_parallel_size) == (4, 4)
    source["parallel_config"]["expert_parallel"] = 3  # MindFormers' own rules, refused by name at import
    with pytest.raises(RecipeError, match=r"parallel_config.expert_parallel: 3 does not divide "
                                          r"model.model_config.num_experts \(128\)"):
        from_mindformers(write_config(source, tmp_path, "a3b_3"), str(tmp_path / "out.yaml"))


def test_load_balancing_types_map_to_the_scope_of_their_tokens(tmp_path):
    """gbs_aux_loss is our "global" scope, seq_aux_loss (per data-parallel block) our "micro_batch"; per model-parallel
    block (sub_seq_aux_loss with model_parallel > 1) is ours at no scope."""
    source = qwen3_moe_as_the_error_says("CPU")
    source["parallel_config"].update(data_parallel=2, expert_parallel=1)
    for kind, scope in (("gbs_aux_loss", "global"), ("seq_aux_loss", "micro_batch"),
                        ("sub_seq_aux_loss", "micro_batch")):
        source["model"]["model_config"]["moe_router_load_balancing_type"] = kind
        recipe, report = import_to(write_config(source, tmp_path, kind), tmp_path, kind)
        assert recipe.model.model_config.router_aux_loss_scope == scope, kind
        assert {e.key: e.status for e in report.entries}["model.model_config.moe_router_load_balancing_type"] \
            == "translated"
    source["parallel_config"]["model_parallel"] = 2
    with pytest.raises(RecipeError, match="'sub_seq_aux_loss' computes the load-balancing loss per data x model"):
        from_mindformers(write_config(source, tmp_path, "a3b"), str(tmp_path / "out.yaml"))


def test_dense_template_takes_the_model_from_config_json(hf_dirs, tmp_path):
    path = WHEEL["general/llm_pretrain_dense_template.yaml"]
    source = read(path)
    recipe, report = import_to(path, tmp_path, "template", hf_dirs["qwen3"])
    tc, tie = mindformers_transformer_config(source, hf_dirs["qwen3"])
    assert_same_model(recipe, tc, tie)
    cfg = recipe.model.model_config
    assert (cfg.hidden_size, cfg.num_layers, cfg.rope_theta) == (1024, 28, 1e6)  # from config.json
    assert (cfg.compute_dtype, recipe.parallel_config.data_parallel) == ("bfloat16", 2)     # from the YAML
    assert {e.key: e.status for e in report.entries}["model.model_config.layer_types"] == "dropped"


def test_moe_template_imports_and_other_families_are_refused_by_name(hf_dirs, tmp_path):
    path = WHEEL["general/llm_pretrain_moe_template.yaml"]
    recipe, _ = import_to(path, tmp_path, "moe_template", hf_dirs["qwen3_moe"])
    # its seq_aux_loss at DP 2 x TP 2 (sequence parallel) counts each data-parallel rank's micro-batch
    assert recipe.model.model_config.router_aux_loss_scope == "micro_batch"
    assert recipe.parallel_config.model_parallel == 2
    with pytest.raises(RecipeError, match="config.json cannot be read"):
        from_mindformers(path, "/nonexistent/out.yaml", os.path.dirname(path))
    with pytest.raises(RecipeError, match="model_type: 'glm4' .* is a family ours does not implement"):
        from_mindformers(WHEEL["general/llm_pretrain_dense_template.yaml"], "/nonexistent/out.yaml",
                         hf_dirs["glm4"])


def test_defaults_are_mindformers_own():
    import dataclasses
    from mindformers.parallel_core.transformer_config import TransformerConfig
    from mindformers.models.qwen3.configuration_qwen3 import Qwen3Config
    from mindformers.models.qwen3_moe.configuration_qwen3_moe import Qwen3MoeConfig

    for family, cls in (("qwen3", Qwen3Config), ("qwen3_moe", Qwen3MoeConfig)):
        config = cls()
        for key, value in DEFAULTS[family].items():
            assert getattr(config, key, None) == value, (family, key)
    fields = {f.name: f.default for f in dataclasses.fields(TransformerConfig)}
    assert {key: fields[key] for key in TC_DEFAULTS} == TC_DEFAULTS


def test_command_line_reads_the_pretrained_model_dir(hf_dirs, tmp_path):
    out = tmp_path / "recipes" / "template.yaml"
    args = [sys.executable, os.path.join(REPO_ROOT, "scripts", "convert_recipe.py"), "--from-mindformers",
            WHEEL["general/llm_pretrain_dense_template.yaml"], "--pretrained-model-dir", hf_dirs["qwen3"],
            "--output", str(out), "--report", str(tmp_path / "report.md")]
    done = subprocess.run(args, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert load_recipe(str(out), planning=True).model.model_config.hidden_size == 1024
    refused = subprocess.run(args[:4] + ["--output", str(tmp_path / "other.yaml")], capture_output=True, text=True,
                             timeout=120)
    assert refused.returncode == 2 and "--pretrained-model-dir DIR" in refused.stderr


TINY = os.path.join(REPO_ROOT, "recipes", "tiny_cpu.yaml")
# Tiny recipes of each family MindFormers 1.9's own format is written for (over tiny_cpu.yaml's Llama).
EXPORTED = {
    "qwen3": dict(qk_norm=True, head_dim=32),
    "qwen3_moe": dict(qk_norm=True, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48,
                      router_aux_loss_coef=0.01, routed_scaling_factor=1.5, router_score="sigmoid", n_group=2,
                      topk_group=1, shared_expert_intermediate_size=32, shared_expert_gate=True),
    "deepseek_v3": dict(num_kv_heads=None, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=16,
                        v_head_dim=16, num_experts=8, num_experts_per_tok=4, moe_intermediate_size=32,
                        router_score="sigmoid", n_group=4, topk_group=2, routed_scaling_factor=2.5, expert_bias=True,
                        expert_bias_update_rate=0.001, shared_expert_intermediate_size=32, dense_layers=[0],
                        router_aux_loss_coef=0.001),
}


def tiny_recipe(tmp_path, name: str, **model) -> str:
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump({"base": TINY, "model": {"model_config": model}}))
    return str(path)


@pytest.mark.parametrize("family", EXPORTED)
def test_export_writes_mindformers_own_format_that_its_classes_build_and_that_imports_back(family, tmp_path):
    from ascend_llm_recipes.training.recipe.mindformers import to_mindformers

    path = tiny_recipe(tmp_path, family, **EXPORTED[family])
    text, report = to_mindformers(path)
    exported = yaml.safe_load(text)
    assert exported["use_legacy"] is False and exported["model"]["model_config"]["model_type"] == family
    # named as the wheel's own configs name the family (ours is "llama" by default)
    assert exported["trainer"]["model_name"] == {"qwen3": "Qwen3", "qwen3_moe": "qwen3_moe",
                                                 "deepseek_v3": "deepseekV3"}[family]
    tc, tie = mindformers_transformer_config(exported)   # MindFormers' own config class, from what was written
    ours = load_recipe(path, planning=True)
    cfg = ours.model.model_config
    if family == "deepseek_v3":
        assert param_count(cfg, padded=False) == deepseek_parameters(tc)
        assert (tc.q_lora_rank, tc.kv_lora_rank, tc.qk_head_dim, tc.qk_pos_emb_head_dim, tc.v_head_dim,
                tc.rotary_scaling_factor, tc.qk_layernorm, tc.mtp_num_layers) == (32, 32, 16, 16, 16, 1.0, True, 0)
        assert (tc.moe_router_bias_update_rate, tc.moe_layer_freq) == (0.001, [0, 1])
        assert exported["callbacks"][-1]["type"] == "TopkBiasBalanceCallback"
    else:
        assert_same_model(ours, tc, tie)
    if cfg.moe:
        assert (cfg.router_score, cfg.expert_bias, cfg.n_group, cfg.topk_group, cfg.routed_scaling_factor,
                cfg.shared_expert_intermediate_size, cfg.shared_expert_gate, cfg.router_aux_loss_coef) == \
            (tc.moe_router_score_function, tc.moe_router_enable_expert_bias, tc.moe_router_num_groups,
             tc.moe_router_group_topk, tc.moe_router_topk_scaling_factor, tc.moe_shared_expert_intermediate_size,
             tc.use_shared_expert_gating, tc.moe_aux_loss_coeff)
    exported_path = tmp_path / f"mf_{family}.yaml"
    exported_path.write_text(text)
    back, _ = import_to(str(exported_path), tmp_path, f"back_{family}")
    assert back.model == ours.model


def test_export_refuses_what_mindformers_own_classes_compute_differently(tmp_path):
    from ascend_llm_recipes.training.recipe.mindformers import to_mindformers

    path = tiny_recipe(tmp_path, "moe", **{**EXPORTED["qwen3_moe"], "router_z_loss_coef": 0.001,
                                           "dense_layers": [0], "n_group": 2, "topk_group": 2,
                                           "capacity_factor": 1.25})
    with pytest.raises(RecipeError) as err:
        to_mindformers(path)
    for fragment in ("router_z_loss_coef: 0.001: MindFormers 1.9's training graph has no router z-loss",
                     "dense_layers: [0]: MindFormers' Qwen3-MoE gives every layer experts",
                     "topk_group: 2: MindFormers scores a group by its best num_experts_per_tok // topk_group = 1",
                     "capacity_factor: 1.25: MindFormers 1.9's training graph never drops"):
        assert fragment in str(err.value)


TINY_MOE_ASCEND = os.path.join(REPO_ROOT, "recipes", "tiny_moe_ascend.yaml")
TOP1 = ["model.model_config.num_experts_per_tok=1", "model.model_config.norm_topk_prob=False"]


def test_top1_softmax_routing_builds_mindformers_moe_layer_and_exports_pre_softmax(tmp_path):
    """F6: MindFormers' TransformerConfig refuses top-1 softmax routing unless the softmax precedes the top-k
    (transformer_config.py:2161-2169), which its training router and ours both do: the layer's config says so, and
    the export carries it and imports back to the same model."""
    from ascend_llm_recipes.training.recipe.mindformers import model_layout, to_mindformers

    recipe = load_recipe(TINY_MOE_ASCEND, TOP1, planning=True)
    experts = model_layout(recipe).experts  # what every Ascend worker builds
    assert (experts.moe_router_topk, experts.moe_router_pre_softmax) == (1, True)
    path = tmp_path / "top1.yaml"
    path.write_text(yaml.safe_dump({"base": TINY_MOE_ASCEND, "model": {"model_config": {
        "num_experts_per_tok": 1, "norm_topk_prob": False, "dense_layers": [],
        "fused_rms_norm": True}}}))  # MindFormers' own classes always fuse it: not exported (KERNELS)
    text, _ = to_mindformers(str(path))
    assert yaml.safe_load(text)["model"]["model_config"]["moe_router_pre_softmax"] is True
    (tmp_path / "mf_top1.yaml").write_text(text)
    back, _ = import_to(str(tmp_path / "mf_top1.yaml"), tmp_path, "back_top1")
    assert back.model == load_recipe(str(path), planning=True).model

