"""Imports run one way (common <- models, data <- training <- scripts), data/ reads no recipe, and one package
root is installed."""

import ast
import configparser
import importlib.metadata
import os

import pytest

from conftest import REPO_ROOT

ROOT = "ascend_llm_recipes"
# folder -> the packages of ours it must not import
FORBIDDEN = {"common": (f"{ROOT}.models", f"{ROOT}.data", f"{ROOT}.training"),
             "models": (f"{ROOT}.training",), "data": (f"{ROOT}.training",)}


def imported_modules(path: str, package: str) -> list:
    """(line, absolute module name) of every import in a file, relative imports resolved against `package`."""
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), filename=path)
    found = []
    for node in ast.walk(tree):  # function-level imports count as much as top-level ones
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module
            # `from ascend_llm_recipes import training` names the package in the imported names
            found += [(node.lineno, f"{module}.{alias.name}") for alias in node.names]
    return found


def layering_violations(repo: str) -> list:
    """'file:line imports X' for every import against the layering in FORBIDDEN."""
    problems = []
    for folder, forbidden in FORBIDDEN.items():
        for directory, _, files in os.walk(os.path.join(repo, folder)):
            for name in sorted(files):
                if not name.endswith(".py"):
                    continue
                path = os.path.join(directory, name)
                package = ".".join([ROOT] + os.path.relpath(directory, repo).split(os.sep))
                for line, module in imported_modules(path, package):
                    if any(module == f or module.startswith(f + ".") for f in forbidden):
                        problems.append(f"{os.path.relpath(path, repo)}:{line} imports {module}")
    return problems


def test_models_data_and_common_do_not_import_upwards():
    assert layering_violations(REPO_ROOT) == []


@pytest.mark.parametrize("folder, statement", [
    ("models", "from ascend_llm_recipes.training.recipe.loading import load_recipe"),
    ("data", "def f():\n    from ..training import errors\n"),
    ("common", "import ascend_llm_recipes.models.arithmetic"),
])
def test_an_upward_import_is_caught(tmp_path, folder, statement):
    for name in FORBIDDEN:
        os.makedirs(tmp_path / name)
    (tmp_path / folder / "bad.py").write_text(statement + "\n")
    problems = layering_violations(str(tmp_path))
    assert len(problems) == 1 and problems[0].startswith(f"{folder}/bad.py:"), problems


# What reading a recipe looks like: a name for the recipe, or a section only a recipe has. data/ takes plain
# inputs (data/loader.py LoaderSpec) that training builds, so none of these may appear there.
RECIPE_NAMES = ("recipe", "rcp")
RECIPE_SECTIONS = ("runner_config", "runner_wrapper", "lr_schedule", "train_dataset", "train_dataset_task",
                   "parallel_config", "recompute_config", "data_preparation", "eval_dataset", "checkpointing",
                   "global_batch_size", "use_parallel")


def recipe_reads(repo: str, folder: str = "data") -> list:
    """'file:line reads X' for every recipe name (a variable or parameter) and recipe section used in `folder`."""
    problems = []
    for directory, _, files in os.walk(os.path.join(repo, folder)):
        for name in sorted(files):
            if not name.endswith(".py"):
                continue
            path = os.path.join(directory, name)
            with open(path, encoding="utf-8") as f:
                tree = ast.parse(f.read(), filename=path)
            for node in ast.walk(tree):
                read = (node.id if isinstance(node, ast.Name) and node.id in RECIPE_NAMES else
                        node.arg if isinstance(node, ast.arg) and node.arg in RECIPE_NAMES else
                        node.attr if isinstance(node, ast.Attribute) and node.attr in RECIPE_SECTIONS else None)
                if read:
                    problems.append(f"{os.path.relpath(path, repo)}:{node.lineno} reads {read}")
    return problems


def test_data_reads_no_recipe():
    assert recipe_reads(REPO_ROOT) == []


def test_the_recipe_sections_named_are_the_recipes():
    import dataclasses

    from ascend_llm_recipes.training.recipe.schema import Recipe

    names = {f.name for f in dataclasses.fields(Recipe)} | {n for n in dir(Recipe) if not n.startswith("_")}
    assert set(RECIPE_SECTIONS) <= names, set(RECIPE_SECTIONS) - names


@pytest.mark.parametrize("statement", [
    "def batches(recipe):\n    return 1\n",
    "def batches(spec):\n    return spec.runner_config.batch_size\n",
    "from x import y\nsize = y().parallel_config\n",
])
def test_a_recipe_read_in_data_is_caught(tmp_path, statement):
    os.makedirs(tmp_path / "data")
    (tmp_path / "data" / "bad.py").write_text(statement)
    problems = recipe_reads(str(tmp_path))
    assert len(problems) == 1 and problems[0].startswith("data/bad.py:"), problems


def test_one_top_level_package_installed():
    top_level = importlib.metadata.distribution("ascend-llm-recipes").read_text("top_level.txt")
    assert top_level is not None and top_level.split() == [ROOT]


def test_setup_cfg_installs_everything_under_the_root():
    config = configparser.ConfigParser()
    config.read(os.path.join(REPO_ROOT, "setup.cfg"))
    packages = config["options"]["packages"].replace(",", " ").split()
    assert packages and all(p.startswith(ROOT + ".") for p in packages), packages
    # a sub-folder left out of the list is left out of a non-editable install
    folders = {".".join([ROOT] + os.path.relpath(directory, REPO_ROOT).split(os.sep))
               for folder in FORBIDDEN.keys() | {"training"}
               for directory, _, files in os.walk(os.path.join(REPO_ROOT, folder)) if "__init__.py" in files}
    assert folders == set(packages), f"setup.cfg [options] packages: missing {sorted(folders - set(packages))}"
