"""The prompts a load run sends: bundled workloads, a Spec-Bench / MT-Bench ``question.jsonl``, or any
JSONL file in the workloads format (read by :mod:`speclab.workloads`, the one home of that format)."""

from __future__ import annotations

import hashlib
import random
import sys

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


class FreshOrder:
    """The prompts of ``order`` made unique per request, so that no server's prefix cache finds any of them: request
    i sends ``order[i % len(order)]`` behind a nonce of its own, ``"<12 hex digits> <prompt>"``, drawn from ``salt``
    and i. The nonce fills the prompt's first tokens, so no 16-token block (vLLM's, and speclab serve's block) is
    shared with another request's; the rest of the prompt, and so the workload, is unchanged.

    Indexable like a list of unbounded length; :attr:`sent` maps the prompt ids handed out (``"<id>@<nonce>"``) to
    their texts. The same salt gives the same prompts, so two servers measured with it get the same requests and
    their outputs can be compared (each server's cache is its own), while each repetition on one server needs a
    salt of its own."""

    def __init__(self, order: list[Prompt], salt: str):
        if not order:
            raise SpeclabError("no prompts")
        self.order, self.salt = order, salt
        self.sent: dict[str, str] = {}

    def __len__(self) -> int:
        return sys.maxsize

    def nonce(self, i: int) -> str:
        return hashlib.sha256(f"{self.salt}/{i}".encode()).hexdigest()[:12]

    def __getitem__(self, i: int) -> Prompt:
        base, nonce = self.order[i % len(self.order)], self.nonce(i)
        p = Prompt(f"{base.id}@{nonce}", base.category, f"{nonce} {base.prompt}")
        self.sent[p.id] = p.prompt
        return p
