"""The top level is small, and what it names works (NOTE [a small face])."""

from __future__ import annotations

import inspect
import subprocess
import sys

import pytest

import forget

TOP_LEVEL = {
    "BudgetInfeasibleError",
    "Forget",
    "ForgetError",
    "Plan",
    "RecomputationMismatchError",
    "apply_forget",
    "cap",
    "checkpoint",
    "chunked",
    "forget",
    "forget_sequential",
    "in_recomputing",
    "measure",
    "plan",
    "policies",
    "regenerating",
    "saved",
}

# What left the top level: reachable elsewhere, no longer a name of `forget`.
GONE = ("Cap", "ForgetSequential", "MemoryReport", "SavedReport", "fast_path", "models")
GONE += ("profile_chain", "TreePlan")


def test_the_top_level_names_are_these():
    assert set(forget.__all__) == TOP_LEVEL
    assert set(forget._LAZY) | set(forget._SUBMODULES) >= TOP_LEVEL - {
        "BudgetInfeasibleError",
        "ForgetError",
        "RecomputationMismatchError",
    }


# chunked is the engine's (issue 43), checked by its own tests.
@pytest.mark.parametrize("name", sorted(TOP_LEVEL - {"chunked"}))
def test_every_top_level_name_resolves(name):
    assert getattr(forget, name) is not None
    assert name in dir(forget)


def test_the_public_subpackages_resolve():
    assert forget.policies.Policy is not None
    assert forget.schedules.parse_budget("1KiB") == 1024
    assert forget.integrations.__name__ == "forget.integrations"
    from forget.integrations import transformers

    assert callable(transformers.enable) and callable(transformers.cap)


@pytest.mark.parametrize("name", GONE)
def test_what_left_is_no_top_level_name(name):
    assert name not in dir(forget)
    with pytest.raises(AttributeError, match=name):
        getattr(forget, name)


def test_importing_forget_imports_no_torch():
    code = "import forget, sys; forget.policies; forget.schedules; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_cap_takes_a_model_a_budget_and_its_candidates():
    # NOTE [the cap's defaults]: how it evicts, reads and repeats is no argument.
    assert list(inspect.signature(forget.cap).parameters) == ["model", "budget", "candidates"]
