"""Turning logits into the distribution a token is drawn from, and drawing it.

The same function is applied to the draft's and the target's logits, so the two distributions
that the rejection rule compares are the ones the tokens were really drawn from.

All randomness comes in as uniform draws in [0, 1). Sampling is then a pure function
(inverse CDF), which makes rows reproducible from per-row seeds and gives a fused kernel a
single, testable contract (see :mod:`speclab.kernels`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy (argmax)
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


class RowParams:
    """Per-row sampling settings of a batch (continuous batching mixes requests), as tensors that
    broadcast over (n, ..., V) logits. ``greedy[b]`` rows use temperature 1 for display probabilities."""

    def __init__(self, params: list[SamplingParams], device):
        self.params = params
        self.greedy_rows = [p.greedy for p in params]
        self.all_greedy = all(self.greedy_rows)
        self.any_greedy = any(self.greedy_rows)
        n = len(params)
        self.temperature = torch.tensor([p.temperature if not p.greedy else 1.0 for p in params],
                                        dtype=torch.float32, device=device)  # (n,)
        self.top_k = [p.top_k for p in params]
        self.top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device)  # (n,)
        self.greedy = torch.tensor(self.greedy_rows, dtype=torch.bool, device=device)  # (n,)
        self.n = n

    @classmethod
    def uniform(cls, params: SamplingParams, n: int, device) -> "RowParams":
        return cls([params] * n, device)

    def select(self, idx: list[int]) -> "RowParams":
        return RowParams([self.params[i] for i in idx], self.greedy.device)


def _filter(logits: torch.Tensor, top_k, top_p) -> torch.Tensor:
    """top-k then top-p on (..., V) logits. ``top_k`` an int or a per-row list (0 = off); ``top_p`` a float
    or an (n,) tensor broadcast over the leading dimension (1 = off)."""
    V = logits.shape[-1]
    if isinstance(top_k, int):
        if top_k and top_k < V:
            kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]  # (..., 1)
            logits = logits.masked_fill(logits < kth, float("-inf"))
    elif any(0 < k < V for k in top_k):
        kmax = max(k for k in top_k if 0 < k < V)
        vals = torch.topk(logits, kmax, dim=-1).values  # (n, ..., kmax)
        ks = torch.tensor([k - 1 if 0 < k < V else kmax - 1 for k in top_k], device=logits.device)
        shape = (len(top_k),) + (1,) * (logits.dim() - 1)
        kth = vals.gather(-1, ks.view(shape).expand(*vals.shape[:-1], 1))  # (n, ..., 1)
        off = torch.tensor([not (0 < k < V) for k in top_k], device=logits.device).view(shape)
        logits = logits.masked_fill((logits < kth) & ~off, float("-inf"))
    if isinstance(top_p, float):
        if top_p >= 1.0:
            return logits
    elif bool((top_p >= 1.0).all()):
        return logits
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
    sorted_probs = sorted_logits.softmax(-1)
    # drop a token when the tokens ranked above it already reach top_p
    # e.g. probs [.5, .3, .2], top_p .7: mass before = [0, .5, .8] -> keep first two
    mass_before = sorted_probs.cumsum(-1) - sorted_probs
    if not isinstance(top_p, float):
        top_p = top_p.view((-1,) + (1,) * (logits.dim() - 1))
    drop_sorted = mass_before >= top_p
    drop = drop_sorted.scatter(-1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def logits_to_probs(logits: torch.Tensor, params: SamplingParams | RowParams) -> torch.Tensor:
    """(n, ..., V) logits -> float32 probabilities after temperature, top-k and top-p.

    ``params`` is one :class:`SamplingParams` for every row or a :class:`RowParams` (one per row of the
    leading dimension). Greedy rows use temperature 1 here: their probabilities are only for display.
    """
    logits = logits.float()
    if isinstance(params, SamplingParams):
        if not params.greedy:
            logits = logits / params.temperature
        return _filter(logits, params.top_k, params.top_p).softmax(-1)
    t = params.temperature.view((-1,) + (1,) * (logits.dim() - 1))
    return _filter(logits / t, params.top_k, params.top_p).softmax(-1)


FIXED_POINT_BITS = 40
FIXED_POINT_SCALE = float(2**FIXED_POINT_BITS)


def fixed_point_weights(probs: torch.Tensor) -> torch.Tensor:
    """Probabilities (..., V) as int64 multiples of 2^-40 (float32, scaled by a power of two, truncated).

    Integer sums do not depend on the order they are taken in, so every implementation of the draw (this
    sequential scan, the fused kernel's blocked scan, a parallel prefix sum) picks the same token from the
    same uniform. A float CDF does not: its rounding depends on the summation order, and draws that fall
    between two orders' values pick neighbouring tokens. The truncation moves each token's mass by less than
    2^-40, far below float32's own rounding of a CDF over a large vocabulary."""
    return (probs.float() * FIXED_POINT_SCALE).long()


def sample_from_weights(weights: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling from integer weights (..., V) with uniform (...) in [0, 1) -> (...) int64.

    The draw is the first token whose cumulative weight exceeds floor(u * total), the product taken in
    float64 (exact inputs, one IEEE rounding: the same value on every device)."""
    cdf = weights.cumsum(-1)  # (..., V) int64, exact
    goal = (uniform.double() * cdf[..., -1].double()).long()  # (...) < total because u < 1
    idx = torch.searchsorted(cdf.contiguous(), goal.unsqueeze(-1).contiguous(), right=True).squeeze(-1)
    # a zero-weight token is never picked: searchsorted(right=True) skips flat CDF steps; an all-zero row
    # (no mass at all) gives the last token
    return idx.clamp_(max=weights.shape[-1] - 1)


def sample_from_probs(probs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling. probs (..., V) (need not be normalised), uniform (...) in [0,1) -> (...) int64.
    Exact integer sums (:func:`fixed_point_weights`): the fused kernel draws the same token bit for bit."""
    return sample_from_weights(fixed_point_weights(probs), uniform)
