"""Examples in docstrings and in the README run, and do what they say."""

from __future__ import annotations

import doctest
import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
SRC = ROOT / "src"


def _modules_with_examples() -> list[str]:
    """Every module of the package whose source holds a ``>>>`` example."""
    names = []
    for path in sorted((SRC / "forget").rglob("*.py")):
        if ">>>" in path.read_text():
            parts = path.relative_to(SRC).with_suffix("").parts
            names.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return names


MODULES = _modules_with_examples()


def test_examples_are_found():
    assert {
        "forget._engine._forget",
        "forget._nn",
        "forget._planning._plan",
        "forget.schedules",
    } <= set(MODULES)


# The examples plan and profile to show what a plan does with bytes; they run on the
# fixed clock (conftest.py), which skips the timed steps, not the measured ones.
pytestmark = pytest.mark.usefixtures("fixed_clock")


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0, f"{name} has no example"
    assert result.failed == 0


def _python_blocks(text: str) -> list[str]:
    """Each python block of ``text``, led by blank lines to stand on its own lines.

    Compiled under the page's name, a failing line then reads as ``page.md:67`` in
    the traceback (``exec`` gets no assertion rewriting to say more).
    """
    return [
        "\n" * text.count("\n", 0, match.start(1)) + match.group(1)
        for match in re.finditer(r"```python\n(.*?)```", text, flags=re.DOTALL)
    ]


def test_readme_python_examples_run():
    blocks = _python_blocks(README.read_text())
    assert blocks
    for block in blocks:
        exec(compile(block, str(README), "exec"), {})


DOCS = sorted((ROOT / "docs").glob("*.md"))


def test_every_feature_has_a_page():
    names = {path.stem for path in DOCS}
    assert {
        "measure",
        "policies",
        "plan",
        "cli",
        "transformers",
        "compile",
        "distributed",
    } <= names


@pytest.mark.parametrize("page", DOCS, ids=[path.name for path in DOCS])
def test_docs_python_examples_run(page, monkeypatch, tmp_path):
    # One namespace per page, blocks in order: a page's examples build on each other.
    blocks = _python_blocks(page.read_text())
    assert blocks, f"{page.name} has no python example"
    monkeypatch.chdir(tmp_path)
    namespace: dict[str, object] = {"__name__": f"docs_{page.stem}"}
    for block in blocks:
        exec(compile(block, str(page), "exec"), namespace)


def test_readme_names_the_ci_command():
    ci = (README.parent / ".ci" / "run").read_text()
    assert "./dev test" in ci
    assert "./dev test" in README.read_text()
    assert "./dev demo" in README.read_text()


def test_readme_opens_with_the_choice_of_a_tool():
    # Right after the intro, before anything else: situation -> tool.
    text = README.read_text()
    first_table = text[text.index("\n|") : text.index("\n## ")]
    for tool in (
        "forget.plan(",
        "forget.cap(",
        "forget.checkpoint(",
        "forget.apply_forget(",
        "forget.integrations.transformers.enable(",
        "chunk_loss(",
        "forget.chunked(",
    ):
        assert tool in first_table, tool
