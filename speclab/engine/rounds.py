"""Turning one row's round into the records the events carry (kept out of the decode loop, which
then reads top to bottom; built only when some subscriber listens).

Worked example. A row has generated g0 = 10 tokens; it drafts d = [a, b, c] (k = 3); the target
accepts n = 1 (a), rejects b, and puts its own token x where b was. Emitted: [a, x]. Display order
and positions (index among the row's generated tokens)::

    a  accepted   position 10      (g0 + 0)
    b  rejected   position 11      (g0 + 1: where it was proposed, struck through in the UI)
    c  rejected   position 12      (discarded with b: drafts after the first rejection are never verified)
    x  recovered  position 11      (g0 + n: the target's token at the first rejected slot)

All k accepted: the target's token at slot k is a *bonus*. No drafts (k = 0): it is *target*.
An EOS or the budget inside an accepted run cuts ``new``: records past the cut are not emitted.
"""

from __future__ import annotations

import torch

from ..events import RowRound, TokenRecord
from .tree_verify import node_target_probs


def row_round(row: int, g0: int, drafts: list[int], n_acc: int, new: list[int], bonus: bool,
              draft_probs: list[float] | None, target_probs: list[float] | None, next_prob: float | None,
              reason: str | None, request_id: str = "", k: int = 0, k_reason: str = "") -> RowRound:
    """``drafts`` the row's verified drafts, ``n_acc`` how many were kept, ``new`` the tokens emitted this
    round (after any EOS / budget / stop cut), ``draft_probs`` / ``target_probs`` per draft (None: not
    recorded), ``next_prob`` the target's probability of its own token."""
    nd = len(drafts)
    dp = draft_probs if draft_probs is not None else [None] * nd
    tp = target_probs if target_probs is not None else [None] * nd
    recs = [TokenRecord(new[i], "accepted", dp[i], tp[i], g0 + i) for i in range(min(n_acc, len(new)))]
    if n_acc < nd:  # the first rejected draft and the discarded ones after it
        recs += [TokenRecord(drafts[i], "rejected", dp[i], tp[i], g0 + i) for i in range(n_acc, nd)]
    if len(new) > n_acc:  # the target's own token made it in
        status = "target" if nd == 0 else ("bonus" if bonus else "recovered")
        recs.append(TokenRecord(new[n_acc], status, None, next_prob, g0 + n_acc))
    return RowRound(row, nd, n_acc, recs, reason is not None, reason, request_id, k, k_reason)


def prefill_round(row: int, token: int, prob: float | None, reason: str | None, request_id: str = "") -> RowRound:
    """A request's first token, sampled from its prefill."""
    return RowRound(row, 0, 0, [TokenRecord(token, "target", None, prob, 0)], reason is not None, reason,
                    request_id, 0, "prefill")


def tree_row_round(row: int, g0: int, tokens: list[int], parents: list[int], path: list[int], new: list[int],
                   bonus: bool, draft_probs: list[float] | None, target_probs: list[float] | None,
                   next_prob: float | None, reason: str | None, request_id: str = "", k: int = 0,
                   k_reason: str = "") -> RowRound:
    """A tree round: ``tokens`` / ``parents`` the row's verified nodes (parent -1 = the root), ``path`` the
    accepted nodes in root-to-leaf order, ``new`` the tokens emitted (after any cut). Display order: the
    accepted path, the rejected nodes (depth first), then the target's token; a rejected node's position is
    where it was proposed (g0 + depth - 1). The event's ``tree`` holds the whole tree with each node's fate:
    "accepted" (on the path), "rejected" (a child of the root or of a path node, tried and refused) or
    "discarded" (under a rejected node: never reached)."""
    nd, na = len(tokens), len(path)
    dp = draft_probs if draft_probs is not None else [None] * nd
    tp = target_probs if target_probs is not None else [None] * nd
    depth = []
    for i in range(nd):
        depth.append(1 if parents[i] < 0 else depth[parents[i]] + 1)
    on_path = set(path)
    reached = {-1} | on_path
    fates = ["accepted" if i in on_path else "rejected" if parents[i] in reached else "discarded" for i in range(nd)]
    recs = [TokenRecord(new[j], "accepted", dp[i], tp[i], g0 + j) for j, i in enumerate(path[:len(new)])]
    for i in sorted((i for i in range(nd) if i not in on_path), key=lambda i: (depth[i], i)):
        recs.append(TokenRecord(tokens[i], "rejected", dp[i], tp[i], g0 + depth[i] - 1))
    if len(new) > na:
        status = "target" if nd == 0 else ("bonus" if bonus else "recovered")
        recs.append(TokenRecord(new[na], status, None, next_prob, g0 + na))
    tree = {"tokens": list(tokens), "parents": list(parents), "depth": depth, "fates": fates, "path": list(path),
            "draft_probs": list(dp), "target_probs": list(tp), "next_token": new[na] if len(new) > na else None,
            "next_status": recs[-1].status if len(new) > na else None}
    return RowRound(row, nd, na, recs, reason is not None, reason, request_id, k, k_reason, tree=tree)


