"""Data: cleaning, packing, MindRecord round trip, manifest checks, atomic output."""

import json
import os
import re

import numpy as np
import pytest

from conftest import tiny_corpus_files
from oracles import CleanStats, clean_documents, pack_documents, read_documents
from ascend_llm_recipes.common.errors import DataError
from ascend_llm_recipes.data.text.clean import clean_text
from ascend_llm_recipes.data.text.corpus import python_stdlib_files
from ascend_llm_recipes.data.mindrecord_io import MANIFEST, partial_dir, read_manifest, read_samples, verify_files
from ascend_llm_recipes.data.packing import PackStats
from ascend_llm_recipes.data.prepare import check_dataset, prepare_dataset
from ascend_llm_recipes.data.tokenizer import EOD_ID, PAD_ID, load_tokenizer


def test_clean_text_keeps_cjk_and_drops_controls():
    text = "print('你好，世界')\r\n\x1b[31mred\x1b[0m\x00 カタカナ\tx"
    assert clean_text(text) == "print('你好，世界')\nred カタカナ\tx"  # NFC (the default) keeps it as written
    assert clean_text(text, "NFKC") == "print('你好,世界')\nred カタカナ\tx"  # NFKC folds the full-width comma


def test_clean_documents_counts_what_it_drops():
    stats = CleanStats()
    raw = [("a", b"x" * 40), ("b", b"x" * 40), ("c", b"short"), ("d", b"\xff\xfe" + b"y" * 40), ("e", b"z" * 40)]
    kept = list(clean_documents(raw, stats))
    assert kept == ["x" * 40, "z" * 40]
    assert stats.as_dict() == {"read": 5, "kept": 2, "invalid_utf8": 1, "too_short": 1, "too_long": 0,
                               "duplicates": 1, "near_duplicates": 0, "duplicate_ratio": 0.2}


def test_packing_predicts_every_token_once_and_pads_only_the_tail():
    docs = [list(range(10, 30)), list(range(40, 45)), list(range(50, 63))]
    stats = PackStats()
    rows = list(pack_documents(docs, seq_length=16, eod_id=EOD_ID, pad_id=PAD_ID, stats=stats))
    stream = [t for d in docs for t in d + [EOD_ID]]
    assert all(len(r) == 17 for r in rows)
    # Labels (positions 1..S of each row) cover the stream after its first token exactly once.
    labels = [int(t) for r in rows for t in r[1:] if t != PAD_ID]
    assert labels == stream[1:]
    assert stats.tokens == len(stream) == 41 and stats.samples == 3
    assert stats.padding_tokens == 3 * 17 - (41 + 2)  # two tokens are stored twice (row overlaps)
    assert all(PAD_ID not in r for r in rows[:-1])


def test_stdlib_corpus_is_found():
    files = python_stdlib_files()
    assert len(files) > 300
    assert not any("site-packages" in str(f) for f in files)


def test_mindrecord_round_trip(tiny_dataset):
    """text -> samples -> decoded text equals the cleaned documents joined by EOD."""
    manifest = read_manifest(tiny_dataset)
    verify_files(tiny_dataset, manifest)
    assert manifest["seq_length"] == 64 and manifest["sample_length"] == 65
    assert manifest["padding_rate"] < 0.001
    assert manifest["tokenizer"]["vocab_size"] == 512
    samples = list(read_samples(tiny_dataset, manifest))
    assert len(samples) == manifest["samples"] == sum(s["samples"] for s in manifest["shards"])
    assert all(s.dtype == np.int32 and s.shape == (65,) for s in samples)
    stream = list(samples[0]) + [t for s in samples[1:] for t in s[1:]]
    while stream and stream[-1] == PAD_ID:
        stream.pop()
    sp = load_tokenizer(os.path.join(tiny_dataset, "tokenizer.model"))
    pieces, current = [], []
    for token in stream:
        if token == EOD_ID:
            pieces.append(sp.decode(current))
            current = []
        else:
            current.append(int(token))
    stats = CleanStats()
    expected = list(clean_documents(read_documents(tiny_corpus_files()[:60]), stats))
    assert pieces == expected


def test_dataset_must_match_recipe(tiny_dataset):
    check_dataset(tiny_dataset, seq_length=64, vocab_size=512, pad_token_id=3, eos_token_id=2)
    with pytest.raises(DataError, match=r"(?s)built for another model: seq_length 64 \(model\.model_config\."
                                        r"seq_length is 128\).*prepare_data\.py --output NEW_DIR --seq-length 128"):
        check_dataset(tiny_dataset, seq_length=128, vocab_size=512, pad_token_id=3, eos_token_id=2)
    with pytest.raises(DataError, match=r"tokenizer vocab_size 512 exceeds model\.model_config\.vocab_size 256"):
        check_dataset(tiny_dataset, seq_length=64, vocab_size=256, pad_token_id=3, eos_token_id=2)


def test_missing_dataset_names_key_and_command(tmp_path):
    missing = str(tmp_path / "nowhere")
    with pytest.raises(DataError, match=r"train_dataset\.data_loader\.dataset_dir: dataset .*nowhere: directory "
                                        r"does not exist\n---> HINT: build it with: python scripts/prepare_data\.py"):
        check_dataset(missing, seq_length=64, vocab_size=512, pad_token_id=3, eos_token_id=2)


