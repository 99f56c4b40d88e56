"""Sources of raw documents.

The default corpus is the Python standard library's own source: real text that exists
wherever Python runs, so the demo needs no download.
"""

import os
import sysconfig
from pathlib import Path
from typing import Iterator

SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "__pycache__", "idle_test"}


def python_stdlib_files() -> list:
    """The standard library's .py files (tests and installed packages left out), sorted."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS)
        files.extend(Path(dirpath) / name for name in filenames if name.endswith(".py"))
    return sorted(files)


def read_documents(paths) -> Iterator:
    """Yield (path, bytes) for each file: one file is one document; decoding is cleaning's job."""
    for path in paths:
        yield str(path), Path(path).read_bytes()
