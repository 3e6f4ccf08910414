"""Token trees: their shape (a drafter parameter), how they are grown from a drafter's distributions,
and the layout a tree block is verified with. One home for every drafter that proposes trees (draft
models, the self-drafting heads, prompt lookup).

A tree proposal per row is N nodes in topological order (a parent before its children): node i holds a
token and hangs under ``parents[i]`` (-1 = the root, the row's newest committed token). The verify
block is ``[root, node 0, ..., node N-1]``: the root is block index 0, node i is block index i + 1, and
a node's depth (its position after the root) is 1 + its parent's depth.

Shapes (``TreeShape.kind``):

* ``chain``: no tree (a plain chain of k drafts);
* ``static``: top-k branching per depth, ``branch = (b1, b2, ...)`` children per node at depth 1, 2, ...
  (the last factor repeats), filled level by level, best parents first, until the node budget is used;
* ``dynamic``: EAGLE-2: each level expands the ``width`` candidates with the highest cumulative draft
  probability (product of the draft's probabilities along the root path), each proposing its ``width``
  most likely children; the tree verified is the ``nodes`` candidates of highest cumulative
  probability among all generated. Growth stops early when no frontier node can enter that top set
  (a child's cumulative probability never exceeds its parent's). Ranking counts each node's most likely
  child with probability p ** ``trunk`` (default 0.6; 1 is EAGLE-2's rule): the heads and drafts here are
  under-confident on the target's own greedy text, so the most likely path deserves more of the budget.

The node budget of a row is ``min(nodes, k)``: the policy's k is the row's verification budget, the
same for a chain of k tokens and a tree of k nodes.

Trees are deterministic given the context: the draft's sampling settings shape the probabilities that
rank the candidates, but no candidate is drawn at random, so the verifier scores every node as a one-hot
draft (``Proposal.probs`` is None), which the multi-candidate rejection rule keeps exact.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import torch

from ..engine.tree_verify import check_tree, tree_layout  # noqa: F401  (the verify block's layout, named here too)
from ..errors import SpeclabError

SHAPES = ("chain", "static", "dynamic")


@dataclass(frozen=True)
class TreeShape:
    kind: str = "chain"
    nodes: int | None = None  # node budget cap (None: the row's k)
    branch: tuple[int, ...] = (2, 2, 1)  # static: children per node at depth 1, 2, ...; the last repeats
    width: int = 3  # dynamic: candidates expanded per level, children proposed per expanded candidate
    depth: int | None = None  # deepest level grown (None: the budget)
    # ranking: a node's most likely child counts with probability p ** trunk (1: EAGLE-2's cumulative draft
    # probability; < 1 favours extending the most likely path). 0.6: measured with the EAGLE head at 8 nodes,
    # where it beat the chain of 8 on every workload and 1.0 lost on code (docs/heads.md): the head is
    # under-confident on the target's own (repetitive) greedy text
    trunk: float = 0.6

    def __post_init__(self):
        if self.kind not in SHAPES:
            raise SpeclabError(f"unknown tree shape '{self.kind}' (one of {', '.join(SHAPES)})")
        if self.nodes is not None and not 1 <= self.nodes <= 64:
            raise SpeclabError(f"a tree's node budget must be in 1..64, got {self.nodes}")
        if not self.branch or any(b < 1 for b in self.branch):
            raise SpeclabError(f"tree branching factors must be >= 1, got {self.branch}")
        if not 1 <= self.width <= 16:
            raise SpeclabError(f"tree width must be in 1..16, got {self.width}")
        if self.depth is not None and self.depth < 1:
            raise SpeclabError(f"tree depth must be >= 1, got {self.depth}")
        if not 0.0 <= self.trunk <= 1.0:
            raise SpeclabError(f"tree trunk exponent must be in [0, 1], got {self.trunk}")

    @property
    def is_tree(self) -> bool:
        return self.kind != "chain"

    def budget(self, k: int) -> int:
        return max(0, min(int(k), self.nodes if self.nodes is not None else int(k)))

    def branch_at(self, depth: int) -> int:
        """Children per node at ``depth`` (1 = the root's children)."""
        return self.branch[min(depth, len(self.branch)) - 1]

    def label(self) -> str:
        if not self.is_tree:
            return ""
        extra = f"branch={'-'.join(map(str, self.branch))}" if self.kind == "static" else f"width={self.width}"
        extra += f":trunk={self.trunk:g}" if self.trunk != TreeShape.trunk else ""
        return f"tree={self.kind}" + (f":nodes={self.nodes}" if self.nodes else "") + f":{extra}"

    @classmethod
    def from_options(cls, tree=None, nodes=None, branch=None, width=None, depth=None, trunk=None) -> "TreeShape":
        """From drafter keyword options / spec strings: ``tree="dynamic", nodes=8`` or
        ``branch="3-2-1"`` (also "3,2,1" or a tuple)."""
        kw = {}
        if tree is not None:
            kw["kind"] = str(tree).strip().lower()
        if nodes is not None:
            kw["nodes"] = int(nodes)
        if branch is not None:
            if isinstance(branch, str):
                parts = [p for p in branch.replace(",", "-").split("-") if p.strip()]
                try:
                    branch = tuple(int(p) for p in parts)
                except ValueError:
                    raise SpeclabError(f"tree branch must be numbers like 3-2-1, got '{branch}'") from None
            kw["branch"] = tuple(int(b) for b in branch)
        if width is not None:
            kw["width"] = int(width)
        if depth is not None:
            kw["depth"] = int(depth)
        if trunk is not None:
            kw["trunk"] = float(trunk)
        if "kind" not in kw and ("nodes" in kw or "branch" in kw or "width" in kw):
            kw["kind"] = "static" if "branch" in kw else "dynamic"
        return cls(**kw)


# ----------------------------------------------------------------------------------------------- layout
# ----------------------------------------------------------------------------------------------- growing
@dataclass
class RowTree:
    """One row's candidate pool while a tree grows: every candidate generated (pool index = list index).
    ``h`` is free for the drafter (e.g. the head's hidden state of an expanded candidate)."""

    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)  # pool index, -1 = root
    depth: list[int] = field(default_factory=list)  # 1 = a child of the root
    score: list[float] = field(default_factory=list)  # log cumulative draft probability
    prob: list[float] = field(default_factory=list)  # the draft's probability of the token given its parent

    def add(self, token: int, parent: int, logp: float, weight: float = 1.0) -> int:
        """A candidate with draft log-probability ``logp`` given its parent; its score adds ``weight * logp``."""
        base = self.score[parent] if parent >= 0 else 0.0
        self.tokens.append(token)
        self.parents.append(parent)
        self.depth.append(self.depth[parent] + 1 if parent >= 0 else 1)
        self.score.append(base + weight * logp)
        self.prob.append(math.exp(logp))
        return len(self.tokens) - 1


