"""Suffix decoding: no model; suffix trees over the request's own tokens and over earlier outputs.

The method of SuffixDecoding (Oliaro et al., arXiv 2411.04975) as vLLM serves it (``method: suffix``):

* a per-row tree over the row's prompt and everything it has generated so far, and a global tree over
  the outputs of requests that have finished (the last ``cache`` of them);
* each tree holds every substring of up to ``depth`` tokens, each node counting how often its substring
  occurs: a bounded-depth suffix trie;
* to draft, the row's last m tokens are looked up for every m (the *match length*); from a matched node
  the draft follows the most frequent continuation while the product of the branch frequencies
  (the draft's estimated probability of reaching that token) stays >= ``min_prob``, and for at most
  ``factor * m + offset`` tokens: a longer match earns a longer draft;
* of all the match lengths and both trees, the draft with the highest score (the sum of those
  estimated probabilities: the expected number of accepted tokens) wins.

A draft is deterministic (scored one-hot under sampling). Only greedy rows consult the global tree:
a greedy row's output never depends on its drafts, while a sampled row's realised tokens do, and a
request's output must not depend on what other requests the server ran before it.

Where prompt lookup finds the single most recent occurrence of the last few tokens (and
:mod:`speclab.drafters.suffix` the most recent occurrence of the longest match), suffix decoding weighs every
earlier occurrence and sizes the draft to the evidence: long confident drafts on repetitive text (JSON,
code, agent loops), short or none on open prose. It is what ``--draft suffix`` names.
"""

from __future__ import annotations

from collections import deque

from ..errors import SpeclabError
from .base import DraftContext, Proposal


class _Node:
    """One substring: ``count`` occurrences, ``out`` of them followed by a token (``children``), the
    most frequent follower ``best`` (ties: the one counted last, i.e. the most recent)."""

    __slots__ = ("count", "out", "children", "best")

    def __init__(self):
        self.count = 0
        self.out = 0
        self.children: dict[int, _Node] | None = None  # made on the first follower: most nodes are leaves
        self.best: int | None = None

    def bump(self, tok: int) -> "_Node":
        """Count one more occurrence of ``tok`` after this substring; returns the child."""
        if self.children is None:
            self.children = {}
        child = self.children.get(tok)
        if child is None:
            child = self.children[tok] = _Node()
        child.count += 1
        self.out += 1
        if self.best is None or child.count >= self.children[self.best].count:
            self.best = tok
        return child

    def drop(self, tok: int) -> "_Node":
        """Undo one :meth:`bump`; a child counted zero times is removed."""
        child = self.children[tok]
        child.count -= 1
        self.out -= 1
        if child.count == 0:
            del self.children[tok]
        if tok == self.best:
            self.best = max(self.children, key=lambda t: self.children[t].count) if self.children else None
        return child


def _walk(node: _Node, limit: int, min_prob: float) -> tuple[list[int], float]:
    """The most frequent continuation below ``node``: up to ``limit`` tokens while the estimated probability
    of reaching each (the product of ``child.count / node.out`` along the way) is >= ``min_prob``.
    Returns the tokens and their score (the sum of those probabilities)."""
    toks: list[int] = []
    prob, score = 1.0, 0.0
    while len(toks) < limit and node.best is not None:
        child = node.children[node.best]
        prob *= child.count / node.out
        if prob < min_prob:
            break
        toks.append(node.best)
        score += prob
        node = child
    return toks, score


