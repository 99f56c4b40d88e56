"""Training reads prepared data: one seeded order on every rank, disjoint per-rank slices, blending by
weight, a resumable position; and a blended recipe trains for real through the launcher."""

import json
import os

import numpy as np
import pytest

from conftest import REPO_ROOT, TINY_RECIPE
from ascend_llm_recipes.common.errors import DataError, RecipeError
from ascend_llm_recipes.data.text.corpus import python_stdlib_files
from ascend_llm_recipes.data.loader import blend_order, build_train_dataset, rank_samples
from ascend_llm_recipes.data.mindrecord_io import read_manifest, read_samples
from ascend_llm_recipes.data.prepare import prepare_dataset
from ascend_llm_recipes.training.launcher.datasets import check_blend
from ascend_llm_recipes.training.launcher.cli import launch
from ascend_llm_recipes.training.recipe.loader_spec import loader_spec
from ascend_llm_recipes.training.recipe.loading import load_recipe
from ascend_llm_recipes.training.recipe.mindformers import data_parallel_layout

DP2_RECIPE = os.path.join(REPO_ROOT, "recipes", "tiny_dp2_cpu.yaml")


@pytest.fixture(scope="module")
def second_dataset(tmp_path_factory, tiny_dataset):
    """Other stdlib modules, same tokenizer and seq_length as the tiny dataset: blendable with it."""
    out = str(tmp_path_factory.mktemp("blend") / "more")
    prepare_dataset(out, 64, inputs=[str(p) for p in python_stdlib_files()[60:90]],
                    tokenizer=os.path.join(tiny_dataset, "tokenizer.model"), show_progress=False, workers=0)
    return out


def recipe(path, dataset, *overrides):
    return load_recipe(path, (f"train_dataset.data_loader.dataset_dir={dataset}", *overrides))


def batches(rcp, rank, count, start_step=0):
    data = build_train_dataset(loader_spec(rcp, rank), start_step).create_tuple_iterator(output_numpy=True)
    return [next(data)[0] for _ in range(count)]


def test_blend_keeps_every_prefix_in_proportion_and_cycles_small_datasets():
    dataset, sample = blend_order([50, 400], [3.0, 1.0], seed=7, passes=1, shuffle=True)
    assert len(dataset) == 450
    for n in (10, 100, 451 - 1):
        assert abs((dataset[:n] == 0).sum() - 0.75 * n) <= 1
    small = sample[dataset == 0]  # 337 draws from 50 samples: whole cycles, each a fresh permutation
    cycles = [small[i:i + 50] for i in range(0, 300, 50)]
    assert all(sorted(c) == list(range(50)) for c in cycles)
    assert not all((c == cycles[0]).all() for c in cycles[1:])
    again, same = blend_order([50, 400], [3.0, 1.0], seed=7, passes=1, shuffle=True)
    other = blend_order([50, 400], [3.0, 1.0], seed=8, passes=1, shuffle=True)[1]
    assert (again == dataset).all() and (same == sample).all() and not (other == sample).all()
    _, ordered = blend_order([5], [1.0], seed=0, passes=2, shuffle=False)
    assert ordered.tolist() == list(range(5)) * 2


def test_ranks_read_disjoint_slices_that_make_up_the_global_batch(tiny_dataset):
    one, two = recipe(TINY_RECIPE, tiny_dataset), recipe(DP2_RECIPE, tiny_dataset)
    assert data_parallel_layout(two, 1) == (1, 2, 2)
    _, order0, _ = rank_samples(loader_spec(two, 0))
    _, order1, _ = rank_samples(loader_spec(two, 1))
    _, single, _ = rank_samples(loader_spec(one, 0))
    assert not set(order0.tolist()) & set(order1.tolist())
    assert len(order0) == len(order1) == len(single) // 2
    # Step by step, the two ranks' batches are exactly the single process's batch: the same seeded order.
    assert (np.stack([order0.reshape(-1, 2), order1.reshape(-1, 2)], 1).reshape(-1) == single).all()
    assert sorted(single.tolist()) == list(range(len(single)))  # one pass: every sample once (shuffled)
    assert single[:20].tolist() != list(range(20))
    got0, got1, whole = batches(two, 0, 3), batches(two, 1, 3), batches(one, 0, 3)
    for a, b, w in zip(got0, got1, whole):
        assert a.shape == b.shape == (2, 65) and (np.concatenate([a, b]) == w).all()


def test_the_position_is_all_a_resumed_run_needs(tiny_dataset):
    rcp = recipe(TINY_RECIPE, tiny_dataset)
    full = batches(rcp, 0, 5)
    resumed = batches(rcp, 0, 2, start_step=3)
    assert (resumed[0] == full[3]).all() and (resumed[1] == full[4]).all()


