"""The corpus-scale data pipeline on real inputs: formats, filters, dedup, packing modes, the validation
split, restart after a real kill, bad input, and the --validate/--report/--show commands."""

import gzip
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import time

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import sentencepiece as spm

from conftest import REPO_ROOT
from data.clean import clean_text
from data.corpus import python_stdlib_files
from data.mindrecord_io import partial_dir, read_manifest, read_samples, verify_files
from data.prepare import prepare_dataset
from data.tokenizer import EOD_ID, PAD_ID, load_tokenizer
from training.errors import DataError

SCRIPT = os.path.join(REPO_ROOT, "scripts", "prepare_data.py")
CJK_DOCS = ["中文测试：这是一个包含汉字的文档，用来检查中文文本在清洗、分词和打包之后是否完整无缺。",
            "日本語のテキスト：ひらがな、カタカナ、漢字がすべて正しく残ることを確認します。",
            "Mixed script 混合文字 with English, 中文, 日本語, 한국어 and Ελληνικά in one document."]


@pytest.fixture(scope="module")
def docs():
    """Real documents: Python standard library modules (distinct, a few KB each)."""
    texts = [f.read_text(encoding="utf-8") for f in python_stdlib_files()[60:100]]
    return [t for t in texts if len(t) > 200]


@pytest.fixture(scope="module")
def tokenizer(tiny_dataset):
    return os.path.join(tiny_dataset, "tokenizer.model")


def prepare(out, tokenizer, inputs, **options):
    options.setdefault("workers", 0)
    return prepare_dataset(str(out), 64, inputs=[str(p) for p in inputs], tokenizer=tokenizer, show_progress=False,
                           **options)


def write_jsonl(path, texts, field="text", compress=False):
    lines = "".join(json.dumps({field: t}) + "\n" for t in texts)
    with (gzip.open(path, "wt", encoding="utf-8") if compress else open(path, "w", encoding="utf-8")) as f:
        f.write(lines)
    return path


def decoded_documents(dataset_dir):
    """Stream-packed samples -> the token stream (rows overlap by one) -> documents split at EOD, decoded."""
    manifest = read_manifest(dataset_dir)
    samples = list(read_samples(dataset_dir, manifest))
    stream = list(samples[0]) + [t for s in samples[1:] for t in s[1:]]
    while stream and stream[-1] == PAD_ID:
        stream.pop()
    sp = load_tokenizer(os.path.join(dataset_dir, "tokenizer.model"))
    out, current = [], []
    for token in stream:
        if token == EOD_ID:
            out.append(sp.decode(current))
            current = []
        else:
            current.append(int(token))
    assert not current  # the stream ends with an EOD
    return out


def shard_bytes(dataset_dir):
    manifest = read_manifest(dataset_dir)
    return [open(os.path.join(dataset_dir, s["file"]), "rb").read() for s in manifest["shards"]]


def test_every_format_round_trips_to_the_cleaned_documents(tmp_path, docs, tokenizer):
    """.jsonl, .jsonl.gz, .parquet, .txt per file, .txt.gz per line: decoded samples == cleaned docs joined by EOD."""
    src = tmp_path / "in"
    src.mkdir()
    write_jsonl(src / "a.jsonl", docs[:8])
    write_jsonl(src / "b.jsonl.gz", docs[8:14], compress=True)
    pq.write_table(pa.table({"text": docs[14:20]}), src / "c.parquet", row_group_size=2)
    (src / "d.txt").write_text(docs[20], encoding="utf-8")
    one_line = [d.replace("\n", " ") for d in docs[21:24]]
    (src / "e.txt.gz").write_bytes(gzip.compress("\n".join(one_line).encode()))
    manifest = prepare(tmp_path / "ds", tokenizer, [src], lines=False)
    per_line = prepare(tmp_path / "lines", tokenizer, [src / "e.txt.gz"], lines=True)
    verify_files(str(tmp_path / "ds"), manifest)
    expected = [clean_text(d).strip() for d in docs[:21] + ["\n".join(one_line)]]
    assert decoded_documents(str(tmp_path / "ds")) == expected
    assert decoded_documents(str(tmp_path / "lines")) == [clean_text(d).strip() for d in one_line]
    assert per_line["documents"]["read"] == 3
    formats = {os.path.basename(i["path"]): (i["format"], i["documents"]) for i in manifest["inputs"]["list"]}
    assert formats == {"a.jsonl": ("jsonl", 8), "b.jsonl.gz": ("jsonl+gzip", 6), "c.parquet": ("parquet", 6),
                       "d.txt": ("text", 1), "e.txt.gz": ("text+gzip", 1)}
    assert all(len(i["sha256"]) == 64 and i["bytes"] > 0 for i in manifest["inputs"]["list"])


