"""Recipe loading: strict keys with dotted paths, types, overrides, cross-field rules."""

import glob
import os
import re

import pytest

from conftest import DEMO_RECIPE, REPO_ROOT, TINY_RECIPE
from training.errors import RecipeError
from training.recipe import load_recipe


def write(tmp_path, text, base=TINY_RECIPE):
    """A copy of `base` with `text` substituted via (old, new) pairs."""
    with open(base, encoding="utf-8") as f:
        content = f.read()
    content = content.replace("base: base/cpu.yaml", f"base: {os.path.join(REPO_ROOT, 'recipes', 'base', 'cpu.yaml')}")
    for old, new in text:
        assert old in content, old
        content = content.replace(old, new)
    path = tmp_path / "recipe.yaml"
    path.write_text(content, encoding="utf-8")
    return str(path)


@pytest.mark.parametrize("path", sorted(glob.glob(os.path.join(REPO_ROOT, "recipes", "*.yaml"))))
def test_every_shipped_recipe_loads(path):
    recipe = load_recipe(path)
    assert recipe.world_size >= 1
    assert recipe.model.model_config.seq_length % 16 == 0


def test_demo_recipe_values():
    recipe = load_recipe(DEMO_RECIPE)
    assert recipe.context.mode == 0
    assert recipe.runner_config.sink_mode is False
    assert recipe.tokens_per_step == 8 * 256
    # The YAML anchor copy of train_dataset is accepted and not repeated in the resolved recipe.
    assert "dataset_config" not in recipe.to_dict()["train_dataset_task"]


def test_unknown_key_names_dotted_path_and_suggests(tmp_path):
    path = write(tmp_path, [("    num_layers: 2", "    num_layer: 2")])
    with pytest.raises(RecipeError, match=r"model\.model_config\.num_layer: unknown key; did you mean num_layers\?"):
        load_recipe(path)


def test_all_problems_reported_together(tmp_path):
    path = write(tmp_path, [("    num_layers: 2", "    num_layer: 2"),
                            ("  batch_size: 4", "  batch_size: four\n  sinkmode: True")])
    with pytest.raises(RecipeError) as info:
        load_recipe(path)
    problems = info.value.problems
    assert any(p.startswith("model.model_config.num_layer: unknown key") for p in problems)
    assert any(p.startswith("runner_config.batch_size: expected int, got 'four'") for p in problems)
    assert any(p.startswith("runner_config.sinkmode: unknown key; did you mean sink_mode?") for p in problems)
    assert any("model.model_config.num_layers: missing required key" in p for p in problems)


def test_bad_enum_value(tmp_path):
    path = write(tmp_path, [("output_dir: runs/tiny_cpu", "output_dir: runs/tiny_cpu\ncontext:\n  device_target: NPU")])
    with pytest.raises(RecipeError, match=r"context\.device_target: 'NPU' is not one of 'CPU', 'Ascend', 'GPU'"):
        load_recipe(path)


def test_bases_are_merged_under_the_recipe():
    dp2 = load_recipe(os.path.join(REPO_ROOT, "recipes", "tiny_dp2_cpu.yaml"))
    tiny = load_recipe(TINY_RECIPE)
    assert dp2.runner_config.batch_size == 2 and dp2.parallel_config.data_parallel == 2
    assert dp2.model == tiny.model and dp2.lr_schedule == tiny.lr_schedule  # inherited through two levels
    assert dp2.context.device_target == "CPU" and dp2.runner_wrapper.type == "PortableTrainOneStepCell"
    assert "base" not in dp2.to_dict()


def test_base_errors(tmp_path):
    (tmp_path / "a.yaml").write_text("base: b.yaml\n")
    (tmp_path / "b.yaml").write_text("base: a.yaml\n")
    with pytest.raises(RecipeError, match="circular inheritance"):
        load_recipe(str(tmp_path / "a.yaml"))
    (tmp_path / "c.yaml").write_text("base: missing.yaml\n")
    with pytest.raises(RecipeError, match=r"(?s)missing\.yaml: 1 problem.*file not found \(base of .*c\.yaml\)"):
        load_recipe(str(tmp_path / "c.yaml"))


def test_tensor_parallel_stays_within_a_node():
    with pytest.raises(RecipeError, match=r"parallel_config\.model_parallel: 4 must fit within one node "
                                          r"\(hardware\.devices_per_node 2\)"):
        load_recipe(TINY_RECIPE, ("context.device_target=Ascend", "use_parallel=True",
                                  "parallel_config.model_parallel=4", "hardware.devices_per_node=2",
                                  "model.model_config.num_kv_heads=4"))


def test_missing_file():
    with pytest.raises(RecipeError, match=r"(?s)recipes/nope\.yaml: 1 problem.*file not found"):
        load_recipe("recipes/nope.yaml")


