"""Device tests, run only on an 8-device Ascend node: the acceptance kit may not FAIL any check."""

import json
import subprocess

import pytest

from ascend_llm_recipes.training.tools.acceptance import REPO_ROOT, ascend_missing

pytestmark = [pytest.mark.ascend, pytest.mark.skipif(bool(ascend_missing()), reason=ascend_missing() or "-")]


def test_acceptance_kit_has_no_failed_check(tmp_path):
    result = subprocess.run(["bash", f"{REPO_ROOT}/scripts/ascend_acceptance.sh", str(tmp_path)], timeout=6 * 3600)
    with open(tmp_path / "acceptance.json", encoding="utf-8") as f:
        report = json.load(f)
    failed = {name: r for name, r in report.items() if r["status"] == "FAIL"}
    assert not failed and result.returncode == 0, failed
