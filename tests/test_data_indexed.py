"""Megatron indexed corpora (.bin + .idx written by megatron-core's own IndexedDatasetBuilder) packed into our
MindRecord without re-tokenizing: the token stream is the .bin's in document order with one EOD per document,
several tasks write the same bytes as one, --weights blend by samples, and bad files are named."""

import os
import shutil
import struct

import numpy as np
import pytest

from conftest import TINY_RECIPE, load_script
from ascend_llm_recipes.common.errors import DataError
from ascend_llm_recipes.data.text.corpus import python_stdlib_files
from ascend_llm_recipes.data.indexed.prepare import IndexedOptions, prepare_indexed
from ascend_llm_recipes.data.loader import build_train_dataset
from ascend_llm_recipes.data.mindrecord_io import partial_dir, read_manifest, read_samples, verify_files
from ascend_llm_recipes.data.packing import StreamPacker
from ascend_llm_recipes.data.prepare import check_dataset
from ascend_llm_recipes.data.tokenizer import EOD_ID, PAD_ID, load_tokenizer
from ascend_llm_recipes.training.launcher.datasets import check_datasets
from ascend_llm_recipes.training.recipe.loader_spec import loader_spec
from ascend_llm_recipes.training.recipe.loading import load_recipe

torch = pytest.importorskip("torch")
indexed_dataset = pytest.importorskip("megatron.core.datasets.indexed_dataset",
                                      reason="megatron-core (a test dependency) writes the fixtures")
SEQ = 64


@pytest.fixture(scope="module")
def corpora(tmp_path_factory, tiny_dataset):
    """Two corpora tokenized with the tiny dataset's tokenizer, as Megatron's tools write them:
    `web` (uint16) one sequence per document, every other one ending with EOD (preprocess_data.py --append-eod),
    one empty document; `code` (int32) documents of several sequences (preprocess_data.py --split-sentences)."""
    root = tmp_path_factory.mktemp("indexed")
    tokenizer = os.path.join(tiny_dataset, "tokenizer.model")
    sp = load_tokenizer(tokenizer)
    texts = [f.read_text(encoding="utf-8")[:3000] for f in python_stdlib_files()[200:236]]
    web = indexed_dataset.IndexedDatasetBuilder(str(root / "web.bin"), dtype=np.uint16)
    for k, text in enumerate(texts[:18]):
        ids = sp.encode_batch([text])[0] + ([EOD_ID] if k % 2 else [])
        web.add_document(torch.tensor(ids), [len(ids)])
        if k == 5:
            web.add_document(torch.tensor([], dtype=torch.int64), [0])
    web.finalize(str(root / "web.idx"))
    code = indexed_dataset.IndexedDatasetBuilder(str(root / "code.bin"), dtype=np.int32)
    for text in texts[18:]:
        for paragraph in [p for p in text.split("\n\n") if p.strip()][:4]:
            code.add_item(torch.tensor(sp.encode_batch([paragraph])[0]))
        code.end_document()
    code.finalize(str(root / "code.idx"))
    return root, tokenizer


def megatron_documents(prefix):
    """Each document's tokens as megatron-core's own reader returns them (sequences of a document joined)."""
    data = indexed_dataset.IndexedDataset(str(prefix))
    bounds = data.document_indices
    return [np.concatenate([data[i] for i in range(bounds[d], bounds[d + 1])] or [np.zeros(0, np.int64)])
            .astype(np.int32) for d in range(len(bounds) - 1)]


def expected_stream(*prefixes):
    """Documents in order, empty ones skipped, each followed by one EOD unless it already ends with it."""
    parts = []
    for prefix in prefixes:
        for doc in megatron_documents(prefix):
            if len(doc):
                parts.append(doc if doc[-1] == EOD_ID else np.append(doc, np.int32(EOD_ID)))
    return np.concatenate(parts)


