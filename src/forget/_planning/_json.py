"""Plans saved as JSON: one set of file methods over a plan class's dict form."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeVar

from ..policies import Policy

__all__ = ["SavedAsJson"]

_P = TypeVar("_P", bound="SavedAsJson")


class SavedAsJson:
    """``to_json``, ``save``, ``from_json`` and ``load`` over ``to_dict``/``from_dict``.

    `Plan`'s ``to_dict`` says what its dict holds; this is how it reaches a
    file; ``options`` gives back the policies of a plan's options by name.
    """

    def to_dict(self) -> dict[str, Any]:
        raise NotImplementedError

    @classmethod
    def from_dict(
        cls: type[_P], obj: Mapping[str, Any], *, options: Mapping[str, Policy | bool] | None = None
    ) -> _P:
        raise NotImplementedError

    def to_json(self) -> str:
        """The plan as JSON text."""
        return json.dumps(self.to_dict(), indent=2)

    def save(self, path: str | Path) -> None:
        """Write the plan as JSON to ``path``."""
        Path(path).write_text(self.to_json() + "\n")

    @classmethod
    def from_json(
        cls: type[_P], text: str, *, options: Mapping[str, Policy | bool] | None = None
    ) -> _P:
        """Rebuild a plan from `to_json`'s text."""
        return cls.from_dict(json.loads(text), options=options)

    @classmethod
    def load(
        cls: type[_P], path: str | Path, *, options: Mapping[str, Policy | bool] | None = None
    ) -> _P:
        """Read a plan written by `save`."""
        return cls.from_json(Path(path).read_text(), options=options)
