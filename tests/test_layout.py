"""The package's layout keeps its rules: packages talk through their public names."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "forget"
MODULES = sorted(p for p in SRC.rglob("*.py") if "__pycache__" not in p.parts)


def _package(path: Path) -> tuple[str, ...]:
    """The package a module sits in, as a tuple of names under ``forget``.

    A private subpackage (``planning/_tree/``) is a room of the public package
    above it: `_owner` of this is the package whose private names it may use.
    """
    parts = path.relative_to(SRC.parent).with_suffix("").parts
    return parts[:-1]


def _imports(source: str, package: tuple[str, ...]) -> list[tuple[tuple[str, ...], str]]:
    """(module imported from, name) for every ``forget`` import of a module's source."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.ImportFrom):
            continue
        if node.level:
            base = package[: len(package) - node.level + 1]
            target = base + tuple(node.module.split(".") if node.module else ())
        elif node.module and node.module.split(".")[0] == "forget":
            target = tuple(node.module.split("."))
        else:
            continue
        found += [(target, alias.name) for alias in node.names]
    return found


def _owner(target: tuple[str, ...]) -> tuple[str, ...]:
    """The package a dotted target lives in: the part before its first private name."""
    for i, part in enumerate(target):
        if part.startswith("_"):
            return target[:i]
    return target


@pytest.mark.parametrize("path", MODULES, ids=[str(p.relative_to(SRC)) for p in MODULES])
def test_no_module_imports_another_packages_private_names(path):
    package = _package(path)
    for target, name in _imports(path.read_text(), package):
        private = any(p.startswith("_") for p in target) or (
            name.startswith("_") and name != "__future__"
        )
        if not private or target == ("__future__",):
            continue
        owner = _owner(target) if any(p.startswith("_") for p in target) else target
        assert owner == _owner(package), (
            f"{path.relative_to(SRC)} imports {name!r} from {'.'.join(target)}, a private "
            f"name of the package {'.'.join(owner)}; import a public name of that package"
        )


def test_the_rules_catch_what_they_forbid():
    # The check above can fail: relative and absolute private imports resolve to
    # the package that owns them.
    planning = ("forget", "planning")
    relative = _imports("from ..engine._region import Region\n", planning)
    absolute = _imports("from forget.engine import _region\n", planning)
    assert relative == [(("forget", "engine", "_region"), "Region")]
    assert absolute == [(("forget", "engine"), "_region")]
    assert _owner(relative[0][0]) == ("forget", "engine") != planning
    assert _imports("from ._plan import Plan\n", planning) == [
        (("forget", "planning", "_plan"), "Plan")
    ]
    # A room (a private subpackage) uses its package's private names, no other's.
    room = ("forget", "planning", "_tree")
    shared = _imports("from .._guard import guard\n", room)
    assert _owner(shared[0][0]) == _owner(room) == planning
    other = _imports("from ...engine._region import Region\n", room)
    assert _owner(other[0][0]) == ("forget", "engine") != _owner(room)


def test_public_functions_stay_functions_once_every_subpackage_is_imported():
    # A subpackage named like a public function would replace it on `forget`
    # when imported (what made `forget.plan` a module); none is.
    import importlib

    import forget

    for name in ("engine", "memory", "planning", "schedules", "cli", "integrations"):
        importlib.import_module(f"forget.{name}")
    for name in ("forget", "checkpoint", "plan", "saved", "measure", "regenerating"):
        value = getattr(forget, name)
        assert callable(value) and not isinstance(value, type(forget)), name
    assert forget.plan.__module__ == "forget.planning._chain.planner"
