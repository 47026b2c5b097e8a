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
    """The package a dotted target lives in.

    Each package directly under ``forget`` is a package of its own, private
    (``_engine``) or public (``integrations``); below that, the part before the
    first private name: a private subpackage is a room of its package.
    """
    if target[:1] != ("forget",) or len(target) < 2:
        return target[:1]
    for i in range(2, len(target)):
        if target[i].startswith("_"):
            return target[:i]
    return target


def _private(target: tuple[str, ...], name: str) -> bool:
    """Whether an import reaches past a package's public names."""
    inner = target[2:] if target[:1] == ("forget",) else target
    return any(p.startswith("_") for p in inner) or (name.startswith("_") and name != "__future__")


@pytest.mark.parametrize("path", MODULES, ids=[str(p.relative_to(SRC)) for p in MODULES])
def test_no_module_imports_another_packages_private_names(path):
    package = _package(path)
    for target, name in _imports(path.read_text(), package):
        if target == ("__future__",) or not _private(target, name):
            continue
        owner = _owner(target)
        assert owner == _owner(package), (
            f"{path.relative_to(SRC)} imports {name!r} from {'.'.join(target)}, a private "
            f"name of the package {'.'.join(owner)}; import a public name of that package"
        )


# Packages below others (DESIGN.md, "Layers of the code"): each imports none of those.
BELOW = {
    "_runtime": ("_planning",),  # the cap uses the model tree's regions, not the planner
    "_regions": ("_planning", "_runtime"),  # facts of the model tree, below both
}


@pytest.mark.parametrize("below", sorted(BELOW))
def test_lower_layers_import_nothing_of_the_higher(below):
    paths = sorted((SRC / below).rglob("*.py"))
    assert paths, below
    for path in paths:
        for target, name in _imports(path.read_text(), _package(path)):
            whole = (*target, name) if target == ("forget",) else target
            above = next((p for p in BELOW[below] if whole[:2] == ("forget", p)), None)
            assert above is None, (
                f"{path.relative_to(SRC)} imports {name!r} from {'.'.join(target)}: "
                f"{below}/ lies below {above}/ and may not import it"
            )


def test_importing_the_cap_imports_no_planning_module():
    # In a fresh process: what `import forget._runtime` loads, lazily imported too.
    import subprocess
    import sys

    code = "import sys, forget._runtime; print(sorted(m for m in sys.modules if 'planning' in m))"
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_the_rules_catch_what_they_forbid():
    # The check above can fail: relative and absolute private imports resolve to
    # the package that owns them.
    planning = ("forget", "_planning")
    relative = _imports("from .._engine._region import Region\n", planning)
    absolute = _imports("from forget._engine import _region\n", planning)
    assert relative == [(("forget", "_engine", "_region"), "Region")]
    assert absolute == [(("forget", "_engine"), "_region")]
    assert _private(*relative[0]) and _private(*absolute[0])
    assert _owner(relative[0][0]) == ("forget", "_engine") != _owner(planning)
    # A package's public names are no private import, though the package is private.
    assert not _private(*_imports("from .._engine import forget\n", planning)[0])
    assert _imports("from ._plan import Plan\n", planning) == [
        (("forget", "_planning", "_plan"), "Plan")
    ]
    # A room (a private subpackage) uses its package's private names, no other's.
    room = ("forget", "_planning", "_tree")
    shared = _imports("from .._guard import guard\n", room)
    assert _owner(shared[0][0]) == _owner(room) == planning
    other = _imports("from ..._engine._region import Region\n", room)
    assert _owner(other[0][0]) == ("forget", "_engine") != _owner(room)
    # The layering check resolves both spellings of an import of the planner.
    runtime = ("forget", "_runtime")
    assert _imports("from .._planning import DEFAULT_OPTIONS\n", runtime) == [
        (("forget", "_planning"), "DEFAULT_OPTIONS")
    ]
    assert _imports("from .. import _planning\n", runtime) == [(("forget",), "_planning")]


def test_public_functions_stay_functions_once_every_subpackage_is_imported():
    # A subpackage named like a public function would replace it on `forget`
    # when imported (what made `forget.plan` a module); none is.
    import importlib

    import forget

    packages = ("_engine", "_memory", "_regions", "_planning", "_runtime", "_cli")
    for name in (*packages, "schedules", "integrations", "policies"):
        importlib.import_module(f"forget.{name}")
    for name in ("forget", "checkpoint", "plan", "saved", "measure", "regenerating"):
        value = getattr(forget, name)
        assert callable(value) and not isinstance(value, type(forget)), name
    assert forget.plan.__module__ == "forget._planning._plan"
