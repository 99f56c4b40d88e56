"""Recipe loading: strict keys with dotted paths, types, overrides, cross-field rules."""

import ast
import copy
import dataclasses
import glob
import math
import os
import re
import types
import typing

import pytest
import yaml

from conftest import DEMO_RECIPE, REPO_ROOT, TINY_RECIPE
from ascend_llm_recipes.common.errors import RecipeError
from ascend_llm_recipes.models.config import ModelConfig
from ascend_llm_recipes.training.tools.planner import plan
from ascend_llm_recipes.training.recipe.loading import apply_override, load_recipe, read_recipe_file, recipe_from_dict
from ascend_llm_recipes.training.recipe.schema import CheckpointMonitorConfig, Recipe


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


def test_base_recipes_leave_the_optimizer_defaults_to_the_schema():
    """AdamW's betas, eps and weight decay are stated once, in OptimizerConfig; a base recipe sets only what differs."""
    from ascend_llm_recipes.training.recipe.schema import OptimizerConfig

    defaults = dataclasses.asdict(OptimizerConfig())
    for path in glob.glob(os.path.join(REPO_ROOT, "recipes", "base", "*.yaml")):
        optimizer = read_recipe_file(path).get("optimizer", {})
        assert not [key for key, value in optimizer.items() if defaults.get(key) == value], path
    assert load_recipe(TINY_RECIPE).optimizer.betas == defaults["betas"]


def test_base_errors(tmp_path):
    (tmp_path / "a.yaml").write_text("base: b.yaml\n")
    (tmp_path / "b.yaml").write_text("base: a.yaml\n")
    with pytest.raises(RecipeError, match="circular inheritance"):
        load_recipe(str(tmp_path / "a.yaml"))
    (tmp_path / "c.yaml").write_text("base: missing.yaml\n")
    with pytest.raises(RecipeError, match=r"(?s)missing\.yaml: 1 problem.*file not found \(base of .*c\.yaml\)"):
        load_recipe(str(tmp_path / "c.yaml"))


def test_tensor_parallel_stays_within_a_node():
    with pytest.raises(RecipeError, match=r"parallel_config\.model_parallel: 4 must divide "
                                          r"hardware\.devices_per_node \(2\): a tensor-parallel group stays"):
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


def test_mixture_of_experts_and_qwen3_keys_are_checked_naming_each():
    mc = "model.model_config."
    with pytest.raises(RecipeError) as info:
        load_recipe(TINY_RECIPE, (mc + "num_experts=4", mc + "num_experts_per_tok=5", mc + "moe_intermediate_size=40",
                                  mc + "shared_expert_gate=True", mc + "head_dim=18"))
    text = str(info.value)
    assert f"{mc}num_experts_per_tok: 5 exceeds num_experts 4" in text
    assert f"{mc}moe_intermediate_size: 40 is not a multiple of 16 (the Cube unit's tile); use 48" in text
    assert f"{mc}shared_expert_gate: gates a shared expert, but {mc}shared_expert_intermediate_size is 0" in text
    assert f"{mc}head_dim: 18 is not a multiple of 16" in text
    with pytest.raises(RecipeError,
                       match=rf"{mc}dense_layers: \[0, 2\] must list distinct layer indices within 0\.\.1"):
        load_recipe(TINY_RECIPE, (mc + "num_experts=4", mc + "dense_layers=[0, 2]"))
    with pytest.raises(RecipeError, match=rf"{mc}dense_layers: is set, but {mc}num_experts is 0 \(a dense model\)"):
        load_recipe(TINY_RECIPE, (mc + "dense_layers=[0]",))
    recipe = load_recipe(TINY_RECIPE, (mc + "num_experts=4", mc + "dense_layers=[0]", mc + "qk_norm=True",
                                       mc + "head_dim=32", mc + "moe_intermediate_size=32"))
    cfg = recipe.model.model_config
    assert (cfg.head_size, cfg.is_moe_layer(0), cfg.is_moe_layer(1), cfg.expert_size) == (32, False, True, 32)


def test_expert_parallel_follows_mindformers_layout_rules_naming_the_keys():
    from ascend_llm_recipes.models.config import ModelConfig
    from ascend_llm_recipes.models.parallel import expert_problems

    moe = os.path.join(REPO_ROOT, "recipes", "tiny_moe_cpu.yaml")
    ascend = ("context.device_target=Ascend", "use_parallel=True", "parallel.parallel_mode=1",
              "parallel.full_batch=True", "parallel.gradients_mean=False")
    pc = "parallel_config."
    ep4 = load_recipe(moe, (*ascend, pc + "data_parallel=4", pc + "expert_parallel=4"))
    assert ep4.parallel_config.expert_parallel == 4
    # with tensor parallel the MoE layers run sequence parallel: the sequence splits over TP
    tp2 = load_recipe(moe, (*ascend, pc + "data_parallel=2", pc + "model_parallel=2", pc + "expert_parallel=4"))
    assert tp2.parallel_config.model_parallel == 2
    odd = ModelConfig(vocab_size=128, hidden_size=96, num_layers=2, num_heads=6, intermediate_size=96, seq_length=64,
                      num_experts=6, moe_intermediate_size=48)
    assert expert_problems(odd, dp=1, tp=3, ep=3) == [
        f"{pc}model_parallel: 3 does not divide model.model_config.seq_length (64): with tensor parallel the MoE "
        "layers split each sequence over the tensor-parallel ranks"]
    cases = [  # (overrides, the problem named)
        ((pc + "data_parallel=8", pc + "expert_parallel=8"),
         f"{pc}expert_parallel: 8 does not divide model.model_config.num_experts (4)"),
        ((pc + "data_parallel=2", pc + "expert_parallel=4"),
         f"{pc}expert_parallel: 4 does not divide {pc}data_parallel x model_parallel (2 x 1 = 2)"),
    ]
    for overrides, message in cases:
        with pytest.raises(RecipeError, match=re.escape(message)):
            load_recipe(moe, (*ascend, *overrides))
    with pytest.raises(RecipeError, match=re.escape(f"{pc}expert_parallel: 2 on a dense model")):
        load_recipe(TINY_RECIPE, (*ascend, pc + "data_parallel=2", pc + "expert_parallel=2"))
    with pytest.raises(RecipeError, match=re.escape(f"{pc}expert_parallel: 2 needs Ascend; expert parallel has no CPU "
                                                    "backend (the CPU path computes every expert locally)")):
        load_recipe(moe, ("use_parallel=True", pc + "data_parallel=2", pc + "expert_parallel=2"))