class SuffixTree:
    """Every substring of up to ``depth`` tokens of the sequences added, with occurrence counts.

    e.g. depth 3, sequence [5, 6, 5, 6]: nodes [5] x2, [5, 6] x2, [5, 6, 5] x1, [6] x2, [6, 5] x1,
    [6, 5, 6] x1; below [5] the follower 6 was seen twice out of two: a draft [6, 5] from there."""

    def __init__(self, depth: int):
        self.depth = depth
        self.root = _Node()

    def add(self, seq: list[int]) -> None:
        for j in range(len(seq)):
            node = self.root
            for tok in seq[j:j + self.depth]:
                node = node.bump(tok)

    def remove(self, seq: list[int]) -> None:
        """Forget a sequence added earlier (the global cache evicts its oldest output)."""
        for j in range(len(seq)):
            node = self.root
            for tok in seq[j:j + self.depth]:
                node = node.drop(tok)

    def matches(self, context: list[int]) -> list[tuple[int, _Node]]:
        """(m, node of the context's last m tokens) for m = 1, 2, ... while the substring occurs (a longer
        suffix cannot occur where a shorter one does not) and a continuation can still fit under the depth."""
        out = []
        for m in range(1, min(self.depth - 1, len(context)) + 1):
            node = self.root
            for tok in context[len(context) - m:]:
                node = node.children.get(tok) if node.children else None
                if node is None:
                    return out
            out.append((m, node))
        return out


class _RowTree(SuffixTree):
    """A row's own tree, grown one token at a time: ``active[i]`` is the node of the row's last i + 1 tokens,
    so appending a token is one :meth:`_Node.bump` per active node, and the matches are ``active`` itself."""

    def __init__(self, depth: int, request_id, prompt_len: int):
        super().__init__(depth)
        self.request_id = request_id
        self.prompt_len = prompt_len
        self.tokens: list[int] = []
        self.active: list[_Node] = []

    def extend(self, toks: list[int]) -> None:
        keep = self.depth - 1  # a node at full depth is counted but never extended: no room below it
        for tok in toks:
            self.active = ([self.root.bump(tok)] + [node.bump(tok) for node in self.active])[:keep]
        self.tokens.extend(toks)

    def matches(self, context=None) -> list[tuple[int, _Node]]:
        return [(i + 1, node) for i, node in enumerate(self.active)]


