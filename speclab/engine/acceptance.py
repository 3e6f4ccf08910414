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

from .sampling import sample_from_probs

RESIDUAL_EPS = 1e-9


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
        residual = (t_next - d_next).clamp_(min=0.0)  # (B, V)
        mass = residual.sum(-1, keepdim=True)  # (B, 1)
        # mass ~ 0 only when target == draft up to rounding, where a rejection has probability ~0;
        # fall back to the target's own distribution rather than divide by zero
        use_residual = rejected[:, None] & (mass > RESIDUAL_EPS)
        dist = torch.where(use_residual, residual, t_next)
    else:
        dist = t_next
    next_token = sample_from_probs(dist, uniform_next)  # (B,)
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
    from .sampling import logits_to_probs

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
