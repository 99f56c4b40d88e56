"""Which files an `--input` names: a path, a glob, or a folder read for its data files only.

A folder is read for its data format, the most structured one its files have: its `.jsonl`/
`.jsonl.gz`/`.parquet` files when it holds any, else its `.txt`/`.txt.gz` files. Everything else
in it (a dataset card README.md, .gitattributes, dataset_info.json, a LICENSE.txt beside .jsonl
files, hidden files and folders such as .git or .cache) is listed as skipped, with the reason,
before anything is read. A file named explicitly is read whatever its suffix (any other suffix
as text), and a glob reads every file it matches, as the user chose them.

Whatever the input, nothing prepare_data.py writes is ever read: the run's own output (OUTPUT,
OUTPUT.partial, OUTPUT.lock, OUTPUT.logs and the validation dataset's), a dataset an earlier run wrote (a
folder with our manifest.json), an interrupted one (*.partial with its state/) and a report.
"""

import glob
import json
import os
from dataclasses import dataclass, field

from ascend_llm_recipes.common.errors import DataError
from ascend_llm_recipes.data.mindrecord_io import (MANIFEST, PADDING_PLOT, REPORT_TEXT, lock_path, logs_dir,
                                                   partial_dir)
from ascend_llm_recipes.data.run_state import STATE

STRUCTURED = (".jsonl", ".jsonl.gz", ".parquet")
PLAIN = (".txt", ".txt.gz")
OUR_OUTPUT = "the output of this run"


@dataclass
class Inputs:
    """files: sorted, to read; problems: [(path or pattern, reason)] naming nothing readable (counted as
    unreadable); skipped: [(path, reason)] found in a folder or by a glob but not read, by the rules above
    (a folder's path ends with a separator)."""

    files: list = field(default_factory=list)
    problems: list = field(default_factory=list)
    skipped: list = field(default_factory=list)


def written_paths(output_dir: str, val_output: str) -> list:
    """Everything a run into `output_dir` writes beside its inputs (the lock files and task records included)."""
    return [p for d in (output_dir, val_output) for p in (d, partial_dir(d), lock_path(d), logs_dir(d))]


def expand_inputs(patterns: list, written: list = ()) -> Inputs:
    """The files `patterns` name (paths, globs, folders), sorted so that the output does not depend on the order
    the shell or the user listed them in. `written`: paths this run writes (written_paths), never read.

    A dangling symbolic link or a FIFO that a glob or a folder yields is a problem reported here, before anything
    is read, rather than failing (or blocking) when it is opened.
    """
    ours = [os.path.abspath(p) for p in written]
    files, problems, skipped = set(), {}, {}
    for pattern in map(str, patterns):
        if glob.has_magic(pattern):
            found = [p for p in glob.glob(pattern, recursive=True) if not os.path.isdir(p)]
            if not found:
                problems[pattern] = "the pattern matches no file"
            found = _not_ours(found, _literal_base(pattern), ours, skipped)
        elif os.path.isdir(pattern):
            found, reason = _folder(pattern, ours, skipped)
            if reason:
                problems[pattern] = reason
        elif os.path.lexists(pattern):
            within = _within(pattern, ours)
            if within:
                raise DataError(f"--input {pattern} is written by this run (--output {within})",
                                hint="a run never reads its own output: choose an --output outside the input, or "
                                     "another input; nothing was written")
            found = [pattern]
        else:
            found = []
            problems[pattern] = "no such file"
        for path in found:
            if os.path.isfile(path):
                files.add(path)
            else:
                problems[path] = _not_a_file(path)
    return Inputs(sorted(files), sorted(problems.items()), sorted(skipped.items()))


