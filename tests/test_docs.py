"""README.md and its Simplified-Chinese version README.zh-CN.md stay in step: same sections, same commands."""

import os
import re

import pytest

from conftest import REPO_ROOT

ENGLISH = os.path.join(REPO_ROOT, "README.md")
CHINESE = os.path.join(REPO_ROOT, "README.zh-CN.md")

# An inline code span a reader types or looks for: a path, an option, a command line, a KEY=value, a file name.
COMMAND = re.compile(r"/|^-|=|^(python|bash|pip|sbatch|docker|source|pytest|kill|ray|msrun)\b"
                     r"|\.[A-Za-z][A-Za-z0-9]{0,8}$")


class Section:
    """One heading and what follows it up to the next heading (fenced code blocks apart)."""

    def __init__(self, level: int, title: str):
        self.level, self.title = level, title
        self.text, self.blocks = [], []

    def __str__(self):
        return f"{'#' * self.level} {self.title}"

    def commands(self) -> set:
        """The section's inline code spans that are commands or paths, whitespace normalised (spans may wrap)."""
        spans = re.findall(r"`([^`]+)`", "\n".join(self.text))
        return {" ".join(span.split()) for span in spans if COMMAND.search(" ".join(span.split()))}


def sections(path: str) -> list:
    """The file's sections in order; text before the first heading belongs to a level-0 section."""
    found = [Section(0, "(before the first heading)")]
    block = None
    with open(path, encoding="utf-8") as f:
        for line in f:
            if block is not None:
                block.append(line)
                if line.strip() == "```":
                    found[-1].blocks.append("".join(block))
                    block = None
            elif line.startswith("```"):
                block = [line]
            elif re.match(r"#{1,6} ", line):
                level = len(line) - len(line.lstrip("#"))
                found.append(Section(level, line[level:].strip()))
            else:
                found[-1].text.append(line)
    assert block is None, f"{path}: a fenced code block is never closed"
    return found


@pytest.fixture(scope="module")
def readmes():
    return sections(ENGLISH), sections(CHINESE)


def test_each_readme_links_to_the_other():
    with open(ENGLISH, encoding="utf-8") as f:
        english = f.read().splitlines()[:5]
    with open(CHINESE, encoding="utf-8") as f:
        chinese = f.read().splitlines()[:5]
    assert any("(README.zh-CN.md)" in line for line in english), "README.md: no link to README.zh-CN.md at the top"
    assert any("(README.md)" in line for line in chinese), "README.zh-CN.md: no link back to README.md at the top"


def heading_problems(english: list, chinese: list) -> list:
    for i, (en, zh) in enumerate(zip(english, chinese)):
        if en.level != zh.level:
            return [f"heading {i}: README.md has {en!s:.60} (level {en.level}) where README.zh-CN.md has {zh!s:.60} "
                    f"(level {zh.level}); the section structures differ from here on"]
    if len(english) != len(chinese):
        extra = (english if len(english) > len(chinese) else chinese)[min(len(english), len(chinese)):]
        return [f"README.md has {len(english) - 1} headings, README.zh-CN.md {len(chinese) - 1}; the extra ones: "
                + "; ".join(map(str, extra))]
    return []


def code_block_problems(english: list, chinese: list) -> list:
    problems = []
    for en, zh in zip(english, chinese):
        if len(en.blocks) != len(zh.blocks):
            problems.append(f"section {en} / {zh}: {len(en.blocks)} fenced code block(s) in README.md, "
                            f"{len(zh.blocks)} in README.zh-CN.md")
        for number, (a, b) in enumerate(zip(en.blocks, zh.blocks), 1):
            a, b = a.splitlines() + [""], b.splitlines() + [""]
            line = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
            if line is not None:
                problems.append(f"section {en} / {zh}, code block {number}, line {line + 1}: README.md has "
                                f"{a[line]!r}, README.zh-CN.md has {b[line]!r}")
    return problems


def command_problems(english: list, chinese: list) -> list:
    problems = []
    for en, zh in zip(english, chinese):
        problems += [f"section {en} / {zh}: `{span}` is in README.md, not in README.zh-CN.md"
                     for span in sorted(en.commands() - zh.commands())]
        problems += [f"section {en} / {zh}: `{span}` is in README.zh-CN.md, not in README.md"
                     for span in sorted(zh.commands() - en.commands())]
    return problems


def test_same_headings_at_the_same_levels(readmes):
    problems = heading_problems(*readmes)
    assert not problems, problems[0]


def test_same_code_blocks_in_the_same_sections(readmes):
    assert not heading_problems(*readmes), "the section structures differ: see test_same_headings_at_the_same_levels"
    problems = code_block_problems(*readmes)
    assert not problems, "fenced code blocks are copied verbatim, never translated:\n" + "\n".join(problems)


def test_same_commands_and_paths_in_the_same_sections(readmes):
    assert not heading_problems(*readmes), "the section structures differ: see test_same_headings_at_the_same_levels"
    problems = command_problems(*readmes)
    assert not problems, "inline commands and paths differ (copy them verbatim):\n" + "\n".join(problems)


def test_each_difference_is_named_with_its_section(readmes, tmp_path):
    """The checks above on an edited copy of the Chinese README: each edit is reported where it is."""
    english = readmes[0]
    with open(CHINESE, encoding="utf-8") as f:
        text = f.read()
    edited = text.replace("pip install -e . && bash scripts/run_distributed.sh recipes/demo_cpu.yaml",
                          "pip install -e . && bash scripts/run_distributed.sh recipes/tiny_cpu.yaml", 1)
    edited = edited.replace("`python scripts/benchmark_convert.py`", "`python scripts/benchmark_convert.py --x`", 1)
    copy = tmp_path / "README.zh-CN.md"
    copy.write_text(edited, encoding="utf-8")
    chinese = sections(str(copy))
    assert code_block_problems(english, chinese) == [
        f"section {english[2]} / {chinese[2]}, code block 1, line 2: README.md has "
        "'pip install -e . && bash scripts/run_distributed.sh recipes/demo_cpu.yaml', README.zh-CN.md has "
        "'pip install -e . && bash scripts/run_distributed.sh recipes/tiny_cpu.yaml'"]
    converting = next(i for i, s in enumerate(english) if s.title == "Converting checkpoints")
    assert command_problems(english, chinese) == [
        f"section {english[converting]} / {chinese[converting]}: `python scripts/benchmark_convert.py` is in "
        "README.md, not in README.zh-CN.md",
        f"section {english[converting]} / {chinese[converting]}: `python scripts/benchmark_convert.py --x` is in "
        "README.zh-CN.md, not in README.md"]
    copy.write_text(text.replace("\n### 多节点\n", "\n## 多节点\n", 1), encoding="utf-8")
    problem, = heading_problems(english, sections(str(copy)))
    assert problem.startswith("heading ")
    assert "has ### Several nodes (level 3) where README.zh-CN.md has ## 多节点 (level 2)" in problem
