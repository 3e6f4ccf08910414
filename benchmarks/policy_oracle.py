"""The mixed stream's headroom: a policy that knows each request's workload (``python benchmarks/policy_oracle.py``:
``speclab bench policies``, then the oracle on the same cells).

On a stream mixing workloads, a policy that decides per row gains over every single fixed k by learning which row is
which. :class:`KindOracle` is told: it drafts each request's kind at that kind's best fixed k in hindsight (measured
in the same run on the kind's own workload at the same batch), one k a round for the whole batch as the loop runs it
(the rounded mean of the rows' ks). Its speedup over the best single fixed k measures what knowing each row's kind is
worth, before a policy pays anything to learn it or to weigh its rounds. It is not a bound on every policy: one that
knew each request's own best k could do a little better."""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as `python benchmarks/NAME.py`: the root on the path, siblings as benchmarks.NAME
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import random
import statistics
from dataclasses import dataclass, field

from speclab.analysis.bench_policies import paired_ratios
from speclab.analysis.bench_runs import lockstep
from speclab.engine import Choice, PolicyView


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


def run_oracle(target, draft_name, results: list[dict], fixed: list[tuple[str, int]], kinds: list[str],
               run: dict) -> list[dict]:
    """The mixed stream's headroom : each mixed level again, in lockstep, plain and every fixed k beside
    a :class:`KindOracle` drafting each request's workload at that workload's best fixed
    k at this level in the main repetitions (``kinds``: the workloads; ``run``: the mixed cells' queues, budgets and
    the queue's kinds, the levels, repetitions, seed, clock, the calibrated cost table, the logger and the greedy
    references). Returns one row per level: the oracle's ks, every configuration's speedup (median of the
    repetitions' paired ratios), its repetitions' ratios, and whether every output matched plain greedy decoding."""
    from speclab.analysis.sweep import cached_model
    from speclab.drafters import make_drafter
    from speclab.engine import make_policy

    by = {(r["workload"], r["batch"], r["config"]): r for r in results}
    labels = [label for label, _ in fixed]
    order = random.Random(f"{run['seed']}-oracle")
    out = []
    for B in run["levels"]:
        q, lens = run["queue"][("mixed", B)], run["lengths"][("mixed", B)]
        ks = best_fixed_by_kind(by, kinds, B, labels)
        rid = {f"bench-{i}": run["kinds"][i % len(run["kinds"])] for i in range(len(q))}
        oracle = KindOracle(rid, ks)
        runs = [(make_drafter(draft_name, target, load=cached_model) if k else None, make_policy(None, k))
                for _, k in fixed]
        runs.append((make_drafter(draft_name, target, load=cached_model), oracle))
        tables = [run["costs"]] * len(fixed) + [run["costs"].copy()]
        tps: dict[str, list[float]] = {c: [] for c in labels + ["kind-oracle"]}
        same = True
        for _ in range(run["reps"]):
            res = lockstep(target, runs, q, B, lens, tables, run["seed"], run["clock"], shuffle=order)
            for c, (ntok, spent, reqs) in zip(labels + ["kind-oracle"], res):
                tps[c].append(ntok / spent)
                same = same and all(r.generated == run["ref"][tuple(r.prompt_ids)][:r.max_new_tokens] for r in reqs)
        ratios = {c: paired_ratios(v, tps["plain"]) for c, v in tps.items()}
        out.append(dict(batch=B, ks=ks, speedup={c: statistics.median(r) for c, r in ratios.items()},
                        speedups=ratios, plain_tokens_per_s=statistics.median(tps["plain"]), identical=same))
        run["log"](f"[policies] kind oracle at batch {B} done")
    return out


def main(argv: list[str] | None = None) -> int:
    """``speclab bench policies`` with the same flags, then the kind oracle on its mixed cells."""
    from benchmarks._cli import parser, run
    from speclab.analysis.bench_policies import run_policies
    from speclab.analysis.cli import add_policies_flags, check_numbers

    p = parser("policy_oracle", "speclab bench policies, then the mixed stream's headroom: each mixed level again "
               "beside a policy that knows each request's workload and drafts its best fixed k.")
    add_policies_flags(p)

    def runner(args) -> int:
        check_numbers(args)
        args.after_grid = lambda *a: {"oracle": run_oracle(*a)}
        return run_policies(args)

    return run(p, runner, argv, "policy_oracle")


if __name__ == "__main__":
    sys.exit(main())
