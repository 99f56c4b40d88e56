"""The corpus-scale data pipeline on real inputs: formats, filters, dedup, packing modes, the validation
split, restart after a real kill, bad input, and the --validate/--report/--show commands."""

import gzip
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import sentencepiece as spm

from conftest import REPO_ROOT, load_script
from ascend_llm_recipes.common.errors import DataError
from ascend_llm_recipes.data.text.clean import clean_text
from ascend_llm_recipes.data.text.corpus import python_stdlib_files
from ascend_llm_recipes.data.mindrecord_io import partial_dir, read_manifest, read_samples, verify_cached, verify_files
from ascend_llm_recipes.data.prepare import prepare_dataset
from ascend_llm_recipes.data.tokenizer import EOD_ID, PAD_ID, load_tokenizer

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
    # a glob: a folder holding .jsonl or .parquet files is read for those alone (tests/test_data_inputs.py)
    manifest = prepare(tmp_path / "ds", tokenizer, [src / "*"], lines=False)
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
    assert decoded[0].startswith("中文测试：")  # NFC (the default) keeps the full-width colon


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


# ~9 shards per 1 MB chunk (17 in all, 64 with 256): a snapshot (one per shard) still falls inside every chunk, at a
# quarter of the shard writes (each MindRecord shard costs a FileWriter commit and two sha256 whatever its size).
SHARD = 1024


@pytest.fixture(scope="module")
def restart_corpus(tmp_path_factory, tokenizer):
    """(~3 MB JSONL of stdlib sources with malformed lines, its dataset built in one go) for the restart tests."""
    root = tmp_path_factory.mktemp("restart")
    texts = [f.read_text(encoding="utf-8") for f in python_stdlib_files()[100:220]]
    path = write_jsonl(root / "corpus.jsonl", texts)  # ~3 MB: a few 1 MB chunks
    lines = path.read_text().splitlines(keepends=True)
    path.write_text("".join(line + ('{"text": broken\n' if i % 10 == 5 else "") for i, line in enumerate(lines)))
    reference = prepare(root / "reference", tokenizer, [path], samples_per_shard=SHARD)
    return path, reference, str(root / "reference")


def build_command(path, out, tokenizer, workers=0):
    return [sys.executable, SCRIPT, "--input", str(path), "--output", str(out), "--seq-length", "64",
            "--tokenizer", tokenizer, "--samples-per-shard", str(SHARD), "--workers", str(workers), "--no-progress"]


def stop_when_saved(proc, out, stop, mid_file=True):
    """Wait until the run saved a snapshot (mid-file: the rerun must seek into the input), then stop(proc);
    returns the shards the snapshot lists."""
    snapshot = out.parent / (out.name + ".partial") / "state" / "snapshot.json"
    kept = None
    deadline = time.time() + 120
    while time.time() < deadline and proc.poll() is None:
        try:
            state = json.loads(snapshot.read_text())
        except (OSError, ValueError):
            state = None
        if state and (state["position"]["offset"] > 0 or not mid_file):
            kept = state["splits"]["train"]["shards"]
            stop(proc)
            break
        time.sleep(0.01)
    proc.wait()
    return kept


def test_killed_run_resumes_with_its_shards_and_ends_byte_identical(tmp_path, tokenizer, restart_corpus, capsys):
    path, reference, reference_dir = restart_corpus
    out = tmp_path / "ds"
    command = build_command(path, out, tokenizer)
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    kept = stop_when_saved(proc, out, lambda p: p.send_signal(signal.SIGKILL))
    assert proc.returncode == -signal.SIGKILL, "the run finished before it could be interrupted"
    assert not out.exists() and os.path.isdir(partial_dir(str(out)))
    before = {s["file"]: os.stat(os.path.join(partial_dir(str(out)), s["file"])).st_ino for s in kept}
    # The command line's main() in this process (its exit code and stderr): one interpreter start-up less.
    code, _, stderr = run_script(capsys, *command[2:-3], "--max-chars", "100000", "--no-progress")
    assert code == 2 and "holds an interrupted run with other arguments" in stderr
    assert "max_chars 0 -> 100000" in stderr
    code, _, resumed = run_script(capsys, *command[2:])  # the same command, in this process
    assert code == 0, resumed
    assert re.search(rf"resuming {re.escape(partial_dir(str(out)))} at shard {len(kept)} \(input .*corpus\.jsonl, "
                     r"line [1-9]\d+\)", resumed), resumed
    assert {name: os.stat(out / name).st_ino for name in before} == before  # completed shards were kept
    manifest = read_manifest(str(out))
    assert manifest["shards"] == reference["shards"] and manifest["documents"] == reference["documents"]
    assert manifest["bad_input"] == reference["bad_input"] and reference["bad_input"]["counts"]["malformed_json"] == 12
    assert shard_bytes(str(out)) == shard_bytes(reference_dir)
    assert not os.path.exists(partial_dir(str(out))) and not os.path.exists(out / "state")


