"""The FastAPI app: OpenAI-compatible routes over the engine (its core in a process of its own on a CPU).

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (streaming as server-sent events, ``data:
{...}`` per chunk and a final ``data: [DONE]``, or one JSON body), ``GET /v1/models``, ``GET /health``,
``GET /metrics`` (Prometheus), ``GET /version``. With an API key every ``/v1`` route wants
``Authorization: Bearer KEY`` (401 otherwise); ``/health`` and ``/metrics`` stay open, as in vLLM.

A streamed chunk carries the tokens one verification round committed for the request (its first chunk:
the token its prefill produced), or one token with ``stream_split_tokens``; text is released as it
becomes final (:mod:`.detok`), so a chunk's text may be empty and is then not sent (in split mode every
token gets its chunk). Status codes, each with an OpenAI error body whose ``code`` is a string
(:mod:`.protocol`): 400 bad request (naming the parameter), 401, 404/405 unknown route or method, 429 queue
full, 500 engine failure (only the requests in the failed step), 503 while shutting down, while no engine core
can serve (one died and its replacement is starting) or for the requests of a core that died, 504 past
``request_timeout``. A streamed request that fails after its 200 ends with an error event and ``[DONE]``.

A client that disconnects, mid-stream or while waiting for a whole response, has its request cancelled; its
slot is free before the next round. So has a client that stops reading a stream: when a chunk cannot be
written for ``stream_stall_timeout`` seconds (the connection's buffers are full), the request is cancelled and
the connection closed, so a stalled reader never holds a row.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from .. import __version__
from ..engine.prefix_cache import PrefixCache
from ..engine.request import Request as EngineRequest
from ..engine.scheduler import QueueFull, Scheduler
from ..errors import SpeclabError
from ..models import check_draft_context
from .arrival import ARRIVAL, READ, ArrivalClock
from .detok import IncrementalText, fast_decoder
from .prom import ServerMetrics
from .protocol import (
    DONE,
    FINISH,
    TAG_HEADER,
    APIError,
    Formatter,
    ModelInfo,
    bad,
    new_id,
    parse_body,
    parse_chat,
    parse_completion,
    stop_reason,
    workload_tag,
)
from .runner import ERROR, TOKENS, Engine, NoCore, auto_cores, core_share, fork_ok, plan_cpus


class StalledReader(Exception):
    """A chunk could not be written for the stall timeout: the client stopped reading."""


class SSEResponse(StreamingResponse):
    """A stream whose generator is always closed, so its ``finally`` (cancel the request) runs at once
    whether the stream ended, failed or the client went away. A write that waits longer than ``stall_timeout``
    (the client stopped reading and the buffers filled) ends the stream: the request is cancelled and the
    connection closed."""

    def __init__(self, content, on_close, stall_timeout: float | None = None):
        super().__init__(content, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self.on_close = on_close
        self.stall_timeout = stall_timeout

    async def __call__(self, scope, receive, send):
        if self.stall_timeout is not None:
            send = self._bounded(send)
        try:
            await super().__call__(scope, receive, send)
        except StalledReader:
            # returning with the response unfinished makes uvicorn close the connection
            log.warning("a client stopped reading its stream for %.0f s: request cancelled", self.stall_timeout)
        finally:
            self.on_close()  # also when the client left before the stream started
            await self.body_iterator.aclose()

    def _bounded(self, send):
        limit = self.stall_timeout

        async def bounded(message):
            try:
                async with asyncio.timeout(limit):  # a timer per write, no task
                    await send(message)
            except TimeoutError:
                raise StalledReader() from None

        return bounded

log = logging.getLogger("speclab.serve")


class Server:
    """Everything one app serves: the model, the engine, the metrics, the switches."""

    def __init__(self, target, drafter, policy, *, served_name: str, max_num_seqs: int = 64,
                 max_waiting: int = 256, max_model_len: int | None = None, api_key: str | None = None,
                 stream_split_tokens: bool = False, method: str = "none", draft_name: str = "none",
                 engine_process: bool | None = None, engine_threads: int | None = None, cpu_binding: str = "none",
                 engine_cores: int | None = None, prefix_caching: bool = True, costs=None,
                 request_timeout: float | None = None, stream_stall_timeout: float | None = 30.0,
                 max_workload_tags: int = 32):
        self.lm = target
        self.decode = fast_decoder(target)  # == target.decode, cheaper per call
        context = min(max_model_len or target.max_context, target.max_context)
        self.info = ModelInfo(served_name, target, context)
        self.api_key = api_key
        self.split = stream_split_tokens
        self.draining = False
        self.failed: str | None = None  # why the engine gave up (the server then exits non-zero)
        self.on_exit = None  # set by whoever runs the app: called to stop serving once the engine gave up
        self.stall_timeout = stream_stall_timeout
        self.created = int(time.time())
        speculative = drafter is not None and policy.k_max > 0
        # a draft must hold every position a request needs: refused here, with the other limits (a 400)
        self.draft_lm = getattr(drafter, "lm", None) if speculative else None
        self.metrics = ServerMetrics(served_name, speculative=speculative, k_max=policy.k_max if speculative else 0,
                                     policy=policy.name, method=method if speculative else "none",
                                     draft=draft_name if speculative else "none", max_model_len=context,
                                     max_tags=max_workload_tags)
        # step costs: calibrated by the caller, or learnt online (every scheduler of a core shares them)
        # the engine core in a process of its own where a fork is safe (speclab.serve.runner); a forked process
        # cannot use the parent's OpenMP thread pool, so it runs the model on one thread: asked for more, the
        # core goes on a thread of this process
        threads = engine_threads or 1
        process = fork_ok(target.device) and threads == 1 if engine_process is None else engine_process
        cores = min(auto_cores(process), max_num_seqs) if engine_cores is None else int(engine_cores)
        if not 1 <= cores <= max_num_seqs:
            raise SpeclabError(f"engine cores (data parallelism) must be between 1 and --max-num-seqs "
                               f"({max_num_seqs}), got {cores}")

        def make_scheduler(hooks, core: int = 0):
            nonlocal costs  # a rebuilt scheduler keeps the step costs measured so far
            # --max-num-seqs bounds the running rows of all cores together: each core runs its share
            rows = core_share(max_num_seqs, cores, core)
            s = Scheduler(target, drafter if speculative else None, policy, hooks, max_running=rows,
                          max_waiting=max_waiting, max_len=context, capacity=min(rows, 8), costs=costs,
                          record_costs=policy.name not in ("fixed", "off"),
                          prefix_cache=PrefixCache() if prefix_caching else None)  # one per core, in its process
            costs = s.costs
            return s

        if process and threads > 1:
            raise SpeclabError(f"an engine process runs the model on one thread (a forked process cannot use OpenMP's "
                               f"thread pool); asked for {threads}: use 1 thread, or the engine on a thread")
        if cores > 1 and not process:
            raise SpeclabError(f"{cores} engine cores (data parallelism) need engine processes: the engine runs on a "
                               f"thread here (CUDA, --engine thread or --threads > 1); use --data-parallel-size 1")
        self.engine = Engine(make_scheduler, self.metrics, process=process, max_in_flight=max_num_seqs + max_waiting,
                             threads=1 if process else None, cpus=plan_cpus(cpu_binding, cores), cores=cores,
                             max_running=max_num_seqs, request_timeout=request_timeout, on_fatal=self._fatal)
        self.metrics.bind(self.engine.counts, lambda: sum(c.serving for c in self.engine.cores))

    def _fatal(self, reason: str) -> None:
        """The engine gave up (its cores kept dying): refuse new requests and stop, so the process exits non-zero."""
        self.failed = reason
        self.draining = True
        if self.on_exit is not None:
            self.on_exit()

    # ------------------------------------------------------------------ requests
    def check(self, request: Request) -> None:
        if self.draining:
            raise APIError(503, self.failed or "the server is shutting down", code="server_shutting_down")
        if self.api_key is not None:
            auth = request.headers.get("authorization", "")
            if not hmac.compare_digest(auth.encode(), f"Bearer {self.api_key}".encode()):
                raise APIError(401, "missing or wrong API key (send 'Authorization: Bearer KEY')",
                               "authentication_error", code="invalid_api_key")

    def submit(self, g, rid: str, arrival: float, tag: str | None = None):
        req = EngineRequest(g.prompt_ids, g.max_tokens, g.params, g.seed, g.stop, g.ignore_eos, request_id=rid,
                            arrival=arrival)
        try:
            if self.draft_lm is not None:
                check_draft_context(self.lm, self.draft_lm, len(g.prompt_ids) + g.max_tokens)
            return self.engine.submit(req, g.stream, tag)
        except QueueFull as e:
            self.metrics.rejected()
            raise APIError(429, str(e)) from None
        except NoCore as e:
            raise APIError(503, str(e), code="engine_unavailable") from None
        except SpeclabError as e:
            raise bad(str(e)) from None

    async def generate(self, request: Request, kind: str):
        # the request's clock started when its first bytes reached the machine (.arrival), before any parsing
        arrival = request.scope.get(ARRIVAL) or time.perf_counter()
        read = request.scope.get(READ)
        if read is not None:
            self.metrics.read(read - arrival)
        self.check(request)
        body = parse_body(await request.body())
        g = (parse_chat if kind == "chat" else parse_completion)(body, self.info)
        tag = workload_tag(request.headers.get(TAG_HEADER), body)
        rid = new_id(kind)
        h = self.submit(g, rid, arrival, tag)
        fmt = Formatter(kind, rid, self.info.served_name, g.return_token_ids, g.prompt_ids)
        if g.stream:
            return SSEResponse(self.stream(h, g, fmt), lambda: self.engine.cancel(h), self.stall_timeout)
        item = await self.wait(request, h)
        if item is None:  # the client left; nobody reads this
            return Response(status_code=499)
        what, payload, req = item
        if what == ERROR:
            raise failure(payload)
        full = self.lm.decode(req.generated)
        text = full[:req.stop_at] if req.stop_at is not None else full
        return JSONResponse(fmt.response(req, text, stop_reason(req, full)))

    async def wait(self, request: Request, h):
        """The FINAL/ERROR item, or None when the client disconnects first (the request is cancelled)."""
        result = asyncio.ensure_future(h.get())
        gone = asyncio.ensure_future(_disconnected(request))
        try:
            await asyncio.wait({result, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
        if result.done():
            return result.result()
        result.cancel()
        self.engine.cancel(h)
        return None

    async def stream(self, h, g, fmt: Formatter):
        """The request's chunks as server-sent events. Its TTFT ends when the first chunk with output has been handed
        to the connection (the generator resumes once the chunk has been sent): what a client sees, less the
        network and its own reading."""
        detok = IncrementalText(self.decode, g.stop)
        split = self.split
        first = True
        # continuous usage stats: (prompt tokens, tokens sent so far) -> each chunk's usage
        counts = [len(g.prompt_ids), 0] if g.continuous_usage else None

        def so_far(n: int) -> dict | None:
            if counts is None:
                return None
            counts[1] += n
            return {"prompt_tokens": counts[0], "completion_tokens": counts[1], "total_tokens": counts[0] + counts[1]}

        try:
            if fmt.kind == "chat":
                yield fmt.role_chunk()
            while True:
                what, payload, req = await h.get()
                if what == TOKENS:
                    if split:
                        yield "".join(fmt.chunk(detok.push((t,)), [t], usage=so_far(1)) for t in payload)
                    else:
                        text = detok.push(payload)
                        if not (text or g.return_token_ids):
                            if counts is not None:
                                counts[1] += len(payload)  # counted in the next chunk's usage
                            continue
                        yield fmt.chunk(text, payload, usage=so_far(len(payload)))
                    if first:
                        first = False
                        self.engine.first_written(h, time.perf_counter())
                    continue
                if what == ERROR:
                    yield fmt.error_event(failure(payload)) + DONE
                    return
                out = []
                last = payload
                if split and len(payload) > 1:
                    out += [fmt.chunk(detok.push((t,)), [t], usage=so_far(1)) for t in payload[:-1]]
                    last = payload[-1:]
                text = detok.push(last) if last else ""
                text += detok.finish(req.generated, req.stop_at)
                sr = stop_reason(req, self.lm.decode(req.generated)) if req.finish_reason == "stop" else None
                out.append(fmt.chunk(text, list(last), FINISH.get(req.finish_reason, "abort"), sr,
                                     usage=so_far(len(last))))
                if g.include_usage:
                    out.append(fmt.usage_chunk(req))
                out.append(DONE)
                yield "".join(out)
                if first and req.generated:
                    self.engine.first_written(h, time.perf_counter())
                return
        finally:
            self.engine.cancel(h)  # no-op once the request is done

    # ------------------------------------------------------------------ other routes
    def models(self) -> dict:
        return {"object": "list", "data": [{"id": self.info.served_name, "object": "model", "created": self.created,
                                            "owned_by": "speclab", "root": self.lm.path, "parent": None,
                                            "max_model_len": self.info.context}]}


def failure(f) -> APIError:
    """A request's end without output (speclab.serve.runner.Failure) as the error the client gets."""
    return APIError(f.status, f.message, code=f.code)