def _folder(root: str, ours: list, skipped: dict) -> tuple:
    """(files to read, or a reason there are none) below folder `root`; what is left out goes to `skipped`."""
    reason = OUR_OUTPUT if _within(root, ours) else _written_by_prepare(os.path.abspath(root))
    if reason:
        return [], f"the folder is {reason}: prepare_data.py never reads what it wrote"
    candidates, total = [], 0
    for dirpath, dirnames, names in os.walk(root):
        kept = []
        for name in sorted(dirnames):
            path = os.path.join(dirpath, name)
            if name.startswith("."):
                why = "a hidden folder"
            else:
                why = OUR_OUTPUT if _within(path, ours) else _written_by_prepare(os.path.abspath(path))
            if why:
                skipped[path + os.sep] = why
            else:
                kept.append(name)
        dirnames[:] = kept
        for name in names:
            path, total = os.path.join(dirpath, name), total + 1
            if name.startswith("."):
                skipped[path] = "a hidden file"
            elif _within(path, ours):
                skipped[path] = OUR_OUTPUT
            else:
                candidates.append(path)
    if not total and not skipped:
        return [], "the folder holds no file"
    for kinds in (STRUCTURED, PLAIN):
        chosen = [p for p in candidates if p.lower().endswith(kinds)]
        if chosen:
            label = "/".join(kinds)
            for path in candidates:
                if path not in chosen:
                    skipped[path] = f"not the folder's data format ({label}); name the file to read it as text"
            return chosen, None
    for path in candidates:
        skipped[path] = "not a data format read in folders (.jsonl, .parquet, .txt)"
    suffixes = sorted({_suffix(p) for p in candidates})
    example = os.path.join(root, "**", "*" + (suffixes[0] if suffixes else ""))
    return [], ("the folder holds no .jsonl, .parquet or .txt file" +
                (f" (it holds {', '.join(s or 'no suffix' for s in suffixes)}); to read such files as text, name them "
                 f"or give a glob, e.g. --input '{example}'" if candidates else ""))


def _not_ours(found: list, base: str, ours: list, skipped: dict) -> list:
    """Glob matches without what this run or an earlier one wrote (checked in the folders below the glob's base)."""
    kept, checked = [], {}
    for path in found:
        reason = OUR_OUTPUT if _within(path, ours) else ""
        folder = os.path.dirname(os.path.abspath(path))
        while not reason and _within(folder, [base]):
            if folder not in checked:
                checked[folder] = _written_by_prepare(folder)
            reason = checked[folder]
            if folder == base:
                break
            folder = os.path.dirname(folder)
        if reason:
            skipped[path] = reason
        else:
            kept.append(path)
    return kept


def _literal_base(pattern: str) -> str:
    """The absolute folder a glob starts from (its components before the first wildcard)."""
    parts = pattern.split(os.sep)
    literal = parts[:next(i for i, p in enumerate(parts) if glob.has_magic(p))]
    return os.path.abspath(os.sep.join(literal) or (os.sep if pattern.startswith(os.sep) else "."))


def _within(path: str, ours: list) -> str:
    """The written path that `path` is or lies inside, else ''."""
    path = os.path.abspath(path)
    return next((w for w in ours if path == w or path.startswith(w.rstrip(os.sep) + os.sep)), "")


def _written_by_prepare(folder: str) -> str:
    """Why `folder` is something prepare_data.py wrote, else ''."""
    try:
        with open(os.path.join(folder, MANIFEST), encoding="utf-8") as f:
            if "format_version" in json.load(f):
                return "a dataset written by prepare_data.py"
    except (OSError, ValueError, TypeError):
        pass
    if folder.endswith(".partial") and os.path.isdir(os.path.join(folder, STATE)):
        return "an unfinished dataset of prepare_data.py"
    if os.path.isfile(os.path.join(folder, REPORT_TEXT)) and os.path.isfile(os.path.join(folder, PADDING_PLOT)):
        return "a report written by prepare_data.py --report"
    return ""


def _suffix(path: str) -> str:
    """'.md', '.json.gz', or '' (no suffix)."""
    name = os.path.basename(path).lower()
    compressed = name.endswith(".gz")
    suffix = os.path.splitext(name[:-3] if compressed else name)[1]
    return suffix + ".gz" if suffix and compressed else suffix


def _not_a_file(path: str) -> str:
    if os.path.islink(path) and not os.path.exists(path):
        return f"a symbolic link to {os.readlink(path)}, which does not exist"
    return "not a regular file"
