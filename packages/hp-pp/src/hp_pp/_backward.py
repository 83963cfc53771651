"""Zero-bubble backward: one micro-batch's backward split into an input pass and a weight pass.

A full backward walks the autograd graph once and computes, at every node, both the gradient
flowing towards the stage inputs (the activation-gradient chain) and the gradient flowing into
the weights. Zero-bubble schedules send the input gradients first and compute the weight
gradients later, so the split must not walk the activation chain twice.

The graph is split once per micro-batch, when the input pass runs:

- the *activation chain* is the set of nodes from which a stage input (a leaf that requires
  grad) can be reached;
- a *split node* is a node of the chain with an edge leaving the chain towards a weight (any
  other leaf that requires grad): a linear layer's ``addmm``, a norm's kernel, ...;
- a root of the backward that is off the chain (the first stage, whose inputs need no
  gradient) starts the weight pass directly with its own gradient.

The input pass (:func:`backward_input`) computes the input gradients with
``torch.autograd.grad`` (so nodes compute only the chain's gradients) and records, through a
pre-hook on every split node, the gradients that arrive at it. The weight pass
(:class:`WeightPass`) restarts backward from those recorded gradients at the split nodes, with
the weights as the only inputs: each split node computes only its weight-side outputs, and
nothing on the chain runs again. The weights' ``AccumulateGrad`` nodes accumulate into
``.grad`` as a full backward does (same values, same hooks).

Split nodes whose weight-side subgraphs touch (a weight used in two places) form one group.
A ``backward`` call with the weights of a group as inputs would also run the chain from one of
its split nodes down to another group's split node below it, so groups get calls of their own,
except consecutive groups none of whose split nodes lies below another's on the chain
(parallel branches: the q/k/v projections, an MLP's gate and up), which share one. Inside a
group whose weight is reached from two split nodes at different depths, the recorded gradients
are pinned with a pre-hook so the deeper node does not receive its gradient twice.

What is held between the passes: the graph (as between forward and backward) and one recorded
gradient per split-node output; each group's gradients are dropped as soon as its call ran, and
the graph is freed when the weight pass ends.

See Also:
    :pt:`torch.distributed.pipelining.PipelineStage` (its ``backward_one_chunk`` with
    ``full_backward=False`` and ``backward_weight_one_chunk``)
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge

__all__ = ["WeightPass", "backward_input", "cut_from_graph"]


def _leaf_of(node: Node, children: list[Node]) -> torch.Tensor | None:
    """The tensor an ``AccumulateGrad`` node accumulates into (``None`` for other nodes)."""
    if children:
        return None
    variable = getattr(node, "variable", None)
    return variable if isinstance(variable, torch.Tensor) else None


def _graph(starts: Sequence[Node]) -> tuple[list[Node], dict[Node, list[Node]]]:
    """Every node reachable from ``starts`` in post-order (children before parents, by an
    iterative DFS), and each node's children (``next_functions`` is read once per node: every
    read builds new tuples)."""
    order: list[Node] = []
    kids: dict[Node, list[Node]] = {}

    def visit(node: Node) -> Iterator[Node]:
        kids[node] = [c for c, _ in node.next_functions if c is not None]
        return iter(kids[node])

    for start in starts:
        if start in kids:
            continue
        stack = [(start, visit(start))]
        while stack:
            node, pending = stack[-1]
            for child in pending:
                if child not in kids:
                    stack.append((child, visit(child)))
                    break
            else:
                stack.pop()
                order.append(node)
    return order, kids


def _reaching(order: list[Node], kids: dict[Node, list[Node]], targets: set[Node]) -> set[Node]:
    """The nodes of ``order`` (post-order) from which a node of ``targets`` is reachable."""
    out: set[Node] = set()
    for node in order:
        if node in targets or any(c in out for c in kids[node]):
            out.add(node)
    return out


@dataclass
class _Group:
    """Starts of one weight-pass call and the weights it accumulates into."""

    split_nodes: list[Node] = field(default_factory=list)
    root_edges: list[tuple[GradientEdge, torch.Tensor]] = field(default_factory=list)
    weights: list[torch.Tensor] = field(default_factory=list)
    #: Bits of its split nodes, and of the split nodes below them on the chain.
    own: int = 0
    below: int = 0

    @property
    def walks_chain(self) -> bool:
        """Whether one of its split nodes lies below another on the chain (a weight used at
        two depths): its call runs the chain between them."""
        return bool(self.own & self.below)

    def absorb(self, other: _Group) -> None:
        self.split_nodes += other.split_nodes
        self.root_edges += other.root_edges
        self.weights += other.weights
        self.own |= other.own
        self.below |= other.below


class _UnionFind:
    def __init__(self) -> None:
        self.parent: dict[Node, Node] = {}

    def find(self, x: Node) -> Node:
        root = self.parent.setdefault(x, x)
        while root is not self.parent[root]:
            root = self.parent[root]
        while x is not root:  # path compression
            self.parent[x], x = root, self.parent[x]
        return root

    def union(self, a: Node, b: Node) -> None:
        ra, rb = self.find(a), self.find(b)
        if ra is not rb:
            self.parent[rb] = ra


class WeightPass:
    """The weight half of one micro-batch's backward, recorded by :func:`backward_input`.

    :meth:`run` accumulates the weight gradients into ``.grad`` (once); the recorded gradients
    and the graph are released as it goes.
    """

    def __init__(
        self,
        groups: list[_Group],
        recorded: dict[Node, tuple[torch.Tensor | None, ...]],
        *,
        retain_graph: bool,
    ) -> None:
        self._groups = groups
        self._num_groups = len(groups)
        self._recorded = recorded
        self._retain_graph = retain_graph

    @property
    def num_groups(self) -> int:
        """How many ``backward`` calls :meth:`run` makes (one per group of weights)."""
        return self._num_groups

    def held_gradients(self) -> list[torch.Tensor]:
        """The gradients recorded at split nodes that the weight pass still holds."""
        return [g for grads in self._recorded.values() for g in grads if g is not None]

    def run(self) -> None:
        """Compute the weight gradients and accumulate them into the weights' ``.grad``."""
        groups, self._groups = self._groups, []
        for group in groups:
            edges: list[GradientEdge] = []
            values: list[torch.Tensor] = []
            for edge, root_grad in group.root_edges:
                edges.append(edge)
                values.append(root_grad)
            pinned: list[tuple[Node, tuple[torch.Tensor | None, ...]]] = []
            for node in group.split_nodes:
                grads = self._recorded.pop(node, None)
                if grads is None:  # the input pass never reached it: no gradient flows there
                    continue
                pinned.append((node, grads))
                for nr, grad in enumerate(grads):
                    if grad is not None:
                        edges.append(GradientEdge(node, nr))
                        values.append(grad)
            if not edges or not group.weights:
                continue
            handles = []
            if group.walks_chain:
                # A deeper split node of this group is also reached through the chain from a
                # shallower one: it must see its recorded gradient only, not the sum.
                for node, grads in pinned:
                    handles.append(node.register_prehook(lambda _g, saved=grads: saved))
            del pinned
            try:
                torch.autograd.backward(
                    edges, values, retain_graph=self._retain_graph, inputs=group.weights
                )
            finally:
                for handle in handles:
                    handle.remove()
            del edges, values
        self._recorded.clear()


