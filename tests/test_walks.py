"""NOTE [cached walks]: a module walk kept from call to call notices every change."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from torch import nn

from forget._engine import ModuleWalks, storage_key


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Sequential(nn.Linear(4, 2)))


def _fresh(model: nn.Module) -> tuple[list[int], list[int], list[int]]:
    return (
        [id(m) for m in model.modules()],
        [id(p) for p in model.parameters()],
        [id(b) for b in model.buffers()],
    )


def _ids(walked: tuple[list[nn.Module], list[torch.Tensor], list[torch.Tensor]]) -> tuple:
    return tuple([id(x) for x in part] for part in walked)


def _replace_weight(model: nn.Module) -> None:
    model[0].weight = nn.Parameter(torch.zeros(4, 4))


def _write_buffer_slot(model: nn.Module) -> None:
    model[1]._buffers["running_mean"] = torch.ones(4)  # as Module._apply does


def _delete_bias(model: nn.Module) -> None:
    del model[0].bias


def _add_module(model: nn.Module) -> None:
    model[2].add_module("extra", nn.Linear(2, 2))


def _replace_module(model: nn.Module) -> None:
    model[2][0] = nn.Linear(4, 2)


@pytest.mark.parametrize(
    "change",
    [_replace_weight, _write_buffer_slot, _delete_bias, _add_module, _replace_module],
    ids=["parameter-set", "buffer-slot-written", "parameter-deleted", "module-added", "module-set"],
)
def test_a_change_between_walks_is_walked_again(change) -> None:
    model, walks = _model(), ModuleWalks()
    assert _ids(walks.walk([model])) == _fresh(model)
    change(model)
    gc.collect()  # a freed object's id may be taken again: the check must still tell
    assert _ids(walks.walk([model])) == _fresh(model)


def test_an_unchanged_model_reuses_the_walk_and_other_roots_do_not(monkeypatch) -> None:
    model, walks = _model(), ModuleWalks()
    first = _ids(walks.walk([model]))

    def no_walk(self: nn.Module):
        raise AssertionError("walked again")

    with monkeypatch.context() as patched:
        patched.setattr(nn.Module, "modules", no_walk)
        assert _ids(walks.walk([model])) == first  # checked, not walked
    assert _ids(walks.walk([model[2]])) == _fresh(model[2])


def test_a_walk_holds_nothing_alive() -> None:
    model, walks = _model(), ModuleWalks()
    walks.walk([model])
    ref = weakref.ref(model)
    del model
    gc.collect()
    assert ref() is None


def test_the_kept_storage_keys_follow_a_swapped_data() -> None:
    model, walks = _model(), ModuleWalks()
    _, parameters, _ = walks.walk([model])
    before = walks.keys.keys(parameters)
    assert before == {storage_key(p) for p in parameters}
    model[0].weight.data = torch.zeros(4, 4)  # the same object, another storage
    _, parameters, _ = walks.walk([model])
    after = walks.keys.keys(parameters)
    assert after == {storage_key(p) for p in parameters} and after != before