async def _disconnected(request: Request) -> None:
    while True:
        msg = await request.receive()
        if msg["type"] == "http.disconnect":
            return


def create_app(server: Server) -> FastAPI:
    """The ASGI app for ``server``; the engine thread runs while the app's lifespan does."""

    @asynccontextmanager
    async def lifespan(app):
        await server.engine.start()
        try:
            yield
        finally:
            server.engine.request_stop()
            await asyncio.to_thread(server.engine.stop)

    app = FastAPI(title="speclab serve", version=__version__, lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.server = server
    app.add_middleware(ArrivalClock)

    @app.exception_handler(APIError)
    async def api_error(request, exc: APIError):
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(HTTPException)
    async def http_error(request, exc: HTTPException):  # an unknown route or method: the same body as the rest
        detail = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
        msg = f"{detail}: {request.method} {request.url.path}"
        return JSONResponse(APIError(exc.status_code, msg).body(), status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(Exception)
    async def unexpected(request, exc: Exception):
        return JSONResponse(APIError(500, f"internal error: {type(exc).__name__}: {exc}", "server_error").body(),
                            status_code=500)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await server.generate(request, "completion")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await server.generate(request, "chat")

    @app.get("/v1/models")
    async def models(request: Request):
        server.check(request)
        return server.models()

    @app.get("/health")
    async def health():
        # 503 during start-up (until every core has said READY once) and while no core can serve
        ok = server.engine.ready and not server.draining
        return Response(status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics():
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return Response(generate_latest(server.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/version")
    async def version():
        return {"version": __version__}

    @app.get("/")
    async def root():
        return PlainTextResponse(f"speclab serve {__version__}: OpenAI-compatible API under /v1\n")

    return app
