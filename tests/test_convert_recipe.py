"""scripts/convert_recipe.py on real MindFormers configs (tests/data/mindformers, vendored from MindFormers v1.5.0)."""

import inspect
import os
import subprocess
import sys

import pytest
import yaml

from conftest import REPO_ROOT, TINY_RECIPE
from ascend_llm_recipes.common.errors import RecipeError
from ascend_llm_recipes.models.arithmetic import param_count
from ascend_llm_recipes.training.launcher.cli import plan_report
from ascend_llm_recipes.training.recipe.mindformers import (LLAMA_CONFIG_ARGS, MF_DEFAULTS, _leaves, from_mindformers,
                                                            mindformers_ffn_width, to_mindformers)
from ascend_llm_recipes.training.recipe.loading import load_recipe

DATA = os.path.join(REPO_ROOT, "tests", "data", "mindformers")
SCRIPT = os.path.join(REPO_ROOT, "scripts", "convert_recipe.py")
LLAMA_FAMILY = ["pretrain_llama2_7b", "pretrain_llama2_13b", "pretrain_llama3_70b", "finetune_qwen2_7b"]


def mf_config(name: str) -> dict:
    with open(os.path.join(DATA, f"{name}.yaml"), encoding="utf-8") as f:
        return yaml.safe_load(f)