def test_ctrl_c_says_one_line_exits_130_and_a_rerun_continues(tmp_path, tokenizer, restart_corpus, capsys):
    """SIGINT to the whole process group, as a terminal sends it (worker processes included)."""
    path, reference, reference_dir = restart_corpus
    out = tmp_path / "ds"
    command = build_command(path, out, tokenizer, workers=2)
    # SIGINT as a terminal leaves it, even when pytest runs with it ignored (a `cmd &` of a script inherits SIG_IGN).
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    kept = stop_when_saved(proc, out, lambda p: os.killpg(p.pid, signal.SIGINT), mid_file=False)
    stderr = proc.stderr.read()
    assert proc.returncode == 130, stderr
    assert stderr.strip().splitlines() == ["interrupted; rerun the same command to continue"]
    assert kept and not out.exists() and not os.path.exists(os.path.join(partial_dir(str(out)), "manifest.json"))
    code, _, resumed = run_script(capsys, *command[2:])  # the same command, in this process
    assert code == 0, resumed
    assert f"resuming {partial_dir(str(out))} at shard" in resumed
    assert read_manifest(str(out))["shards"] == reference["shards"]
    assert shard_bytes(str(out)) == shard_bytes(reference_dir)


def test_full_disk_names_the_output_and_space_needed_and_a_rerun_continues(tmp_path, tokenizer, restart_corpus,
                                                                           capsys):
    """A real full disk: a tmpfs 10 MB (MindRecord keeps that free) larger than 3/4 of the dataset, so the run
    fails in its last chunk with a snapshot saved; then the disk is grown and the command rerun."""
    path, reference, reference_dir = restart_corpus
    disk = tmp_path / "disk"
    disk.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    used = sum(os.lstat(os.path.join(reference_dir, n)).st_blocks * 512 for n in os.listdir(reference_dir))
    size = f"size={(10 << 10) + used * 3 // 4 // 1024}k"
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", size, "tmpfs", str(disk)], capture_output=True, text=True)
    if mounted.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        out = disk / "ds"
        command = build_command(path, out, tokenizer)
        full = subprocess.run(command, capture_output=True, text=True, timeout=300)
        assert full.returncode == 2, full.stderr
        assert "Traceback" not in full.stderr
        assert re.search(rf"error: disk full while writing dataset {re.escape(str(out))}: "
                         r"[\d.,]+ (GiB|MiB|KiB|B) free, [\d.,]+ (GiB|MiB|KiB|B) "
                         r"needed to finish", full.stderr), full.stderr
        assert re.search(r"HINT: free at least [\d.,]+ (GiB|MiB|KiB|B) more on that disk, "
                         r"then rerun the same command",
                         full.stderr), full.stderr
        assert not out.exists()
        written = [os.path.join(d, n) for d, _, names in os.walk(disk) for n in names]
        assert not any(n.endswith("manifest.json") for n in written)  # nothing looks complete
        assert os.path.isfile(os.path.join(partial_dir(str(out)), "state", "snapshot.json"))
        subprocess.run(["mount", "-o", "remount,size=64m", str(disk)], check=True)
        code, _, resumed = run_script(capsys, *command[2:])  # the same command, in this process
        assert code == 0, resumed
        assert f"resuming {partial_dir(str(out))} at shard" in resumed
        assert shard_bytes(str(out)) == shard_bytes(reference_dir)
    finally:
        subprocess.run(["umount", "-l", str(disk)], capture_output=True)


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
    assert not os.path.exists(tmp_path / "ds") and not os.path.exists(tmp_path / "ds.partial")
    # (a user's vocabulary that is not a multiple of 16 is accepted: tests/test_tokenizer.py)


