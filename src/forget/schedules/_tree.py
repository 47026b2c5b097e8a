"""A model as a module tree: nodes, their choices, and the cost model of an assignment.

A chain (`Chain`) sees a model as a line of stages; most models are a tree of
modules, and any submodule may be the region to forget, inside another one.
Describe the model as a `Tree` of `TreeNode` figures (bytes, seconds), each node
with the choices it may take; `tree_figures` predicts what an assignment of
choices costs, and `solve_tree` (in `._tree_solve`) finds the fastest that fits
a budget.

NOTE [tree cost model]: a node ``v`` runs its own ops and its children in order
in its forward; its backward meets them in reverse. A choice for ``v`` is judged
by three figures, bytes above what was allocated just before ``v``'s forward:
``held`` (kept from its forward's end to its backward), ``peak`` (the most during
its backward, at least ``held``) and ``extra`` (seconds added to a plain step).
With ``a``, ``w``, ``t``, ``in`` its `TreeNode` own, work, tail and input bytes
and ``c_1 .. c_k`` its children:

* ``"keep"``: ``held = a + Σ held(c_i)``; the tail's backward runs first with
  every child held, then each child's with the children before it still held:
  ``peak = max(a + Σ_i held(c_i) + w, a - t + max_i (Σ_{j<i} held(c_j) + peak(c_i)))``,
  ``extra = Σ extra(c_i)`` (own work between children: NOTE [backward work]).
* ``"forget"``: ``held = in``, ``peak = in + [the keep peak]``, ``extra =
  forward_s + Σ extra(c_i)``: the subtree runs once more.
* a leaf option (`TreeOption`): figures as measured, every node below kept.

The step peaks at ``base_bytes + peak(root)`` (what the plain step holds where
backward starts), and never below ``floor_bytes``, every parameter's gradient at
backward's end: a model whose gradients outweigh its activations peaks there
(benchmarks/measured.md, "Models nobody here wrote").

NOTE [tree model assumptions]: a forgotten region's first forward holds only its
inputs, whatever its nodes choose, so an option that would hold bytes there (a
policy keep: NOTE [options at the top level] in `._dp`) is offered outside
regions only (``in_regions=False``); and a forward's transient bytes stay below
the backward's peaks, which the chain model (`._schedule`) counts and this one
does not.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import NamedTuple

from ._chain import _check_bytes, _check_seconds

__all__ = ["FORGET", "KEEP", "Tree", "TreeFigures", "TreeNode", "TreeOption", "tree_figures"]

#: The choices every node offers (``FORGET`` unless ``can_forget=False``).
KEEP = "keep"
FORGET = "forget"


@dataclass(frozen=True)
class TreeOption:
    """Describe a measured way to run a whole subtree: fewer bytes held, some time added.

    A leaf option trades memory for compute inside one node by a means the tree
    does not model node by node (keep only the matmul outputs and re-run the
    rest, regenerate, offload to the host), so it fixes the whole subtree: every
    node below is kept, no region inside. Its figures are measured.

    Attributes:
        name: a label, unique within its node (not ``"keep"`` or ``"forget"``).
        held_bytes: bytes the node holds from its forward to its backward.
        peak_bytes: the most the node allocates during its backward, above what
            was allocated before its forward (``held_bytes`` included).
        extra_s: seconds added to the step over keeping the subtree.
        in_regions: the option may run inside a forgotten region: its forward
            there holds nothing (regenerate, offload). ``False`` (top level
            only) by default, as for `StageOption`: a policy keep holds its
            outputs even in a region's first forward (NOTE [tree model assumptions]).

    Raises:
        TypeError: a field of the wrong type, an empty name.
        ValueError: a reserved name, negative figures, a peak below the held bytes.
    """

    name: str
    held_bytes: int
    peak_bytes: int
    extra_s: float
    in_regions: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise TypeError(f"forget: TreeOption.name must be a non-empty str, got {self.name!r}")
        if self.name in (KEEP, FORGET):
            raise ValueError(
                f"forget: TreeOption.name {self.name!r} is reserved for a node's own choices; "
                "pick another name, such as 'selective:matmuls'"
            )
        owner = f"TreeOption {self.name!r}"
        held = _check_bytes(owner, "held_bytes", self.held_bytes)
        peak = _check_bytes(owner, "peak_bytes", self.peak_bytes)
        if peak < held:
            raise ValueError(
                f"forget: {owner}.peak_bytes={peak} is below its held_bytes={held}; the "
                "backward starts with the held bytes allocated, so its peak counts them"
            )
        object.__setattr__(self, "held_bytes", held)
        object.__setattr__(self, "peak_bytes", peak)
        object.__setattr__(self, "extra_s", _check_seconds(owner, "extra_s", self.extra_s))
        _check_bool(owner, "in_regions", self.in_regions)


@dataclass(frozen=True)
class TreeNode:
    """Describe one module of the tree: what it saves, what it reads, how long it runs.

    Attributes:
        name: the module's dotted path, unique in the tree.
        children: its submodules, in the order its forward runs them.
        own_bytes: bytes its own ops (not inside a child) save for backward in
            a plain step.
        input_bytes: bytes it holds from forward to backward when forgotten (its
            inputs).
        forward_s: time of its whole forward, children included, in a plain step.
        options: leaf options it may take besides ``"keep"`` and ``"forget"``.
        can_forget: whether it may be a forgotten region; ``True`` by default.
        work_bytes: the most the backward of its own ops after its last child
            allocates beyond the bytes saved for it: the gradients it makes and
            its temporaries (a language model's loss: the logits' gradient); a
            node without children, its whole backward's. 0 by default.
        tail_bytes: of ``own_bytes``, those saved by its ops after its last
            child, freed before any child's backward; 0 by default.

    Raises:
        TypeError: a field of the wrong type.
        ValueError: negative figures, two options of the same name.
    """

    name: str
    children: tuple[TreeNode, ...] = ()
    own_bytes: int = 0
    input_bytes: int = 0
    forward_s: float = 0.0
    options: tuple[TreeOption, ...] = ()
    can_forget: bool = True
    work_bytes: int = 0
    tail_bytes: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise TypeError(f"forget: TreeNode.name must be a non-empty str, got {self.name!r}")
        owner = f"TreeNode {self.name!r}"
        for name in ("own_bytes", "input_bytes", "work_bytes", "tail_bytes"):
            object.__setattr__(self, name, _check_bytes(owner, name, getattr(self, name)))
        if self.tail_bytes > self.own_bytes:
            raise ValueError(
                f"forget: {owner}.tail_bytes={self.tail_bytes} is above its "
                f"own_bytes={self.own_bytes}; the tail's saved bytes are part of its own"
            )
        object.__setattr__(self, "forward_s", _check_seconds(owner, "forward_s", self.forward_s))
        _check_bool(owner, "can_forget", self.can_forget)
        for attr, kind in (("children", TreeNode), ("options", TreeOption)):
            values = tuple(getattr(self, attr))
            for value in values:
                if not isinstance(value, kind):
                    raise TypeError(
                        f"forget: {owner}.{attr} must hold {kind.__name__} values, got "
                        f"{type(value).__name__} {value!r}"
                    )
            object.__setattr__(self, attr, values)
        names = [option.name for option in self.options]
        for name in names:
            if names.count(name) > 1:
                raise ValueError(
                    f"forget: {owner} has two options named {name!r}; option names must be "
                    "unique within a node"
                )

    def choice_names(self) -> tuple[str, ...]:
        """Return the choices this node may take: ``"keep"``, ``"forget"``, its options."""
        own = (KEEP, FORGET) if self.can_forget else (KEEP,)
        return own + tuple(option.name for option in self.options)


@dataclass(frozen=True)
class Tree:
    """Hold a model's module tree and the bytes its step holds besides (``base_bytes``).

    Attributes:
        root: the outermost module.
        base_bytes: bytes alive at the step's peak whatever the plan (parameters,
            gradients, optimizer state, inputs, loss); 0 by default.
        floor_bytes: the least the step peaks at whatever the plan (every parameter
            gradient, held at backward's end); 0 by default.

    Raises:
        ValueError: two nodes of the same name, negative ``base_bytes`` or
            ``floor_bytes``.
    """

    root: TreeNode
    base_bytes: int = 0
    floor_bytes: int = 0
    _nodes: dict[str, TreeNode] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.root, TreeNode):
            raise TypeError(f"forget: Tree.root must be a TreeNode, got {type(self.root).__name__}")
        object.__setattr__(self, "base_bytes", _check_bytes("Tree", "base_bytes", self.base_bytes))
        floor = _check_bytes("Tree", "floor_bytes", self.floor_bytes)
        object.__setattr__(self, "floor_bytes", floor)
        nodes: dict[str, TreeNode] = {}
        for node in _preorder(self.root):
            if node.name in nodes:
                raise ValueError(
                    f"forget: the tree has two nodes named {node.name!r}; a node is named by "
                    "its module's dotted path, which is unique in a model"
                )
            nodes[node.name] = node
        object.__setattr__(self, "_nodes", nodes)

    def __len__(self) -> int:
        return len(self._nodes)

    def node(self, name: str) -> TreeNode:
        """Return the node called ``name``.

        Raises:
            ValueError: no node has that name.
        """
        try:
            return self._nodes[name]
        except (KeyError, TypeError):
            some = ", ".join(repr(n) for n in list(self._nodes)[:4])
            raise ValueError(
                f"forget: the tree has no node named {name!r}; its nodes are dotted module "
                f"paths such as {some}"
            ) from None


class TreeFigures(NamedTuple):
    """What an assignment of choices costs, in the model of NOTE [tree cost model]."""

    #: bytes the root holds from its forward to its backward.
    held_bytes: int
    #: the step's peak: ``base_bytes`` plus the root's backward peak.
    peak_bytes: int
    #: seconds added to the plain step.
    extra_s: float


def tree_figures(tree: Tree, choices: Mapping[str, str]) -> TreeFigures:
    """Predict what an assignment of choices costs, in the model of NOTE [tree cost model].

    Args:
        tree: the modules and their figures.
        choices: node name to ``"keep"``, ``"forget"`` or a leaf option's name;
            a node not named is kept (a `TreeSchedule`'s ``choices`` fit).

    Returns:
        ``(held_bytes, peak_bytes, extra_s)``; the peak is the step's,
        ``base_bytes`` included, and no less than ``floor_bytes``.

    Raises:
        ValueError: a name that is not a node, a choice the node does not
            offer, a choice below a leaf option, or a top-level-only option
            inside a forgotten region.

    Example:
        >>> from forget.schedules import Tree, TreeNode, tree_figures
        >>> layer = TreeNode("layer", own_bytes=400, input_bytes=100, forward_s=1.0)
        >>> tree = Tree(TreeNode("model", (layer,), own_bytes=50), base_bytes=1000)
        >>> tree_figures(tree, {"layer": "forget"})
        TreeFigures(held_bytes=150, peak_bytes=1550, extra_s=1.0)
    """
    tree = _check_tree(tree)
    if not isinstance(choices, Mapping):
        raise TypeError(f"forget: choices must be a mapping, got {type(choices).__name__}")
    for name, choice in choices.items():
        node = tree.node(name)
        if choice not in node.choice_names():
            valid = ", ".join(repr(c) for c in node.choice_names())
            why = "; it cannot be forgotten (can_forget=False)" if choice == FORGET else ""
            raise ValueError(
                f"forget: node {name!r} has no choice {choice!r}{why}; its choices are: {valid}"
            )
    held, peak, extra = _figures(tree.root, choices, None, None)
    return TreeFigures(held, max(tree.base_bytes + peak, tree.floor_bytes), extra)


# --- helpers -----------------------------------------------------------------------------


def _check_bool(owner: str, field_name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise TypeError(
            f"forget: {owner}.{field_name} must be a bool, got {type(value).__name__} {value!r}"
        )


def _check_tree(tree: object) -> Tree:
    if not isinstance(tree, Tree):
        raise TypeError(f"forget: expected a forget.schedules.Tree, got {type(tree).__name__}")
    return tree


def _preorder(node: TreeNode) -> Iterator[TreeNode]:
    yield node
    for child in node.children:
        yield from _preorder(child)


def _figures(
    node: TreeNode, choices: Mapping[str, str], region: str | None, fixed_by: str | None
) -> tuple[int, int, float]:
    """held, peak and extra of ``node``'s subtree; ``region`` and ``fixed_by`` name the
    innermost forgotten ancestor and the leaf-option ancestor, if any."""
    choice = choices.get(node.name, KEEP)
    if fixed_by is not None and choice != KEEP:
        raise ValueError(
            f"forget: node {node.name!r} takes {choice!r} inside {fixed_by!r}, whose leaf "
            f"option {choices[fixed_by]!r} fixes its whole subtree; keep {node.name!r}, or "
            f"choose 'keep' or 'forget' for {fixed_by!r}"
        )
    if choice in (KEEP, FORGET):
        inner = node.name if choice == FORGET else region
        held_sum, peak, extra = 0, 0, 0.0
        for child in node.children:
            h, p, e = _figures(child, choices, inner, fixed_by)
            peak = max(peak, held_sum + p)
            held_sum += h
            extra += e
        a = node.own_bytes
        peak = max(a + held_sum + node.work_bytes, a - node.tail_bytes + peak)
        if choice == KEEP:
            return a + held_sum, peak, extra
        return node.input_bytes, node.input_bytes + peak, node.forward_s + extra
    option = next(o for o in node.options if o.name == choice)
    if region is not None and not option.in_regions:
        raise ValueError(
            f"forget: node {node.name!r} takes option {choice!r} inside the forgotten region "
            f"{region!r}, but the option is for the top level only (in_regions=False): it "
            "would hold bytes in the region's first forward; keep the node there instead"
        )
    for child in node.children:
        _figures(child, choices, region, node.name)
    return option.held_bytes, option.peak_bytes, option.extra_s
