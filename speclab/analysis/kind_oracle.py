"""The mixed stream's headroom: a policy that knows each request's workload (``speclab bench --policies --oracle``).

On a stream mixing workloads, a policy that decides per row gains over every single fixed k by learning which row is
which. :class:`KindOracle` is told: it drafts each request's kind at that kind's best fixed k in hindsight (measured
in the same run on the kind's own workload at the same batch), one k a round for the whole batch as the loop runs it
(the rounded mean of the rows' ks). Its speedup over the best single fixed k measures what knowing each row's kind is
worth, before a policy pays anything to learn it or to weigh its rounds. It is not a bound on every policy: one that
knew each request's own best k would do a little better (measured at one row in one run: 1.181x plain, against
1.164x for fixed k = 2 and 1.160x for the kind oracle; docs/policies.md)."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..engine import Choice, PolicyView


@dataclass
class KindOracle:
    """Draft length from each row's known kind: ``kinds`` maps request id -> kind, ``ks`` kind -> k (0: plain). One
    k a round (the verify block is padded to the widest row and a draft step runs every row): the rounded mean of
    the rows' ks. e.g. ks {json: 4, code: 1}, rows json, code, code: round(2.0) = 2."""

    kinds: dict[str, str]
    ks: dict[str, int]
    name: str = field(default="kind-oracle", init=False)

    @property
    def k_max(self) -> int:
        return max(self.ks.values(), default=0)

    def choose(self, view: PolicyView) -> list[Choice]:
        if not view.rows:
            return []
        want = [self.ks.get(self.kinds.get(r.request_id, ""), 0) for r in view.rows]
        k = int(sum(want) / len(want) + 0.5)
        return [Choice(k, f"kind oracle: k={k}")] * len(view.rows)

    def draft_stop(self):
        return None


def best_fixed_by_kind(by: dict, kinds: list[str], batch: int, fixed: list[str]) -> dict[str, int]:
    """Each kind's best fixed configuration at ``batch`` (by speedup, plain included as k = 0) as its k, from the
    run's rows ``by`` ((workload, batch, config) -> row with 'speedup' and 'k'). e.g. json best fixed-4, code
    plain: {json: 4, code: 0}."""
    out = {}
    for w in kinds:
        best = max(fixed, key=lambda c: by[(w, batch, c)]["speedup"])
        out[w] = by[(w, batch, best)]["k"]
    return out