# expand(pools, frontier) -> (n, F, V) probabilities of the children of frontier[b][j] (rows with fewer
# frontier nodes are padded; their rows of the result are ignored)
Expand = Callable[[list[RowTree], list[list[int]]], torch.Tensor]


def _tops(probs: torch.Tensor, k: int) -> tuple[list, list]:
    """The k most likely tokens of (..., V) probabilities as nested lists (log-probabilities, ids), best
    first: one top-k and one host copy for a whole level."""
    v, i = probs.topk(min(k, probs.shape[-1]), -1)
    return v.clamp(min=1e-30).log().tolist(), i.tolist()


def grow_trees(shape: TreeShape, budgets: list[int], root_probs: torch.Tensor, expand: Expand
               ) -> tuple[list[RowTree], list[list[int]]]:
    """Grow one tree per row from ``root_probs`` (n, V) (the draft's distribution after the root) with
    ``expand`` giving the children distributions of chosen candidates. Returns the pools and, per row,
    the pool indices selected for verification (at most the row's budget, in topological order)."""
    n = root_probs.shape[0]
    pools = [RowTree() for _ in range(n)]
    max_depth = [min(b, shape.depth or b) for b in budgets]
    frontier: list[list[int]] = [[] for _ in range(n)]
    # level 1: children of the root
    want = shape.branch_at(1) if shape.kind == "static" else shape.width
    lp1, ids1 = _tops(root_probs, want)
    for b in range(n):
        if budgets[b] <= 0:
            continue
        m = min(want, budgets[b]) if shape.kind == "static" else want
        for r, (t, p) in enumerate(zip(ids1[b][:m], lp1[b][:m])):
            pools[b].add(t, -1, p, shape.trunk if r == 0 else 1.0)
        frontier[b] = _next_frontier(shape, pools[b], list(range(len(pools[b].tokens))), budgets[b],
                                     max_depth[b], 1)
    depth = 1
    while any(frontier):
        depth += 1
        probs = expand(pools, frontier)  # (n, F, V)
        want = shape.branch_at(depth) if shape.kind == "static" else shape.width
        lps, idss = _tops(probs, want)
        new_frontier: list[list[int]] = [[] for _ in range(n)]
        for b in range(n):
            if not frontier[b]:
                continue
            pool, added = pools[b], []
            room = budgets[b] - len(pool.tokens) if shape.kind == "static" else want * len(frontier[b])
            for j, node in enumerate(frontier[b]):  # best parents first
                m = min(want, room)
                if m <= 0:
                    break
                for r, (t, p) in enumerate(zip(idss[b][j][:m], lps[b][j][:m])):
                    added.append(pool.add(t, node, p, shape.trunk if r == 0 else 1.0))
                room -= m
            new_frontier[b] = _next_frontier(shape, pool, added, budgets[b], max_depth[b], depth)
        frontier = new_frontier
    return pools, [_select(shape, pools[b], budgets[b]) for b in range(n)]


