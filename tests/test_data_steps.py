"""The text preparation steps (data/text/steps.py) composed by hand, as data/text/pipeline.py and data/cluster/scale.py
compose them:
dedup keeps the first copy across chunks, decide's verdicts replayed by `Verdicts` keep what `Dedup` keeps, and a
bad input line under --strict stops the Account step naming its file and line."""

import json

import numpy as np
import pytest

from ascend_llm_recipes.common.errors import DataError
from ascend_llm_recipes.data.text.dedup import KeyIndex
from ascend_llm_recipes.data.text.pipeline import PrepareOptions
from ascend_llm_recipes.data.report import Report, Tallies
from ascend_llm_recipes.data.run_state import Job
from ascend_llm_recipes.data.text.steps import (DUPLICATE, KEEP, Account, CleanTokenize, Dedup, PerBatch, Reader,
                                                Verdicts, run_steps)
from ascend_llm_recipes.data.text.workers import WorkerConfig

DOCS = ["the first document, long enough", "a second document, also long enough", "the first document, long enough",
        "a third one that is different", "a second document, also long enough"]


class Keeps(PerBatch):
    """The last step: what survived dedup, per batch."""

    def __init__(self):
        self.keeps, self.digests = [], []

    def apply(self, batch) -> None:
        self.keeps.append(batch.keep.copy())
        self.digests.append(batch.result.digest[:len(batch.keep)])


def job_for(tmp_path, lines: list, **options) -> Job:
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    opts = PrepareOptions(min_chars=1, workers=0, **options)
    return Job(str(tmp_path / "ds"), 64, 256, "jsonl", [str(path)], [str(path)], [], 0, "", 16, False, opts)


def read_steps(job: Job, tallies: Tallies) -> list:
    """Reader -> CleanTokenize (clean and hash only) -> Account."""
    config = WorkerConfig(job.opts.clean(), job.opts.text_field, None, 2, False)
    return [Reader(job), CleanTokenize(config, 0), Account(Report(job, tallies))]


def test_dedup_keeps_the_first_copy_within_a_chunk_and_across_chunks(tmp_path):
    job = job_for(tmp_path, [json.dumps({"text": d}) for d in DOCS])
    tallies, keeps = Tallies(1), Keeps()
    seen = KeyIndex(str(tmp_path / "seen.u64"))
    dedup = Dedup(tallies, seen)
    run_steps(read_steps(job, tallies) + [dedup, keeps])
    assert keeps.keeps[0].tolist() == [True, True, False, True, False]
    assert tallies.documents["read"] == 5 and tallies.documents["duplicates"] == 2
    run_steps(read_steps(job, tallies) + [dedup, keeps])  # the same input again: every document seen before
    assert not keeps.keeps[1].any() and tallies.documents["duplicates"] == 7
    seen.close()
    restored = KeyIndex(str(tmp_path / "seen.u64"), 2)  # a resumed run's index, restored to its snapshot
    digests = keeps.digests[0]
    assert Dedup(Tallies(1), restored).judge(digests[[0, 3, 1]], None, None, None, None, None).tolist() == \
        [DUPLICATE, KEEP, DUPLICATE]


def test_verdicts_taken_once_keep_what_dedup_keeps(tmp_path):
    """data/cluster/scale.py's decide stage judges with Dedup.judge; its pack stage replays the verdicts with
    Verdicts."""
    job = job_for(tmp_path, [json.dumps({"text": d}) for d in DOCS])
    tallies, keeps = Tallies(1), Keeps()
    run_steps(read_steps(job, tallies) + [Dedup(tallies, KeyIndex(str(tmp_path / "seen.u64"))), keeps])
    verdicts = np.where(keeps.keeps[0], KEEP, DUPLICATE).astype(np.uint8)
    replayed, replay_keeps = Tallies(1), Keeps()
    step = Verdicts(replayed, verdicts)
    run_steps(read_steps(job, replayed) + [step, replay_keeps])
    assert replay_keeps.keeps[0].tolist() == keeps.keeps[0].tolist() and step.at == len(verdicts)
    assert replayed.documents == tallies.documents


def test_a_bad_line_under_strict_stops_the_account_step_naming_file_and_line(tmp_path):
    job = job_for(tmp_path, [json.dumps({"text": DOCS[0]}), '{"text": "unterminated', json.dumps({"text": DOCS[1]})],
                  strict=True)
    with pytest.raises(DataError, match=r"bad input: .*docs\.jsonl:2: "):
        run_steps(read_steps(job, Tallies(1)))
    lenient = job_for(tmp_path, [json.dumps({"text": DOCS[0]}), '{"text": "unterminated'])
    tallies = Tallies(1)
    run_steps(read_steps(lenient, tallies))
    assert tallies.bad["malformed_json"] == 1 and tallies.first["malformed_json"].startswith(f"{lenient.files[0]}:2:")
