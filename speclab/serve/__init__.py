"""``speclab serve``: an OpenAI-compatible HTTP server over the continuous-batching scheduler, with
vLLM's metric names.

One job per file: :mod:`.config` (``--speculative-config`` and the models it names), :mod:`.protocol`
(request checking, OpenAI response/chunk/error bodies), :mod:`.core` (the engine core: owns the Scheduler, in
a process of its own on a CPU), :mod:`.channel` (messages between the core and the HTTP side), :mod:`.runner`
(the HTTP side's engine: starts the core, delivers each request's output to asyncio), :mod:`.detok` (incremental
detokenisation with stop-string hold-back), :mod:`.prom` (Prometheus metrics from the scheduler's events),
:mod:`.app` (the FastAPI app and routes), :mod:`.cli` (the ``serve`` command).

In a program: ``create_app(Server(target, drafter, policy, served_name=...))`` is an ASGI app.
"""
