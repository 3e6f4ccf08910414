"""``/metrics``: Prometheus metrics fed from the scheduler's events (as the engine core reports them), under
vLLM's names.

Names, types, label names (``model_name``, ``engine="0"``) and histogram buckets are those vLLM 0.32
exports (checked against its CPU server), so the same dashboards and probes read both servers:

* counters (exported with ``_total``): ``vllm:prompt_tokens``, ``vllm:generation_tokens`` (emitted tokens,
  never draft tokens), ``vllm:request_success`` (label ``finished_reason``: stop, length, abort, error,
  repetition), ``vllm:num_preemptions`` (always 0: rows are never preempted), ``vllm:admission_rejections``
  (label ``reason``; ``max_num_queued_reqs`` when the queue is full: HTTP 429); with speculation only, as
  vLLM: ``vllm:spec_decode_num_drafts`` (row-rounds that drafted at least one token),
  ``vllm:spec_decode_num_draft_tokens``, ``vllm:spec_decode_num_accepted_tokens`` and
  ``vllm:spec_decode_num_accepted_tokens_per_pos`` (label ``position`` 0..k-1);
* gauges: ``vllm:num_requests_running``, ``vllm:num_requests_waiting`` (the engine's latest report, when scraped);
* histograms: ``vllm:time_to_first_token_seconds`` (from the request's arrival, when its first bytes reached the
  machine (:mod:`.arrival`), to its first chunk with output handed to the connection; unstreamed: to its first token
  reaching the HTTP side), ``vllm:inter_token_latency_seconds``
  (one observation per round and request, as vLLM's per-step ITL: under speculation a round brings several
  tokens), ``vllm:request_time_per_output_token_seconds`` ((finish - first token) / (tokens - 1)),
  ``vllm:e2e_request_latency_seconds``, ``vllm:request_queue_time_seconds``, ``vllm:request_prefill_time_seconds``,
  ``vllm:request_decode_time_seconds``, ``vllm:request_inference_time_seconds``, ``vllm:request_prompt_tokens``,
  ``vllm:request_generation_tokens``, ``vllm:request_params_max_tokens``, ``vllm:request_params_n``,
  ``vllm:request_max_num_generation_tokens``.

What vLLM lacks, under ``speclab:``:

* ``speclab:draft_length`` (gauge): the draft length in force, the mean k the policy chose over the rows of
  the last round (rows whose k was cut by their token budget left out);
* ``speclab:spec_decode_num_draft_tokens_per_pos`` (counter, label ``position``): drafts verified at each
  position; with adaptive k or short n-gram proposals it differs from the number of drafts, and
  per-position acceptance rates need it;
* ``speclab:verify_rounds`` (counter), ``speclab:engine_errors`` (counter: failed engine steps) and
  ``speclab:spec_policy_info`` (policy, method, draft model, num_speculative_tokens);
* ``speclab:request_read_delay_seconds`` (histogram): from a request's first bytes reaching the machine to the
  server's event loop reading them (with ``--arrival kernel`` on Linux): the HTTP side's wait for a CPU, which
  vLLM's arrival time leaves out of its TTFT.

Every server has its own :class:`CollectorRegistry` (no process-wide state), so several apps can live in
one process.
"""

from __future__ import annotations

from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info

# vLLM 0.32's buckets
TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0]
ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
               80.0]
READ_DELAY_BUCKETS = [0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0]
REQUEST_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                   480.0, 960.0, 1920.0, 7680.0]
FINISHED_REASONS = ("stop", "length", "abort", "error", "repetition")


def token_buckets(max_len: int) -> list[float]:
    """1, 2, 5, 10, 20, 50, ... up to ``max_len`` (vLLM's ``build_1_2_5_buckets``)."""
    out, exp = [], 0
    while True:
        for m in (1, 2, 5):
            v = m * 10 ** exp
            if v > max_len:
                return [float(x) for x in out]
            out.append(v)
        exp += 1