def run_script(capsys, *args):
    """scripts/prepare_data.py's main(), in this process: (exit code, stdout, stderr)."""
    code = load_script("prepare_data").main([str(a) for a in args])
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


# Real Chinese text: classical poems (public domain) and Debian's fortunes-zh (Eric S. Raymond's Unix principles).
POEMS = ["床前明月光，疑是地上霜。举头望明月，低头思故乡。", "春眠不觉晓，处处闻啼鸟。", "白日依山尽，黄河入海流。",
         "千山鸟飞绝，万径人踪灭。孤舟蓑笠翁，独钓寒江雪。", "红豆生南国，春来发几枝。愿君多采撷，此物最相思。"]
RAYMOND = "    -- Eric S. Raymond, UNIX哲学基础第{}条，《UNIX编程艺术》"
PRINCIPLES = ["模块原则：使用简洁的接口拼合简单的部件。", "清晰原则：清晰胜于技巧。", "组合原则：设计时考虑拼接组合。",
              "分离原则：策略同机制分离，接口同引擎分离。", "简洁原则：设计要简洁，复杂度能低则低。",
              "吝啬原则：除非别无他法，不要编写庞大的程序。", "透明性原则：设计要可见，以便审查和调试。",
              "健壮原则：健壮源于透明与简洁。", "表示原则：将知识叠入数据，以求逻辑质朴而健壮。"]
CONTRACT = ("我们明白，某些我们的用户需要使用不符合 Debian 自由软件指导方针的作品。我们为这些作品，在我们的 FTP 库中"
            "留出了 contrib 以及 non-free 目录。在这些目录下的软件包，并不属于 Debian 系统，尽管它们已被配置成可以在 "
            "Debian 下使用。我们鼓励光盘制造商阅读这些目录下的软件的许可证，以判断他们是否可以在光盘中发行这些软件。"
            "\n    -- Debian 《社会契约》第五条")


def test_chinese_text_is_kept_as_written_and_its_length_measured_fairly(tmp_path, tokenizer):
    """NFC by default (full-width punctuation stays), and --min-chars 32 keeps 12-character Chinese lines."""
    path = tmp_path / "poems.txt"
    path.write_text("\n".join(POEMS + ["太短了。", "too short for 32"]), encoding="utf-8")
    manifest = prepare(tmp_path / "ds", tokenizer, [path], lines=True)
    assert manifest["options"]["normalization"] == "NFC" and manifest["options"]["min_chars"] == 32
    assert decoded_documents(str(tmp_path / "ds")) == POEMS  # 12 to 24 characters each: kept, "，" and "。" intact
    assert manifest["documents"]["too_short"] == 2  # 4 CJK characters count 12, "too short for 32" 16
    folded = prepare(tmp_path / "nfkc", tokenizer, [path], lines=True, normalization="NFKC")
    assert folded["documents"]["kept"] == 5 and decoded_documents(str(tmp_path / "nfkc"))[1] == "春眠不觉晓,处处闻啼鸟。"


def test_vocabulary_hints_point_the_right_way_and_name_the_users_files(tmp_path, docs, capsys):
    english = write_jsonl(tmp_path / "small.jsonl", [docs[0][:3000]])
    code, _, stderr = run_script(capsys, "--input", english, "--output", tmp_path / "a", "--seq-length", 64,
                                 "--vocab-size", 4096, "--no-progress")
    limit = int(re.search(r"enough distinct pieces for at most (\d+)", stderr).group(1))
    assert code == 2 and f"cannot be trained on --input {english}" in stderr
    assert f"HINT: lower --vocab-size to at most {limit // 16 * 16}, give more text" in stderr
    chinese = tmp_path / "poems.txt"
    chinese.write_text("\n".join(POEMS * 3), encoding="utf-8")
    code, _, stderr = run_script(capsys, "--input", chinese, "--lines", "--output", tmp_path / "b", "--seq-length", 64,
                                 "--vocab-size", 256, "--no-progress")
    needed = int(re.search(r"sentencepiece needs (\d+) pieces", stderr).group(1))
    assert code == 2 and needed > 256 and f"HINT: raise --vocab-size to at least {-(-needed // 16) * 16}" in stderr
    not_a_model = tmp_path / "tok.model"
    not_a_model.write_bytes(b"not a sentencepiece model")
    code, _, stderr = run_script(capsys, "--input", chinese, "--output", tmp_path / "c", "--seq-length", 64,
                                 "--tokenizer", not_a_model, "--no-progress")
    assert code == 2 and f"tokenizer {not_a_model}: cannot be loaded" in stderr
    assert ".partial" not in stderr and "Traceback" not in stderr
    assert not any(p.name.endswith(".partial") for p in tmp_path.iterdir())


