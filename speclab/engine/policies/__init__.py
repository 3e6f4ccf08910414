"""Draft-length policies: each round, how many tokens each running row drafts (0 = no speculation).

A policy is small and pure: :meth:`Policy.choose` maps a :class:`PolicyView` (every running row's
acceptance history, the number of running and waiting requests, the step costs measured online) to
one :class:`Choice` per row. The scheduler caps each choice by the row's budget (a round emits up to
k+1 tokens) and reports both in the events. A policy may also end a row's draft early inside the
round (:meth:`Policy.draft_stop`).

Policies that adapt keep per-request state (keyed by request id) only as a cache of what they would
compute from the whole history again; given the same views in the same order they decide the same.

The policies (``POLICIES``; ``make_policy("name[:args]", k)``, k = the largest k):

==============  ==================================================================================
``fixed``       k every round (vLLM ``num_speculative_tokens``, HF ``num_assistant_tokens_schedule=
                "constant"``).
``off``         no speculation.
``batch-table`` k from a table of running-batch ranges (vLLM's ``num_speculative_tokens_per_batch_size``
                form; k = 0 switches speculation off for a range).
``heuristic``   per row, +2 after a round whose drafts were all accepted, -1 otherwise, within [1, K]
                (Hugging Face ``num_assistant_tokens_schedule="heuristic"``).
``ema``         per row, an EMA of the accepted length picks one of a few step tiers, with
                hysteresis (SGLang-style adaptive steps).
``goodput``     per round, the k in 0..K that maximises expected committed tokens per expected round
                time, from per-row, per-position acceptance estimates and the measured cost model
                (SmartSpec / TurboSpec).
``confidence``  every row drafts up to K, stopping when the draft's top probability is below a
                threshold (HF ``assistant_confidence_threshold``) or AdaEDL's entropy bound on
                acceptance is below a floor.
==============  ==================================================================================

``heuristic``, ``ema`` and ``confidence`` run behind a *cost gate* (speclab's addition, ``gate=False``
for the published rule alone): a round whose chosen drafts the cost model says lose to plain
decoding (k = 0) runs k = 0 instead, so each switches itself off under load or at low acceptance.
``goodput`` needs no gate: k = 0 is one of its candidates.

Exactness does not depend on the policy: greedy output is the target's argmax whatever k each round
used, and sampled output is an exact sample of the target's distribution. Which sample a seed gives
depends on the k of each round (a row's draws are laid out by its own k), so under a policy that
reacts to load or to batch-mates a sampled row's output, while exact, depends on them too.

Files: ``base`` (views, choices, the protocol, fixed and off), ``tracker`` (acceptance estimates), ``weighing`` (the
cost side: round times, prefill and catch-up, probes, the switch-on band, held decisions, the cost gate), ``table``
(batch-table), ``rules`` (heuristic, ema, confidence), ``goodput``, ``registry`` (names, ``make_policy``).
"""

from .base import Choice, Fixed, Off, Policy, PolicyView, RowView
from .goodput import Goodput
from .registry import ADAPTIVE, POLICIES, make_policy, seed_costs
from .rules import Confidence, Ema, GatedRule, Heuristic, ema_tiers
from .table import BatchTable, parse_table
from .tracker import POSITION_PRIORS, AcceptanceTracker, expected_tokens, position_priors
from .weighing import (
    NEVER,
    SWITCH_MARGIN,
    CostGate,
    DraftHold,
    OffHold,
    PlainCheck,
    ProbeBudget,
    RoundTimes,
    affine_in_k,
    batch_tokens,
    catch_up_time,
    costs_ready,
    draft_prefill_share,
    monotone,
    prefill_per_token,
    probe_cost,
    round_tokens,
    row_tokens,
    switch_on,
    worth_probing,
)

__all__ = ["ADAPTIVE", "NEVER", "POLICIES", "POSITION_PRIORS", "SWITCH_MARGIN", "AcceptanceTracker", "BatchTable",
           "Choice", "Confidence", "CostGate", "DraftHold", "Ema", "Fixed", "GatedRule", "Goodput", "Heuristic",
           "Off", "OffHold", "PlainCheck", "Policy", "PolicyView", "ProbeBudget", "RoundTimes", "RowView",
           "affine_in_k", "batch_tokens", "catch_up_time", "costs_ready", "draft_prefill_share", "ema_tiers",
           "expected_tokens", "make_policy", "monotone", "parse_table", "position_priors", "prefill_per_token",
           "probe_cost", "round_tokens", "row_tokens", "seed_costs", "switch_on", "worth_probing"]