def test_cjk_and_mixed_scripts_come_through_intact(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "cjk.jsonl", CJK_DOCS)
    prepare(tmp_path / "ds", tokenizer, [path], min_chars=10)
    decoded = decoded_documents(str(tmp_path / "ds"))
    assert decoded == [clean_text(d) for d in CJK_DOCS]
    assert "漢字がすべて正しく" in decoded[1] and "한국어 and Ελληνικά" in decoded[2]
    assert decoded[0].startswith("中文测试:")  # NFKC folds the full-width colon, nothing else changes


def test_samples_are_16_aligned_and_padding_stays_below_a_thousandth(tmp_path, docs, tokenizer):
    path = write_jsonl(tmp_path / "a.jsonl", docs)
    manifest = prepare(tmp_path / "ds", tokenizer, [path], samples_per_shard=500)
    samples = list(read_samples(str(tmp_path / "ds"), manifest))
    assert manifest["seq_length"] % 16 == 0 and {len(s) for s in samples} == {65}
    assert manifest["samples"] > 1000 and 0 < manifest["padding_rate"] < 0.001
    assert manifest["padding_tokens"] == sum(int((s == PAD_ID).sum()) for s in samples) < 65
    assert [s["samples"] for s in manifest["shards"]][:-1] == [500] * (len(manifest["shards"]) - 1)
    dropped = prepare(tmp_path / "drop", tokenizer, [path], tail="drop")
    assert dropped["padding_tokens"] == 0 and dropped["samples"] == manifest["samples"] - 1
    assert dropped["dropped_tokens"] == 65 - manifest["padding_tokens"] - 1
    with pytest.raises(DataError, match="seq_length 72 is not a multiple of 16"):
        prepare_dataset(str(tmp_path / "x"), 72, inputs=[str(path)], tokenizer=tokenizer, show_progress=False)


def test_best_fit_never_splits_a_document_that_fits_and_reports_its_padding(tmp_path, tokenizer):
    sp = spm.SentencePieceProcessor(model_file=tokenizer)
    texts = [f"document {i}: " + " ".join(f"w{j}" for j in range(1 + (7 * i) % 13)) for i in range(60)]
    texts.append("a long document " + " ".join(f"token{j}" for j in range(60)))
    path = write_jsonl(tmp_path / "a.jsonl", texts)
    manifest = prepare(tmp_path / "ds", tokenizer, [path], packing="best_fit", min_chars=1)
    samples = list(read_samples(str(tmp_path / "ds"), manifest))
    segments = set()
    for s in samples:
        ids = [int(t) for t in s if t != PAD_ID]
        cuts = [-1] + [i for i, t in enumerate(ids) if t == EOD_ID]
        segments.update(tuple(ids[a + 1:b]) for a, b in zip(cuts, cuts[1:]))
    lengths = [len(sp.encode(t)) + 1 for t in texts]
    fitting = [sp.encode(t) for t, n in zip(texts, lengths) if n <= 65]
    assert len(fitting) == 60 and lengths[-1] > 65  # every short document fits, the long one does not
    assert all(tuple(ids) in segments for ids in fitting)
    assert manifest["packing"] == {"mode": "best_fit", "tail": "pad", "split_documents": 1}
    pads = sum(int((s == PAD_ID).sum()) for s in samples)
    assert manifest["padding_tokens"] == pads > 0
    assert manifest["padding_rate"] == pytest.approx(pads / (len(samples) * 65), abs=1e-8)
    assert manifest["tokens"] == sum(len(sp.encode(t)) + 1 for t in texts)


