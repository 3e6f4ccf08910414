"""Turning logits into the distribution a token is drawn from, and drawing it.

The same function is applied to the draft's and the target's logits, so the two distributions
that the rejection rule compares are the ones the tokens were really drawn from.

All randomness comes in as uniform draws in [0, 1). Sampling is then a pure function
(inverse CDF), which makes rows reproducible from per-row seeds and gives a fused kernel a
single, testable contract (see ``kernels/``).
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


def logits_to_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """(..., V) logits -> (..., V) float32 probabilities after temperature, top-k and top-p.

    Greedy decoding uses temperature 1 here: the probabilities are only for display.
    """
    logits = logits.float()
    if not params.greedy:
        logits = logits / params.temperature
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]  # (..., 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        sorted_probs = sorted_logits.softmax(-1)
        # drop a token when the tokens ranked above it already reach top_p
        # e.g. probs [.5, .3, .2], top_p .7: mass before = [0, .5, .8] -> keep first two
        mass_before = sorted_probs.cumsum(-1) - sorted_probs
        drop_sorted = mass_before >= params.top_p
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits.softmax(-1)


def sample_from_probs(probs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling. probs (..., V) (need not be normalised), uniform (...) in [0,1) -> (...) int64."""
    cdf = probs.float().cumsum(-1)  # (..., V)
    target = uniform.unsqueeze(-1) * cdf[..., -1:]  # (..., 1)
    idx = torch.searchsorted(cdf.contiguous(), target.contiguous(), right=True).squeeze(-1)
    # a zero-probability token is never picked: searchsorted(right=True) skips flat CDF steps,
    # and u < 1 keeps the index inside the vocabulary
    return idx.clamp_(max=probs.shape[-1] - 1)


class RowRNG:
    """One torch.Generator per row, so a row's samples depend on its own seed only."""

    def __init__(self, seeds: list[int], device: torch.device | str = "cpu"):
        self.device = torch.device(device)
        self.gens = []
        for s in seeds:
            g = torch.Generator(device=self.device)
            g.manual_seed(int(s))
            self.gens.append(g)

    def uniform(self, n: int) -> torch.Tensor:
        """(B, n) uniform draws, row b from generator b."""
        return torch.stack([torch.rand(n, generator=g, device=self.device) for g in self.gens])
