"""Regions of a model's module tree: facts about the tree, below the planner and the cap.

- `_candidates`: which submodules may become regions (NOTE [tree candidates]),
  their nesting, and the model's structure;
- `_head`: a language model's head, whose logits a budget may not go below
  unless chunked (NOTE [the head's floor]);
- `_forward`: `RegionForward`, the one way a module runs as a region: its
  forward set on the instance, through the owner's call (NOTE [instance
  forward]), for a plan and a cap alike.

`forget._planning` and `forget._runtime` both build on this package; it imports
neither. Other packages import the names below, never the underscore modules.
"""

from ._candidates import ROOT as ROOT
from ._candidates import CandidateSpec as CandidateSpec
from ._candidates import ancestors as ancestors
from ._candidates import find_candidates as find_candidates
from ._candidates import first_difference as first_difference
from ._candidates import parents as parents
from ._candidates import structure as structure
from ._forward import RegionForward as RegionForward
from ._forward import owner_of as owner_of
from ._forward import unwrap_forward as unwrap_forward
from ._forward import wrap_forward as wrap_forward
from ._head import CHUNKED as CHUNKED
from ._head import HEAD as HEAD
from ._head import head_hint as head_hint
from ._head import logits_head as logits_head

__all__ = [
    "CHUNKED",
    "HEAD",
    "ROOT",
    "CandidateSpec",
    "RegionForward",
    "ancestors",
    "find_candidates",
    "first_difference",
    "head_hint",
    "logits_head",
    "owner_of",
    "parents",
    "structure",
    "unwrap_forward",
    "wrap_forward",
]