def test_when_no_document_is_usable_each_reason_is_shown_with_its_first_line(tmp_path, docs, tokenizer):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "cut off\n' + json.dumps({"body": docs[0]}) + "\n")
    short = tmp_path / "short.txt"
    short.write_text("a short line\nanother one\n")
    with pytest.raises(DataError, match=r"(?s)no usable document among 2 input files of --input .*: "
                                        rf"1 malformed json \(first: {re.escape(str(bad))}:1: malformed JSON.*"
                                        rf"1 missing field \(first: {re.escape(str(bad))}:2: no 'text' field.*"
                                        rf"2 too short \(under --min-chars 32; first: {re.escape(str(short))}:1\)"
                                        r".*HINT: .*lower --min-chars"):
        prepare(tmp_path / "ds", tokenizer, [bad, short], lines=True)
    with pytest.raises(DataError, match=rf"2 too short \(under --min-chars 32; first: {re.escape(str(short))}:1\)"):
        prepare_dataset(str(tmp_path / "trained"), 64, 512, inputs=[str(short)], lines=True, show_progress=False)
    assert not os.path.exists(tmp_path / "ds.partial") and not os.path.exists(tmp_path / "trained.partial")


def test_output_that_cannot_be_written_is_an_error_not_a_traceback(tmp_path, docs, tokenizer, capsys):
    path = write_jsonl(tmp_path / "a.jsonl", docs[:2])
    (tmp_path / "file").write_text("a file, not a directory")
    code, _, stderr = run_script(capsys, "--input", path, "--output", tmp_path / "file" / "ds", "--seq-length", 64,
                                 "--tokenizer", tokenizer, "--no-progress")
    assert code == 2 and f"error: --output: {tmp_path / 'file' / 'ds'} cannot be created: {tmp_path / 'file'} is a " \
        "file, not a directory" in stderr
    assert "Traceback" not in stderr


def test_a_huge_single_line_is_tokenized_in_bounded_memory_to_the_same_tokens(tmp_path, tokenizer):
    """A 4M-character line: encoded whole it grew the worker by 172 MB (2.4 GB for a 50 MB line), in pieces ~25 MB."""
    script = tmp_path / "measure.py"
    script.write_text(f"""
import json, sys
import sentencepiece as spm
from ascend_llm_recipes.data.text.clean import CleanOptions, clean_text
from ascend_llm_recipes.data.text.corpus import Piece, python_stdlib_files
from ascend_llm_recipes.data.text.workers import WorkerConfig, init_worker, process_chunk
text = " ".join(f.read_text(encoding="utf-8").replace("\\n", " ") for f in python_stdlib_files()[:400])
text = clean_text((text * (1 + 4_000_000 // len(text)))[:4_000_000]).strip()
line = text.encode("utf-8")
init_worker(WorkerConfig(CleanOptions(), tokenizer_path={tokenizer!r}))
copy = bytearray(line) * 3  # the peak before: the text and a few copies, as reading and cleaning make
del copy
def peak_mb():  # VmHWM: this process's own peak (ru_maxrss starts at the forking parent's)
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM")) // 1024
before = peak_mb()
result = process_chunk([Piece("lines", 0, 1, line)])
growth = peak_mb() - before
whole = spm.SentencePieceProcessor(model_file={tokenizer!r}).encode(text) + [2]
print(json.dumps({{"growth_mb": growth, "documents": len(result.lengths), "same": result.tokens.tolist() == whole}}))
""")
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    measured = json.loads(out.stdout.splitlines()[-1])
    assert measured["documents"] == 1 and measured["same"]
    assert measured["growth_mb"] < 80, f"tokenizing one 4M-character line grew memory by {measured['growth_mb']} MB"