def _rank(pool: RowTree, idx: list[int]) -> list[int]:
    """Best first: higher cumulative probability, then shallower, then older."""
    return sorted(idx, key=lambda i: (-pool.score[i], pool.depth[i], i))


def _next_frontier(shape: TreeShape, pool: RowTree, added: list[int], budget: int, max_depth: int,
                   depth: int) -> list[int]:
    """The candidates of the level just added that will be expanded (none past the depth limit)."""
    if depth >= max_depth or not added:
        return []
    if shape.kind == "static":
        if len(pool.tokens) >= budget:
            return []
        room, out = budget - len(pool.tokens), []
        for node in _rank(pool, added):  # only as many parents as the remaining budget can give children
            if room <= 0:
                break
            out.append(node)
            room -= shape.branch_at(depth + 1)
        return out
    best = _rank(pool, added)[: shape.width]
    if len(pool.tokens) >= budget:
        # no child can beat the budget-th best candidate already in the pool: stop growing
        cut = sorted(pool.score, reverse=True)[budget - 1]
        best = [i for i in best if pool.score[i] > cut]
    return best


def _select(shape: TreeShape, pool: RowTree, budget: int) -> list[int]:
    """The candidates verified, in topological order (depth, then pool order)."""
    if not pool.tokens or budget <= 0:
        return []
    chosen = _rank(pool, list(range(len(pool.tokens))))[:budget] if shape.kind == "dynamic" \
        else list(range(min(budget, len(pool.tokens))))
    keep = set(chosen)
    # a child's cumulative probability never exceeds its parent's, so top-by-score is closed under
    # parents up to ties; make sure anyway (a tie broken against a parent would orphan its child)
    for i in list(chosen):
        p = pool.parents[i]
        while p >= 0 and p not in keep:
            keep.add(p)
            p = pool.parents[p]
    out = sorted(keep, key=lambda i: (pool.depth[i], i))
    return out[:budget] if len(out) > budget else out


def pack_trees(pools: list[RowTree], chosen: list[list[int]], device) -> tuple[torch.Tensor, torch.Tensor,
                                                                              torch.Tensor, torch.Tensor]:
    """Selected candidates as proposal tensors: tokens (n, N) -1 padded, parents (n, N) as node indices
    (-1 root or padding), lengths (n,), token probabilities (n, N) (display)."""
    N = max((len(c) for c in chosen), default=0)
    tokens, parents, probs = [], [], []
    for pool, sel in zip(pools, chosen):
        where = {p: j for j, p in enumerate(sel)}
        pad = N - len(sel)
        tokens.append([pool.tokens[p] for p in sel] + [-1] * pad)
        parents.append([where[pool.parents[p]] if pool.parents[p] >= 0 else -1 for p in sel] + [-1] * pad)
        probs.append([pool.prob[p] for p in sel] + [0.0] * pad)
    n = len(pools)
    lengths = torch.tensor([len(c) for c in chosen], dtype=torch.long, device=device)
    return (torch.tensor(tokens, dtype=torch.long, device=device).view(n, N),
            torch.tensor(parents, dtype=torch.long, device=device).view(n, N),
            lengths, torch.tensor(probs, dtype=torch.float32, device=device).view(n, N))


def trie(continuations: list[list[int]], weights: list[float], budget: int, decay: float = 0.8
         ) -> tuple[list[int], list[int], list[float]]:
    """Merge token sequences into a tree of at most ``budget`` nodes (prompt lookup with several
    matches). A node's score is the weight of the sequences through it over its parent's, times
    ``decay`` per level (a match is less likely to go on the further it runs); the ``budget`` nodes of
    highest cumulative score are kept (closed under parents), in topological order.
    Returns (tokens, parents, scores) with parents as node indices (-1 = root)."""
    pool = RowTree()
    kids: dict[tuple[int, int], int] = {}  # (parent pool index, token) -> pool index
    through: list[float] = []
    for seq, w in zip(continuations, weights):
        parent = -1
        for t in seq:
            key = (parent, t)
            if key not in kids:
                kids[key] = pool.add(t, parent, 0.0)
                through.append(0.0)
            parent = kids[key]
            through[parent] += w
    total = sum(weights)
    for i in range(len(pool.tokens)):  # scores in insertion order: parents are scored first
        par = pool.parents[i]
        base = total if par < 0 else through[par]
        pool.score[i] = (pool.score[par] if par >= 0 else 0.0) + math.log(max(through[i] / base, 1e-30) * decay)
    chosen = _select(TreeShape("dynamic"), pool, budget)
    where = {p: j for j, p in enumerate(chosen)}
    return ([pool.tokens[p] for p in chosen], [where[pool.parents[p]] if pool.parents[p] >= 0 else -1 for p in chosen],
            [pool.score[p] for p in chosen])
