"""The Load tab's run, free of Gradio: ``speclab load`` over rising concurrency against a ``speclab serve`` per
policy started in this process, or against a server at a URL (:class:`LoadJob`).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import SpeclabError
from ..limits import check_int
from .config import MAX_K, AppConfig, as_list, check_model_choice, check_policy
from .jobs import Job
from .models import get_target

LOAD_LEVELS = [1, 2, 4, 8, 16, 32]
LOAD_IN_PROCESS = "a speclab serve started by this tab"
LOAD_REMOTE = "a server at a URL"
MAX_LOAD_CELLS = 30  # (policy, level) cells per run


@dataclass(frozen=True)
class LoadSettings:
    server: str
    url: str | None
    target: str
    draft: str
    policies: tuple[str, ...]  # for the in-process server: "off" = plain decoding
    k: int
    levels: tuple[int, ...]
    workload: str
    requests: int  # per level
    max_tokens: int
    split: bool  # one token per SSE chunk

    @property
    def cells(self) -> int:
        return len(self.levels) * (len(self.policies) if self.server == LOAD_IN_PROCESS else 1)


def validate_load(cfg: AppConfig, server, url, target, draft, policies, k, levels, workload, requests, max_tokens,
                  split=False) -> LoadSettings:
    from ..load.runner import base_url
    from ..workloads import list_workloads

    if server not in (LOAD_IN_PROCESS, LOAD_REMOTE):
        raise SpeclabError(f"unknown server choice {server!r}")
    if server == LOAD_REMOTE:
        if not cfg.allow_remote_servers:
            raise SpeclabError("measuring a server at a URL needs the app started with --allow-remote-servers")
        if not isinstance(url, str) or not url.strip():
            raise SpeclabError("type the server's URL, e.g. http://127.0.0.1:8000")
        url = base_url(url)
    else:
        url = None
    target = check_model_choice(cfg, target, "target")
    draft = check_model_choice(cfg, draft, "draft")
    pols = []
    for p in as_list("policies", policies):
        p = check_policy(p)
        if p not in pols:
            pols.append(p)
    if server == LOAD_IN_PROCESS and not pols:
        raise SpeclabError("pick at least one policy (off = plain decoding)")
    if server == LOAD_IN_PROCESS and draft == "none" and any(p != "off" for p in pols):
        raise SpeclabError("pick a draft for the speculative policies (or only 'off')")
    lv = sorted({check_int("load level", v, 1, 256) for v in as_list("load levels", levels)})
    if not lv:
        raise SpeclabError("pick at least one load level")
    if workload not in list_workloads():
        raise SpeclabError(f"unknown workload {workload!r}")
    s = LoadSettings(server, url, target, draft, tuple(pols), check_int("k", k, 1, MAX_K), tuple(lv), workload,
                     check_int("requests per level", requests, 1, 256), check_int("max tokens", max_tokens, 1, 512),
                     bool(split))
    if s.cells > MAX_LOAD_CELLS:
        raise SpeclabError(f"this run has {s.cells} cells (at most {MAX_LOAD_CELLS}): pick fewer policies or levels")
    return s


class LoadJob(Job):
    """``speclab load`` over rising concurrency against each policy's ``speclab serve`` (started in this
    process, one after another) or a server at a URL, on a worker thread; ``cancel()`` stops after the
    current level."""

    def __init__(self, cfg: AppConfig, s: LoadSettings):
        super().__init__(cfg, s)
        self.results: dict[str, dict] = {}  # series name -> speclab load result

    def _server(self, policy: str):
        from ..analysis.sweep import new_drafter
        from ..engine import make_policy
        from ..serve.app import Server
        from ..serve.inprocess import InProcessServer

        target = get_target(self.cfg, self.s.target)
        pol = make_policy(policy, self.s.k)
        drafter = new_drafter(self.s.draft, target) if policy != "off" else None
        name = f"{self.s.target}"
        # the engine core on a thread: a fork from the app's process, whose other threads may hold locks (OpenSSL's,
        # inside an HTTP request), copies them held into a child that deadlocks on them
        srv = Server(target, drafter, pol, served_name=name, stream_split_tokens=self.s.split,
                     method="draft_model" if drafter is not None else "none",
                     draft_name=self.s.draft if drafter is not None else "none", engine_process=False)
        return InProcessServer(srv), name

    def _run(self) -> None:
        from ..load.client import Endpoint
        from ..load.prompts import load_prompts
        from ..load.runner import LoadSpec, run
        from ..load.shapes import LoadLevel

        prompts = load_prompts(self.s.workload)
        series = self.s.policies if self.s.server == LOAD_IN_PROCESS else ("remote",)
        total, done = self.s.cells, 0
        for name in series:
            if self._cancel.is_set():
                return
            self.desc = f"starting speclab serve ({name})" if name != "remote" else "contacting the server"
            ctx, model = self._server(name) if name != "remote" else (None, None)
            url = ctx.start().url if ctx is not None else self.s.url
            try:
                ep = Endpoint(url, model=model, max_tokens=self.s.max_tokens, timeout=60.0)
                levels = []
                for i, c in enumerate(self.s.levels):
                    if self._cancel.is_set():
                        break
                    self.desc = f"{name}: concurrency {c}"
                    spec = LoadSpec([LoadLevel("concurrency", c)], prompts, num_requests=max(self.s.requests, c),
                                    quiet=True, warmup=1 if i == 0 else 0, tokenizer=None)
                    r = run(ep, spec)
                    if all(lv["summary"]["completed"] == 0 for lv in r["levels"]):
                        why = r["levels"][0]["summary"].get("failure_examples") or ["no request completed"]
                        raise SpeclabError(f"{url}: every request failed ({why[0]})")
                    levels += r["levels"]
                    done += 1
                    self.progress = done / total
                if levels:
                    from ..load import fingerprint

                    r["levels"] = levels
                    r["verdict"] = fingerprint.verdict([(lv["level"]["label"], lv["level"]["value"],
                                                         lv["fingerprint"]) for lv in levels])
                    self.results[name] = r
            finally:
                if ctx is not None:
                    ctx.stop()


def load_tables(results: dict[str, dict]):
    """(rows per series and level, acceptance rows from /metrics) as DataFrames."""
    import pandas as pd

    from ..load.report import level_rows

    rows, acc = [], []
    for name, r in results.items():
        for row in level_rows(r):
            rows.append(dict(policy=name, verdict=r["verdict"]["verdict"], **row))
        for lv in r["levels"]:
            server = lv.get("server") or {}
            sd = server.get("spec_decode") or {}
            # the whole level, then each workload tag the server counted apart (speclab serve: speclab:workload_*)
            tags = list((server.get("spec_decode_by_workload") or {}).items())
            for workload, s in ([("all", sd)] if sd else []) + tags:
                acc.append(dict(policy=name, load=lv["level"]["label"], workload=workload,
                                acceptance_rate=s.get("acceptance_rate"),
                                mean_acceptance_length=s.get("mean_acceptance_length"),
                                per_position=" ".join(f"{x:.2f}" for x in (s.get("per_position_acceptance") or []))))
    return pd.DataFrame(rows), pd.DataFrame(acc)
