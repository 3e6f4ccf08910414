"""``speclab serve``: the command line of the OpenAI-compatible server (registered by ``add_commands``).

Serve /v1/completions and /v1/chat/completions (streaming or not), /v1/models, /health and /metrics
(Prometheus, vLLM's metric names) over the continuous-batching scheduler. Chat uses the model's chat template;
the family has none and uses a plain one ('role: content' lines, then 'assistant:'). Completions default to
max_tokens 16, chat to the rest of the context.

Startup order: cheap checks and the listening socket first (a bad flag or a busy port fails in a second,
as one line, exit 2), then the models, a short warm-up (the first forwards of a process are slow), then
uvicorn. SIGTERM drains: new requests get 503 and new connections are refused, the requests in flight
complete, then the process exits 0. A second SIGTERM or Ctrl-C stops at once.

An engine core that dies is replaced (its requests in flight fail with a 503; the other cores keep serving);
if cores keep dying (3 times within a minute) the server stops and exits 1 with a one-line reason.
"""

from __future__ import annotations

import argparse
import signal
import socket
import sys

from ..errors import SpeclabError
from ..optional import require_package
from .arrival import event_loop, stamp_listener, stamping_protocol

SPEC_HELP = ("speculation, as vLLM's JSON: {\"method\": \"draft_model\"|\"ngram\"|\"suffix\"|\"eagle3\"|\"synthetic\", "
             "\"model\": NAME, "
             "\"num_speculative_tokens\": K, \"prompt_lookup_max\": N, \"prompt_lookup_min\": N}, or 'none' for plain "
             "decoding; NAME may be any drafter `speclab models` lists (eagle3: a speculators directory, or the "
             "family's 'eagle3'). Default: for a model of the embedded family, "
             "its default drafter (eagle+suffix: the EAGLE head, suffix decoding where the text repeats) with "
             "num_speculative_tokens 4; for any other model, none")


def add_commands(sub) -> None:
    p = sub.add_parser(
        "serve", help="an OpenAI-compatible server with continuous batching and speculation metrics",
        description=__doc__.split("\n\n")[1])

    p.add_argument("--model", default=None, help="family name, local HF directory or hub id (default: the family's "
                   "target)")
    p.add_argument("--served-model-name", default=None, help="the name clients send as 'model' (default: --model)")
    p.add_argument("--speculative-config", default=None, metavar="JSON", help=SPEC_HELP)
    p.add_argument("--spec-policy", default="fixed", help="draft-length policy (speclab.engine.policies; default "
                   "fixed: k = num_speculative_tokens every round; adaptive ones use it as their largest k)")
    p.add_argument("--max-num-seqs", type=int, default=64, help="requests running at once (rows; default 64)")
    p.add_argument("--max-waiting-requests", type=int, default=256, help="requests queued beyond those; more get "
                   "HTTP 429 (default 256)")
    p.add_argument("--max-model-len", type=int, default=None, help="tokens per request, prompt + completion "
                   "(default: the model's context)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1 routes")
    p.add_argument("--stream-split-tokens", action="store_true", help="stream one token per SSE chunk (default: one "
                   "verification round per chunk, as real servers do)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: 1 for tiny models)")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when present)")
    p.add_argument("--engine", choices=("auto", "process", "thread"), default="auto", help="where the engine core "
                   "runs: its own process (the HTTP side and the model then use a core each, as vLLM's API server and "
                   "EngineCore) or a thread of the server's process; auto: a process on the CPU, a thread on CUDA")
    p.add_argument("--data-parallel-size", "-dp", default="auto", metavar="N|auto",
                   help="engine cores, each with its own scheduler and caches, as vLLM's data parallelism; a request "
                   "goes to the core with the fewest in flight (the first when idle). auto (default): one per CPU this "
                   "process may use, with engine processes on a CPU; else 1")
    p.add_argument("--cpu-binding", choices=("auto", "none"), default="auto",
                   help="auto (default): with one engine process and at least 2 CPUs, bind it to the first CPU and the "
                   "HTTP side to the others, as vLLM's CPU build binds its worker to a core (measured: less CPU per "
                   "token); with several engine cores, or none: the OS places every process")
    p.add_argument("--uvicorn-log-level", default="info", choices=["critical", "error", "warning", "info", "debug",
                                                                   "trace"])
    p.add_argument("--disable-uvicorn-access-log", action="store_true", help="no log line per HTTP request")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="reuse the keys and values of prompts already prefilled (a repeated prompt, a shared system "
                   "prompt: speclab.engine.prefix_cache); on by default, as in vLLM")
    p.add_argument("--calibrate-costs", action=argparse.BooleanOptionalAction, default=True,
                   help="with an adaptive --spec-policy: time the step costs it weighs at start-up (a few seconds) "
                   "instead of learning them from the first requests (default on)")
    p.add_argument("--request-timeout", type=float, default=None, metavar="SECONDS",
                   help="cancel a request still in flight this long after it arrived (HTTP 504, or an error event in "
                   "its stream); default: no limit")
    p.add_argument("--stream-stall-timeout", type=float, default=30.0, metavar="SECONDS",
                   help="cancel a stream whose client has not taken a chunk for this long (its connection's buffers "
                   "are full) and close its connection, freeing its row (default 30)")
    p.add_argument("--max-workload-tags", type=int, default=32, metavar="N",
                   help="workload tags (a request's metadata.workload or X-Workload header) exported with their own "
                   "speclab:workload_* series on /metrics; later tags share the '_other' series (default 32)")
    p.add_argument("--http", choices=("auto", "httptools", "h11"), default="auto",
                   help="uvicorn's HTTP parser; auto (default): httptools (C) when installed, else h11 (pure Python)")
    p.add_argument("--loop", choices=("auto", "uvloop", "asyncio"), default="auto",
                   help="the event loop; auto (default): asyncio's with --arrival kernel (the kernel's stamps are "
                        "read through it), else uvloop when installed; uvloop with --arrival kernel stamps at the read")
    p.add_argument("--arrival", choices=("kernel", "read"), default="kernel",
                   help="where a request's clock (TTFT, queue time, E2E) starts: 'kernel' (default) when its bytes "
                        "reached the machine (the kernel's receive time, Linux; elsewhere as 'read'), 'read' when the "
                        "server's event loop read them (vLLM's arrival: a loop waiting for a CPU is not counted)")
    p.set_defaults(func=cmd_serve)


