"""The prompts a load run sends: bundled workloads, a Spec-Bench / MT-Bench ``question.jsonl``, or any
JSONL file in the workloads format (read by :mod:`speclab.workloads`, the one home of that format)."""

from __future__ import annotations

import random

from ..errors import SpeclabError
from ..workloads import Prompt, load_workload, workload_names


def load_prompts(workload: str | None = None, prompts_file: str | None = None) -> list[Prompt]:
    """Prompts from ``prompts_file`` when given (either JSONL format), else from the bundled workloads
    named by ``workload`` ("all", a name, or a comma list). Workloads are interleaved (code, json, code,
    json, ...) so that any prefix of the list, which is what a short run sends, mixes them."""
    if prompts_file:
        return load_workload(prompts_file)
    per = [load_workload(name) for name in workload_names(workload or "all")]
    if not per:
        raise SpeclabError("no workloads given")
    out: list[Prompt] = []
    for i in range(max(len(p) for p in per)):
        out += [p[i] for p in per if i < len(p)]
    return out


def request_order(prompts: list[Prompt], seed: int | None = None) -> list[Prompt]:
    """The order requests take prompts in (request i sends ``order[i % len(order)]``): shuffled when a
    seed is given. The same seed gives every load level the same sequence, so levels differ only in load."""
    if not prompts:
        raise SpeclabError("no prompts")
    order = list(prompts)
    if seed is not None:
        random.Random(seed).shuffle(order)
    return order