def _shown_probs(drafts, verdict, want_probs: bool):
    """Per row, the probabilities shown with its tokens (each None when no subscriber reads them): the draft's and
    the target's for every verified draft, and the target's for its own next token."""
    if not want_probs:
        return None, None, None
    res, tprobs, tokens = verdict.result, verdict.target_probs, drafts.tokens
    n, kk = tokens.shape
    r_idx = torch.arange(n, device=tokens.device)
    if drafts.tree:
        tp = node_target_probs(tprobs, tokens, drafts.tree[0])  # (n, kk)
        pathx = torch.cat([res.path, res.path.new_full((n, 1), -1)], 1)  # (n, kk+1): kk may be 0
        end = pathx.gather(1, (res.num_accepted - 1).clamp(min=0)[:, None]).squeeze(1)  # (n,) last node
        last = torch.where(res.num_accepted > 0, end + 1, 0)  # (n,) block index the next token was read at
    else:
        tp = tprobs[:, :kk].gather(2, tokens.clamp(min=0)[..., None]).squeeze(-1)  # (n, kk)
        last = res.num_accepted
    prop = drafts.proposal
    dp = prop.token_probs.tolist() if prop is not None and prop.token_probs is not None else None
    return dp, tp.tolist(), tprobs[r_idx, last, res.next_token].tolist()


def row_events(rows, drafts, verdict, news, ks: list[int], why: list[str], want_probs: bool) -> list[RowRound]:
    """Every row's record of a round. ``drafts`` / ``verdict`` as the round made them (speclab.engine.round),
    ``news`` per row: (tokens generated before the round, the tokens it kept, why it ended or None)."""
    res = verdict.result
    d_h, bonus_h, n_h = drafts.tokens.tolist(), res.is_bonus.tolist(), res.num_accepted.tolist()
    nd_h = drafts.num_draft.tolist()
    dp_h, tp_h, tpn_h = _shown_probs(drafts, verdict, want_probs)
    if drafts.tree:
        par_h, path_h = drafts.tree[0].tolist(), res.path.tolist()
    out = []
    for b, r in enumerate(rows):
        na, nd = n_h[b], nd_h[b]
        g0, new, reason = news[b]
        dp, tp = (dp_h[b][:nd] if dp_h else None), (tp_h[b][:nd] if tp_h else None)
        tpn = tpn_h[b] if tpn_h else None
        if drafts.tree:
            out.append(tree_row_round(r.row, g0, d_h[b][:nd], par_h[b][:nd], path_h[b][:na], new, bonus_h[b], dp, tp,
                                      tpn, reason, r.request_id, ks[b], why[b]))
        else:
            out.append(row_round(r.row, g0, d_h[b][:nd], na, new, bonus_h[b], dp, tp, tpn, reason, r.request_id,
                                 ks[b], why[b]))
    return out
