"""A chain proposal built one draft step at a time: the bookkeeping every autoregressive drafter shares
(a draft model, an EAGLE head, early exit). The drafter runs its own forwards; :class:`ChainDraft` turns each
step's logits into the step's token (greedy, or sampled from the row's distribution with the row's uniform
draw), keeps what the acceptance rule needs (the distributions drawn from) and what the app shows (each
token's draft probability), applies a policy's in-round stop rule, and packs the :class:`Proposal`."""

from __future__ import annotations

import torch

from ..engine.sampling import logits_to_probs, sample_from_probs
from .base import Proposal, StopRule


def greedy_display(logits_steps: list[torch.Tensor], tokens: torch.Tensor) -> torch.Tensor:
    """The draft's (temperature 1) probability of each greedy draft token, one softmax for all steps: (n, k)."""
    return torch.stack(logits_steps, 1).float().softmax(-1).gather(2, tokens[..., None]).squeeze(-1)


class ChainDraft:
    """Tokens 0, 1, ... of a chain for n rows. ``ks`` (per row) caps each row's length; ``uniform`` (n, k)
    holds the rows' draws; ``stop`` (a policy's rule) may end a row's draft before token i."""

    def __init__(self, ks, params, uniform, want_probs: bool, stop: StopRule | None, device) -> None:
        self.params, self.uniform, self.want_probs, self.stop = params, uniform, want_probs, stop
        self.sampled = not params.all_greedy
        self.lengths = torch.tensor(ks, device=device)
        self.toks: list[torch.Tensor] = []
        self.probs: list[torch.Tensor] = []
        self.tprobs: list[torch.Tensor] = []
        self.greedy_logits: list[torch.Tensor] = []

    def step(self, logits: torch.Tensor) -> tuple[torch.Tensor, bool]:
        """Token i = len(self) from the draft's logits (n, V). Returns it (n,) and whether any row still wants
        a token after it (False once the stop rule has ended every row)."""
        i = len(self.toks)
        p = logits_to_probs(logits, self.params) if (self.sampled or self.stop is not None) else None  # (n, V)
        tok = logits.argmax(-1)  # (n,)
        if self.sampled:
            tok = torch.where(self.params.greedy, tok, sample_from_probs(p, self.uniform[:, i]))
            self.probs.append(p)
            self.tprobs.append(p.gather(1, tok[:, None]).squeeze(1))
        elif self.want_probs:
            self.greedy_logits.append(logits)  # one softmax for every step, in proposal()
        if self.stop is not None:
            halt = self.stop(i, p) & (self.lengths > i)
            self.lengths = torch.where(halt, torch.full_like(self.lengths, i), self.lengths)
        self.toks.append(tok)
        return tok, not (self.stop is not None and bool((self.lengths <= i + 1).all()))

    def __len__(self) -> int:
        return len(self.toks)

    def proposal(self) -> Proposal:
        steps = len(self.toks)
        dev = self.lengths.device
        tokens = torch.stack(self.toks, 1) if self.toks else torch.zeros(len(self.lengths), 0, dtype=torch.long,
                                                                          device=dev)
        tprobs = list(greedy_display(self.greedy_logits, tokens).unbind(1)) if self.greedy_logits else self.tprobs
        return Proposal(tokens=tokens, lengths=torch.minimum(self.lengths, torch.full_like(self.lengths, steps)),
                        probs=torch.stack(self.probs, 1) if self.probs else None,
                        token_probs=torch.stack(tprobs, 1) if tprobs else None)