class SuffixTreeDrafter:
    """Suffix decoding (see the module's docstring). Keeps a :class:`_RowTree` per slot, grown with each
    round's committed tokens (nothing to roll back: drafts are never inserted), and a global tree of up to
    ``cache`` finished outputs (0: none).

    Knobs (vLLM's names in brackets): ``depth`` (max_tree_depth, 24): the longest substring kept, which
    bounds match length plus draft length; ``factor`` (max_spec_factor, 1.0) and ``offset`` (max_spec_offset,
    0): a draft of at most ``factor * m + offset`` tokens after a match of m; ``min_prob`` (min_token_prob,
    0.1): stop where the estimated probability of reaching a token falls below it; ``cache``
    (max_cached_requests, 1000); ``min_match`` (speclab's, 1): ignore matches shorter than this."""

    features: tuple[int, ...] = ()
    admits_late = True  # a row's tree is built from ctx alone, when it first drafts

    def __init__(self, depth: int = 24, factor: float = 1.0, offset: float = 0.0, min_prob: float = 0.1,
                 cache: int = 1000, min_match: int = 1):
        if not 2 <= int(depth) <= 256:
            raise SpeclabError(f"suffix depth must be in 2..256, got {depth}")
        if not (factor > 0 and offset >= 0):
            raise SpeclabError(f"suffix factor must be > 0 and offset >= 0, got {factor}, {offset}")
        if not 0 <= min_prob <= 1:
            raise SpeclabError(f"suffix min_prob must be in [0, 1], got {min_prob}")
        if int(cache) < 0:
            raise SpeclabError(f"suffix cache must be >= 0, got {cache}")
        if not 1 <= int(min_match) < int(depth):
            raise SpeclabError(f"suffix min_match must be in 1..depth-1, got {min_match}")
        self.name = "suffix"
        self.depth, self.factor, self.offset = int(depth), float(factor), float(offset)
        self.min_prob, self.cache, self.min_match = float(min_prob), int(cache), int(min_match)
        self.global_tree = SuffixTree(self.depth)
        self.cached: deque[list[int]] = deque()  # outputs in the global tree, oldest first
        self.rows: list[_RowTree | None] = []

    # ------------------------------------------------------------------ rows in and out
    def reset(self, capacity: int, max_len: int) -> None:
        """A fresh scheduler. The global tree stays: it is a cache of what earlier requests wrote."""
        self._retire(range(len(self.rows)))
        self.rows = [None] * capacity

    def admit(self, ctx: DraftContext, rows: range, features) -> None:
        for b in rows:
            self._take_in(ctx, b)

    def move_row(self, src: int, dst: int) -> None:
        self._retire([dst])
        if src < len(self.rows):
            self.rows[dst], self.rows[src] = self.rows[src], None

    def release(self, n: int) -> None:
        self._retire(range(n, len(self.rows)))

    def commit(self, ctx: DraftContext, verified) -> None:
        for b in range(ctx.n):
            self._sync(ctx, b)

    def _take_in(self, ctx: DraftContext, b: int) -> _RowTree:
        if b >= len(self.rows):
            self.rows.extend([None] * (b + 1 - len(self.rows)))
        self._retire([b])
        rid = ctx.request_ids[b] if b < len(ctx.request_ids) else None
        tree = self.rows[b] = _RowTree(self.depth, rid, max(len(ctx.host[b]) - 1, 0))
        tree.extend(ctx.host[b])
        return tree

    def _sync(self, ctx: DraftContext, b: int) -> _RowTree:
        """Row b's tree, holding all its committed tokens; a new one when the slot holds another request
        (a row this drafter was not told about: taken in late, or moved while not yet taken in)."""
        tree = self.rows[b] if b < len(self.rows) else None
        seq = ctx.host[b]
        rid = ctx.request_ids[b] if b < len(ctx.request_ids) else None
        if tree is None or tree.request_id != rid or len(seq) < len(tree.tokens) or \
                (tree.tokens and seq[len(tree.tokens) - 1] != tree.tokens[-1]):
            return self._take_in(ctx, b)
        if len(seq) > len(tree.tokens):
            tree.extend(seq[len(tree.tokens):])
        return tree

    def _retire(self, slots) -> None:
        """The rows in ``slots`` are gone: their outputs join the global cache (oldest evicted first)."""
        for b in slots:
            tree = self.rows[b] if b < len(self.rows) else None
            if tree is None:
                continue
            self.rows[b] = None
            self.remember(tree.tokens[tree.prompt_len:])

    def remember(self, output: list[int]) -> None:
        """Add a finished request's output to the global cache (a server's drafter does this as requests end;
        a benchmark may seed it with other prompts' outputs)."""
        if self.cache and output:
            self.global_tree.add(output)
            self.cached.append(list(output))
            while len(self.cached) > self.cache:
                self.global_tree.remove(self.cached.popleft())

    # ------------------------------------------------------------------ drafting
    def best_draft(self, tree: _RowTree, context: list[int], k: int, use_global: bool) -> list[int]:
        """The highest-scoring draft over every match length in the row's tree (and the global one);
        on a tie the longer match wins."""
        candidates = tree.matches()
        if use_global and self.cached:
            candidates = candidates + self.global_tree.matches(context)
        best, best_key = [], (0.0, 0)
        for m, node in candidates:
            limit = min(k, int(self.factor * m + self.offset))
            if limit <= 0 or node.best is None or m < self.min_match:
                continue
            toks, score = _walk(node, limit, self.min_prob)
            if toks and (score, m) > best_key:
                best, best_key = toks, (score, m)
        return best

    def propose(self, ctx: DraftContext, ks, params, uniform, want_probs, stop=None) -> Proposal:
        n, k = ctx.n, max(ks) if ks else 0
        greedy = getattr(params, "greedy_rows", None) or [False] * n
        drafts = []
        for b in range(n):
            tree = self._sync(ctx, b)  # every row's tree follows its context, drafting this round or not
            drafts.append(self.best_draft(tree, ctx.host[b], ks[b], bool(greedy[b])) if ks[b] else [])
        return Proposal.from_host(drafts, max(k, 1), ctx.tokens.device)