def cut_from_graph(tensors: Sequence[object]) -> None:
    """Detach ``tensors`` in place once their backward ran: a reference held elsewhere (a
    send in flight keeps the tensor it sends) must not keep the graph, and with it every
    activation the weight pass does not free, alive. Views cannot be detached in place;
    they keep their graph until dropped."""
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.grad_fn is not None:
            with contextlib.suppress(RuntimeError):
                t.detach_()


def backward_input(
    roots: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor | None],
    input_leaves: Sequence[torch.Tensor],
    *,
    keep_graph: bool = False,
) -> tuple[list[torch.Tensor | None], WeightPass]:
    """The input half of a backward, and the recorded weight half.

    Args:
        roots: The tensors backward starts from (a stage's outputs, or its loss).
        grads: Their incoming gradients (``None`` for a scalar loss).
        input_leaves: The leaves whose gradients are wanted now (a stage's inputs).
        keep_graph: Keep the graph after the weight pass (for a later pass over the roots).

    Returns:
        The gradients of ``input_leaves`` (``None`` where unused), and the weight pass.
    """
    root_edges = [get_gradient_edge(r) for r in roots]
    order, kids = _graph([e.node for e in root_edges])
    input_ids = {id(t) for t in input_leaves}
    input_nodes: set[Node] = set()
    weight_nodes: dict[Node, torch.Tensor] = {}
    for node in order:
        leaf = _leaf_of(node, kids[node])
        if leaf is None:
            continue
        if id(leaf) in input_ids:
            input_nodes.add(node)
        else:
            weight_nodes[node] = leaf
    chain = _reaching(order, kids, input_nodes)
    to_weights = _reaching(order, kids, set(weight_nodes))

    # Starts of the weight pass, and the weight-side subgraph each one reaches.
    uf = _UnionFind()
    starts: list[Node] = []
    split_nodes: list[Node] = []
    root_starts: dict[Node, list[tuple[GradientEdge, torch.Tensor]]] = {}
    assigned: set[Node] = set()

    def claim(start: Node, first: list[Node]) -> None:
        stack = [n for n in first if n not in assigned]
        for n in first:
            uf.union(start, n)
        while stack:
            node = stack.pop()
            if node in assigned:
                continue
            assigned.add(node)
            for child in kids[node]:
                if child in to_weights and child not in chain:
                    uf.union(node, child)
                    if child not in assigned:
                        stack.append(child)

    for edge, root, grad in zip(root_edges, roots, grads, strict=True):
        node = edge.node
        if node in chain or node not in to_weights:
            continue
        if node not in root_starts:
            starts.append(node)
            root_starts[node] = []
        value = grad if grad is not None else torch.ones_like(root)
        root_starts[node].append((edge, value))
        claim(node, [node])
    for node in reversed(order):  # parents first: the order a backward reaches them
        if node not in chain or node in input_nodes:
            continue
        off_chain = [c for c in kids[node] if c in to_weights and c not in chain]
        if off_chain:
            starts.append(node)
            split_nodes.append(node)
            claim(node, off_chain)

    groups: dict[Node, _Group] = {}
    for node in starts:
        group = groups.setdefault(uf.find(node), _Group())
        if node in root_starts:
            group.root_edges.extend(root_starts[node])
        else:
            group.split_nodes.append(node)
    for wnode, weight in weight_nodes.items():
        if wnode in uf.parent and uf.find(wnode) in groups:
            groups[uf.find(wnode)].weights.append(weight)
    # Groups none of whose split nodes lies below another's on the chain share one call
    # (parallel branches: q/k/v projections, gate and up): nothing on the chain is needed from
    # any of their starts, so the call still runs only weight-side nodes.
    bit = {node: 1 << i for i, node in enumerate(split_nodes)}
    below: dict[Node, int] = {}
    for node in order:  # children first
        if node in chain:
            mask = bit.get(node, 0)
            for child in kids[node]:
                mask |= below.get(child, 0)
            below[node] = mask
    ordered: list[_Group] = []
    for group in groups.values():
        for node in group.split_nodes:
            group.own |= bit[node]
            for child in kids[node]:
                group.below |= below.get(child, 0)
        last = ordered[-1] if ordered else None
        if last is not None and not (last.below & group.own) and not (group.below & last.own):
            last.absorb(group)
        else:
            ordered.append(group)

    # The input pass: record what reaches every split node.
    recorded: dict[Node, tuple[torch.Tensor | None, ...]] = {}
    handles = []
    for node in split_nodes:

        def record(grad_outputs: tuple[torch.Tensor | None, ...], node: Node = node) -> None:
            recorded[node] = tuple(grad_outputs)

        handles.append(node.register_prehook(record))
    input_grads: list[torch.Tensor | None] = [None] * len(input_leaves)
    try:
        if input_leaves and chain:
            input_grads = list(
                torch.autograd.grad(
                    list(roots),
                    list(input_leaves),
                    list(grads),
                    retain_graph=True,
                    allow_unused=True,
                )
            )
    finally:
        for handle in handles:
            handle.remove()
    retain = keep_graph or any(g.walks_chain for g in ordered)
    return input_grads, WeightPass(ordered, recorded, retain_graph=retain)
