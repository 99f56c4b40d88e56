"""What `--input` reads: the data files of a folder (not its dataset card, .gitattributes or metadata), never what
prepare_data.py itself wrote; and the hints for a dataset whose tokenizer's ids are not the recipe's."""

import json
import os

import pytest

from conftest import LLAMA2_LAYOUT_SP_MODEL, TINY_RECIPE, load_script
from ascend_llm_recipes.common.errors import DataError
from ascend_llm_recipes.data.inspection import validate_dataset
from ascend_llm_recipes.data.mindrecord_io import read_manifest
from ascend_llm_recipes.data.prepare import check_dataset, prepare_dataset
from ascend_llm_recipes.data.text.inputs import expand_inputs, written_paths
from ascend_llm_recipes.training.recipe.loading import load_recipe

TEXTS = [f"Document {i}: the quick brown fox jumps over the lazy dog, {i * 7} times before breakfast."
         for i in range(12)]


def run_script(capsys, *args):
    """scripts/prepare_data.py's main(), in this process: (exit code, stdout, stderr)."""
    code = load_script("prepare_data").main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


def hf_dataset_folder(root):
    """A folder laid out like a dataset downloaded from the HuggingFace Hub."""
    (root / "data").mkdir(parents=True)
    (root / "data" / "train-00000.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    (root / "README.md").write_text("---\nlicense: mit\n---\n# A dataset card\n\nTwelve documents about a fox, "
                                    "written for a test of what a folder's input is.\n")
    (root / ".gitattributes").write_text("*.jsonl filter=lfs diff=lfs merge=lfs -text\n" * 3)
    (root / "dataset_info.json").write_text(json.dumps({"features": {"text": {"dtype": "string"}},
                                                        "splits": {"train": {"num_examples": 12}}}, indent=2))
    (root / "LICENSE.txt").write_text("Permission is hereby granted, free of charge, to any person obtaining a copy.")
    return root


def build(capsys, inputs, output, *extra):
    return run_script(capsys, "--input", *inputs, "--output", output, "--seq-length", 64, "--tokenizer",
                      LLAMA2_LAYOUT_SP_MODEL, "--min-chars", 10, "--no-progress", "--workers", 0, *extra)


def test_a_hf_dataset_folder_reads_its_data_files_only_and_never_its_own_output(tmp_path, capsys):
    folder = hf_dataset_folder(tmp_path / "hf")
    code, stdout, stderr = build(capsys, [folder], folder / "ds")
    assert code == 0, stderr
    manifest = read_manifest(str(folder / "ds"))
    assert [f["path"] for f in manifest["inputs"]["list"]] == [str(folder / "data" / "train-00000.jsonl")]
    assert manifest["documents"]["read"] == len(TEXTS)
    skipped = {os.path.relpath(s["path"], folder): s["reason"] for s in manifest["inputs"]["skipped"]}
    assert set(skipped) == {"README.md", ".gitattributes", "dataset_info.json", "LICENSE.txt"}
    assert skipped["README.md"] == "not the folder's data format (.jsonl/.jsonl.gz/.parquet); name the file to " \
                                   "read it as text"
    assert skipped[".gitattributes"] == "a hidden file"
    # listed before anything is read, counted in the summary, listed in the report
    assert f"not reading 4 path(s) in the input folders (listed in the manifest's inputs.skipped):\n  " \
           f"{folder / '.gitattributes'}: a hidden file\n" in stderr, stderr
    assert "Not read: 4 path(s) in the input folders" in stdout
    code, stdout, stderr = run_script(capsys, "--report", folder / "ds")
    assert code == 0 and f"not read (4 path(s) in the input folders):\n  {folder / '.gitattributes'}" in stdout
    # A rerun into another output inside the folder reads neither the first dataset nor its own output.
    code, stdout, stderr = build(capsys, [folder], folder / "ds2")
    assert code == 0, stderr
    again = read_manifest(str(folder / "ds2"))
    assert [f["path"] for f in again["inputs"]["list"]] == [str(folder / "data" / "train-00000.jsonl")]
    assert again["documents"]["read"] == len(TEXTS)
    assert {"path": str(folder / "ds") + os.sep, "reason": "a dataset written by prepare_data.py"} in \
        again["inputs"]["skipped"]
    assert [s["sha256"] for s in again["shards"]] == [s["sha256"] for s in manifest["shards"]]


def test_an_interrupted_run_inside_its_input_folder_is_not_read_by_its_rerun(tmp_path):
    """What an interrupted run leaves in the folder (OUTPUT.partial with its state, the lock) is not input, so the
    rerun sees the same files as the run it continues."""
    folder = hf_dataset_folder(tmp_path / "hf")
    written = written_paths(str(folder / "ds"), str(folder / "ds-val"))
    before = expand_inputs([str(folder)], written)
    (folder / "ds.partial" / "state").mkdir(parents=True)
    (folder / "ds.partial" / "state" / "run.json").write_text('{"fingerprint": "x", "identity": {}}')
    (folder / "ds.partial" / "notes.txt").write_text("written by the interrupted run, not a document " * 4)
    (folder / "ds.lock").write_text("pid 1\n")
    (folder / "ds.logs" / "pack" / "completions").mkdir(parents=True)  # the run in many tasks
    (folder / "ds.logs" / "pack" / "completions" / "00000.txt").write_text("")
    after = expand_inputs([str(folder)], written)
    assert after.files == before.files == [str(folder / "data" / "train-00000.jsonl")]
    assert (str(folder / "ds.partial") + os.sep, "the output of this run") in after.skipped
    assert (str(folder / "ds.lock"), "the output of this run") in after.skipped
    assert (str(folder / "ds.logs") + os.sep, "the output of this run") in after.skipped


