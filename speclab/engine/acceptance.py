"""The acceptance step: pure functions from tensors to tensors.

Vocabulary (as in vLLM): a drafted token is *accepted* when the target keeps it, the first one
it does not keep is *rejected* (and every draft after it is discarded), the token the target
puts in its place is *recovered*, and when every draft is accepted the target adds a *bonus*
token from its (k+1)-th distribution. Either way each round emits ``num_accepted + 1`` tokens.

Shapes: B rows, k draft slots (rows may use fewer: ``num_draft``), V vocabulary.
Padding slots in ``draft_tokens`` hold -1.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .sampling import FIXED_POINT_SCALE, fixed_point_weights, logits_to_probs, sample_from_probs, sample_from_weights

RESIDUAL_EPS = 1e-9
# the same threshold on a residual's fixed-point mass (its integer sum: exact, as the fused kernel takes it)
RESIDUAL_EPS_FIXED = int(RESIDUAL_EPS * FIXED_POINT_SCALE)


@dataclass
class AcceptResult:
    num_accepted: torch.Tensor  # (B,) int64, drafts kept per row, 0..num_draft[b]
    next_token: torch.Tensor  # (B,) int64, recovered (num_accepted < num_draft) or bonus token
    is_bonus: torch.Tensor  # (B,) bool, every draft of the row was accepted


def _first_rejection(keep: torch.Tensor) -> torch.Tensor:
    """(B, k) bool -> (B,) number of leading True values, e.g. [T, T, F, T] -> 2."""
    return keep.long().cumprod(-1).sum(-1)


def _valid_slots(draft_tokens: torch.Tensor, num_draft: torch.Tensor) -> torch.Tensor:
    k = draft_tokens.shape[1]
    return torch.arange(k, device=draft_tokens.device)[None, :] < num_draft[:, None]  # (B, k)


def greedy_accept(
    draft_tokens: torch.Tensor,  # (B, k) int64, -1 = padding
    target_argmax: torch.Tensor,  # (B, k+1) int64, the target's argmax at each verified position
    num_draft: torch.Tensor,  # (B,) int64
) -> AcceptResult:
    """Keep drafts while they equal the target's argmax; the next token is the target's argmax.

    The output is by construction what greedy decoding of the target alone produces.
    """
    k = draft_tokens.shape[1]
    keep = (draft_tokens == target_argmax[:, :k]) & _valid_slots(draft_tokens, num_draft)  # (B, k)
    n = _first_rejection(keep)  # (B,)
    next_token = target_argmax.gather(1, n[:, None]).squeeze(1)  # (B,)
    return AcceptResult(n, next_token, n == num_draft)


def rejection_sample(
    draft_tokens: torch.Tensor,  # (B, k) int64, -1 = padding
    draft_probs: torch.Tensor | None,  # (B, k, V) float, None = deterministic draft (one-hot)
    target_probs: torch.Tensor,  # (B, k+1, V) float
    num_draft: torch.Tensor,  # (B,) int64
    uniform_accept: torch.Tensor,  # (B, k) in [0, 1)
    uniform_next: torch.Tensor,  # (B,) in [0, 1)
) -> AcceptResult:
    """Speculative sampling (Leviathan et al. 2023; Chen et al. 2023).

    Draft i is accepted with probability min(1, target(d_i) / draft(d_i)); at the first
    rejection the next token is drawn from the normalised residual max(target - draft, 0);
    if every draft is accepted it is drawn from the target's next distribution (bonus).
    The emitted tokens are distributed exactly as the target's own samples.
    """
    B, k = draft_tokens.shape
    valid = _valid_slots(draft_tokens, num_draft)  # (B, k)
    safe_tokens = draft_tokens.clamp(min=0)  # (B, k) padding -> 0, masked by `valid`
    target_probs = target_probs.float()
    p_target = target_probs[:, :k].gather(-1, safe_tokens[..., None]).squeeze(-1)  # (B, k)
    if draft_probs is None:
        p_draft = torch.ones_like(p_target)  # a deterministic draft proposed its token with prob 1
    else:
        draft_probs = draft_probs.float()
        p_draft = draft_probs.gather(-1, safe_tokens[..., None]).squeeze(-1)  # (B, k)
    # u < min(1, pt/pd)  <=>  u * pd < pt   (pd > 0 for a token that was drawn from pd)
    keep = (uniform_accept * p_draft < p_target) & valid  # (B, k)
    n = _first_rejection(keep)  # (B,)
    rejected = n < num_draft  # (B,)

    rows = torch.arange(B, device=draft_tokens.device)
    t_next = target_probs[rows, n]  # (B, V) target distribution at the first unaccepted slot
    if k > 0:
        slot = n.clamp(max=k - 1)  # (B,) for rows without a rejection the value is unused
        if draft_probs is None:
            d_next = torch.zeros_like(t_next)
            d_next.scatter_(1, safe_tokens[rows, slot][:, None], 1.0)  # one-hot of the rejected draft
        else:
            d_next = draft_probs[rows, slot]  # (B, V)
        residual = fixed_point_weights((t_next - d_next).clamp_(min=0.0))  # (B, V) int64
        mass = residual.sum(-1, keepdim=True)  # (B, 1), exact
        # mass ~ 0 only when target == draft up to rounding, where a rejection has probability ~0;
        # fall back to the target's own distribution rather than divide by zero
        use_residual = rejected[:, None] & (mass > RESIDUAL_EPS_FIXED)
        weights = torch.where(use_residual, residual, fixed_point_weights(t_next))
    else:
        weights = fixed_point_weights(t_next)
    next_token = sample_from_weights(weights, uniform_next)  # (B,)
    return AcceptResult(n, next_token, ~rejected)


def accept_rows(
    draft_tokens: torch.Tensor,  # (n, k) int64, -1 = padding
    draft_probs: torch.Tensor | None,  # (n, k, V) or None (deterministic drafts)
    target_logits: torch.Tensor,  # (n, k+1, V)
    num_draft: torch.Tensor,  # (n,)
    params,  # speclab.engine.sampling.RowParams: which rows are greedy, and every row's sampling settings
    uniform_accept: torch.Tensor | None,  # (n, k) draws of the sampled rows (None when all rows are greedy)
    uniform_next: torch.Tensor | None,  # (n,)
    want_probs: bool = False,
    reject=rejection_sample,  # the sampling rule (the fused kernel has the same contract)
) -> tuple[AcceptResult, torch.Tensor | None]:
    """A batch that mixes greedy and sampled rows: :func:`greedy_accept` for the greedy rows, ``reject``
    for the sampled ones, results merged back in row order. Returns the result and the target's
    probabilities (the sampling distributions; temperature 1 for greedy rows), when sampled rows need
    them or ``want_probs``."""
    if params.all_greedy:
        res = greedy_accept(draft_tokens, target_logits.argmax(-1), num_draft)
        return res, (target_logits.float().softmax(-1) if want_probs else None)
    target_probs = logits_to_probs(target_logits, params)  # (n, k+1, V)
    if not params.any_greedy:
        return reject(draft_tokens, draft_probs, target_probs, num_draft, uniform_accept, uniform_next), target_probs
    g = params.greedy.nonzero().squeeze(1)
    s = (~params.greedy).nonzero().squeeze(1)
    rg = greedy_accept(draft_tokens[g], target_logits[g].argmax(-1), num_draft[g])
    rs = reject(draft_tokens[s], draft_probs[s] if draft_probs is not None else None, target_probs[s], num_draft[s],
                uniform_accept[s], uniform_next[s])
    n = draft_tokens.shape[0]
    out = AcceptResult(torch.empty(n, dtype=torch.long, device=draft_tokens.device),
                       torch.empty(n, dtype=torch.long, device=draft_tokens.device),
                       torch.empty(n, dtype=torch.bool, device=draft_tokens.device))
    for field_name in ("num_accepted", "next_token", "is_bonus"):
        t = getattr(out, field_name)
        t[g] = getattr(rg, field_name)
        t[s] = getattr(rs, field_name)
    return out, target_probs


# ----------------------------------------------------------------------------------------------- trees
# A tree proposal per row: N nodes, node i holds ``tokens[b, i]`` (-1 = padding) and hangs under
# ``parents[b, i]`` (-1 = the root, the row's newest committed token). Parents come before their
# children (parents[b, i] < i), so one pass in index order sees every parent before its children.
# The target was run on the whole tree at once: ``target_probs[b, 0]`` is its next-token distribution
# at the root and ``target_probs[b, i + 1]`` the one after node i (the root path to i as context).
#
# Worked example (one row, N = 5):        root
#   tokens  = [7, 3, 5, 9, 2]             /    \
#   parents = [-1, -1, 0, 0, 1]          7(0)   3(1)
#                                       /   \      \
#                                     5(2)  9(3)   2(4)
# Node 0 and node 1 are the root's candidates (tried in that order), nodes 2 and 3 are node 0's. A root
# path accepting 7 then 9 gives path = [0, 3], num_accepted = 2, and the next token comes from
# target_probs[b, 3 + 1] (node 3 is a leaf: a bonus token).


@dataclass
class TreeAcceptResult:
    path: torch.Tensor  # (n, N) int64 accepted node indices in root-to-leaf order, -1 padded
    num_accepted: torch.Tensor  # (n,) int64 nodes on the accepted path
    next_token: torch.Tensor  # (n,) int64 recovered token, or bonus token when the path ends in a leaf
    is_bonus: torch.Tensor  # (n,) bool, the path's last node (or the root) has no children in the tree


def _children_of(parents: torch.Tensor, valid: torch.Tensor, node: torch.Tensor) -> torch.Tensor:
    """(n, N) bool: the valid nodes whose parent is ``node[b]`` (-1 = the root)."""
    return (parents == node[:, None]) & valid


def tree_greedy_accept(
    tokens: torch.Tensor,  # (n, N) int64, -1 = padding
    parents: torch.Tensor,  # (n, N) int64, -1 = child of the root
    target_argmax: torch.Tensor,  # (n, N+1) int64: index 0 at the root, i + 1 after node i
) -> TreeAcceptResult:
    """The longest root path whose every node is the target's argmax after its parent; the next token is
    the target's argmax after the path's last node. Exactly greedy decoding of the target: every path
    kept is the greedy continuation. (Siblings holding the same token: the deepest path wins, then the
    lowest node index.)"""
    n, N = tokens.shape
    dev = tokens.device
    valid = tokens >= 0  # (n, N)
    on_path = torch.zeros(n, N, dtype=torch.bool, device=dev)  # the node and all its ancestors match
    depth = torch.zeros(n, N, dtype=torch.long, device=dev)  # the root's children have depth 1
    for i in range(N):  # parents first: node i's parent is already decided
        par = parents[:, i]  # (n,)
        at_root = par < 0
        pc = par.clamp(min=0)[:, None]  # (n, 1)
        par_ok = at_root | on_path.gather(1, pc).squeeze(1)
        par_depth = torch.where(at_root, 0, depth.gather(1, pc).squeeze(1))
        want = target_argmax.gather(1, (par + 1)[:, None]).squeeze(1)  # (n,) the argmax after the parent
        on_path[:, i] = valid[:, i] & par_ok & (tokens[:, i] == want)
        depth[:, i] = par_depth + 1
    # the deepest node on an all-matching path, ties to the lowest index; score 0 = no node matches
    idx = torch.arange(N, device=dev)
    score = torch.where(on_path, depth * (N + 1) + (N - idx), 0)  # (n, N)
    best = torch.full((n,), -1, dtype=torch.long, device=dev)  # (n,) the path's last node, -1 = the root
    num = torch.zeros(n, dtype=torch.long, device=dev)
    if N:
        top, arg = score.max(-1)
        best = torch.where(top > 0, arg, best)
        num = torch.where(top > 0, depth.gather(1, arg[:, None]).squeeze(1), num)
    next_token = target_argmax.gather(1, (best + 1)[:, None]).squeeze(1)
    is_bonus = ~_children_of(parents, valid, best).any(-1)
    return TreeAcceptResult(_path_to(best, num, parents), num, next_token, is_bonus)


def _path_to(last: torch.Tensor, num: torch.Tensor, parents: torch.Tensor) -> torch.Tensor:
    """(n, N) root-to-``last`` node indices, -1 padded, by walking up the parents from the last node."""
    n, N = parents.shape
    path = torch.full((n, N + 1), -1, dtype=torch.long, device=parents.device)  # column N: a sink for done rows
    node, d = last.clone(), num.clone()
    for _ in range(int(num.max()) if n and N else 0):  # one step per level of the deepest path
        live = node >= 0
        col = torch.where(live, d - 1, N)
        path.scatter_(1, col[:, None], torch.where(live, node, -1)[:, None])
        node = torch.where(live, parents.gather(1, node.clamp(min=0)[:, None]).squeeze(1), -1)
        d = d - 1
    return path[:, :N]


def tree_rejection_sample(
    tokens: torch.Tensor,  # (n, N) int64, -1 = padding
    parents: torch.Tensor,  # (n, N) int64, -1 = child of the root; parents[b, i] < i
    draft_probs: torch.Tensor | None,  # (n, N, V): the distribution node i was drawn from; None = all one-hot
    target_probs: torch.Tensor,  # (n, N+1, V): index 0 at the root, i + 1 after node i
    uniform_accept: torch.Tensor,  # (n, N) in [0, 1): node i's acceptance draw
    uniform_next: torch.Tensor,  # (n,) in [0, 1): the draw of the final (recovered or bonus) token
) -> TreeAcceptResult:
    """Multi-candidate speculative sampling over a token tree (SpecInfer, Miao et al. 2024; EAGLE).

    Starting at the root with the target's distribution p there, the children of the current node are
    tried in index order. Child c (token x, drawn from q = ``draft_probs[b, c]``) is accepted with
    probability min(1, p(x) / q(x)); the walk then moves to c with the target's distribution after c.
    On rejection p becomes the normalised residual max(p - q, 0) and the next sibling is tried against
    it. When a node has no children left to try, the next token is drawn from the current p: the last
    residual (a *recovered* token), or the target's own distribution at a leaf (a *bonus* token).

    Exact when every child was drawn from its q independently of its earlier siblings (i.i.d. siblings
    of a sampled draft share their parent's q), and for one-hot q whatever chose the child: top-k
    branching, prompt lookup. A one-hot q accepts with probability p(x) and the residual then removes the
    rejected token from p. Pass ``draft_probs=None`` for an all-deterministic tree, or one-hot rows for
    such nodes. Siblings drawn *without* replacement must not be scored with the q they came from.

    Randomness: node i uses ``uniform_accept[b, i]`` (each node is tried at most once) and the final
    token ``uniform_next[b]``: a row's draws are laid out by its own tree, never by other rows.
    A chain is the tree ``parents = [-1, 0, 1, ...]`` and gives :func:`rejection_sample`'s result.
    """
    n, N = tokens.shape
    dev = tokens.device
    rows = torch.arange(n, device=dev)
    idx = torch.arange(N, device=dev)
    valid = tokens >= 0  # (n, N)
    safe = tokens.clamp(min=0)  # (n, N)
    target_probs = target_probs.float()
    V = target_probs.shape[-1]
    if draft_probs is not None:
        draft_probs = draft_probs.float()
    cur = torch.full((n,), -1, dtype=torch.long, device=dev)  # the node whose children are tried
    tried = torch.full((n,), -1, dtype=torch.long, device=dev)  # children <= tried are done (children > parent)
    dist = target_probs[:, 0].clone()  # (n, V) the current p, unnormalised: p = dist / mass
    mass = torch.ones(n, device=dev)  # (n,) target distributions come normalised
    rejected_here = torch.zeros(n, dtype=torch.bool, device=dev)  # a child of `cur` was rejected
    num = torch.zeros(n, dtype=torch.long, device=dev)
    path = torch.full((n, N + 1), -1, dtype=torch.long, device=dev)  # column N: a sink for rows not accepting
    for _ in range(N):  # every step tries one node per row (or none): N steps try them all
        cand = _children_of(parents, valid, cur) & (idx[None] > tried[:, None])  # (n, N)
        has = cand.any(-1)  # (n,)
        if not bool(has.any()):
            break
        c = cand.long().argmax(-1)  # (n,) the first untried child (argmax returns the first maximum)
        x = safe[rows, c]  # (n,)
        if draft_probs is None:
            q = torch.zeros(n, V, device=dev).scatter_(1, x[:, None], 1.0)  # (n, V) one-hot
        else:
            q = draft_probs[rows, c]  # (n, V)
        q_x = q.gather(1, x[:, None]).squeeze(1)
        p_x = dist.gather(1, x[:, None]).squeeze(1)
        # u < min(1, p(x) / q(x)) with p = dist / mass  <=>  u * q(x) * mass < dist(x)
        accept = has & (uniform_accept[rows, c] * q_x * mass < p_x)  # (n,)
        reject = has & ~accept
        residual = (dist - q * mass[:, None]).clamp_(min=0.0)  # (n, V) = mass * max(p - q, 0)
        r_mass = residual.sum(-1)  # (n,)
        # r_mass ~ 0 only when p == q up to rounding, where a rejection has probability ~0: keep p
        # rather than divide by zero (as rejection_sample falls back to the target)
        update = reject & (r_mass > RESIDUAL_EPS * mass)
        path.scatter_(1, torch.where(accept, num, N)[:, None], torch.where(accept, c, -1)[:, None])
        num = num + accept.long()
        cur = torch.where(accept, c, cur)
        tried = torch.where(has, c, tried)  # accepted: its children all have larger indices than c
        dist = torch.where(accept[:, None], target_probs[rows, c + 1],
                           torch.where(update[:, None], residual, dist))
        mass = torch.where(accept, torch.ones_like(mass), torch.where(update, r_mass, mass))
        rejected_here = (rejected_here & ~accept) | reject
    next_token = sample_from_probs(dist, uniform_next)  # (n,)
    return TreeAcceptResult(path[:, :N], num, next_token, ~rejected_here)


def fused_rejection_sample(draft_tokens, draft_probs, target_probs, num_draft, uniform_accept, uniform_next,
                           block_v: int | None = None) -> AcceptResult:
    """:func:`rejection_sample`'s contract run by the fused Triton kernel (``kernels/rejection.py``); the reference
    itself where the kernel cannot run (no Triton, or a CPU tensor without ``TRITON_INTERPRET=1``)."""
    kernel = _kernel_module()
    if kernel is None or not kernel.triton_available(target_probs.device):
        return rejection_sample(draft_tokens, draft_probs, target_probs, num_draft, uniform_accept, uniform_next)
    n, tok = kernel.rejection_counts(draft_tokens, draft_probs, target_probs, num_draft, uniform_accept,
                                     uniform_next, RESIDUAL_EPS_FIXED, block_v)
    return AcceptResult(n, tok, n == num_draft)


def rejection_impl(device: torch.device):
    """The acceptance rule a decoder on ``device`` runs: the fused kernel on CUDA when Triton is installed, else
    the pure PyTorch reference."""
    if device.type == "cuda":
        kernel = _kernel_module()
        if kernel is not None and kernel.triton_available(device):
            return fused_rejection_sample
    return rejection_sample


def _kernel_module():
    """``speclab.kernels.rejection``, or None when it cannot load. Imported when first asked for: the module imports
    Triton where it is installed, a cost a CPU run never needs to pay."""
    try:
        from ..kernels import rejection
    except ImportError:
        return None
    return rejection
