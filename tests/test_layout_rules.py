"""A house a newcomer can walk: no module over 600 lines, no folder over 12 modules.

A module past ~600 lines usually holds two jobs, a folder past ~12 modules two audiences; either is
split by job (training/launcher: cli, cluster, supervision, failure_report) or by who runs the code
(training/: launcher, worker, recipe, tools). Modules are the .py files of a folder, __init__.py aside;
each folder is counted on its own, sub-folders included.
"""

import os

from conftest import REPO_ROOT

FOLDERS = ("common", "models", "data", "training", "scripts")
MAX_LINES = 600
MAX_MODULES = 12

# Known exceptions, each being split on another branch: remove an entry once that branch is merged
# (test_known_exceptions_are_still_needed fails on an entry that no longer exceeds the limit).
OVERSIZED = {}
CROWDED = {}


def _folders(repo: str):
    for top in FOLDERS:
        for directory, dirs, files in os.walk(os.path.join(repo, top)):
            dirs[:] = sorted(d for d in dirs if d != "__pycache__" and not d.startswith("."))
            yield os.path.relpath(directory, repo), sorted(f for f in files if f.endswith(".py"))


def module_lines(repo: str) -> dict:
    """{path relative to the repository: line count} of every module under FOLDERS."""
    lines = {}
    for folder, files in _folders(repo):
        for name in files:
            with open(os.path.join(repo, folder, name), encoding="utf-8") as f:
                lines[os.path.join(folder, name)] = sum(1 for _ in f)
    return lines


def folder_modules(repo: str) -> dict:
    """{folder relative to the repository: number of modules in it, __init__.py aside}."""
    return {folder: len([f for f in files if f != "__init__.py"]) for folder, files in _folders(repo)}


def oversized_modules(repo: str, allowed=()) -> list:
    return [f"{path}: {n} lines (at most {MAX_LINES}); split it by job"
            for path, n in sorted(module_lines(repo).items()) if n > MAX_LINES and path not in allowed]


def crowded_folders(repo: str, allowed=()) -> list:
    return [f"{folder}/: {n} modules (at most {MAX_MODULES}); split it by who runs the code"
            for folder, n in sorted(folder_modules(repo).items()) if n > MAX_MODULES and folder not in allowed]


def test_no_module_over_600_lines():
    assert oversized_modules(REPO_ROOT, OVERSIZED) == []


def test_no_folder_over_12_modules():
    assert crowded_folders(REPO_ROOT, CROWDED) == []


def test_known_exceptions_are_still_needed():
    lines, modules = module_lines(REPO_ROOT), folder_modules(REPO_ROOT)
    stale = [f"{path} ({why}): {lines.get(path, 'gone')} lines now; remove it from OVERSIZED"
             for path, why in OVERSIZED.items() if lines.get(path, 0) <= MAX_LINES]
    stale += [f"{folder}/ ({why}): {modules.get(folder, 'gone')} modules now; remove it from CROWDED"
              for folder, why in CROWDED.items() if modules.get(folder, 0) <= MAX_MODULES]
    assert stale == []


def test_a_long_module_and_a_crowded_folder_are_caught(tmp_path):
    (tmp_path / "training" / "tools").mkdir(parents=True)
    (tmp_path / "training" / "long.py").write_text("x = 1\n" * (MAX_LINES + 1))
    (tmp_path / "training" / "short.py").write_text("x = 1\n" * MAX_LINES)
    for i in range(MAX_MODULES + 1):
        (tmp_path / "training" / "tools" / f"m{i}.py").write_text("")
    (tmp_path / "training" / "tools" / "__init__.py").write_text("")  # not a module of its own
    assert oversized_modules(str(tmp_path)) == [f"training/long.py: {MAX_LINES + 1} lines (at most {MAX_LINES}); "
                                                "split it by job"]
    assert crowded_folders(str(tmp_path)) == [f"training/tools/: {MAX_MODULES + 1} modules (at most {MAX_MODULES}); "
                                              "split it by who runs the code"]
    os.remove(tmp_path / "training" / "tools" / "m0.py")
    assert crowded_folders(str(tmp_path)) == [] and oversized_modules(str(tmp_path), {"training/long.py"}) == []
