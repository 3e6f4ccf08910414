"""Verifying a tree proposal: the block's layout, acceptance over a batch that mixes greedy and sampled
rows, and which cache slots the accepted path keeps. The acceptance math itself is
:func:`~speclab.engine.acceptance.tree_greedy_accept` / :func:`~speclab.engine.acceptance.tree_rejection_sample`.

Worked example (one row, start = 9: the newest token sits at slot 9). Tree: parents [-1, -1, 0, 1], so
the block [root, n0, n1, n2, n3] is written at slots 9..13 with positions 9 + depth = [9, 10, 10, 11, 11].
The target accepts n1 then n3 (path [1, 3]): their K/V move from slots 9+1+1 = 11 and 9+1+3 = 13 down
to slots 10 and 11 (slot = position), and the row's length advances by 3 (two accepted + the next
token), so slots 12.. are stale and are overwritten by the next block.
"""

from __future__ import annotations

import numpy as np
import torch

from ..errors import SpeclabError
from .acceptance import TreeAcceptResult, tree_greedy_accept, tree_rejection_sample
from .sampling import logits_to_probs


def tree_layout(parents: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Depths and the ancestor mask of the verify block [root, node 0 .. node N-1] (pure).

    parents (n, N) parent node index (-1 = root), valid (n, N) bool (padding nodes: False).
    Returns depth (n, N+1) int64 (root 0; padding nodes get their parent's depth + 1, harmless: no real
    query sees them) and mask (n, N+1, N+1) bool: mask[b, t, s] = block token s is t or an ancestor of t.

    e.g. parents [-1, -1, 0]: block [r, a, b, c], c under a:
         depth [0, 1, 1, 2]; c (t=3) sees r, a and itself, not its uncle b.
    """
    n, N = parents.shape
    # a loop over the nodes on the host (N is small; one copy in, one out, instead of ~5 kernels per node)
    par = (parents + 1).clamp(min=0).cpu().numpy()  # (n, N) the parent's block index (root = 0)
    ok = np.concatenate([np.ones((n, 1), dtype=bool), valid.cpu().numpy()], 1)  # (n, N+1)
    depth = np.zeros((n, N + 1), dtype=np.int64)
    mask = np.zeros((n, N + 1, N + 1), dtype=bool)
    mask[:, 0, 0] = True
    rows = np.arange(n)
    for i in range(N):  # parents come first: node i's parent row of the mask is complete
        pb = par[:, i]
        depth[:, i + 1] = depth[rows, pb] + 1
        mask[:, i + 1] = mask[rows, pb]
        mask[:, i + 1, i + 1] = True
    mask &= ok[:, None, :]
    mask[:, np.arange(N + 1), np.arange(N + 1)] = True  # every token sees itself (padding too)
    dev = parents.device
    return torch.from_numpy(depth).to(dev), torch.from_numpy(mask).to(dev)


def check_tree(parents: torch.Tensor, lengths: torch.Tensor) -> None:
    """Parents must come before their children (-1 or an index < the node's), within the row's nodes."""
    n, N = parents.shape
    idx = torch.arange(N, device=parents.device)[None]
    real = idx < lengths[:, None]
    bad = real & ((parents >= idx) | (parents < -1))
    if bool(bad.any()):
        raise SpeclabError("a tree proposal's parents must come before their children")


def tree_inputs(tokens: torch.Tensor, parents: torch.Tensor, num_nodes: torch.Tensor):
    """Nodes past a row's count become padding. Returns tokens (n, N) -1 padded, parents (n, N),
    depth (n, N+1) and the ancestor mask (n, N+1, N+1) of the block [root, nodes...]."""
    N = tokens.shape[1]
    valid = torch.arange(N, device=tokens.device)[None] < num_nodes[:, None]  # (n, N)
    tokens = torch.where(valid, tokens, -1)
    parents = torch.where(valid, parents, -1)
    check_tree(parents, num_nodes)
    depth, mask = tree_layout(parents, valid & (tokens >= 0))
    return tokens, parents, depth, mask


def accept_tree_rows(tokens: torch.Tensor, parents: torch.Tensor, draft_probs: torch.Tensor | None,
                     target_logits: torch.Tensor, params, uniform_accept: torch.Tensor | None,
                     uniform_next: torch.Tensor | None, want_probs: bool = False, reject=tree_rejection_sample
                     ) -> tuple[TreeAcceptResult, torch.Tensor | None]:
    """Greedy rows by :func:`tree_greedy_accept`, sampled rows by ``reject`` (the multi-candidate rule),
    merged in row order; also the target's probabilities (n, N+1, V) when sampled rows need them or
    ``want_probs`` (temperature 1 for greedy rows). target_logits (n, N+1, V): index 0 at the root."""
    if params.all_greedy:
        res = tree_greedy_accept(tokens, parents, target_logits.argmax(-1))
        return res, (target_logits.float().softmax(-1) if want_probs else None)
    target_probs = logits_to_probs(target_logits, params)  # (n, N+1, V)
    N = tokens.shape[1]
    ua = uniform_accept[:, :N]
    if not params.any_greedy:
        return reject(tokens, parents, draft_probs, target_probs, ua, uniform_next), target_probs
    g = params.greedy.nonzero().squeeze(1)
    s = (~params.greedy).nonzero().squeeze(1)
    rg = tree_greedy_accept(tokens[g], parents[g], target_logits[g].argmax(-1))
    rs = reject(tokens[s], parents[s], draft_probs[s] if draft_probs is not None else None, target_probs[s],
                ua[s], uniform_next[s])
    n, dev = tokens.shape[0], tokens.device
    out = TreeAcceptResult(torch.full((n, N), -1, dtype=torch.long, device=dev),
                           torch.empty(n, dtype=torch.long, device=dev), torch.empty(n, dtype=torch.long, device=dev),
                           torch.empty(n, dtype=torch.bool, device=dev))
    for name in ("path", "num_accepted", "next_token", "is_bonus"):
        t = getattr(out, name)
        t[g] = getattr(rg, name)
        t[s] = getattr(rs, name)
    return out, target_probs


def kept_slots(start: torch.Tensor, path: torch.Tensor, num: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Source and destination cache slots (n, N) that move the accepted path down to slot = position:
    node path[b, j] was written at slot start + 1 + path[b, j] and belongs at start + 1 + j. Entries past
    a row's path copy a slot onto itself (a no-op)."""
    N = path.shape[1]
    j = torch.arange(N, device=path.device)[None]  # (1, N)
    dst = start[:, None] + 1 + j  # (n, N)
    src = torch.where(j < num[:, None], start[:, None] + 1 + path.clamp(min=0), dst)
    return src, dst


def keep_path(cache, n: int, start: torch.Tensor, path: torch.Tensor, num: torch.Tensor) -> None:
    """Move the accepted paths' K/V down to slot = position in rows 0..n-1 of ``cache`` (nothing to move
    when every path runs through the first nodes in order: node j at block index j + 1, a common case)."""
    src, dst = kept_slots(start, path, num)
    if bool((src != dst).any()):
        cache.move_slots(slice(0, n), src, dst)


def block_path(path: torch.Tensor, num: torch.Tensor) -> torch.Tensor:
    """Block indices of the committed tokens: the root (0) then the accepted nodes (i + 1), -1 padded
    (n, N+1): what :class:`~speclab.drafters.base.Verified` hands a drafter with the block's features."""
    n, N = path.shape
    j = torch.arange(N, device=path.device)[None]
    nodes = torch.where(j < num[:, None], path + 1, -1)
    return torch.cat([torch.zeros(n, 1, dtype=torch.long, device=path.device), nodes], 1)


def node_target_probs(tprobs: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor) -> torch.Tensor:
    """(n, N): the target's probability of each node's token, read after its parent (display)."""
    at = (parents + 1).clamp(min=0)  # (n, N) block index of the parent
    dist = tprobs.gather(1, at[..., None].expand(-1, -1, tprobs.shape[-1]))  # (n, N, V)
    return dist.gather(2, tokens.clamp(min=0)[..., None]).squeeze(-1)