def test_exact_and_near_duplicates_are_counted_across_inputs(tmp_path, docs, tokenizer):
    edited = docs[3].replace("def ", "def  ", 2) + "\n# one more comment line"
    write_jsonl(tmp_path / "a.jsonl", docs[:10])
    write_jsonl(tmp_path / "b.jsonl", [docs[2], docs[5] + "  \r\n", edited, docs[11]])
    exact = prepare(tmp_path / "exact", tokenizer, [tmp_path / "a.jsonl", tmp_path / "b.jsonl"])
    near = prepare(tmp_path / "near", tokenizer, [tmp_path / "a.jsonl", tmp_path / "b.jsonl"], near_dedup=True)
    assert exact["documents"]["read"] == near["documents"]["read"] == 14
    # docs[5] differs only in trailing whitespace, which cleaning strips: an exact duplicate.
    assert (exact["documents"]["duplicates"], exact["documents"]["near_duplicates"], exact["documents"]["kept"]) \
        == (2, 0, 12)
    assert (near["documents"]["duplicates"], near["documents"]["near_duplicates"], near["documents"]["kept"]) \
        == (2, 1, 11)
    assert near["documents"]["duplicate_ratio"] == pytest.approx(3 / 14, abs=1e-6)


def test_validation_split_holds_out_whole_documents_by_hash(tmp_path, docs, tokenizer):
    path = write_jsonl(tmp_path / "a.jsonl", docs)
    manifest = prepare(tmp_path / "ds", tokenizer, [path], val_fraction=0.25)
    val_dir = str(tmp_path / "ds-val")
    val = read_manifest(val_dir)
    assert val["split"] == "validation" and manifest["split"] == "train"
    assert manifest["validation"]["dataset_dir"] == "../ds-val"
    assert os.path.isfile(os.path.join(val_dir, "tokenizer.model"))
    train_docs, val_docs = decoded_documents(str(tmp_path / "ds")), decoded_documents(val_dir)
    cleaned = [clean_text(d).strip() for d in docs]
    assert 0 < len(val_docs) == manifest["documents"]["validation"] < len(docs) / 2
    assert sorted(train_docs + val_docs) == sorted(cleaned) and not set(train_docs) & set(val_docs)
    again = prepare(tmp_path / "again", tokenizer, [path], val_fraction=0.25)  # deterministic
    assert decoded_documents(str(tmp_path / "again-val")) == val_docs
    assert again["shards"] == manifest["shards"]


def test_worker_processes_write_the_same_shards_as_one_process(tmp_path, docs, tokenizer):
    path = write_jsonl(tmp_path / "a.jsonl", docs)
    one = prepare(tmp_path / "one", tokenizer, [path], workers=0, samples_per_shard=300)
    two = prepare(tmp_path / "two", tokenizer, [path], workers=2, samples_per_shard=300)
    assert one["shards"] == two["shards"] and shard_bytes(str(tmp_path / "one")) == shard_bytes(str(tmp_path / "two"))


