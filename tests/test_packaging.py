"""setup.cfg declares what the installed package imports."""

import ast
import configparser
import os
import re
import sys
from importlib.metadata import packages_distributions

from conftest import REPO_ROOT

PACKAGE_FOLDERS = ("common", "models", "data", "training")
# Imported only by features that say so when the module is missing; declared in an extra.
OPTIONAL = {
    "torch": "reading .bin/.pt and Megatron checkpoints, --verify",
    "transformers": "--verify's reference model",
    "datatrove": "prepare_data.py --executor/--tasks (the scale extra)",
    "ray": "prepare_data.py --executor ray (the scale extra)",
}


def requirement_names(text: str) -> set:
    names = (re.split(r"[<>=!~;\[ ]", line.strip(), maxsplit=1)[0] for line in text.splitlines())
    return {re.sub(r"[-_.]+", "-", name).lower() for name in names if name and not name.startswith("#")}


def imported_modules() -> dict:
    """Top-level third-party module -> the package files importing it (function-level imports included)."""
    found = {}
    for folder in PACKAGE_FOLDERS:
        for directory, _, files in os.walk(os.path.join(REPO_ROOT, folder)):
            for name in (f for f in files if f.endswith(".py")):
                path = os.path.join(directory, name)
                with open(path, encoding="utf-8") as f:
                    tree = ast.parse(f.read(), path)
                for node in ast.walk(tree):
                    if isinstance(node, ast.Import):
                        modules = [alias.name for alias in node.names]
                    elif isinstance(node, ast.ImportFrom) and node.level == 0:
                        modules = [node.module]
                    else:
                        continue
                    for top in (m.split(".")[0] for m in modules):
                        if top not in sys.stdlib_module_names and top != "ascend_llm_recipes":
                            found.setdefault(top, set()).add(os.path.relpath(path, REPO_ROOT))
    return found


def test_every_imported_distribution_is_declared():
    setup = configparser.ConfigParser()
    setup.read(os.path.join(REPO_ROOT, "setup.cfg"))
    required = requirement_names(setup["options"]["install_requires"])
    extras = set().union(*(requirement_names(v) for v in setup["options.extras_require"].values()))
    distributions = packages_distributions()
    undeclared = []
    for module, files in sorted(imported_modules().items()):
        assert module in distributions, f"{module} (imported by {sorted(files)}) is not installed"
        names = {re.sub(r"[-_.]+", "-", d).lower() for d in distributions[module]}
        declared = extras if module in OPTIONAL else required
        if not names & declared:
            undeclared.append(f"{module} ({', '.join(sorted(files))})")
    assert not undeclared, f"imported but not declared in setup.cfg: {undeclared}"


def test_every_data_file_of_the_package_is_installed_with_it():
    """A non-editable install copies .py files only, unless package_data names the others (e.g. the version table)."""
    setup = configparser.ConfigParser()
    setup.read(os.path.join(REPO_ROOT, "setup.cfg"))
    declared = {(package.split(".")[1], os.path.join(*package.split(".")[2:], name))
                for package, names in setup["options.package_data"].items()
                for name in names.split(",") for name in [name.strip()] if name}
    shipped = {(folder, os.path.relpath(os.path.join(directory, name), os.path.join(REPO_ROOT, folder)))
               for folder in PACKAGE_FOLDERS for directory, dirs, files in os.walk(os.path.join(REPO_ROOT, folder))
               for name in files if not name.endswith((".py", ".pyc"))}
    assert shipped and shipped <= declared, f"not in setup.cfg [options.package_data]: {sorted(shipped - declared)}"