def test_set_overrides_and_typos():
    recipe = load_recipe(TINY_RECIPE, ("runner_config.batch_size=2", "lr_schedule.learning_rate=1e-3",
                                       "callbacks.1.prefix=other"))
    assert recipe.runner_config.batch_size == 2
    assert recipe.lr_schedule.learning_rate == pytest.approx(1e-3)  # PyYAML reads 1e-3 as a string
    assert recipe.callbacks[1].prefix == "other"
    with pytest.raises(RecipeError, match=r"runner_config\.batch_sise: unknown key; did you mean batch_size\?"):
        load_recipe(TINY_RECIPE, ("runner_config.batch_sise=2",))
    with pytest.raises(RecipeError, match=r"--set callbacks\.7\.prefix: callbacks\.7 is not an index of a 2-item list"):
        load_recipe(TINY_RECIPE, ("callbacks.7.prefix=x",))
    with pytest.raises(RecipeError, match="expected key.path=value"):
        load_recipe(TINY_RECIPE, ("runner_config.batch_size",))


def test_seq_length_must_be_16_aligned():
    with pytest.raises(RecipeError, match=r"model\.model_config\.seq_length: 100 is not a multiple of 16.*Use 112"):
        load_recipe(TINY_RECIPE, ("model.model_config.seq_length=100",))


def test_hidden_head_and_mlp_sizes_are_16_aligned():
    with pytest.raises(RecipeError) as info:
        load_recipe(TINY_RECIPE, ("model.model_config.hidden_size=72", "model.model_config.intermediate_size=170"))
    text = str(info.value)
    assert "model.model_config.hidden_size: 72 is not a multiple of 16" in text
    assert "model.model_config.intermediate_size: 170 is not a multiple of 16 (the Cube unit's tile); use 176" in text
    assert "head size 18 is not a multiple of 16" in text


def test_cpu_refuses_what_needs_ascend():
    with pytest.raises(RecipeError) as info:
        load_recipe(TINY_RECIPE, ("model.model_config.compute_dtype=bfloat16", "use_parallel=True",
                                  "parallel_config.model_parallel=2", "runner_config.sink_mode=True",
                                  "runner_wrapper.type=MFTrainOneStepCell"))
    text = str(info.value)
    assert "model.model_config.compute_dtype: bfloat16 kernels exist only on Ascend/GPU" in text
    assert "parallel_config.model_parallel: 2 needs Ascend" in text
    assert "runner_config.sink_mode: True on CPU silently multiplies" in text
    assert "runner_wrapper.type: MFTrainOneStepCell checks overflow with an Ascend-only kernel" in text
    # The same recipe is fine for Ascend, where those features exist.
    recipe = load_recipe(TINY_RECIPE, ("context.device_target=Ascend", "model.model_config.compute_dtype=bfloat16",
                                       "use_parallel=True", "parallel_config.model_parallel=2"))
    assert recipe.world_size == 2


def test_silent_mindformers_traps_are_refused():
    with pytest.raises(RecipeError, match=r"runner_config\.gradient_accumulation_steps: > 1 is silently reset"):
        load_recipe(TINY_RECIPE, ("runner_config.gradient_accumulation_steps=4",))
    with pytest.raises(RecipeError, match=r"use_parallel: must be True when .* = 2 devices"):
        load_recipe(TINY_RECIPE, ("parallel_config.data_parallel=2",))
    with pytest.raises(RecipeError, match=r"train_dataset\.drop_remainder: must be True"):
        load_recipe(TINY_RECIPE, ("train_dataset.drop_remainder=False",))


def test_task_dataset_block_must_match(tmp_path):
    path = write(tmp_path, [("train_dataset:\n", "train_dataset_task:\n  dataset_config:\n    repeat: 3\n"
                                                 "train_dataset:\n")])
    with pytest.raises(RecipeError, match=r"train_dataset_task\.dataset_config: differs from train_dataset"):
        load_recipe(path)


def _header_parameter_count(path):
    with open(path, encoding="utf-8") as f:
        match = re.search(r"Arithmetic: ([\d,]+) parameters", f.read())
    return int(match.group(1).replace(",", ""))


SHIPPED = sorted(p for p in glob.glob(os.path.join(REPO_ROOT, "recipes", "*.yaml")))


@pytest.mark.parametrize("path", SHIPPED)
def test_header_states_parameters_tokens_and_memory(path):
    from models.arithmetic import param_count

    recipe = load_recipe(path)
    with open(path, encoding="utf-8") as f:
        header = f.read().split("\n\n")[0]
    tp = recipe.parallel_config.model_parallel
    assert _header_parameter_count(path) == param_count(recipe.model.model_config, tensor_parallel=tp)
    assert f"{recipe.tokens_per_step:,}" in header
    assert "Memory" in header or "memory" in header


@pytest.mark.parametrize("path", [TINY_RECIPE, DEMO_RECIPE])
def test_header_parameter_count_matches_the_model(path):
    import mindspore as ms
    from models.llama import LlamaConfig, LlamaForCausalLM

    cfg = load_recipe(path).model.model_config
    fields = {k: v for k, v in vars(cfg).items() if k not in ("type", "compute_dtype")}
    net = LlamaForCausalLM(LlamaConfig(**fields))
    counted = sum(int(p.size) for p in net.get_parameters())
    assert counted == _header_parameter_count(path)
    del ms