class ServerMetrics:
    """The server's metrics; an observer of :class:`speclab.serve.runner.Engine`."""

    def __init__(self, model_name: str, *, speculative: bool, k_max: int, policy: str, method: str, draft: str,
                 max_model_len: int, max_tags: int = 32):
        self.registry = reg = CollectorRegistry()
        L = ("model_name", "engine")
        lv = (model_name, "0")
        self.speculative = speculative

        def counter(name, doc, extra=(), **kw):
            return Counter(name, doc, L + extra, registry=reg, **kw)

        def hist(name, doc, buckets):
            return Histogram(name, doc, L, registry=reg, buckets=buckets).labels(*lv)

        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.").labels(*lv)
        self.generation_tokens = counter("vllm:generation_tokens", "Number of generation tokens processed.").labels(*lv)
        success = counter("vllm:request_success", "Count of successfully processed requests.", ("finished_reason",))
        self.success = {r: success.labels(*lv, r) for r in FINISHED_REASONS}
        counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.").labels(*lv)
        rej = Counter("vllm:admission_rejections", "Number of admission attempts rejected by a queue limit, by reason.",
                      ("model_name", "reason"), registry=reg)
        self.rejections = rej.labels(model_name, "max_num_queued_reqs")
        rej.labels(model_name, "max_num_queued_tokens")
        self.running = Gauge("vllm:num_requests_running", "Number of requests in model execution batches.", L,
                             registry=reg).labels(*lv)
        self.waiting = Gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.", L,
                             registry=reg).labels(*lv)
        self.cores_serving = Gauge("speclab:engine_cores_serving", "Engine cores taking requests now (a dead one's "
                                   "replacement counts once it is ready).", L, registry=reg).labels(*lv)
        tok = token_buckets(max_model_len)
        self.ttft = hist("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                         TTFT_BUCKETS)
        self.itl = hist("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", ITL_BUCKETS)
        self.tpot = hist("vllm:request_time_per_output_token_seconds",
                         "Histogram of time_per_output_token_seconds per request.", ITL_BUCKETS)
        self.e2e = hist("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                        REQUEST_BUCKETS)
        self.queue_time = hist("vllm:request_queue_time_seconds",
                               "Histogram of time spent in WAITING phase for request.", REQUEST_BUCKETS)
        self.inference_time = hist("vllm:request_inference_time_seconds",
                                   "Histogram of time spent in RUNNING phase for request.", REQUEST_BUCKETS)
        self.prefill_time = hist("vllm:request_prefill_time_seconds",
                                 "Histogram of time spent in PREFILL phase for request.", REQUEST_BUCKETS)
        self.decode_time = hist("vllm:request_decode_time_seconds",
                                "Histogram of time spent in DECODE phase for request.", REQUEST_BUCKETS)
        self.req_prompt = hist("vllm:request_prompt_tokens", "Number of prefill tokens processed.", tok)
        self.req_generation = hist("vllm:request_generation_tokens", "Number of generation tokens processed.", tok)
        self.params_max_tokens = hist("vllm:request_params_max_tokens",
                                      "Histogram of the max_tokens request parameter.", tok)
        self.params_n = hist("vllm:request_params_n", "Histogram of the n request parameter.", [1, 2, 5, 10, 20])
        self.max_gen = hist("vllm:request_max_num_generation_tokens",
                            "Histogram of maximum number of requested generation tokens.", tok)
        if speculative:
            self.drafts = counter("vllm:spec_decode_num_drafts", "Number of spec decoding drafts.").labels(*lv)
            self.draft_tokens = counter("vllm:spec_decode_num_draft_tokens", "Number of draft tokens.").labels(*lv)
            self.accepted = counter("vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.").labels(*lv)
            acc_pos = counter("vllm:spec_decode_num_accepted_tokens_per_pos", "Accepted tokens per draft position.",
                              ("position",))
            drf_pos = counter("speclab:spec_decode_num_draft_tokens_per_pos",
                              "Draft tokens verified per draft position.", ("position",))
            self.accepted_pos = [acc_pos.labels(*lv, str(i)) for i in range(k_max)]
            self.drafted_pos = [drf_pos.labels(*lv, str(i)) for i in range(k_max)]
            self._pos_metrics = (acc_pos, drf_pos, lv)
            self.draft_length = Gauge("speclab:draft_length", "Mean draft length k chosen over the rows of the last "
                                      "verification round.", L, registry=reg).labels(*lv)
        self.prefix_queries = counter("vllm:prefix_cache_queries",
                                      "Prefix cache queries, in terms of number of queried tokens.").labels(*lv)
        self.prefix_hits = counter("vllm:prefix_cache_hits",
                                   "Prefix cache hits, in terms of number of cached tokens.").labels(*lv)
        self.rounds = counter("speclab:verify_rounds", "Verification rounds run (one target forward each).").labels(*lv)
        self.read_delay = hist("speclab:request_read_delay_seconds", "Time from a request's first bytes reaching the "
                               "machine to the server's event loop reading them.", READ_DELAY_BUCKETS)
        self.engine_errors = counter("speclab:engine_errors", "Engine steps that raised (their requests failed).")
        self.engine_errors = self.engine_errors.labels(*lv)
        self.core_deaths = counter("speclab:engine_core_deaths", "Engine cores that died (each is replaced unless "
                                   "they keep dying).").labels(*lv)
        Info("speclab:spec_policy", "Speculation in force: method, draft model, policy, num_speculative_tokens.",
             registry=reg).info({"model_name": model_name, "method": method, "draft_model": draft, "policy": policy,
                                 "num_speculative_tokens": str(k_max)})
        self._prefill_s: dict[str, float] = {}
        self.by_tag = TagCounters(reg, lv, speculative, max_tags)

    def bind(self, counts: Callable[[], tuple[int, int]], serving: Callable[[], int] | None = None) -> None:
        """Read running/waiting from ``counts()`` (and the cores serving from ``serving()``) whenever /metrics is
        scraped."""
        self.running.set_function(lambda: counts()[0])
        self.waiting.set_function(lambda: counts()[1])
        if serving is not None:
            self.cores_serving.set_function(serving)

    # ------------------------------------------------------------------ observer (speclab.serve.runner.Engine)
    def on_round(self, phase: str, time: float, prefill_s: float, rows: list, handles: dict, prefix_queries: int = 0,
                 prefix_hits: int = 0) -> None:
        """A scheduler event as the engine core reports it (speclab.serve.core): ``rows`` ``(request id, new
        tokens, k, k capped by the budget, drafted, accepted)``; ``handles`` the requests in flight by id; a
        prefill's prompt tokens looked up in the prefix cache and found there."""
        gen = sum(r[1] for r in rows)
        if gen:
            self.generation_tokens.inc(gen)
        if phase == "prefill":
            if prefix_queries:
                self.prefix_queries.inc(prefix_queries)
            if prefix_hits:
                self.prefix_hits.inc(prefix_hits)
            started = time - prefill_s
            for rid, *_ in rows:
                h = handles.get(rid)
                if h is None:
                    continue
                req = h.req
                n = len(req.prompt_ids)
                self.prompt_tokens.inc(n)
                self.req_prompt.observe(n)
                self.params_max_tokens.observe(req.max_new_tokens)
                self.max_gen.observe(req.max_new_tokens)
                self.params_n.observe(1)
                self.queue_time.observe(max(0.0, started - req.arrival))
                self.prefill_time.observe(prefill_s)
                self._prefill_s[rid] = prefill_s
            return
        self.rounds.inc()
        if not self.speculative:
            return
        drafts = drafted = accepted = 0
        ks = n_k = 0
        for _, _, k, capped, nd, na in rows:
            if not capped:  # a row near its end drafts less: not the policy's choice
                ks += k
                n_k += 1
            if nd > len(self.drafted_pos):  # never with k <= k_max; kept safe for drafters that overshoot
                self._grow_positions(nd)
            if nd:
                drafts += 1
                drafted += nd
                accepted += na
                for i in range(nd):
                    self.drafted_pos[i].inc()
                for i in range(na):
                    self.accepted_pos[i].inc()
        if drafts:
            self.drafts.inc(drafts)
            self.draft_tokens.inc(drafted)
            self.accepted.inc(accepted)
        if n_k:
            self.draft_length.set(ks / n_k)

    def first_token(self, req, now: float) -> None:
        """Time to first token: from the request's arrival to ``now``, when its first output left (see the module)."""
        self.ttft.observe(max(0.0, now - req.arrival))

    def inter_token(self, gap: float) -> None:
        """One observation per round and request (vLLM's per-step ITL)."""
        self.itl.observe(gap)

    def _grow_positions(self, n: int) -> None:
        acc_pos, drf_pos, lv = self._pos_metrics
        for i in range(len(self.drafted_pos), n):
            self.accepted_pos.append(acc_pos.labels(*lv, str(i)))
            self.drafted_pos.append(drf_pos.labels(*lv, str(i)))

    def finished(self, req, status: str, tag: str | None = None) -> None:
        self.success[status].inc()
        if tag is not None:
            self.by_tag.finished(req, status, tag)
        prefill_s = self._prefill_s.pop(req.request_id, 0.0)
        if status in ("abort", "error") or req.first_token_time is None or req.finish_time is None:
            return
        n = len(req.generated)
        decode = req.finish_time - req.first_token_time
        self.e2e.observe(req.finish_time - req.arrival)
        self.decode_time.observe(decode)
        self.inference_time.observe(decode + prefill_s)
        self.req_generation.observe(n)
        if n > 1:
            self.tpot.observe(decode / (n - 1))

    def read(self, delay: float) -> None:
        """A request's bytes were read by the event loop ``delay`` seconds after they reached the machine."""
        self.read_delay.observe(max(0.0, delay))

    def rejected(self) -> None:
        self.rejections.inc()

    def engine_error(self) -> None:
        self.engine_errors.inc()

    def core_died(self) -> None:
        self.core_deaths.inc()


OTHER_TAG = "_other"  # the bucket of the tags beyond the first max_tags


class TagCounters:
    """Per workload tag (a request's ``metadata.workload`` or ``X-Workload`` header): requests finished,
    generation tokens and the raw spec-decode counters, as vLLM's (drafts, draft tokens, accepted tokens, per
    position), under ``speclab:workload_*`` with a ``workload`` label. A request's counts are added when it
    finishes (a request that fails adds none of its counts). The first ``max_tags`` tags seen get their own label
    value, later ones share :data:`OTHER_TAG`, so a client cannot grow the series without bound. Requests without
    a tag are counted only in the server-wide metrics."""

    def __init__(self, reg: CollectorRegistry, lv: tuple, speculative: bool, max_tags: int):
        L = ("model_name", "engine", "workload")
        self.lv, self.max_tags, self.speculative = lv, max_tags, speculative
        self.known: set[str] = set()
        self.requests = Counter("speclab:workload_requests", "Requests finished, per workload tag.",
                                L + ("finished_reason",), registry=reg)
        self.generation = Counter("speclab:workload_generation_tokens", "Generation tokens, per workload tag.", L,
                                  registry=reg)
        if speculative:
            self.drafts = Counter("speclab:workload_spec_decode_num_drafts", "Spec decoding drafts (rounds that "
                                  "drafted), per workload tag.", L, registry=reg)
            self.draft_tokens = Counter("speclab:workload_spec_decode_num_draft_tokens", "Draft tokens, per workload "
                                        "tag.", L, registry=reg)
            self.accepted = Counter("speclab:workload_spec_decode_num_accepted_tokens", "Accepted tokens, per "
                                    "workload tag.", L, registry=reg)
            self.accepted_pos = Counter("speclab:workload_spec_decode_num_accepted_tokens_per_pos", "Accepted tokens "
                                        "per draft position, per workload tag.", L + ("position",), registry=reg)
            self.drafted_pos = Counter("speclab:workload_spec_decode_num_draft_tokens_per_pos", "Draft tokens "
                                       "verified per draft position, per workload tag.", L + ("position",),
                                       registry=reg)

    def label(self, tag: str) -> str:
        if tag in self.known:
            return tag
        if len(self.known) < self.max_tags:
            self.known.add(tag)
            return tag
        return OTHER_TAG

    def finished(self, req, status: str, tag: str) -> None:
        lv = (*self.lv, self.label(tag))
        self.requests.labels(*lv, status).inc()
        if status == "error":
            return
        if req.generated:
            self.generation.labels(*lv).inc(len(req.generated))
        if not self.speculative or not req.drafted:
            return
        self.drafts.labels(*lv).inc(sum(1 for d, _ in req.history if d > 0))
        self.draft_tokens.labels(*lv).inc(req.drafted)
        self.accepted.labels(*lv).inc(req.accepted)
        for i, n in enumerate(req.pos_drafted):
            if n:
                self.drafted_pos.labels(*lv, str(i)).inc(n)
        for i, n in enumerate(req.pos_accepted):
            if n:
                self.accepted_pos.labels(*lv, str(i)).inc(n)