def mindformers_parameters(model_config: dict) -> int:
    """Parameters of MindFormers' LlamaForCausalLM, from its config keys alone (test oracle).

    The MLP width follows mindformers/models/llama/llama_layer.py:302-309 when intermediate_size
    is unset; attention: wq/wo (h x h), wk/wv (h x kv_heads*head_dim) plus q/k/v bias with
    qkv_has_bias; two RMSNorm weights per layer, a final norm, embedding and (untied) lm_head.
    """
    h, layers, vocab = model_config["hidden_size"], model_config["num_layers"], model_config["vocab_size"]
    heads = model_config["num_heads"]
    kv = (model_config.get("n_kv_heads") or heads) * (h // heads)
    ffn = model_config.get("intermediate_size")
    if ffn is None:
        ffn = 4 * h
        if model_config.get("ffn_dim_multiplier") is not None:
            ffn = int((model_config["ffn_dim_multiplier"] + 0.01) * ffn)
        ffn = int(2 * ffn / 3)
        multiple_of = model_config.get("multiple_of", 256)
        ffn = multiple_of * ((ffn + multiple_of - 1) // multiple_of)
    attention = 2 * h * h + 2 * h * kv + ((h + 2 * kv) if model_config.get("qkv_has_bias") else 0)
    per_layer = attention + 3 * h * ffn + 2 * h
    tables = vocab * h * (1 if model_config.get("tie_word_embeddings") else 2)
    return layers * per_layer + h + tables


def import_config(name: str, tmp_path) -> tuple:
    out = tmp_path / "recipes" / f"{name}.yaml"
    text, report = from_mindformers(os.path.join(DATA, f"{name}.yaml"), str(out))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    return str(out), report


@pytest.mark.parametrize("name", LLAMA_FAMILY)
def test_import_loads_plans_and_keeps_the_parameter_count(name, tmp_path):
    source = mf_config(name)
    path, report = import_config(name, tmp_path)
    recipe = load_recipe(path, planning=True)
    model = source["model"]["model_config"]
    assert param_count(recipe.model.model_config, padded=False) == mindformers_parameters(model)
    degrees = source["parallel_config"]
    p = recipe.parallel_config
    assert (p.data_parallel, p.model_parallel, p.pipeline_stage) == \
        (degrees["data_parallel"], degrees["model_parallel"], degrees["pipeline_stage"])
    text = plan_report(recipe)  # what `run_distributed.sh RECIPE --plan` prints
    assert text.startswith(f"plan: {param_count(recipe.model.model_config, p.model_parallel):,} parameters on "
                           f"DP {p.data_parallel} x TP {p.model_parallel} x PP {p.pipeline_stage}")
    # every key of the source is accounted for in the report
    reported = {e.key for e in report.entries}
    assert set(_leaves(source)) <= reported


def test_llama2_7b_is_carried_the_same_way(tmp_path):
    path, report = import_config("pretrain_llama2_7b", tmp_path)
    recipe = load_recipe(path, planning=True)
    cfg = recipe.model.model_config
    assert (cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.intermediate_size) == \
        (4096, 32, 32, 32, 11008)
    assert cfg.compute_dtype == "float16" and cfg.pad_token_id == 0 and cfg.initializer_range == 0.01
    # MindFormers' float16 param_init_type: float16 weights, whose float32 masters FoldedAdamW keeps.
    assert cfg.param_dtype == "float16" and recipe.optimizer.type == "FoldedAdamW"
    assert recipe.optimizer.betas == [0.9, 0.95]
    assert recipe.optimizer.weight_decay == 0.0  # AdamWeightDecay's default, not our base recipe's 0.1
    lr = recipe.lr_schedule
    assert (lr.type, lr.learning_rate, lr.lr_end, lr.warmup_ratio, lr.total_steps) == \
        ("CosineWithWarmUpLR", 5e-5, 0.0, 0.03, -1)
    assert recipe.runner_wrapper.scale_sense.loss_scale_value == 65536.0
    assert recipe.runner_wrapper.use_clip_grad and recipe.runner_wrapper.max_grad_norm == 1.0
    assert recipe.runner_config.gradient_accumulation_steps == 8 and recipe.global_batch_size == 64
    assert recipe.parallel.parallel_optimizer_config.optimizer_level == "level1"
    saver = recipe.checkpointing
    assert (saver.prefix, saver.save_checkpoint_steps, saver.keep_checkpoint_max) == ("llama2_7b", 100, 5)
    by_key = {e.key: e for e in report.entries}
    assert by_key["optimizer.type"].status == "translated" and "bias correction" in by_key["optimizer.type"].reason
    assert by_key["model.model_config.multiple_of"].status == "translated"
    assert by_key["callbacks[2].type"].status == "dropped" and "OBS" in by_key["callbacks[2].type"].reason
    assert by_key["processor.tokenizer.type"].status == "dropped"
    assert by_key["model.model_config.use_flash_attention"].status == "carried"  # same key in ours
    assert not [e for e in report.entries if "unknown key" in e.reason]


def test_llama3_ffn_multiplier_and_qwen2_interleave(tmp_path):
    path, _ = import_config("pretrain_llama3_70b", tmp_path)
    cfg = load_recipe(path, planning=True).model.model_config
    assert cfg.intermediate_size == 28672 and cfg.num_kv_heads == 8 and cfg.rope_theta == 500000.0
    path, report = import_config("finetune_qwen2_7b", tmp_path)
    recipe = load_recipe(path, planning=True)
    assert recipe.model.model_config.qkv_bias and recipe.model.model_config.rms_norm_eps == 1e-6
    # MindFormers' global batch: batch_size 1 x data_parallel 2 x micro_batch_interleave_num 2
    assert recipe.global_batch_size == 4 and recipe.runner_config.batch_size == 2
    assert {e.key: e.status for e in report.entries}["train_dataset.input_columns"] == "dropped"


def test_selective_recompute_is_carried_unless_it_has_no_effect(tmp_path):
    source = mf_config("pretrain_llama2_7b")
    source["model"]["model_config"]["use_flash_attention"] = False
    source["recompute_config"].update(select_recompute=True, recompute_slice_activation=True)
    (tmp_path / "select.yaml").write_text(yaml.safe_dump(source))
    text, report = from_mindformers(str(tmp_path / "select.yaml"), str(tmp_path / "out.yaml"))
    recompute = yaml.safe_load(text)["recompute_config"]
    assert recompute["select_recompute"] and recompute["recompute_slice_activation"]
    source["model"]["model_config"]["use_flash_attention"] = True  # MindFormers' Llama then skips it
    (tmp_path / "select.yaml").write_text(yaml.safe_dump(source))
    text, report = from_mindformers(str(tmp_path / "select.yaml"), str(tmp_path / "out.yaml"))
    assert not yaml.safe_load(text)["recompute_config"].get("select_recompute")
    entry = {e.key: e for e in report.entries}["recompute_config.select_recompute"]
    assert entry.status == "dropped" and entry.reason == "no effect with use_flash_attention: True"


def test_other_architectures_are_refused_by_type():
    with pytest.raises(RecipeError, match="ChatGLM2Config.*not a Llama-family model"):
        from_mindformers(os.path.join(DATA, "finetune_glm4_9b.yaml"), "recipes/glm.yaml")


def test_options_that_change_the_model_are_refused(tmp_path):
    source = mf_config("pretrain_llama2_7b")
    source["model"]["model_config"].update(extend_method="PI", attn_proj_has_bias=True, use_ring_attention=True)
    bad = tmp_path / "scaled.yaml"
    bad.write_text(yaml.safe_dump(source))
    with pytest.raises(RecipeError, match="extend_method: 'PI' is not supported") as err:
        from_mindformers(str(bad), str(tmp_path / "out.yaml"))
    assert len(err.value.problems) == 3


def test_warmup_steps_replace_the_ascend_bases_warmup_ratio(tmp_path):
    """recipes/base/ascend.yaml sets warmup_ratio; a config giving warmup_steps must not end up with both."""
    source = mf_config("pretrain_llama2_7b")
    del source["lr_schedule"]["warmup_ratio"]
    source["lr_schedule"]["warmup_steps"] = 20
    path = tmp_path / "steps.yaml"
    path.write_text(yaml.safe_dump(source))
    recipe, _ = import_config_file(str(path), tmp_path)
    assert (recipe.lr_schedule.warmup_steps, recipe.lr_schedule.warmup_ratio) == (20, None)


def test_a_mixture_of_experts_config_is_refused_not_imported_dense(tmp_path):
    """MindFormers builds the model with the top-level moe_config (trainer/base_trainer.py:1250-1258): expert_num > 1
    there or in model_config makes an MoE network, which must not import as the dense model."""
    for place in ("top", "model"):
        source = mf_config("pretrain_llama2_7b")
        moe = {"expert_num": 8, "num_experts_chosen": 2}
        if place == "top":
            source["moe_config"] = moe
        else:
            source["model"]["model_config"]["moe_config"] = moe
        bad = tmp_path / f"moe_{place}.yaml"
        bad.write_text(yaml.safe_dump(source))
        where = "moe_config" if place == "top" else "model.model_config.moe_config"
        with pytest.raises(RecipeError, match=rf"{where}: expert_num 8: a Mixture-of-Experts model"):
            from_mindformers(str(bad), str(tmp_path / "out.yaml"))


def test_a_recipe_mindformers_llama_cannot_express_is_not_exported(tmp_path):
    """Experts without Qwen3's q/k norms: neither LlamaForCausalLM nor MindFormers 1.9's Qwen3-MoE (which always
    builds them) nor DeepSeek-V3 (multi-head latent attention) computes this model."""
    recipe = yaml.safe_load(open(TINY_RECIPE, encoding="utf-8"))
    recipe["base"] = os.path.join(REPO_ROOT, "recipes", "base", "cpu.yaml")
    recipe["model"]["model_config"].update(head_dim=32, num_experts=4, moe_intermediate_size=32)
    path = tmp_path / "moe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    with pytest.raises(RecipeError, match=r"model\.model_config\.qk_norm: False with experts \(a Mixtral or "
                                          r"Qwen2-MoE\): MindFormers 1\.9 has no model class") as err:
        to_mindformers(str(path))
    assert len(err.value.problems) == 1 and "train it with this recipe instead" in str(err.value)


def test_mindformers_defaults_and_width_rule_match_the_installed_package():
    from mindformers.core.callback import CheckpointMonitor
    from mindformers.core.lr import CosineWithWarmUpLR
    from mindformers.core.optim.adamw import AdamW
    from mindformers.models.llama import LlamaConfig
    from mindformers.wrapper import MFTrainOneStepCell
    from mindspore import nn

    def defaults(fn):
        return {k: p.default for k, p in inspect.signature(fn).parameters.items()}

    llama = defaults(LlamaConfig.__init__)
    assert set(LLAMA_CONFIG_ARGS) == set(llama) - {"self", "kwargs"}
    assert all(llama[k] == v for k, v in MF_DEFAULTS["model_config"].items())
    adamw = defaults(AdamW.__init__)
    assert list(adamw["betas"]) == MF_DEFAULTS["AdamW"]["betas"] and adamw["eps"] == MF_DEFAULTS["AdamW"]["eps"]
    assert adamw["weight_decay"] == MF_DEFAULTS["AdamW"]["weight_decay"]
    assert all(defaults(nn.AdamWeightDecay.__init__)[k] == v for k, v in MF_DEFAULTS["AdamWeightDecay"].items())
    assert all(defaults(CosineWithWarmUpLR.__init__)[k] == v for k, v in MF_DEFAULTS["lr_schedule"].items())
    assert all(defaults(MFTrainOneStepCell.__init__)[k] == v for k, v in MF_DEFAULTS["runner_wrapper"].items())
    assert all(defaults(CheckpointMonitor.__init__)[k] == v for k, v in MF_DEFAULTS["CheckpointMonitor"].items())
    # Llama 2 7B/13B/70B and Llama 3 8B/70B widths (published intermediate sizes)
    assert [mindformers_ffn_width(4096), mindformers_ffn_width(5120), mindformers_ffn_width(8192, 4096, 1.3),
            mindformers_ffn_width(4096, 1024, 1.3), mindformers_ffn_width(8192, 256, 1.3)] == \
        [11008, 13824, 28672, 14336, 28672]


def test_export_loads_in_mindformers_and_round_trips(tmp_path):
    from mindformers import MindFormerConfig
    from mindformers.models.llama import LlamaConfig

    for recipe_path in (TINY_RECIPE, os.path.join(REPO_ROOT, "recipes", "llama2_7b_8dev.yaml")):
        text, _ = to_mindformers(recipe_path)
        exported = tmp_path / f"mf_{os.path.basename(recipe_path)}"
        exported.write_text(text)
        config = MindFormerConfig(str(exported))
        assert config.model.arch.type == "LlamaForCausalLM"
        model = {k: v for k, v in config.model.model_config.items() if k != "type"}
        mf = LlamaConfig(**model)  # the config object only: the network needs Ascend kernels
        ours = load_recipe(recipe_path, planning=True)
        assert mindformers_parameters(model) == param_count(ours.model.model_config, padded=False)
        assert (mf.hidden_size, mf.n_kv_heads, mf.intermediate_size) == \
            (ours.model.model_config.hidden_size, ours.model.model_config.num_kv_heads,
             ours.model.model_config.intermediate_size)
        back, _ = import_config_file(str(exported), tmp_path)
        assert back.model == ours.model
        assert back.parallel_config.data_parallel == ours.parallel_config.data_parallel
        assert back.optimizer.betas == ours.optimizer.betas and back.lr_schedule.type == ours.lr_schedule.type


def import_config_file(path: str, tmp_path) -> tuple:
    out = tmp_path / "back" / (os.path.basename(path))
    text, report = from_mindformers(path, str(out))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    return load_recipe(str(out), planning=True), report


def test_command_line_writes_recipe_and_report_and_refuses_cleanly(tmp_path):
    recipes = tmp_path / "recipes"
    out, report = recipes / "llama2_13b_mf.yaml", tmp_path / "report.md"
    args = [sys.executable, SCRIPT, "--from-mindformers", os.path.join(DATA, "pretrain_llama2_13b.yaml"),
            "--output", str(out), "--report", str(report)]
    done = subprocess.run(args, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "wrote" in done.stdout and report.read_text().count("| `") > 100
    again = subprocess.run(args, capture_output=True, text=True, timeout=120)
    assert again.returncode == 2 and "already exists" in again.stderr and "Traceback" not in again.stderr
    glm = subprocess.run([sys.executable, SCRIPT, "--from-mindformers", os.path.join(DATA, "finetune_glm4_9b.yaml"),
                          "--output", str(recipes / "glm.yaml")], capture_output=True, text=True, timeout=120)
    assert glm.returncode == 2 and "not a Llama-family model" in glm.stderr and "Traceback" not in glm.stderr
    assert not (recipes / "glm.yaml").exists()


def test_base_is_relative_to_the_written_recipe():
    text, _ = from_mindformers(os.path.join(DATA, "pretrain_llama2_7b.yaml"),
                               os.path.join(REPO_ROOT, "recipes", "llama2_7b_mf.yaml"))
    assert yaml.safe_load(text)["base"] == "base/ascend.yaml"


@pytest.mark.parametrize("key, value, message", [
    ("parallel_config", {"pipeline_stage": "two"}, "parallel_config.pipeline_stage: expected a number"),
    ("runner_config", True, "runner_config: expected a mapping"),
    ("callbacks", {"type": "MFLossMonitor"}, "callbacks: expected a list"),
])
def test_malformed_values_are_reported_not_crashed_on(key, value, message, tmp_path):
    source = mf_config("pretrain_llama2_7b")
    source[key] = value
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(source))
    with pytest.raises(RecipeError, match=message):
        from_mindformers(str(bad), str(tmp_path / "out.yaml"))


def test_input_and_output_problems_are_messages(tmp_path):
    latin1, duplicate = tmp_path / "latin1.yaml", tmp_path / "dup.yaml"
    latin1.write_bytes("# r\xe9glages\nseed: 1\n".encode("latin-1"))
    duplicate.write_text(open(os.path.join(DATA, "pretrain_llama2_7b.yaml"), encoding="utf-8").read()
                         + "\nseed: 5\nseed: 6\n")
    (tmp_path / "afile").write_text("not a directory")
    for source, output, message in ((latin1, tmp_path / "a.yaml", "not UTF-8 text: byte 0xe9 on line 1"),
                                    (duplicate, tmp_path / "b.yaml", "duplicate key 'seed'"),
                                    (os.path.join(DATA, "pretrain_llama2_7b.yaml"), tmp_path / "afile" / "x.yaml",
                                     "cannot be written")):
        done = subprocess.run([sys.executable, SCRIPT, "--from-mindformers", str(source), "--output", str(output)],
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 2 and message in done.stderr and "Traceback" not in done.stderr, done.stderr


def test_context_ascend_settings_are_carried_not_dropped(tmp_path):
    """precision_mode, the compiler level and the memory-pool step reach the recipe (MindFormers passes them on)."""
    path, report = import_config("finetune_qwen2_7b", tmp_path)
    context = load_recipe(path, planning=True).context
    assert context.ascend_config.precision_mode == "must_keep_origin_dtype" and context.jit_config.jit_level == "O1"
    by_key = {e.key: e for e in report.entries}
    assert by_key["context.ascend_config.precision_mode"].status == "carried"
    assert by_key["context.jit_config.jit_level"].status == "carried"
    path, report = import_config("pretrain_llama3_70b", tmp_path)
    assert load_recipe(path, planning=True).context.mempool_block_size == "52.5GB"
    # absent in the source: pinned by our base recipe, and said so
    assert {e.key: e.status for e in report.entries}["context.ascend_config.precision_mode"] == "default"


def test_parallel_speed_up_file_is_carried_checked_or_dropped_with_the_reason(tmp_path):
    source = mf_config("pretrain_llama2_7b")
    source["context"]["ascend_config"] = {"precision_mode": "force_fp16",
                                          "parallel_speed_up_json_path": "./speed_up.json"}
    config = tmp_path / "mf" / "pretrain.yaml"
    config.parent.mkdir()
    config.write_text(yaml.safe_dump(source))
    (config.parent / "speed_up.json").write_text('{"matmul_grad_comm_overlap": true}')
    text, report = from_mindformers(str(config), str(tmp_path / "out.yaml"))
    ascend = yaml.safe_load(text)["context"]["ascend_config"]
    # found next to the config (MindFormers would resolve it against its own working directory)
    assert ascend["parallel_speed_up_json_path"] == str(config.parent / "speed_up.json")
    assert "precision_mode" not in ascend  # must_keep_origin_dtype, as the base recipe already has it
    entry = {e.key: e for e in report.entries}["context.ascend_config.precision_mode"]
    assert entry.status == "translated" and "'force_fp16' would let CANN lower" in entry.reason
    (config.parent / "speed_up.json").write_text('{"matmul_grad_comm_overlapp": true, "pp_1f1b_overlap": 3}')
    with pytest.raises(RecipeError, match=r"context\.ascend_config\.parallel_speed_up_json_path: .*speed_up\.json: "
                                          r"'matmul_grad_comm_overlapp' is not an option of MindSpore 2\.9; did you "
                                          r"mean matmul_grad_comm_overlap\?") as err:
        from_mindformers(str(config), str(tmp_path / "out.yaml"))
    assert "'pp_1f1b_overlap' must be str, got 3" in str(err.value)
    (config.parent / "speed_up.json").unlink()
    text, report = from_mindformers(str(config), str(tmp_path / "out.yaml"))
    assert "parallel_speed_up_json_path" not in yaml.safe_load(text)["context"].get("ascend_config", {})
    entry = {e.key: e for e in report.entries}["context.ascend_config.parallel_speed_up_json_path"]
    assert entry.status == "dropped" and "./speed_up.json is not found here" in entry.reason


def test_ascend_config_reaches_mindspore_through_mindformers_context_applier(tmp_path):
    """MindFormers' own applier passes the worker's ascend_config to MindSpore's set_context (build_context.py:277-318;
    its later routing entry wins over _apply_ascend's, lines 63-82), whose set_ascend_config knows both keys."""
    import mindspore as ms
    from mindformers.core.context.build_context import _MSContextApplier
    from ascend_llm_recipes.training.worker.train import mindformers_config

    speed_up = tmp_path / "speed_up.json"
    speed_up.write_text('{"matmul_grad_comm_overlap": true}')
    recipe = load_recipe(os.path.join(REPO_ROOT, "recipes", "llama2_7b_8dev.yaml"),
                         [f"context.ascend_config.parallel_speed_up_json_path={speed_up}"], planning=True)
    context = mindformers_config(recipe, str(tmp_path / "run"))["context"]
    groups = _MSContextApplier().split_params(context)
    assert groups["set_context_remaining"]["ascend_config"] == {
        "precision_mode": "must_keep_origin_dtype", "parallel_speed_up_json_path": str(speed_up)}
    assert "ascend_config" not in groups.get("set_context_excluded", {})
    accepted = inspect.getsource(ms.context._Context.set_ascend_config)
    assert "'precision_mode':" in accepted and "'parallel_speed_up_json_path':" in accepted
    text, _ = to_mindformers(os.path.join(REPO_ROOT, "recipes", "llama2_7b_8dev.yaml"))
    assert yaml.safe_load(text)["context"]["ascend_config"] == {"precision_mode": "must_keep_origin_dtype"}


def test_speed_up_options_are_mindspores_own():
    """SPEED_UP_KEYS is the list MindSpore 2.9 checks the file against (context.py:852-888); it also takes a bool for
    the two recompute overlap keys (its own exception, context.py:912-913)."""
    import re
    import mindspore as ms
    from ascend_llm_recipes.training.recipe.device import SPEED_UP_KEYS

    source = inspect.getsource(ms.context._Context._set_speedup_config_path)
    theirs = dict(re.findall(r'"(\w+)":\s*\(\s*ms_ctx_param\.\w+,\s*\(?([\w, ]+?)\)?\)', source))
    assert set(theirs) == set(SPEED_UP_KEYS)
    for key, types in theirs.items():
        expected = {t.strip() for t in types.split(",")}
        if key in ("recompute_comm_overlap", "recomputation_communication_overlap"):
            expected.add("bool")
        assert expected == {t.__name__ for t in SPEED_UP_KEYS[key]}, key


def test_an_output_created_by_another_conversion_meanwhile_is_left_to_it(tmp_path):
    """Without --force the output appears whole or not at all: when another process creates it between the check
    and the write (two conversions at once), the first file stays and this one is refused."""
    from ascend_llm_recipes.common.files import write_new
    from ascend_llm_recipes.training.recipe.mindformers import write_output

    path = tmp_path / "out.yaml"
    write_new(str(path), "first\n")
    with pytest.raises(FileExistsError):
        write_new(str(path), "second\n")
    with pytest.raises(RecipeError, match="already exists; nothing was written"):
        write_output(str(path), "third\n")
    assert path.read_text() == "first\n" and sorted(p.name for p in tmp_path.iterdir()) == ["out.yaml"]
    write_output(str(path), "forced\n", force=True)
    assert path.read_text() == "forced\n"