def packed_rows(stream, pad=PAD_ID):
    packer = StreamPacker(SEQ, pad, "pad")
    rows = np.concatenate([packer.add(stream, np.array([len(stream)])), packer.finish()])
    return rows, packer.stats


def samples(dataset_dir):
    return np.stack(list(read_samples(dataset_dir, read_manifest(dataset_dir))))


def shard_bytes(dataset_dir):
    return [open(os.path.join(dataset_dir, s["file"]), "rb").read() for s in read_manifest(dataset_dir)["shards"]]


def options(root, tokenizer, **kwargs):
    return IndexedOptions(prefixes=(str(root / "web"), str(root / "code")), seq_length=SEQ, tokenizer=tokenizer,
                          samples_per_shard=32, **kwargs)


@pytest.fixture(scope="module")
def one_task(corpora):
    root, tokenizer = corpora
    return prepare_indexed(str(root / "one"), options(root, tokenizer))


def test_the_packed_stream_is_the_bin_read_in_document_order_with_one_eod_each(corpora, one_task):
    root, _ = corpora
    stream = expected_stream(root / "web", root / "code")
    rows, stats = packed_rows(stream)
    assert np.array_equal(samples(str(root / "one")), rows)  # the text path's packer on the .bin's tokens
    manifest = one_task
    assert (manifest["samples"], manifest["tokens"], manifest["padding_tokens"]) == \
        (stats.samples, stats.tokens, stats.padding_tokens)
    web_docs = megatron_documents(root / "web")
    assert manifest["documents"]["read"] == len(web_docs) + len(megatron_documents(root / "code"))
    assert manifest["documents"]["empty"] == 1 and manifest["documents"]["ended_with_eod"] == 9
    assert int((stream == EOD_ID).sum()) == manifest["documents"]["kept"]  # exactly one EOD per document
    formats = [i["format"] for i in manifest["inputs"]["list"]]
    assert formats == ["megatron_indexed (uint16)", "megatron_indexed (int32)"]
    assert manifest["tokenizer"]["file"] == "tokenizer.model" and manifest["sample_length"] == SEQ + 1
    verify_files(str(root / "one"), manifest)
    # What the launcher asks of a dataset for the tiny recipe (seq 64, vocabulary 512, pad 3, EOD 2), and the
    # first batch training reads (no shuffle: the first samples).
    check_dataset(str(root / "one"), SEQ, 512, PAD_ID, EOD_ID)
    recipe = load_recipe(TINY_RECIPE, (f"train_dataset.data_loader.dataset_dir={root / 'one'}",
                                       "train_dataset.data_loader.shuffle=False"))
    assert check_datasets(recipe)["manifest"]["run_fingerprint"] == manifest["run_fingerprint"]
    batch = next(build_train_dataset(loader_spec(recipe, 0)).create_tuple_iterator(output_numpy=True))[0]
    assert np.array_equal(batch, rows[:recipe.runner_config.batch_size])
    assert not os.path.exists(partial_dir(str(root / "one")))


def test_several_tasks_write_the_single_process_bytes_validation_split_included(corpora, one_task, tmp_path):
    pytest.importorskip("datatrove", reason="datatrove is not installed: pip install -e .[scale]")
    root, tokenizer = corpora
    one = prepare_indexed(str(tmp_path / "one"), options(root, tokenizer, val_fraction=0.2))
    three = prepare_indexed(str(tmp_path / "three"), options(root, tokenizer, val_fraction=0.2), tasks=3, workers=2)
    assert shard_bytes(str(tmp_path / "three")) == shard_bytes(str(tmp_path / "one"))
    assert shard_bytes(str(tmp_path / "three-val")) == shard_bytes(str(tmp_path / "one-val"))
    assert three["shards"] == one["shards"]
    assert {**three["validation"], "dataset_dir": "-"} == {**one["validation"], "dataset_dir": "-"}
    assert len(three["shards"]) >= 3 and one["validation"]["documents"] > 0
    # Held-out and training documents together are the whole corpus, each once.
    train, val = samples(str(tmp_path / "one")), samples(str(tmp_path / "one-val"))
    eods = int((train[0] == EOD_ID).sum() + (train[1:, 1:] == EOD_ID).sum() + (val[0] == EOD_ID).sum()
               + (val[1:, 1:] == EOD_ID).sum())
    assert eods == one_task["documents"]["kept"]