def test_a_folder_of_text_files_reads_them_and_skips_other_kinds(tmp_path, capsys):
    folder = tmp_path / "books"
    folder.mkdir()
    for i, text in enumerate(TEXTS[:4]):
        (folder / f"book{i}.txt").write_text(text)
    (folder / "README.md").write_text("# My books\n\nFour short books, one per file, for a test of folders.\n")
    code, _, stderr = build(capsys, [folder], tmp_path / "ds")
    assert code == 0, stderr
    manifest = read_manifest(str(tmp_path / "ds"))
    assert len(manifest["inputs"]["list"]) == 4 and manifest["documents"]["read"] == 4
    assert [os.path.basename(s["path"]) for s in manifest["inputs"]["skipped"]] == ["README.md"]
    # A file named explicitly is read as it always was, whatever its suffix.
    code, _, stderr = build(capsys, [folder / "README.md", folder / "book0.txt"], tmp_path / "explicit")
    assert code == 0, stderr
    assert read_manifest(str(tmp_path / "explicit"))["documents"]["read"] == 2


def test_a_folder_without_a_data_file_is_refused_naming_what_it_holds_and_the_glob_to_use(tmp_path, capsys):
    folder = tmp_path / "meta"
    folder.mkdir()
    (folder / "dataset_info.json").write_text('{"splits": {}}')
    (folder / "README.md").write_text("# nothing here\n")
    code, _, stderr = build(capsys, [folder], tmp_path / "ds")
    assert code == 2
    assert f"no input file found: {folder}: the folder holds no .jsonl, .parquet or .txt file" in stderr
    assert "'" + str(folder) + "/**/*.json'" in stderr or f"{folder}/**/*.json" in stderr
    assert not os.path.exists(tmp_path / "ds")


def test_a_glob_reads_what_it_names_except_a_dataset_prepare_data_wrote(tmp_path, capsys):
    folder = hf_dataset_folder(tmp_path / "hf")
    code, _, stderr = build(capsys, [folder / "data"], folder / "ds")
    assert code == 0, stderr
    code, _, stderr = build(capsys, [str(folder) + "/**/*.json*"], tmp_path / "globbed")
    assert code == 0, stderr
    manifest = read_manifest(str(tmp_path / "globbed"))
    read = sorted(os.path.relpath(f["path"], folder) for f in manifest["inputs"]["list"])
    assert read == ["data/train-00000.jsonl", "dataset_info.json"]  # not ds/manifest.json
    assert str(folder / "ds" / "manifest.json") in [s["path"] for s in manifest["inputs"]["skipped"]]


def test_an_input_inside_the_output_is_refused(tmp_path, capsys):
    folder = hf_dataset_folder(tmp_path / "hf")
    (folder / "ds.partial").mkdir()
    (folder / "ds.partial" / "x.jsonl").write_text(json.dumps({"text": TEXTS[0]}) + "\n")
    code, _, stderr = build(capsys, [folder / "ds.partial" / "x.jsonl"], folder / "ds")
    assert code == 2 and "is written by this run (--output" in stderr, stderr


# D11: a dataset built with a tokenizer.json whose end-of-text id is 1 and which has no pad token.
@pytest.fixture(scope="module")
def eod_one_dataset(tmp_path_factory):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    root = tmp_path_factory.mktemp("eod_one")
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(TEXTS, trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<|endoftext|>"],
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(root / "tokenizer.json"))
    corpus = root / "c.jsonl"
    corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    out = str(root / "ds")
    manifest = prepare_dataset(out, 64, inputs=[str(corpus)], tokenizer=str(root / "tokenizer.json"),
                               show_progress=False, min_chars=10, workers=0)
    assert (manifest["tokenizer"]["eod_id"], manifest["tokenizer"]["pad_id"]) == (1, -1)
    return out


def test_validate_leads_with_the_recipe_values_for_a_tokenizer_with_other_ids(eod_one_dataset, capsys):
    code, _, stderr = run_script(capsys, "--validate", eod_one_dataset, "--recipe", TINY_RECIPE)
    assert code == 2
    hint = stderr.split("HINT:", 1)[1]
    assert hint.lstrip().startswith(f"set in {TINY_RECIPE}, under model: model_config:"), hint
    assert "pad_token_id: -1" in hint and "eos_token_id: 1" in hint
    assert "--set model.model_config.pad_token_id=-1 --set model.model_config.eos_token_id=1" in hint
    assert hint.index("pad_token_id: -1") < hint.index(" or ")
    assert "--tokenizer" not in hint  # rebuilding with the same tokenizer.json gives the same ids
    # The values the hint names make the recipe fit.
    fixed = load_recipe(TINY_RECIPE, ("model.model_config.pad_token_id=-1", "model.model_config.eos_token_id=1"))
    assert "matches recipe" in validate_dataset(eod_one_dataset, TINY_RECIPE, fixed.model.model_config)


def test_the_launch_check_leads_with_the_recipe_values_too(eod_one_dataset):
    with pytest.raises(DataError) as err:
        check_dataset(eod_one_dataset, 64, 512, 3, 2)
    assert err.value.hint.startswith("set in the recipe, under model: model_config: pad_token_id: -1, "
                                     "eos_token_id: 1"), err.value.hint
    assert "--tokenizer" not in err.value.hint