def test_killed_run_resumes_with_its_shards_and_ends_byte_identical(tmp_path, tokenizer):
    texts = [f.read_text(encoding="utf-8") for f in python_stdlib_files()[100:220]]
    path = write_jsonl(tmp_path / "corpus.jsonl", texts)  # ~3 MB: a few 1 MB chunks
    lines = path.read_text().splitlines(keepends=True)
    path.write_text("".join(line + ('{"text": broken\n' if i % 10 == 5 else "") for i, line in enumerate(lines)))
    reference = prepare(tmp_path / "reference", tokenizer, [path], samples_per_shard=256)
    out = tmp_path / "ds"
    command = [sys.executable, SCRIPT, "--input", str(path), "--output", str(out), "--seq-length", "64",
               "--tokenizer", tokenizer, "--samples-per-shard", "256", "--workers", "0", "--no-progress"]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    snapshot = out.parent / "ds.partial" / "state" / "snapshot.json"
    kept = None
    deadline = time.time() + 120
    while time.time() < deadline and proc.poll() is None:
        try:
            state = json.loads(snapshot.read_text())
        except (OSError, ValueError):
            state = None
        if state and state["position"]["offset"] > 0:  # saved mid-file: the rerun must seek into the input
            kept = state["splits"]["train"]["shards"]
            proc.send_signal(signal.SIGKILL)
            break
        time.sleep(0.01)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, "the run finished before it could be interrupted"
    assert not out.exists() and os.path.isdir(partial_dir(str(out)))
    before = {s["file"]: os.stat(os.path.join(partial_dir(str(out)), s["file"])).st_ino for s in kept}
    changed = subprocess.run(command[:-3] + ["--max-chars", "100000", "--no-progress"], capture_output=True,
                             text=True)
    assert changed.returncode == 2 and "holds an interrupted run with other arguments" in changed.stderr
    assert "max_chars 0 -> 100000" in changed.stderr
    resumed = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr
    assert re.search(rf"resuming {re.escape(partial_dir(str(out)))} at shard {len(kept)} \(input .*corpus\.jsonl, "
                     r"line [1-9]\d+\)", resumed.stderr), resumed.stderr
    assert {name: os.stat(out / name).st_ino for name in before} == before  # completed shards were kept
    manifest = read_manifest(str(out))
    assert manifest["shards"] == reference["shards"] and manifest["documents"] == reference["documents"]
    assert manifest["bad_input"] == reference["bad_input"] and reference["bad_input"]["counts"]["malformed_json"] == 12
    assert shard_bytes(str(out)) == shard_bytes(str(tmp_path / "reference"))
    assert not os.path.exists(partial_dir(str(out))) and not os.path.exists(out / "state")


@pytest.mark.parametrize("case", ["empty", "binary", "malformed_json", "missing_field", "unreadable",
                                  "invalid_utf8", "parquet_without_column"])
def test_bad_input_is_skipped_and_counted_or_stops_with_strict(tmp_path, docs, tokenizer, case):
    good = write_jsonl(tmp_path / "good.jsonl", docs[:3])
    bad = tmp_path / "bad.jsonl"
    kind, where = {"empty": ("empty_file", "bad.jsonl: the file is empty"),
                   "binary": ("binary_file", "bad.jsonl: binary content"),
                   "malformed_json": ("malformed_json", "bad.jsonl:2: malformed JSON"),
                   "missing_field": ("missing_field", "bad.jsonl:2: no 'text' field"),
                   "unreadable": ("unreadable", "bad.jsonl: no such file"),
                   "invalid_utf8": ("invalid_utf8", "bad.jsonl:2: invalid UTF-8"),
                   "parquet_without_column": ("missing_field", "bad.parquet: no column 'text'")}[case]
    first_line = json.dumps({"text": docs[5]}) + "\n"
    if case == "empty":
        bad.write_bytes(b"")
    elif case == "binary":
        bad.write_bytes(b"\x7fELF\x02\x01\x01\x00" + bytes(range(256)) * 4)
    elif case == "malformed_json":
        bad.write_text(first_line + '{"text": "cut off\n')
    elif case == "missing_field":
        bad.write_text(first_line + json.dumps({"body": docs[6]}) + "\n")
    elif case == "invalid_utf8":
        bad.write_bytes(first_line.encode() + b'{"text": "caf\xe9 au lait, and more words to be long enough"}\n')
    elif case == "parquet_without_column":
        bad = tmp_path / "bad.parquet"
        pq.write_table(pa.table({"body": docs[5:7]}), bad)
    manifest = prepare(tmp_path / "ds", tokenizer, [good, bad])
    assert manifest["bad_input"]["counts"][kind] == 1
    assert manifest["bad_input"]["first"][kind].startswith(str(tmp_path / where.split(":")[0]))
    assert where in manifest["bad_input"]["first"][kind]
    assert manifest["documents"]["kept"] == 3 + (case in ("malformed_json", "missing_field", "invalid_utf8"))
    with pytest.raises(DataError, match=r"bad input: .*" + where.replace("(", r"\(")) as err:
        prepare(tmp_path / "strict", tokenizer, [good, bad], strict=True)
    assert "run without --strict" in str(err.value)
    assert not os.path.exists(tmp_path / "strict") and not os.path.exists(tmp_path / "strict.partial")