def test_silent_mindformers_traps_are_refused():
    with pytest.raises(RecipeError, match=r"runner_config\.gradient_accumulation_steps: > 1 is silently reset"):
        load_recipe(TINY_RECIPE, ("runner_config.gradient_accumulation_steps=4",))
    with pytest.raises(RecipeError, match=r"use_parallel: must be True when .* = 2 devices"):
        load_recipe(TINY_RECIPE, ("parallel_config.data_parallel=2",))
    with pytest.raises(RecipeError, match=r"train_dataset\.drop_remainder: must be True"):
        load_recipe(TINY_RECIPE, ("train_dataset.drop_remainder=False",))


def test_selective_recompute_is_accepted_and_planned_and_its_bad_values_refused():
    """models/parallel.py recomputes core attention under select_recompute: the recipe takes it, as MindFormers does."""
    recipe = load_recipe(TINY_RECIPE, ("recompute_config.select_recompute=True",
                                       "recompute_config.recompute_slice_activation=True"))
    assert recipe.recompute_config.select_recompute and plan(recipe).recompute == "selective"
    with pytest.raises(RecipeError, match=r"recompute_config\.select_recompute: expected bool, got \[10, 8\]"):
        load_recipe(TINY_RECIPE, ("recompute_config.select_recompute=[10, 8]",))  # MindFormers' mcore per-stage form
    with pytest.raises(RecipeError, match=r"recompute_config\.select_recompute: has no effect with "
                                          r"recompute_config\.recompute: True"):
        load_recipe(TINY_RECIPE, ("recompute_config.select_recompute=True", "recompute_config.recompute=True"))
    with pytest.raises(RecipeError, match=r"recompute_config\.select_recompute: has no effect with "
                                          r"model\.model_config\.use_flash_attention: True"):
        load_recipe(TINY_RECIPE, ("context.device_target=Ascend", "model.model_config.compute_dtype=float16",
                                  "model.model_config.use_flash_attention=True",
                                  "recompute_config.select_recompute=True"))


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
    from ascend_llm_recipes.models.arithmetic import param_count

    recipe = load_recipe(path)
    with open(path, encoding="utf-8") as f:
        header = f.read().split("\n\n")[0]
    tp = recipe.parallel_config.model_parallel
    assert _header_parameter_count(path) == param_count(recipe.model.model_config, tensor_parallel=tp)
    assert f"{recipe.tokens_per_step:,}" in header
    assert "Memory" in header or "memory" in header


@pytest.mark.parametrize("path", [TINY_RECIPE, DEMO_RECIPE, os.path.join(REPO_ROOT, "recipes", "tiny_moe_cpu.yaml"),
                                  os.path.join(REPO_ROOT, "recipes", "tiny_deepseek_cpu.yaml")])
def test_header_parameter_count_matches_the_model(path):
    import mindspore as ms
    from ascend_llm_recipes.models.llama import LlamaConfig, LlamaForCausalLM

    cfg = load_recipe(path).model.model_config
    fields = {k: v for k, v in vars(cfg).items() if k not in ("type", "compute_dtype")}
    net = LlamaForCausalLM(LlamaConfig(**fields))
    from ascend_llm_recipes.models.shapes import STATISTICS
    # every parameter (DeepSeek's correction bias is one, not trained) but MoE's routing statistics
    counted = sum(int(p.size) for p in net.get_parameters() if not p.name.endswith(STATISTICS))
    assert counted == _header_parameter_count(path)
    del ms


# --- The loader never crashes: wrong types at every key path of every shipped recipe ---------------------

def _sections(annotation) -> list:
    """The dataclasses an annotation can hold (a section, an Optional section, a union of tagged sections)."""
    if dataclasses.is_dataclass(annotation):
        return [annotation]
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return [a for a in typing.get_args(annotation) if dataclasses.is_dataclass(a)]
    return []


