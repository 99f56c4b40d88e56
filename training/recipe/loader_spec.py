"""The recipe's training data as data/loader.py's plain LoaderSpec: sources, order, this rank's slice.

data/ never reads a recipe (tests/test_layering.py): training builds the spec here, with the rank's
slice from MindFormers' data-sharding rule (training/recipe/mindformers.py data_parallel_layout).
"""

from ascend_llm_recipes.data.loader import LoaderSpec
from ascend_llm_recipes.training.recipe.mindformers import data_parallel_layout
from ascend_llm_recipes.training.recipe.schema import Recipe


def dataset_sources(recipe: Recipe) -> tuple:
    """((dataset_dir, weight, recipe key), ...) the recipe trains on: its blend, else its one dataset."""
    if recipe.train_dataset.blend:
        return tuple((b.dataset_dir, b.weight, f"train_dataset.blend[{i}].dataset_dir")
                     for i, b in enumerate(recipe.train_dataset.blend))
    return ((recipe.dataset_dir, 1.0, "train_dataset.data_loader.dataset_dir"),)


def dataset_dirs(recipe: Recipe) -> list:
    """Every dataset directory the run reads: the training sources, and the held-out set when evaluating."""
    dirs = [d for d, _, _ in dataset_sources(recipe)]
    if recipe.do_eval and recipe.eval_dataset is not None:
        dirs.append(recipe.eval_dataset.data_loader.dataset_dir)
    return dirs


def loader_spec(recipe: Recipe, rank: int = 0, skips=()) -> LoaderSpec:
    """What `rank` reads; `skips` are the blend-order ranges loss-spike rollbacks removed (data_skips.json)."""
    dp_rank, dp_size, batch = data_parallel_layout(recipe, rank)
    data = recipe.train_dataset
    return LoaderSpec(sources=dataset_sources(recipe), seed=recipe.seed,
                      passes=recipe.runner_config.epochs * data.repeat, shuffle=data.data_loader.shuffle,
                      batch=batch, dp_rank=dp_rank, dp_size=dp_size, skips=tuple(tuple(s) for s in skips),
                      seq_length=recipe.model.model_config.seq_length,
                      num_parallel_workers=data.num_parallel_workers, prefetch_size=data.prefetch_size,
                      numa_enable=data.numa_enable)