def test_weights_blend_samples_of_each_corpus_in_proportion(corpora, tmp_path):
    root, tokenizer = corpora
    manifest = prepare_indexed(str(tmp_path / "blend"), options(root, tokenizer, weights=(1.0, 3.0)))
    web_rows, _ = packed_rows(expected_stream(root / "web"))
    code_rows, _ = packed_rows(expected_stream(root / "code"))
    got = samples(str(tmp_path / "blend"))
    assert len(got) == len(web_rows) + len(code_rows) == manifest["samples"]  # one pass
    web = {row.tobytes() for row in web_rows}
    code = {row.tobytes() for row in code_rows}
    source = np.array([0 if row.tobytes() in web else 1 if row.tobytes() in code else -1 for row in got])
    assert (source >= 0).all()  # every sample is a sample of one corpus's own packing, never a mix
    for n in (8, 40, len(got)):  # every leading part of the output holds the weights' shares
        assert abs((source[:n] == 1).sum() - 0.75 * n) <= 1
    blend = manifest["blend"]
    assert [b["drawn"] for b in blend] == [int((source == 0).sum()), int((source == 1).sum())]
    assert blend[1]["repeats"] > 1 > blend[0]["repeats"]  # code is repeated, web thinned
    assert {row.tobytes() for row in got[source == 1]} == code  # every code sample at least once


def idx_bytes(root):
    return (root / "web.idx").read_bytes()


@pytest.mark.parametrize("case, match", [
    ("magic", r"web\.idx: not a Megatron indexed-dataset index \(magic"),
    ("legacy", r"web\.idx: the legacy \(non-mmap\) IndexedDataset format"),
    ("version", r"web\.idx: index version 2, this reader knows version 1"),
    ("float", r"web\.idx: dtype code 7 \(float32\) holds floating-point values"),
    ("dtype", r"web\.idx: unknown dtype code 9"),
    ("short_idx", r"web\.idx: \d+ bytes, but its header .* needs \d+: the file is truncated"),
    ("short_bin", r"web\.bin: [\d,]+ bytes, but .*web\.idx describes [\d,]+ .*the \.bin is truncated"),
    ("no_idx", r"web\.idx does not exist"),
])
def test_damaged_files_are_refused_naming_the_file(corpora, tmp_path, case, match):
    root, tokenizer = corpora
    shutil.copy(root / "web.bin", tmp_path / "web.bin")
    data = bytearray(idx_bytes(root))
    if case == "magic":
        data[:4] = b"JUNK"
    elif case == "legacy":
        data[:9] = b"TNTIDX\x00\x00\x00"
    elif case == "version":
        data[9:17] = struct.pack("<Q", 2)
    elif case in ("float", "dtype"):
        data[17] = 7 if case == "float" else 9
    elif case == "short_idx":
        data = data[:-5]
    elif case == "short_bin":
        with open(tmp_path / "web.bin", "r+b") as f:
            f.truncate(os.path.getsize(tmp_path / "web.bin") - 2)
    if case != "no_idx":
        (tmp_path / "web.idx").write_bytes(bytes(data))
    with pytest.raises(DataError, match=match):
        prepare_indexed(str(tmp_path / "out"), IndexedOptions(prefixes=(str(tmp_path / "web"),), seq_length=SEQ,
                                                              tokenizer=tokenizer))
    assert not os.path.exists(tmp_path / "out") and not os.path.exists(partial_dir(str(tmp_path / "out")))


