"""The shared base: one atomic writer and one file hash for every package."""

import hashlib
import json
import os

import pytest

from ascend_llm_recipes.common.files import file_sha256, write_atomic, write_json_atomic


def test_write_atomic_replaces_whole_or_not_at_all(tmp_path):
    path = str(tmp_path / "state.json")
    write_json_atomic(path, {"step": 1}, indent=1)
    write_atomic(path, b'{"step": 2}', fsync=False)
    assert json.load(open(path)) == {"step": 2}
    with pytest.raises(UnicodeEncodeError):  # fails while writing the temporary file
        write_atomic(path, '{"step": 3, "bad": "\udc80"}')
    assert json.load(open(path)) == {"step": 2} and os.listdir(tmp_path) == ["state.json"]


def test_file_sha256_reads_in_blocks(tmp_path):
    data = os.urandom((1 << 20) * 2 + 7)  # crosses the 1 MB block boundary
    (tmp_path / "blob").write_bytes(data)
    assert file_sha256(str(tmp_path / "blob")) == hashlib.sha256(data).hexdigest()