def listen(host: str, port: int) -> socket.socket:
    """The listening socket, bound now so a busy port is one line before any model loads."""
    fam = socket.AF_INET6 if ":" in host else socket.AF_INET
    # proto IPPROTO_TCP, not 0: asyncio sets TCP_NODELAY only on accepted sockets whose proto says TCP; without it
    # a stream's small chunks wait behind Nagle for the client's delayed ACK (up to 40 ms on Linux, measured)
    sock = socket.socket(fam, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise SpeclabError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    stamp_listener(sock)  # requests' arrival: when the kernel received them (speclab/serve/arrival.py)
    return sock


def cmd_serve(args) -> int:
    try:
        import fastapi  # noqa: F401
        import prometheus_client  # noqa: F401
        import uvicorn
    except ImportError as e:
        raise SpeclabError(f"speclab serve needs fastapi, uvicorn and prometheus_client ({e}); "
                           "pip install fastapi uvicorn prometheus_client") from None

    from ..limits import MAX_BATCH, check_int
    from .config import build_drafter, family_default, parse_speculative_config

    # cheap checks first: a bad flag is one line in a second, before torch or any model loads
    max_seqs = check_int("--max-num-seqs", args.max_num_seqs, 1, MAX_BATCH)
    max_wait = check_int("--max-waiting-requests", args.max_waiting_requests, 0, 1 << 20)
    dp = None if str(args.data_parallel_size).strip().lower() == "auto" else \
        check_int("--data-parallel-size", args.data_parallel_size, 1, 64)
    check_int("--port", args.port, 0, 65535)
    check_int("--max-workload-tags", args.max_workload_tags, 0, 10_000)
    for flag, v in (("--request-timeout", args.request_timeout), ("--stream-stall-timeout", args.stream_stall_timeout)):
        if v is not None and not v > 0:
            raise SpeclabError(f"{flag} must be a positive number of seconds, got {v:g}")
    spec = parse_speculative_config(args.speculative_config) if args.speculative_config is not None else None
    for flag, mod in (("--http", args.http), ("--loop", args.loop)):
        if mod not in ("auto", "h11", "asyncio"):
            require_package(flag, mod)

    from ..defaults import default_target, setup_threads
    from ..engine import Off, SpeculativeDecoder, make_policy
    from ..engine.costs import OnlineCosts
    from ..engine.policies import seed_costs
    from ..models import load_model
    from .app import Server, create_app

    make_policy(args.spec_policy, 4)  # an unknown policy fails before the models load
    sock = listen(args.host, args.port)
    try:
        model = args.model or default_target()
        target = load_model(model, device=args.device, role="target")
        setup_threads(args.threads, target)
        import torch

        if args.engine == "process" and torch.get_num_threads() > 1:
            raise SpeclabError(f"--engine process runs the model on one thread (a forked process cannot use "
                               f"OpenMP's thread pool); got --threads {torch.get_num_threads()}: use --threads 1 or "
                               f"--engine thread")
        if spec is None:
            spec = family_default(target)
        if args.max_model_len is not None:
            check_int("--max-model-len", args.max_model_len, 1, target.max_context)
        drafter = build_drafter(spec, target)
        policy = make_policy(args.spec_policy, spec.k) if drafter is not None else Off()
        warm = ["Hello, world"]
        SpeculativeDecoder(target, None).generate(warm, k=0, max_new_tokens=4, record=False)
        if drafter is not None and policy.k_max > 0:
            SpeculativeDecoder(target, drafter).generate(warm, k=spec.k, max_new_tokens=8, record=False,
                                                         policy=make_policy(args.spec_policy, spec.k))
        costs = None
        if drafter is not None and args.calibrate_costs:
            # a policy that weighs step costs gets every shape it chooses between timed now, before the server is
            # up, rather than learnt from its first requests (each engine core starts with a copy)
            costs = OnlineCosts()
            spent = seed_costs(policy, costs, target, drafter, min(max_seqs, 32))
            if spent is None:
                costs = None
            else:
                print(f"speclab serve: step costs calibrated for the {policy.name} policy in {spent:.1f} s", flush=True)
        served = args.served_model_name or model
        server = Server(target, drafter, policy, served_name=served, max_num_seqs=max_seqs, max_waiting=max_wait,
                        max_model_len=args.max_model_len, api_key=args.api_key,
                        stream_split_tokens=args.stream_split_tokens, method=spec.method or "none",
                        draft_name=spec.model or spec.method or "none",
                        engine_process=None if args.engine == "auto" else args.engine == "process",
                        cpu_binding=args.cpu_binding, engine_threads=torch.get_num_threads(), engine_cores=dp,
                        prefix_caching=args.enable_prefix_caching, costs=costs,
                        request_timeout=args.request_timeout, stream_stall_timeout=args.stream_stall_timeout,
                        max_workload_tags=args.max_workload_tags)
        app = create_app(server)
    except BaseException:
        sock.close()
        raise
    host, port = sock.getsockname()[:2]
    print(f"speclab serve: model {target.name} served as '{served}' · speculation: {spec.describe()} · policy "
          f"{policy.name} · up to {max_seqs} running, {max_wait} waiting · context {server.info.context} · "
          f"{engine_where(server.engine)} · http://{host}:{port}/v1", file=sys.stderr, flush=True)
    kernel = args.arrival == "kernel"
    config = uvicorn.Config(app, log_level=args.uvicorn_log_level, access_log=not args.disable_uvicorn_access_log,
                            lifespan="on", timeout_graceful_shutdown=None, http=stamping_protocol(args.http, kernel),
                            loop=event_loop(args.loop, kernel))
    uv = draining_server(config, server)
    server.on_exit = lambda: setattr(uv, "should_exit", True)
    uv.run(sockets=[sock])
    if server.failed:  # the engine gave up: a non-zero status, so that whatever runs the server restarts it
        print(f"speclab serve: error: {server.failed}", file=sys.stderr, flush=True)
        return 1
    return 0


def engine_where(engine) -> str:
    if not engine.process:
        return "engine thread"
    n = len(engine.cores)
    return "engine process" if n == 1 else f"{n} engine processes"


def draining_server(config, server):
    """uvicorn's server, except that the first SIGTERM drains and exits 0 (uvicorn re-raises the signal after
    its graceful shutdown, which would end the process with status 143)."""
    import uvicorn

    class DrainingServer(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:
            server.draining = True  # new requests: 503
            if sig == signal.SIGTERM and not self.should_exit:
                self.should_exit = True
                return
            if self.should_exit:  # a second signal: stop now
                self.force_exit = True
            super().handle_exit(sig, frame)

    return DrainingServer(config)
