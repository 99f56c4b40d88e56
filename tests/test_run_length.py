"""How long a run is: stop_step against the data, a rerun of a finished run, an amended schedule's learning rate,
integer keys MindSpore cannot hold, and checkpoints of other frameworks given to load_checkpoint (issue 39)."""

import dataclasses
import json
import math
import os
import re
import shlex
import shutil
import typing

import pytest

from conftest import TINY_RECIPE, tiny_corpus_files
from ascend_llm_recipes.common.errors import DataError, LaunchError, RecipeError
from ascend_llm_recipes.training.launcher.cli import main
from ascend_llm_recipes.training.recipe.loading import load_recipe

SMALL_BATCH = 8  # the small dataset's 50 samples hold 6 global batches of 8


@pytest.fixture(scope="module")
def small_data(tmp_path_factory, tiny_dataset):
    """50 samples (one stdlib module) with the tiny dataset's tokenizer: 6 steps of SMALL_BATCH per epoch."""
    from ascend_llm_recipes.data.prepare import prepare_dataset

    out = str(tmp_path_factory.mktemp("small") / "small")
    prepare_dataset(out, 64, inputs=tiny_corpus_files()[:1], tokenizer=os.path.join(tiny_dataset, "tokenizer.model"),
                    show_progress=False, workers=0)
    return out


def small_settings(run_dir, dataset, *extra) -> list:
    return [f"output_dir={run_dir}", f"train_dataset.data_loader.dataset_dir={dataset}",
            f"runner_config.batch_size={SMALL_BATCH}", *extra]


def cli(settings, *flags) -> int:
    return main([TINY_RECIPE, *[a for s in settings for a in ("--set", s)], *flags])


@pytest.fixture(scope="module")
def every_epoch_run(tmp_path_factory, small_data):
    """The tiny recipe run with runner_config.stop_step 0 (every epoch) on the small dataset: 6 steps."""
    run_dir = str(tmp_path_factory.mktemp("runs") / "every_epoch")
    assert cli(small_settings(run_dir, small_data, "runner_config.stop_step=0")) == 0
    return run_dir


# D7: integer keys that MindSpore holds in 32 bits are range-checked at load, every one of them.

def integer_keys(obj, prefix=""):
    """(dotted key, dataclass field) of every integer field (int or Optional[int]) set in the loaded recipe, list items
    by index."""
    if isinstance(obj, list):
        for i, item in enumerate(obj):
            yield from integer_keys(item, f"{prefix}.{i}")
        return
    hints = typing.get_type_hints(type(obj))
    for f in dataclasses.fields(obj):
        value, key = getattr(obj, f.name), f"{prefix}.{f.name}".lstrip(".")
        if dataclasses.is_dataclass(value) or (isinstance(value, list) and any(map(dataclasses.is_dataclass, value))):
            yield from integer_keys(value, key)
        elif hints[f.name] in (int, typing.Optional[int]) and value is not None:
            yield key, f


def test_every_integer_key_past_what_mindspore_holds_is_refused_at_load_naming_it():
    with pytest.raises(RecipeError, match=re.escape("runner_config.stop_step: 99999999999999999999 is out of range: "
                                                    "must be from -2147483648 to 2147483647 (MindSpore holds steps "
                                                    "and sizes as 32-bit integers)")):
        load_recipe(TINY_RECIPE, ("runner_config.stop_step=99999999999999999999",))
    from ascend_llm_recipes.common.schema import INT32_MAX, INT_MAX

    keys = {key: f.metadata.get(INT_MAX, INT32_MAX) for key, f in integer_keys(load_recipe(TINY_RECIPE))}
    assert {"runner_config.stop_step", "runner_config.batch_size", "model.model_config.seq_length",
            "lr_schedule.warmup_steps", "callbacks.1.save_checkpoint_steps", "seed"} <= set(keys)
    for key, largest in keys.items():
        with pytest.raises(RecipeError) as info:
            load_recipe(TINY_RECIPE, (f"{key}={largest + 1}",))
        named = re.sub(r"\.(\d+)", r"[\1]", key)  # callbacks.1.x is set so, and named callbacks[1].x
        assert info.value.problems[0].startswith(f"{named}: {largest + 1} is out of range"), key
    assert keys["seed"] == 2**32 - 1  # MindSpore's dataset seed is unsigned 32-bit
    assert load_recipe(TINY_RECIPE, (f"seed={2**32 - 1}",)).seed == 2**32 - 1
    with pytest.raises(RecipeError, match=r"lr_schedule\.learning_rate: must be a finite number"):
        load_recipe(TINY_RECIPE, ("lr_schedule.learning_rate=1" + "0" * 400,))