def key_paths(cls, prefix=()):
    """Every key path the schema defines under `cls` (list items as indexes 0 and 1), with its annotation."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        path, annotation = prefix + (f.name,), hints[f.name]
        yield path, annotation
        for section in _sections(annotation):
            yield from key_paths(section, path)
        if typing.get_origin(annotation) is list:
            for section in _sections(typing.get_args(annotation)[0]):
                for index in ("0", "1"):
                    yield from key_paths(section, path + (index,))


def shown(path) -> tuple:
    """How problems spell a key path: callbacks[1].prefix (schema) or callbacks.1.prefix (--set)."""
    return (".".join(path), "".join(f"[{p}]" if p.isdigit() else f".{p}" for p in path).lstrip("."))


def fits(value, annotation) -> bool:
    """Whether VALUE is of the type the schema ANNOTATION names, so that the loader may accept it (a value check
    may still refuse it): an int where a float is allowed, None where the key is optional, a dict for a free-form
    section (common/schema.py's _convert). bool is not taken for an int or a float, and a section's dict holds only
    the section's keys."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if annotation is typing.Any:
        return True
    if annotation is type(None):
        return value is None
    if origin in (typing.Union, types.UnionType):
        return any(fits(value, a) for a in args)
    if origin is typing.Literal:
        return any(type(value) is type(a) and value == a for a in args)
    if dataclasses.is_dataclass(annotation):
        return isinstance(value, dict) and set(value) <= {f.name for f in dataclasses.fields(annotation)}
    if origin is list or annotation is list:
        return isinstance(value, list) and all(fits(v, args[0]) for v in value) if args else isinstance(value, list)
    if origin is dict or annotation is dict:
        return isinstance(value, dict)
    if annotation is float:  # also a string that reads as a number: PyYAML reads `1e-3` as one
        try:
            return type(value) in (int, float) or (isinstance(value, str) and math.isfinite(float(value)))
        except ValueError:
            return False
    if annotation is int:
        return type(value) is int
    return isinstance(value, annotation)


WRONG_VALUES = [True, "text", [1, "a"], {"unexpected": 1}, None, 1.5, -3]
ANNOTATIONS = {}  # key path -> its annotations (one per section a union can hold there)
for _path, _annotation in key_paths(Recipe):
    ANNOTATIONS.setdefault(_path, []).append(_annotation)
SCHEMA_PATHS = sorted(ANNOTATIONS)


@pytest.mark.parametrize("path", SHIPPED)
def test_wrong_values_at_every_key_path_give_a_recipe_error_naming_the_key(path):
    data = read_recipe_file(path)
    for keys in SCHEMA_PATHS:
        for value in WRONG_VALUES:
            variant, problems = copy.deepcopy(data), []
            apply_override(variant, list(keys), copy.deepcopy(value), problems)
            try:
                recipe_from_dict(variant, path, problems, planning=True)
            except RecipeError as err:
                # The key itself, or the section that holds it, is named.
                names = [shown(keys[:n]) for n in range(len(keys), 0, -1)]
                assert any(a in str(err) or b in str(err) for a, b in names), (keys, value, str(err))
            else:
                # Accepted: only a value of the key's type may be (a type check that let it through is a bug).
                assert any(fits(value, a) for a in ANNOTATIONS[keys]), (
                    f"{path}: {shown(keys)[0]} = {value!r} was accepted, but the schema says {ANNOTATIONS[keys]}")


# Sections the tiny recipe leaves out, filled in so that each of their numbers is checked on its own.
COMPLETE = ("eval_dataset={data_loader: {dataset_dir: held_out}}", "profile={start_step: 1, stop_step: 2}",
            "runner_wrapper.scale_sense={type: DynamicLossScaleUpdateCell}",
            "train_dataset.blend=[{dataset_dir: datasets/pystdlib-sp512-s64-n60}, {dataset_dir: other}]")


CHECKPOINT_KEYS = {f.name for f in dataclasses.fields(CheckpointMonitorConfig)}


def test_numeric_keys_have_range_rules():
    """Every number of the schema is range-checked: an absurd value is refused naming its key."""
    for keys, annotation in key_paths(Recipe):
        inner = [a for t in typing.get_args(annotation) for a in typing.get_args(t)]  # Optional[list[int]]
        kinds = {annotation, *typing.get_args(annotation), *inner}
        if not {int, float} & kinds or typing.get_origin(annotation) is typing.Literal:
            continue
        if keys[0] == "callbacks" and (keys[1] == "1") != (keys[2] in CHECKPOINT_KEYS):
            continue  # tiny's callbacks[0] is the loss monitor, callbacks[1] the checkpoint monitor
        for value in ["-1000"] + ([".nan", ".inf"] if float in kinds else []):
            with pytest.raises(RecipeError) as info:
                load_recipe(TINY_RECIPE, COMPLETE + (f"{'.'.join(keys)}={value}",), planning=True)
            named = [p for p in info.value.problems if any(name in p for name in shown(keys))]
            assert named and "unknown key" not in named[0], (keys, value, info.value.problems)


@pytest.mark.parametrize("override, message", [
    ("lr_schedule.lr_end=-1e-4", r"lr_schedule\.lr_end: must be >= 0, got -0\.0001"),
    ("lr_schedule.lr_end=0.5", r"lr_schedule\.lr_end: 0\.5 is above learning_rate"),
    ("lr_schedule.learning_rate=.nan", r"lr_schedule\.learning_rate: must be a finite number, got nan"),
    ("lr_schedule.learning_rate=inf", r"lr_schedule\.learning_rate: must be a finite number, got 'inf'"),
    ("lr_schedule.warmup_steps=-2", r"lr_schedule\.warmup_steps: must be >= 0, got -2"),
    ("lr_schedule.warmup_steps=50", r"lr_schedule\.warmup_steps: 50 exceeds the 20 steps"),
    ("optimizer.eps=-1e-8", r"optimizer\.eps: must be > 0"),
    ("optimizer.weight_decay=-0.1", r"optimizer\.weight_decay: must be >= 0"),
    ("runner_wrapper.max_grad_norm=-1", r"runner_wrapper\.max_grad_norm: must be > 0"),
    ("model.model_config.rms_norm_eps=0", r"model\.model_config\.rms_norm_eps: must be > 0"),
    ("model.model_config.pad_token_id=512", r"model\.model_config\.pad_token_id: 512 is not a token id"),
    ("model.model_config.bos_token_id=-2", r"model\.model_config\.bos_token_id: -2 is not a token id"),
    ("seed=-1", r"seed: must be >= 0"),
    ("callbacks.1.keep_checkpoint_max=0", r"callbacks\[1\]\.keep_checkpoint_max: must be >= 1"),
    ("profile={start_step: 5, stop_step: 30}", r"profile\.stop_step, runner_config\.stop_step: the profile "
                                               r"window 5\.\.30 ends after the run's last step 20"),
])
def test_numbers_that_cannot_be_right_are_refused_naming_the_key(override, message):
    with pytest.raises(RecipeError, match=message):
        load_recipe(TINY_RECIPE, (override,))


def test_yaml_anchors_bools_and_nulls_where_sections_belong(tmp_path):
    path = write(tmp_path, [("output_dir: runs/tiny_cpu", "output_dir: runs/tiny_cpu\nprofile: False\n"
                                                          "eval_dataset: &ev [1, 2]\nhccl: *ev\nanomaly: null\n"
                                                          "monitoring: &loop {tensorboard: *ev}\n"),
                            ("optimizer:\n  weight_decay: 0.0", "optimizer: &opt\n  weight_decay: 0.0\n"
                                                                "  nested: *opt")])
    with pytest.raises(RecipeError) as info:
        load_recipe(path)
    text = str(info.value)
    for expected in ("profile: expected a mapping, got False", "eval_dataset: expected a mapping, got [1, 2]",
                     "hccl: expected a mapping, got [1, 2]", "anomaly: expected a mapping, got None",
                     "monitoring.tensorboard: expected bool, got [1, 2]", "optimizer.nested: unknown key"):
        assert expected in text


# The keys and layout of MindFormers' configs/llama2/pretrain_llama2_7b.yaml (mindspore-lab/mindformers).
MINDFORMERS_LLAMA2_7B = """\
seed: 0
output_dir: './output'
load_checkpoint: ''
src_strategy_path_or_dir: ''
auto_trans_ckpt: False
only_save_strategy: False
resume_training: False
run_mode: 'train'
trainer:
  type: CausalLanguageModelingTrainer
  model_name: 'llama2_7b'
runner_config:
  epochs: 2
  batch_size: 1
  sink_mode: True
  sink_size: 1
  gradient_accumulation_steps: 8
optimizer:
  type: FP32StateAdamWeightDecay
  beta1: 0.9
  beta2: 0.95
  eps: 1.e-8
  learning_rate: 5.e-5
lr_schedule:
  type: CosineWithWarmUpLR
  learning_rate: 5.e-5
  lr_end: 0
  warmup_ratio: 0.03
  total_steps: -1
train_dataset: &train_dataset
  data_loader:
    type: MindDataset
    dataset_dir: ""
    shuffle: True
  input_columns: ["input_ids"]
  num_parallel_workers: 8
  python_multiprocessing: False
  drop_remainder: True
  batch_size: 6
  repeat: 1
  numa_enable: False
  prefetch_size: 1
train_dataset_task:
  type: CausalLanguageModelDataset
  dataset_config: *train_dataset
do_eval: False
eval_dataset: &eval_dataset
  data_loader:
    type: MindDataset
    dataset_dir: ""
    shuffle: False
  input_columns: ["input_ids"]
  drop_remainder: False
eval_dataset_task:
  type: CausalLanguageModelDataset
  dataset_config: *eval_dataset
use_parallel: True
parallel:
  parallel_mode: 1
  gradients_mean: False
  enable_alltoall: False
  full_batch: True
  search_mode: "sharding_propagation"
  enable_parallel_optimizer: True
  strategy_ckpt_save_file: "./ckpt_strategy.ckpt"
  parallel_optimizer_config:
    gradient_accumulation_shard: False
    parallel_optimizer_threshold: 64
parallel_config:
  data_parallel: 8
  model_parallel: 1
  pipeline_stage: 1
  use_seq_parallel: False
  micro_batch_num: 1
  vocab_emb_dp: True
  gradient_aggregation_group: 4
micro_batch_interleave_num: 1
recompute_config:
  recompute: False
  select_recompute: False
callbacks:
  - type: MFLossMonitor
  - type: CheckpointMonitor
    prefix: "llama2_7b"
    save_checkpoint_steps: 100
  - type: ObsMonitor
context:
  mode: 0
  device_target: "Ascend"
  max_call_depth: 10000
  max_device_memory: "58GB"
  save_graphs: False
  save_graphs_path: "./graph"
  device_id: 0
model:
  model_config:
    type: LlamaConfig
    batch_size: 1
    seq_length: 4096
    hidden_size: 4096
    num_layers: 32
    num_heads: 32
    vocab_size: 32000
    multiple_of: 256
    rms_norm_eps: 1.0e-5
    compute_dtype: "float16"
    use_flash_attention: True
  arch:
    type: LlamaForCausalLM
processor:
  return_tensors: ms
  tokenizer:
    type: LlamaTokenizer
  type: LlamaProcessor
metric:
  type: PerplexityMetric
runner_wrapper:
  type: MFTrainOneStepCell
  scale_sense:
    type: DynamicLossScaleUpdateCell
    loss_scale_value: 65536
    scale_factor: 2
    scale_window: 1000
  use_clip_grad: True
eval_callbacks:
  - type: ObsMonitor
auto_tune: False
profile: False
profile_start_step: 1
profile_stop_step: 10
layer_scale: False
"""


def test_a_mindformers_config_is_named_with_the_import_command(tmp_path, capsys):
    """MindFormers' own Llama 2 pretraining config (configs/llama2/pretrain_llama2_7b.yaml, same keys and layout)."""
    config = tmp_path / "pretrain_llama2_7b.yaml"
    config.write_text(MINDFORMERS_LLAMA2_7B, encoding="utf-8")
    from ascend_llm_recipes.training.launcher.cli import main
    assert main([str(config), "--plan"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert f"recipe {config}: 1 problem(s):\n  - this is a MindFormers configuration" in err
    assert "processor, metric" in err and "model.model_config.type LlamaConfig" in err
    assert f"python scripts/convert_recipe.py --from-mindformers {config} --output recipes/NAME.yaml" in err


def test_duplicate_keys_are_refused_with_their_line(tmp_path):
    path = write(tmp_path, [("  lr_end: 5.0e-4", "  lr_end: 5.0e-4\n  lr_end: -5.0e-4")])
    with pytest.raises(RecipeError, match=r"recipe\.yaml: 1 problem\(s\):\n  - not valid YAML: "
                                          r"duplicate key 'lr_end' "
                                          r"on line 23 \(first on line 22\)"):
        load_recipe(path)
    # A mapping's own key may override one merged in with `<<: *anchor`.
    path = write(tmp_path, [("optimizer:\n  weight_decay: 0.0", "optimizer:\n  <<: {weight_decay: 0.1}\n"
                                                                "  weight_decay: 0.0")])
    assert load_recipe(path).optimizer.weight_decay == 0.0
    with pytest.raises(RecipeError, match=r"(?s)--set.*duplicate key 'batch_size'"):
        load_recipe(TINY_RECIPE, ("runner_config={batch_size: 2, batch_size: 3}",))


def test_set_with_a_mapping_merges_into_the_section():
    recipe = load_recipe(TINY_RECIPE, ("runner_config={batch_size: 2}",))
    assert recipe.runner_config.batch_size == 2 and recipe.runner_config.stop_step == 20  # sibling kept
    assert load_recipe(TINY_RECIPE, ("data_preparation=null",)).data_preparation is None  # a non-mapping replaces
    with pytest.raises(RecipeError, match=r"(?s)--set.*not valid YAML"):
        load_recipe(TINY_RECIPE, ("runner_config={batch_size: ",))


def test_bad_base_and_non_utf8_files_are_named(tmp_path):
    (tmp_path / "a.yaml").write_text("base: 5\n")
    with pytest.raises(RecipeError, match=r"base: expected a file name or a list of file names.*got 5"):
        load_recipe(str(tmp_path / "a.yaml"))
    path = write(tmp_path, [("# Tiny:", "# Tiny (r\u00e9sum\u00e9):")])
    with open(path, encoding="utf-8") as f:
        text = f.read()
    with open(path, "w", encoding="latin-1") as f:
        f.write(text)
    with pytest.raises(RecipeError, match=r"not UTF-8 text: byte 0xe9 on line 1(?s:.*)save it as UTF-8"):
        load_recipe(path)


# --- Paths: resolved once at load, against the working directory ------------------------------------------

def test_relative_paths_resolve_against_the_working_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    recipe = load_recipe(TINY_RECIPE, ("load_checkpoint=ckpt/../weights",))
    assert recipe.output_dir == str(tmp_path / "runs" / "tiny_cpu")
    dataset = str(tmp_path / "datasets" / "pystdlib-sp512-s64-n60")
    assert recipe.dataset_dir == recipe.data_preparation.output_dir == dataset
    assert recipe.load_checkpoint == str(tmp_path / "weights")
    # What RUN_DIR/recipe.yaml stores reads back identically from anywhere (the workers run in RUN_DIR).
    monkeypatch.chdir(REPO_ROOT)
    assert recipe_from_dict(yaml.safe_load(recipe.to_yaml())) == recipe


def test_one_dataset_listed_twice_through_other_spellings_is_refused_at_load(tmp_path, monkeypatch):
    (tmp_path / "ds" / "a").mkdir(parents=True)
    (tmp_path / "work").mkdir()
    os.symlink(tmp_path / "ds", tmp_path / "link")
    monkeypatch.chdir(tmp_path / "work")
    blend = f"train_dataset.blend=[{{dataset_dir: {tmp_path}/ds/a}}, {{dataset_dir: ../ds/a}}, " \
            f"{{dataset_dir: {tmp_path}/link/a}}]"
    with pytest.raises(RecipeError) as info:
        load_recipe(TINY_RECIPE, (f"train_dataset.data_loader.dataset_dir={tmp_path}/ds/a", blend))
    assert f"train_dataset.blend[1].dataset_dir: {tmp_path}/ds/a is already listed as train_dataset.blend[0]" \
        in str(info.value)
    assert "train_dataset.blend[2].dataset_dir" in str(info.value)


# --- The datasets a recipe reads: built only when they are its own, checked as a set -----------------------

@pytest.fixture(scope="module")
def small_dataset(tmp_path_factory, tiny_dataset):
    """A few stdlib files with the tiny dataset's tokenizer: blendable with it, and fewer samples."""
    from ascend_llm_recipes.data.text.corpus import python_stdlib_files
    from ascend_llm_recipes.data.prepare import prepare_dataset

    out = str(tmp_path_factory.mktemp("small") / "small")
    prepare_dataset(out, 64, inputs=[str(p) for p in python_stdlib_files()[100:102]],
                    tokenizer=os.path.join(tiny_dataset, "tokenizer.model"), show_progress=False, workers=0)
    return out


def test_a_missing_dataset_is_built_only_when_it_is_the_recipes_own(tmp_path, tiny_dataset, capsys):
    from ascend_llm_recipes.data.mindrecord_io import read_manifest
    from ascend_llm_recipes.common.errors import DataError
    from ascend_llm_recipes.training.launcher.datasets import ensure_dataset

    typo = tmp_path / "pystdlib-sp512-s64-n6O"
    recipe = load_recipe(TINY_RECIPE, (f"train_dataset.data_loader.dataset_dir={typo}",
                                       f"data_preparation.output_dir={tiny_dataset}"))
    with pytest.raises(DataError, match=rf"(?s)train_dataset\.data_loader\.dataset_dir: dataset {typo}: "
                                        rf"directory does not exist.*python scripts/prepare_data\.py --output {typo} "
                                        rf"--seq-length 64 --vocab-size 512; data_preparation builds only its "
                                        rf"output_dir {tiny_dataset}"):
        ensure_dataset(recipe, show_progress=False)
    assert not typo.exists()
    # Its own dataset, even spelled through a symlink and ../, is built when missing.
    (tmp_path / "real").mkdir()
    os.symlink(tmp_path / "real", tmp_path / "link")
    recipe = load_recipe(TINY_RECIPE, (f"train_dataset.data_loader.dataset_dir={tmp_path}/real/own",
                                       f"data_preparation.output_dir={tmp_path}/link/x/../own",
                                       "data_preparation.max_documents=15"))
    manifest = ensure_dataset(recipe, show_progress=False)
    assert f"[launch] dataset {tmp_path}/real/own not found: preparing it" in capsys.readouterr().out
    assert manifest == read_manifest(str(tmp_path / "real" / "own"))


def test_eval_dataset_must_share_the_tokenizer_and_hold_a_batch(tmp_path, tiny_dataset, small_dataset):
    from ascend_llm_recipes.data.text.corpus import python_stdlib_files
    from ascend_llm_recipes.data.mindrecord_io import read_manifest
    from ascend_llm_recipes.data.prepare import prepare_dataset
    from ascend_llm_recipes.common.errors import DataError
    from ascend_llm_recipes.training.launcher.datasets import check_datasets

    def with_eval(eval_dir, *overrides):
        return load_recipe(TINY_RECIPE, (f"train_dataset.data_loader.dataset_dir={tiny_dataset}", "do_eval=True",
                                         f"eval_dataset={{data_loader: {{dataset_dir: {eval_dir}}}}}", *overrides))

    samples = read_manifest(small_dataset)["samples"]
    assert check_datasets(with_eval(small_dataset, f"runner_config.batch_size={samples}"))["warnings"] == []
    with pytest.raises(DataError, match=rf"eval_dataset\.data_loader\.dataset_dir: {small_dataset} holds {samples} "
                                        rf"sample\(s\), fewer than one batch \(runner_config\.batch_size "
                                        rf"{samples + 1}\)"):
        check_datasets(with_eval(small_dataset, f"runner_config.batch_size={samples + 1}"))
    # Same size of vocabulary, another tokenizer: the held-out loss would be on other tokens.
    other = str(tmp_path / "other")
    prepare_dataset(other, 64, 512, inputs=[str(p) for p in python_stdlib_files()[:30]], show_progress=False,
                    workers=0)
    with pytest.raises(DataError, match=r"eval_dataset\.data_loader\.dataset_dir: .*other was tokenised with "
                                        r"another tokenizer than train_dataset\.data_loader\.dataset_dir"):
        check_datasets(with_eval(other))


def test_model_vocabulary_against_the_tokenizer(tiny_dataset):
    from ascend_llm_recipes.common.errors import DataError
    from ascend_llm_recipes.training.launcher.datasets import check_datasets

    larger = load_recipe(TINY_RECIPE, (f"train_dataset.data_loader.dataset_dir={tiny_dataset}",
                                       "model.model_config.vocab_size=1024"))
    assert check_datasets(larger)["warnings"] == [
        f"model.model_config.vocab_size 1024 is larger than the tokenizer's 512 ({tiny_dataset}): 512 embedding "
        "rows are never trained"]
    smaller = load_recipe(TINY_RECIPE, (f"train_dataset.data_loader.dataset_dir={tiny_dataset}",
                                        "model.model_config.vocab_size=256"))
    with pytest.raises(DataError, match=r"tokenizer vocab_size 512 exceeds model\.model_config\.vocab_size 256"):
        check_datasets(smaller)


def test_blend_members_expected_repeats_are_printed_and_warned(tiny_dataset, small_dataset, capsys):
    from ascend_llm_recipes.data.mindrecord_io import read_manifest
    from ascend_llm_recipes.training.launcher.datasets import BLEND_REPEAT_WARNING, ensure_dataset

    big, small = read_manifest(tiny_dataset)["samples"], read_manifest(small_dataset)["samples"]
    recipe = load_recipe(TINY_RECIPE, (f"train_dataset.data_loader.dataset_dir={tiny_dataset}",
                                       f"train_dataset.blend=[{{dataset_dir: {tiny_dataset}, weight: 0.1}}, "
                                       f"{{dataset_dir: {small_dataset}, weight: 0.9}}]"))
    ensure_dataset(recipe, show_progress=False)
    out = capsys.readouterr().out
    repeats = 0.9 * (big + small) / small
    assert repeats > BLEND_REPEAT_WARNING
    assert f"[launch] blend: {small_dataset}: weight 90.0% of the samples, {small:,} samples, read " \
           f"~{repeats:.2f} times per pass" in out
    assert f"[launch] warning: train_dataset.blend[1].dataset_dir: {small_dataset} ({small:,} samples at 90.0% of " \
           f"the blend) is read ~{repeats:.0f} times per pass" in out
    assert "[launch] warning: train_dataset.blend[0]" not in out


# --- context.ascend_config, the 910A and float16 ---------------------------------------------------------------

ASCEND_TINY = ("context.device_target=Ascend", "hardware.device=Ascend910B2")


def test_ascend_precision_mode_is_pinned_and_checked():
    recipe = load_recipe(TINY_RECIPE, ASCEND_TINY)  # no ascend_config written: filled in, never MindSpore's default
    assert recipe.to_dict()["context"]["ascend_config"] == {"precision_mode": "must_keep_origin_dtype"}
    assert load_recipe(os.path.join(REPO_ROOT, "recipes", "llama2_7b_8dev.yaml")).context.ascend_config \
        .precision_mode == "must_keep_origin_dtype"
    with pytest.raises(RecipeError, match=r"context\.ascend_config\.precision_mode: 'force_fp16' lets CANN change"):
        load_recipe(TINY_RECIPE, (*ASCEND_TINY, "context.ascend_config.precision_mode=force_fp16"))
    with pytest.raises(RecipeError, match=r"context\.ascend_config\.precision_mode: 'fp16' is not one of 'force_fp16'"):
        load_recipe(TINY_RECIPE, (*ASCEND_TINY, "context.ascend_config.precision_mode=fp16"))
    with pytest.raises(RecipeError, match=r"context\.ascend_config: sets Ascend operator precision .* remove it for "
                                          r"context\.device_target CPU"):
        load_recipe(TINY_RECIPE, ("context.ascend_config={precision_mode: must_keep_origin_dtype}",))
    with pytest.raises(RecipeError, match=r"context\.ascend_config\.precison_mode: unknown key; did you mean "
                                          r"precision_mode\?"):
        load_recipe(TINY_RECIPE, (*ASCEND_TINY, "context.ascend_config={precison_mode: must_keep_origin_dtype}"))


def test_parallel_speed_up_file_is_resolved_and_checked_at_load(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "speed_up.json").write_text('{"matmul_grad_comm_overlap": true, "dataset_broadcast_opt_level": 3}')
    key = "context.ascend_config.parallel_speed_up_json_path"
    recipe = load_recipe(TINY_RECIPE, (*ASCEND_TINY, f"{key}=speed_up.json"))
    assert recipe.context.ascend_config.parallel_speed_up_json_path == str(tmp_path / "speed_up.json")
    for content, message in (
            (None, r"missing\.json: cannot be read \(No such file or directory\)"),
            ("[1, 2]", r"must hold a JSON object of options, got list"),
            ("{'a': 1}", r"not valid JSON"),
            ('{"enable_task_opt": "yes"}', r"'enable_task_opt' must be bool, got 'yes'"),
            ('{"grad_matmul_comm_overlap": true}', r"'grad_matmul_comm_overlap' is not an option of MindSpore 2\.9; "
                                                   r"did you mean grad_matmul_communication_overlap\?")):
        name = "missing.json" if content is None else "bad.json"
        if content is not None:
            (tmp_path / name).write_text(content)
        with pytest.raises(RecipeError, match=re.escape(key) + ": .*" + message):
            load_recipe(TINY_RECIPE, (*ASCEND_TINY, f"{key}={name}"))


def test_the_910a_refuses_what_it_lacks_and_float16_needs_loss_scaling():
    on_910a = ("context.device_target=Ascend", "hardware.device=Ascend910A")
    with pytest.raises(RecipeError) as err:
        load_recipe(TINY_RECIPE, (*on_910a, "model.model_config.compute_dtype=bfloat16",
                                  "model.model_config.use_flash_attention=True",
                                  "model.model_config.fused_rms_norm=True"))
    text = str(err.value)
    assert "model.model_config.compute_dtype: bfloat16 has no kernels on the 910A (hardware.device Ascend910A)" in text
    assert "model.model_config.use_flash_attention: FlashAttentionScore is not available on the 910A" in text
    assert "model.model_config.fused_rms_norm: MindFormers does not use the RmsNorm kernel on the 910A" in text
    with pytest.raises(RecipeError, match=r"runner_wrapper\.scale_sense: 1\.0 \(no loss scaling\) with "
                                          r"model\.model_config\.compute_dtype float16"):
        load_recipe(TINY_RECIPE, (*on_910a, "model.model_config.compute_dtype=float16"))
    load_recipe(TINY_RECIPE, (*on_910a, "model.model_config.compute_dtype=float16",
                              "runner_wrapper.scale_sense={type: DynamicLossScaleUpdateCell}"))
    load_recipe(TINY_RECIPE, ("model.model_config.compute_dtype=float16",))  # CPU: float16 trains without scaling
    with pytest.raises(RecipeError, match=r"hardware\.device: 'Ascend910C' is not a device of "
                                          r"training/tools/devices\.py's table; use one of .*Ascend910A"):
        load_recipe(TINY_RECIPE, ("hardware.device=Ascend910C",))


def test_910a_recipe_is_float16_with_dynamic_loss_scaling_and_fits_with_headroom():
    from ascend_llm_recipes.training.tools.devices import DEVICES, GB
    from ascend_llm_recipes.training.recipe.device import FIRST_GENERATION_910
    from ascend_llm_recipes.training.recipe.schema import DynamicLossScaleConfig

    assert all(not DEVICES[name].bf16 and DEVICES[name].memory_bytes == 32 * GB for name in FIRST_GENERATION_910)
    recipe = load_recipe(os.path.join(REPO_ROOT, "recipes", "llama2_7b_910a_16dev.yaml"))
    cfg, scale = recipe.model.model_config, recipe.runner_wrapper.scale_sense
    assert recipe.hardware.device in FIRST_GENERATION_910 and cfg.compute_dtype == "float16"
    assert isinstance(scale, DynamicLossScaleConfig)
    assert (scale.loss_scale_value, scale.scale_factor, scale.scale_window) == (65536.0, 2, 1000)
    assert not cfg.use_flash_attention and not cfg.fused_rms_norm
    assert recipe.context.ascend_config.precision_mode == "must_keep_origin_dtype"
    p = plan(recipe)
    assert p.device == "Ascend910A" and p.device_memory_bytes == 28 * GB
    assert p.fits and p.headroom_bytes >= 0.10 * p.device_memory_bytes


def test_16bit_weights_need_the_optimizer_that_keeps_float32_masters():
    """MindFormers' AdamW rounds each update into the 16-bit weight: refused, naming both keys."""
    with pytest.raises(RecipeError, match=r"optimizer.type: AdamW keeps no float32 master copy of the float16 "
                                          r"weights \(model.model_config.param_dtype\)"):
        load_recipe(TINY_RECIPE, ("model.model_config.compute_dtype=float16", "model.model_config.param_dtype=float16",
                                  "optimizer.type=AdamW"))
    load_recipe(TINY_RECIPE, ("model.model_config.compute_dtype=float16", "model.model_config.param_dtype=float16"))


def test_flash_attention_needs_16_bit_inputs_and_heads_it_takes():
    ascend = ("context.device_target=Ascend", "model.model_config.use_flash_attention=True")
    mc = "model.model_config."
    with pytest.raises(RecipeError, match=re.escape(f"{mc}use_flash_attention: FlashAttentionScore takes float16 or "
                                                    "bfloat16 inputs")):
        load_recipe(TINY_RECIPE, (*ascend, mc + "compute_dtype=float32"), planning=True)
    with pytest.raises(RecipeError, match=re.escape(f"{mc}use_flash_attention: the head is 600 wide")):
        load_recipe(TINY_RECIPE, (*ascend, mc + "compute_dtype=bfloat16", mc + "head_dim=600"), planning=True)
    assert load_recipe(TINY_RECIPE, (*ascend, mc + "compute_dtype=bfloat16"), planning=True)


# D8 (issue 39): a key that applies to one kind of model only is refused on another kind, every such key the same way.
ONLY_KIND_MESSAGE = {"moe": "num_experts is 0 (a dense model)", "mla": "kv_lora_rank is not (multi-head latent "
                     "attention is off)", "mha": "kv_lora_rank is set (multi-head latent attention)"}
ONLY_KIND_BASE = {"moe": TINY_RECIPE, "mla": TINY_RECIPE, "mha": os.path.join(REPO_ROOT, "recipes",
                                                                             "tiny_deepseek_cpu.yaml")}


def other_value(f: dataclasses.Field) -> str:
    """A value of field `f` other than its default that its own range rules accept, written for --set."""
    default = f.default_factory() if f.default is dataclasses.MISSING else f.default
    annotation = typing.get_type_hints(ModelConfig)[f.name]
    if typing.get_origin(annotation) is typing.Literal:
        return next(c for c in typing.get_args(annotation) if c != default)
    if isinstance(default, bool):
        return str(not default)
    if isinstance(default, list):
        return "[0]"
    if default is None:
        return "16"
    return str(default + (0.5 if isinstance(default, float) else 1))


@pytest.mark.parametrize("override", ["router_score=sigmoid", "router_aux_loss_coef=0.01", "router_z_loss_coef=0.001",
                                      "num_experts_per_tok=1", "norm_topk_prob=False", "n_group=2", "topk_group=2",
                                      "routed_scaling_factor=2.5", "token_drop_policy=position",
                                      "moe_intermediate_size=32", "expert_bias=True", "capacity_factor=1.5"])
def test_a_dense_recipe_refuses_every_moe_key_the_same_way(override):
    mc = "model.model_config."
    key = override.split("=")[0]
    with pytest.raises(RecipeError, match=re.escape(f"{mc}{key}: is set, but {mc}num_experts is 0 (a dense model); "
                                                    "remove the key")):
        load_recipe(TINY_RECIPE, (mc + override,))


def test_every_key_of_one_kind_of_model_is_refused_on_another_kind():
    """Walks every ModelConfig field marked only(): a value other than its default is refused on a model of another
    kind, naming the key and what makes the model of another kind; the default itself is accepted."""
    mc = "model.model_config."
    marked = {kind: [f for f in dataclasses.fields(ModelConfig) if f.metadata.get("only") == kind]
              for kind in ONLY_KIND_MESSAGE}
    assert all(marked.values()), marked
    for kind, fields in marked.items():
        for f in fields:
            default = f.default_factory() if f.default is dataclasses.MISSING else f.default
            with pytest.raises(RecipeError) as info:
                load_recipe(ONLY_KIND_BASE[kind], (f"{mc}{f.name}={other_value(f)}",))
            assert info.value.problems == [f"{mc}{f.name}: is set, but {mc}{ONLY_KIND_MESSAGE[kind]}; remove the key "
                                           f"(its default is {default!r})"]
            load_recipe(ONLY_KIND_BASE[kind], (f"{mc}{f.name}={'null' if default is None else default}",))


def config_fields_read(module: str) -> set:
    """The ModelConfig fields that models/<module>.py reads as an attribute."""
    with open(os.path.join(REPO_ROOT, "models", f"{module}.py"), encoding="utf-8") as f:
        tree = ast.parse(f.read())
    names = {f.name for f in dataclasses.fields(ModelConfig)}
    return {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute) and n.attr in names}


def test_a_key_only_the_expert_or_latent_attention_cells_read_is_marked_as_theirs():
    """A new field that models/moe.py (or models/mla.py) reads and the dense decoder's modules do not is marked
    only(MOE) (only(MLA)), so that a model of another kind refuses it rather than ignoring it."""
    marks = {f.name: f.metadata.get("only") for f in dataclasses.fields(ModelConfig)}
    dense = config_fields_read("llama") | config_fields_read("layers")
    moe_only = config_fields_read("moe") - dense - config_fields_read("mla") - {"num_experts"}
    mla_only = config_fields_read("mla") - dense - config_fields_read("moe") - {"kv_lora_rank"}
    assert moe_only and mla_only
    assert {name: marks[name] for name in moe_only if marks[name] != "moe"} == {}
    assert {name: marks[name] for name in mla_only if marks[name] != "mla"} == {}