def test_each_epoch_has_its_own_shuffle_and_all_are_read(tiny_dataset):
    rcp = recipe(TINY_RECIPE, tiny_dataset, "runner_config.epochs=3")
    _, order, batch = rank_samples(loader_spec(rcp, 0))
    first, second, third = np.split(order, 3)
    assert sorted(first.tolist()) == sorted(second.tolist()) and (first != second).any()
    data = build_train_dataset(loader_spec(rcp, 0))  # longer than the dataset: read as consecutive segments
    assert data.get_dataset_size() == len(order) // batch
    rows = np.stack(list(read_samples(tiny_dataset, read_manifest(tiny_dataset))))
    got = np.concatenate([b for (b,) in data.create_tuple_iterator(output_numpy=True)])
    assert (got == rows[order]).all()
    data.set_init_step(len(first) // batch + 1)  # how MindFormers skips ahead on resume: into the second pass
    skipped = next(data.create_tuple_iterator(output_numpy=True, num_epochs=1))[0]
    assert (skipped == rows[second[batch:2 * batch]]).all()


@pytest.mark.parametrize("name", ["llama2_7b_8dev", "dense_100b_64dev"])
def test_ascend_layouts_shard_data_like_mindformers(name):
    rcp = load_recipe(os.path.join(REPO_ROOT, "recipes", f"{name}.yaml"), planning=True)
    p = rcp.parallel_config
    dp, mp, pp = p.data_parallel, p.model_parallel, p.pipeline_stage
    assert rcp.parallel.parallel_mode == 1 and rcp.parallel.full_batch  # semi-auto (7B: DP8 TP1, 100B: TP4 PP2)
    # MindFormers sets full_batch in semi-auto parallel (trainer/base_trainer.py:904,924): every rank reads
    # the whole global batch and the graph slices it (tests/test_ascend_path.py checks the samples).
    layouts = [data_parallel_layout(rcp, rank) for rank in range(dp * mp * pp)]
    assert set(layouts) == {(0, 1, rcp.global_batch_size)}


def test_blend_recipe_keys_are_checked(tiny_dataset, second_dataset, tmp_path):
    with pytest.raises(RecipeError, match=r"train_dataset\.blend\[1\]\.weight: must be > 0(?s:.*)"
                                          r"train_dataset\.blend: does not list train_dataset\.data_loader"):
        recipe(TINY_RECIPE, "elsewhere", f"train_dataset.blend=[{{dataset_dir: {tiny_dataset}}}, "
                                         f"{{dataset_dir: {second_dataset}, weight: 0}}]")
    other = str(tmp_path / "other")
    with pytest.raises(DataError, match=r"a tokenizer of 256 pieces cannot be trained on --input .*: sentencepiece "
                                        r"needs (\d+) pieces(?s:.*)raise --vocab-size to at least \d+"):
        prepare_dataset(other, 64, 256, inputs=[str(p) for p in python_stdlib_files()[:30]], show_progress=False)
    assert not os.path.exists(other + ".partial")
    prepare_dataset(other, 64, 512, inputs=[str(p) for p in python_stdlib_files()[:30]], show_progress=False)
    mixed = recipe(TINY_RECIPE, tiny_dataset, f"train_dataset.blend=[{{dataset_dir: {tiny_dataset}}}, "
                                              f"{{dataset_dir: {other}}}]")
    with pytest.raises(DataError, match=r"train_dataset\.blend\[1\]\.dataset_dir: .*other has another tokenizer "
                                        r"sha256"):
        check_blend(mixed)
    missing = recipe(TINY_RECIPE, tiny_dataset, f"train_dataset.blend=[{{dataset_dir: {tiny_dataset}}}, "
                                                f"{{dataset_dir: {tmp_path / 'none'}}}]")
    with pytest.raises(DataError, match=r"train_dataset\.blend\[1\]\.dataset_dir: dataset .*none: directory "
                                        r"does not exist"):
        check_blend(missing)


def test_blended_recipe_trains(tmp_path, tiny_dataset, second_dataset):
    run_dir = str(tmp_path / "run")
    blend = f"train_dataset.blend=[{{dataset_dir: {tiny_dataset}, weight: 0.7}}, " \
            f"{{dataset_dir: {second_dataset}, weight: 0.3}}]"
    code = launch(TINY_RECIPE, [f"output_dir={run_dir}", f"train_dataset.data_loader.dataset_dir={tiny_dataset}",
                                blend, "runner_config.stop_step=8"], show_progress=False)
    assert code == 0
    with open(os.path.join(run_dir, "metrics.jsonl"), encoding="utf-8") as f:
        losses = [json.loads(line)["loss"] for line in f if "val_loss" not in line]
    assert len(losses) == 8 and losses[-1] < losses[0]
    with open(os.path.join(run_dir, "recipe.yaml"), encoding="utf-8") as f:
        assert f"dataset_dir: {os.path.abspath(second_dataset)}" in f.read()
    with open(os.path.join(run_dir, "summary.json"), encoding="utf-8") as f:
        members = json.load(f)["blend"]  # what the launcher printed: each member's expected repeats per pass
    assert [m["dataset_dir"] for m in members] == [os.path.realpath(tiny_dataset), os.path.realpath(second_dataset)]
    assert [m["share"] for m in members] == [0.7, 0.3] and all(m["repeats_per_pass"] > 0 for m in members)


def test_skips_remove_positions_and_a_second_rollback_maps_through_the_first(tiny_dataset):
    from ascend_llm_recipes.data.loader import kept_positions, next_samples, skip_range, training_order

    assert kept_positions(10, [(2, 4), (7, 8)]).tolist() == [0, 1, 4, 5, 6, 8, 9]
    assert skip_range(40, [], 3, 3, 4) == [[8, 12]]  # step 3 reads positions 8..11
    # With [8, 12) already gone, steps 3-4 read positions 12..19; across a gap the range splits.
    assert skip_range(40, [(8, 12)], 3, 4, 4) == [[12, 20]]
    assert skip_range(40, [(8, 12)], 2, 3, 4) == [[4, 8], [12, 16]]
    rcp = recipe(TINY_RECIPE, tiny_dataset)
    _, order = training_order(loader_spec(rcp))
    _, skipped = training_order(loader_spec(rcp, skips=[(8, 12)]))
    assert (skipped == np.delete(order, range(8, 12))).all()
    same = next_samples(loader_spec(rcp), 8)
    other_seed = next_samples(loader_spec(recipe(TINY_RECIPE, tiny_dataset, "seed=3")), 8)
    assert same["first_ids"] == order[8:12].tolist() and same["sha256"] != other_seed["sha256"]
    assert next_samples(loader_spec(rcp, skips=[(8, 12)]), 8)["first_ids"][:4] == order[12:16].tolist()