def test_token_ids_outside_the_vocabulary_are_refused_and_nothing_is_left(corpora, tmp_path):
    root, _ = corpora
    with pytest.raises(DataError, match=r"code\.bin: document \d+ holds token id \d+, outside the vocabulary of 300"):
        prepare_indexed(str(tmp_path / "out"), IndexedOptions(prefixes=(str(root / "code"),), seq_length=SEQ,
                                                              vocab_size=300, eod_id=EOD_ID))
    assert not os.path.exists(tmp_path / "out") and not os.path.exists(partial_dir(str(tmp_path / "out")))


def run_script(capsys, *args):
    code = load_script("prepare_data").main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


def test_command_line_without_a_tokenizer_builds_validates_and_shows_ids(corpora, tmp_path, capsys):
    root, _ = corpora
    out = tmp_path / "ds"
    code, stdout, stderr = run_script(capsys, "--from-megatron-indexed", root / "web", root / "code", "--output", out,
                                      "--seq-length", SEQ, "--vocab-size", 512, "--eod-id", EOD_ID, "--pad-id", PAD_ID)
    assert code == 0, stderr
    assert stdout.startswith(f"dataset {out}: ") and "No tokenizer recorded" in stdout
    assert np.array_equal(samples(str(out)), packed_rows(expected_stream(root / "web", root / "code"))[0])
    code, stdout, stderr = run_script(capsys, "--validate", out, "--recipe", TINY_RECIPE)
    assert code == 0 and "matches recipe" in stdout, stderr
    code, stdout, stderr = run_script(capsys, "--show", out, "--sample", 0)
    row = samples(str(out))[0]
    assert code == 0 and " ".join(map(str, row[:5])) in stdout, stderr
    code, _, stderr = run_script(capsys, "--validate", out, "--recipe", os.path.join(os.path.dirname(TINY_RECIPE),
                                                                                     "demo_cpu.yaml"))
    assert code == 2 and f"--from-megatron-indexed {root / 'web'} {root / 'code'} --output {out}-new " \
                         f"--seq-length 256 --vocab-size" in stderr


@pytest.mark.parametrize("args, match", [
    (["--weights", "1", "2", "3"], "--weights has 3 value"),
    (["--weights", "1", "0"], "every weight must be > 0"),
    (["--near-dedup", "--lines"], "--lines, --near-dedup apply to text input"),
    (["--packing", "best_fit"], "--packing applies to text input"),
    (["--vocab-size", "512"], "--vocab-size comes from --tokenizer"),
])
def test_arguments_that_do_not_apply_are_refused(corpora, tmp_path, capsys, args, match):
    root, tokenizer = corpora
    code, _, stderr = run_script(capsys, "--from-megatron-indexed", root / "web", root / "code", "--tokenizer",
                                 tokenizer, "--output", tmp_path / "ds", "--seq-length", SEQ, *args)
    assert code == 2 and match in stderr and not os.path.exists(tmp_path / "ds")


def test_a_run_stopped_after_its_plan_continues_from_it_to_the_same_bytes(corpora, one_task, tmp_path):
    from ascend_llm_recipes.data.indexed.prepare import IndexedRun, _open_work
    from ascend_llm_recipes.data.indexed.steps import plan, scan

    root, tokenizer = corpora
    out = str(tmp_path / "ds")
    run = IndexedRun(out, options(root, tokenizer))
    _open_work(run)
    scan(run, 0)
    plan(run)  # stopped here: no shard written yet
    planned = os.stat(run.path("plan.json")).st_ino
    with pytest.raises(DataError, match=r"holds an interrupted run with other arguments .*tail 'pad' -> 'drop'"):
        prepare_indexed(out, options(root, tokenizer, tail="drop"))
    assert os.stat(run.path("plan.json")).st_ino == planned
    prepare_indexed(out, options(root, tokenizer))
    assert shard_bytes(out) == shard_bytes(str(root / "one"))