def test_near_dedup_confirms_candidates_by_jaccard_and_lists_what_it_dropped(tmp_path, tokenizer):
    """Principles sharing only the attribution line are kept (one pair is an LSH candidate, Jaccard 0.43);
    an edited copy of a paragraph (Jaccard >= 0.8) is dropped and listed with the one it duplicates."""
    principles = [p + "\n" + RAYMOND.format(n) for p, n in zip(PRINCIPLES, "一二三四五六七八九")]
    edited = CONTRACT.replace("我们鼓励光盘制造商", "我们建议光盘制造商")
    path = write_jsonl(tmp_path / "fortunes.jsonl", [CONTRACT] + principles + [edited])
    manifest = prepare(tmp_path / "ds", tokenizer, [path], near_dedup=True, min_chars=1, normalization="NFC")
    assert manifest["documents"]["near_duplicates"] == 1 and manifest["documents"]["kept"] == 10
    assert decoded_documents(str(tmp_path / "ds")) == [clean_text(d).strip() for d in [CONTRACT] + principles]
    assert manifest["near_duplicates"]["file"] == "near_duplicates.jsonl"
    with open(tmp_path / "ds" / "near_duplicates.jsonl", encoding="utf-8") as f:
        listed = [json.loads(line) for line in f]
    assert len(listed) == 1 and listed[0]["jaccard"] >= 0.8
    assert listed[0]["dropped"]["source"] == listed[0]["duplicate_of"]["source"] == str(path)
    assert (listed[0]["dropped"]["line"], listed[0]["duplicate_of"]["line"]) == (11, 1)


def test_corrupt_index_file_is_a_clear_error_and_index_files_are_hashed(tmp_path, tiny_dataset, capsys):
    copy = tmp_path / "copy"
    shutil.copytree(tiny_dataset, copy)
    manifest = read_manifest(str(copy))
    assert all(len(s["db_sha256"]) == 64 for s in manifest["shards"])
    db = copy / (manifest["shards"][0]["file"] + ".db")
    data = bytearray(db.read_bytes())
    data[100:600] = b"\x07" * 500
    db.write_bytes(bytes(data))
    code, _, stderr = run_script(capsys, "--validate", copy)
    assert code == 2 and "train-00000.mindrecord.db (its MindRecord index) does not match its sha256" in stderr
    with pytest.raises(DataError, match=r"train-00000\.mindrecord\.db does not match its sha256"):
        verify_cached(str(copy), manifest)  # what the launcher runs
    for shard in manifest["shards"]:  # a manifest written before the index files were hashed
        del shard["db_sha256"]
    (copy / "manifest.json").write_text(json.dumps(manifest))
    code, _, stderr = run_script(capsys, "--validate", copy)
    assert code == 2 and "Traceback" not in stderr
    assert "train-00000.mindrecord: MindRecord cannot open it with its index train-00000.mindrecord.db" in stderr
    with pytest.raises(DataError, match=r"train-00000\.mindrecord: MindRecord cannot open it with its index"):
        verify_cached(str(copy), manifest)
    shutil.copyfile(os.path.join(tiny_dataset, db.name), db)
    code, stdout, _ = run_script(capsys, "--validate", copy)
    assert code == 0 and "the .db index files were opened but are not covered by hashes" in stdout


def test_padding_plot_counts_shards_in_whole_numbers(tiny_dataset):
    from ascend_llm_recipes.data.inspection import padding_figure

    manifest = read_manifest(tiny_dataset)
    ax = padding_figure(manifest).axes[0]
    low, high = ax.get_xlim()
    ticks = [t for t in ax.get_xticks() if low <= t <= high]
    assert ticks and all(float(t).is_integer() for t in ticks), ticks


def test_prepare_data_without_the_package_says_how_to_install_it():
    """A Python that lacks the package (-S: no site-packages, where the editable install lives) runs --help."""
    out = subprocess.run([sys.executable, "-S", SCRIPT, "--help"], capture_output=True, text=True, timeout=60,
                         cwd=os.path.dirname(REPO_ROOT))
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    assert out.stderr.strip().splitlines() == [
        f"error: ascend_llm_recipes is not installed in this Python ({sys.executable}): install the repository once "
        f"from its root: cd {REPO_ROOT} && pip install -e ."], out.stderr
