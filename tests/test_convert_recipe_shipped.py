"""`scripts/convert_recipe.py --to-mindformers` on every shipped recipe: it exports and imports back to the same recipe,
or it is refused by rows of the one table of refusals (training/recipe/mindformers_mcore_export.py REFUSALS)."""

import dataclasses
import os
import subprocess
import sys

import pytest
import yaml

from conftest import REPO_ROOT
from ascend_llm_recipes.common.errors import RecipeError
from ascend_llm_recipes.training.recipe.loading import load_recipe
from ascend_llm_recipes.training.recipe.mindformers import to_mindformers
from ascend_llm_recipes.training.recipe.mindformers_mcore_export import REFUSALS, mcore_family, refusals
from test_convert_recipe_mcore import import_to, mindformers_transformer_config

RECIPES = os.path.join(REPO_ROOT, "recipes")
SHIPPED = sorted(name for name in os.listdir(RECIPES) if name.endswith(".yaml"))
M = "model.model_config."
# The shipped recipes MindFormers 1.9's own classes cannot train as written, by the REFUSALS rows that say why.
REFUSED = {
    "dense_100b_64dev.yaml": ["parallel_config.stage_layers"],  # uneven stages: a legacy offset, not imported back
    "mixtral_8x7b_64dev.yaml": [M + "qk_norm"],                 # no MindFormers class for MoE without q/k norms
    "tiny_deepseek_cpu.yaml": [M + "topk_group"],               # groups scored by their best 2 // 2 = 1 expert
    "tiny_moe_ascend.yaml": [M + "dense_layers"],               # Qwen3-MoE gives every layer experts
    "tiny_moe_cpu.yaml": [M + "router_z_loss_coef", M + "dense_layers"],  # and no router z-loss
}


def same_model(cfg):
    """The model_config with num_kv_heads as the model reads it (None: one key/value head per query head)."""
    return dataclasses.replace(cfg, num_kv_heads=cfg.kv_heads)


def test_every_row_of_the_refusal_table_names_a_recipe_key():
    recipe = load_recipe(os.path.join(RECIPES, "tiny_cpu.yaml"), planning=True)
    for row in REFUSALS:
        section, _, key = row.key.rpartition(".")
        assert hasattr(recipe.model.model_config if section == M[:-1] else getattr(recipe, section), key), row.key
    assert set(REFUSED) <= set(SHIPPED)


@pytest.mark.parametrize("name", SHIPPED)
def test_every_shipped_recipe_exports_and_imports_back_or_is_refused_by_the_table(name, tmp_path):
    path = os.path.join(RECIPES, name)
    recipe = load_recipe(path, planning=True)
    if name in REFUSED:
        with pytest.raises(RecipeError) as err:
            to_mindformers(path)
        assert [problem.split(": ")[0] for problem in err.value.problems] == REFUSED[name]
        assert err.value.problems == refusals(recipe, mcore_family(recipe.model.model_config))
        return
    text, _ = to_mindformers(path)
    exported = tmp_path / f"mf_{name}"
    exported.write_text(text)
    back, _ = import_to(str(exported), tmp_path, f"back_{os.path.splitext(name)[0]}")
    assert same_model(back.model.model_config) == same_model(recipe.model.model_config)
    assert back.model.arch == recipe.model.arch and back.parallel_config == recipe.parallel_config
    config = yaml.safe_load(text)
    if mcore_family(recipe.model.model_config) == "deepseek_v3":  # its fused-norm switch, as MindFormers reads it
        tc, _ = mindformers_transformer_config(config)
        assert tc.fused_norm is recipe.model.model_config.fused_rms_norm


def test_the_issues_command_names_the_refused_keys_and_why(tmp_path):
    """Issue 39 D9: --to-mindformers recipes/tiny_moe_cpu.yaml: exit 2, each key with the MindFormers 1.9 source."""
    done = subprocess.run([sys.executable, os.path.join(REPO_ROOT, "scripts", "convert_recipe.py"), "--to-mindformers",
                           os.path.join(RECIPES, "tiny_moe_cpu.yaml"), "--output", str(tmp_path / "mf.yaml")],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and not (tmp_path / "mf.yaml").exists()
    assert "model.model_config.router_z_loss_coef: 0.001: MindFormers 1.9's training graph has no router z-loss: " \
           "TransformerConfig keeps moe_z_loss_coeff (parallel_core/transformer_config.py:1787" in done.stderr
    assert "model.model_config.dense_layers: [0]: MindFormers' Qwen3-MoE gives every layer experts" in done.stderr
    assert "set dense_layers: [] for a model MindFormers' Qwen3-MoE builds" in done.stderr