def test_corrupt_shard_is_detected(tiny_dataset, tmp_path):
    import shutil
    copy = str(tmp_path / "copy")
    shutil.copytree(tiny_dataset, copy)
    manifest = read_manifest(copy)
    shard = os.path.join(copy, manifest["shards"][0]["file"])
    with open(shard, "r+b") as f:
        f.seek(100)
        f.write(b"\x00\x01\x02")
    with pytest.raises(DataError, match=r"shard train-00000\.mindrecord does not match its sha256"):
        verify_files(copy, manifest)


def test_failed_preparation_leaves_nothing_that_looks_complete(tmp_path):
    out = str(tmp_path / "ds")
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"\xff" * 100)  # not UTF-8: no usable document
    with pytest.raises(DataError, match="no usable document among 1 input files"):
        prepare_dataset(out, 64, 512, inputs=[str(bad)], show_progress=False)
    assert not os.path.exists(out) and not os.path.exists(partial_dir(out))


def test_existing_output_is_never_overwritten(tiny_dataset, tmp_path):
    with pytest.raises(DataError, match="already exists"):
        prepare_dataset(tiny_dataset, 64, 512, show_progress=False)
    stray = tmp_path / "stray"
    stray.mkdir()
    (stray / "notes.txt").write_text("mine")
    with pytest.raises(DataError, match="exists but is not a complete dataset"):
        prepare_dataset(str(stray), 64, 512, show_progress=False)
    assert (stray / "notes.txt").read_text() == "mine"


def test_prepare_refuses_unaligned_seq_length(tmp_path):
    with pytest.raises(DataError, match="(?s)seq_length 100 is not a multiple of 16.*use 112"):
        prepare_dataset(str(tmp_path / "x"), 100, 512, show_progress=False)


def test_manifest_describes_the_data(tiny_dataset):
    with open(os.path.join(tiny_dataset, MANIFEST), encoding="utf-8") as f:
        manifest = json.load(f)
    assert manifest["format_version"] == 1
    assert manifest["documents"]["kept"] <= manifest["documents"]["read"] == 60
    assert len(manifest["tokenizer"]["sha256"]) == 64
    assert {"eod_id", "pad_id", "bos_id", "unk_id"} <= set(manifest["tokenizer"])


def test_launch_verifies_shard_contents_before_training(tiny_dataset, tmp_path):
    """ensure_dataset: full sha256 on first use, then size + mtime + sampled hash from the cache; one changed
    byte is refused with the --validate command, also when the file keeps its size and mtime."""
    import shutil

    from conftest import TINY_RECIPE
    from ascend_llm_recipes.data.mindrecord_io import VERIFY_CACHE
    from ascend_llm_recipes.training.launcher.datasets import ensure_dataset
    from ascend_llm_recipes.training.recipe.loading import load_recipe

    copy = str(tmp_path / "copy")
    shutil.copytree(tiny_dataset, copy)
    shutil.rmtree(os.path.join(copy, VERIFY_CACHE), ignore_errors=True)
    recipe = load_recipe(TINY_RECIPE, (f"train_dataset.data_loader.dataset_dir={copy}",))
    manifest = read_manifest(copy)
    files = 2 * len(manifest["shards"]) + 1  # shards, their .db index files, the tokenizer
    ensure_dataset(recipe, show_progress=False)
    with open(os.path.join(copy, VERIFY_CACHE), encoding="utf-8") as f:
        assert len(json.load(f)) == files
    shard = os.path.join(copy, manifest["shards"][0]["file"])
    st = os.stat(shard)
    with open(shard, "r+b") as f:  # one byte, inside the first sampled block; size and mtime kept
        f.seek(100)
        byte = f.read(1)
        f.seek(100)
        f.write(bytes([byte[0] ^ 1]))
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns))
    with pytest.raises(DataError, match=rf"train-00000\.mindrecord does not match its sha256 .*training on it is "
                                        rf"refused\n---> HINT: run python scripts/prepare_data\.py --validate "
                                        rf"{re.escape(copy)}"):
        ensure_dataset(recipe, show_progress=False)
    os.utime(shard)  # a new mtime: checked in full again
    with pytest.raises(DataError, match=r"train-00000\.mindrecord does not match its sha256"):
        ensure_dataset(recipe, show_progress=False)
    with open(shard, "r+b") as f:
        f.seek(100)
        f.write(byte)
    ensure_dataset(recipe, show_progress=False)


def test_launch_names_what_it_verified(tiny_dataset, capsys):
    from conftest import TINY_RECIPE
    from ascend_llm_recipes.training.launcher.datasets import ensure_dataset
    from ascend_llm_recipes.training.recipe.loading import load_recipe

    recipe = load_recipe(TINY_RECIPE, (f"train_dataset.data_loader.dataset_dir={tiny_dataset}",))
    ensure_dataset(recipe, show_progress=False)
    ensure_dataset(recipe, show_progress=False)
    out = capsys.readouterr().out.splitlines()
    files = 2 * len(read_manifest(tiny_dataset)["shards"]) + 1
    assert f"[launch] dataset {tiny_dataset}: {files} file(s) verified: 0 by full sha256, {files} by size, mtime " \
           "and sampled hash" in out