def test_tokenizer_that_does_not_fit_is_refused(tmp_path, docs, tokenizer):
    path = write_jsonl(tmp_path / "a.jsonl", docs[:4])
    with pytest.raises(DataError, match=r"tokenizer .*tokenizer\.model: vocabulary of 512 does not fit "
                                        r"model\.model_config\.vocab_size 256"):
        prepare(tmp_path / "ds", tokenizer, [path], model_vocab_size=256)
    (tmp_path / "lines.txt").write_text("\n".join(docs[:4]))
    spm.SentencePieceTrainer.train(input=str(tmp_path / "lines.txt"), model_prefix=str(tmp_path / "odd"),
                                   vocab_size=500, unk_id=0, bos_id=1, eos_id=2, pad_id=3, minloglevel=2)
    with pytest.raises(DataError, match=r"vocabulary of 500 is not a multiple of 16"):
        prepare(tmp_path / "ds2", str(tmp_path / "odd.model"), [path])
    assert not os.path.exists(tmp_path / "ds") and not os.path.exists(tmp_path / "ds2.partial")


def run_script(capsys, *args):
    """scripts/prepare_data.py's main(), in this process: (exit code, stdout, stderr)."""
    spec = importlib.util.spec_from_file_location("prepare_data_script", SCRIPT)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    code = script.main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


def test_command_line_builds_validates_reports_and_shows(tmp_path, docs, capsys):
    write_jsonl(tmp_path / "a.jsonl", docs[:20] + CJK_DOCS)
    out = tmp_path / "ds"
    code, stdout, stderr = run_script(capsys, "--input", tmp_path / "*.jsonl", "--output", out, "--seq-length", 64,
                                      "--vocab-size", 512, "--val-fraction", 0.2, "--min-chars", 10, "--no-progress")
    assert code == 0, stderr
    assert stdout.startswith(f"dataset {out}: 23 of 23 documents kept")
    manifest = read_manifest(str(out))
    assert manifest["tokenizer"]["source"] == "trained" and manifest["tokenizer"]["vocab_size"] == 512
    assert manifest["command"].endswith("--no-progress")
    assert manifest["arguments"]["inputs"] == [str(tmp_path / "*.jsonl")]
    code, stdout, stderr = run_script(capsys, "--validate", out, "--recipe",
                                      os.path.join(REPO_ROOT, "recipes", "tiny_cpu.yaml"))
    assert code == 0, stderr
    assert "matches recipe" in stdout and f"validation dataset {out}-val" in stdout
    code, _, stderr = run_script(capsys, "--validate", out, "--recipe", os.path.join(REPO_ROOT, "recipes",
                                                                                     "demo_cpu.yaml"))
    assert code == 2 and "seq_length 64 (model.model_config.seq_length is 256)" in stderr
    assert f"prepare_data.py --output {out}-new --seq-length 256 --vocab-size 2048 --input" in stderr
    code, stdout, stderr = run_script(capsys, "--report", out)
    assert code == 0 and "tokens per source" in stdout, stderr
    for name in ("doc_lengths.png", "tokens_per_source.png", "padding.png"):
        assert (out / "report" / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    code, stdout, _ = run_script(capsys, "--show", out, "--sample", 0)
    assert code == 0 and "sample 0 of" in stdout and clean_text(docs[0]).strip()[:40] in stdout
    with open(out / manifest["shards"][0]["file"], "r+b") as f:
        f.seek(200)
        f.write(b"\x00\x01")
    code, _, stderr = run_script(capsys, "--validate", out)
    assert code == 2 and "train-00000.mindrecord does not match its sha256" in stderr
    assert "rebuild it with: python scripts/prepare_data.py" in stderr
