"""One streamed request to an OpenAI-compatible server -> one :class:`RequestRecord`.

The record keeps what the client saw and nothing derived: when each chunk that carried output arrived,
its text, the token count the server reported for it (if any), the final ``usage`` and ``speculation``
objects, and why the request failed. Token counting and statistics happen later (:mod:`.tokens`,
:mod:`.stats`), so the same record can be re-analysed.

A chunk "carries output" when its first choice has non-empty text (``text`` for completions,
``delta.content`` for chat) or token ids. vLLM's ``bench serve`` also times chunks with empty text
(the chat role chunk, a bare finish chunk); those carry no token, so here they set neither TTFT nor a gap.

Failures are records too, each with a one-line reason: an HTTP error status (with the server's
message), a connection error, the per-request timeout, a stream that ended without ``[DONE]``, an
error object inside the stream, or data that is not JSON.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import asdict, dataclass, field

import httpx


@dataclass
class Endpoint:
    """Where and how to send: ``base_url`` without ``/v1``; ``kind`` "completions" or "chat"."""

    base_url: str
    kind: str = "completions"
    model: str | None = None
    api_key: str | None = None
    max_tokens: int = 64
    temperature: float = 0.0
    timeout: float = 120.0
    seed: int | None = None
    extra: dict = field(default_factory=dict)  # more request fields, e.g. {"return_token_ids": True}
    tag_workloads: bool = True  # send each request's workload as its X-Workload header (servers without it ignore it)

    @property
    def url(self) -> str:
        return f"{self.base_url}/v1/{'chat/completions' if self.kind == 'chat' else 'completions'}"

    def headers(self, workload: str | None = None) -> dict:
        """The request headers; with ``workload`` (and ``tag_workloads``), its tag as ``X-Workload``, which speclab
        serve counts acceptance by (``speclab:workload_*`` on /metrics) and other servers ignore."""
        h = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        if workload and self.tag_workloads:
            h["X-Workload"] = workload_tag(workload)
        return h

    def payload(self, prompt: str, max_tokens: int | None = None) -> dict:
        """The request body; ``max_tokens``: this request's own budget (default: the endpoint's)."""
        body: dict = {"max_tokens": max_tokens or self.max_tokens, "temperature": self.temperature, "stream": True,
                      "stream_options": {"include_usage": True}}
        if self.model is not None:
            body["model"] = self.model
        if self.kind == "chat":
            body["messages"] = [{"role": "user", "content": prompt}]
        else:
            body["prompt"] = prompt
        if self.seed is not None:
            body["seed"] = self.seed
        body.update(self.extra)
        return body


def workload_tag(name: str) -> str:
    """A workload's name as a tag speclab serve accepts (1-64 of letters, digits, ``_-.:/``): others become ``_``.
    e.g. "math reasoning" -> "math_reasoning"."""
    tag = "".join(c if c.isascii() and (c.isalnum() or c in "_-.:/") else "_" for c in name)[:64]
    return tag or "_"


@dataclass
class RequestRecord:
    """What one request saw. Times are seconds: ``sent`` from the level's start, the rest from ``sent``.

    ``sent`` is when the request's headers had been written to its connection (httpcore's trace event), the
    moment the server can see it; ``send_wait`` is the client's own time before that, from the call
    (building the request, waiting for its event loop and for a connection), kept apart so that a busy
    client does not show as server latency. Without the trace event (a transport that does not emit it)
    ``sent`` stays at the call and ``send_wait`` is None."""

    index: int
    prompt_id: str = ""
    category: str = ""
    sent: float = 0.0
    send_wait: float | None = None
    max_tokens: int | None = None  # this request's budget when it has its own (a length spread); else the endpoint's
    ok: bool = False
    error: str | None = None
    error_kind: str | None = None  # http_status, timeout, truncated, connection, stream_error, bad_data, no_output
    status: int | None = None
    chunk_times: list[float] = field(default_factory=list)  # arrival of each chunk that carried output
    chunk_texts: list[str] = field(default_factory=list)
    # tokens in each chunk as the server reported them (vLLM's return_token_ids, or a running usage
    # count); None when the server did not say. Filled by :mod:`.tokens` otherwise.
    chunk_tokens: list[int] | None = None
    chunk_token_source: str | None = None
    done_time: float | None = None  # when [DONE] arrived
    finish_reason: str | None = None
    usage: dict | None = None
    speculation: dict | None = None
    output_tokens: int | None = None  # N, from usage or the tokenizer (see token_source)
    token_source: str | None = None
    prompt_tokens: int | None = None
    token_mismatch: int | None = None  # tokenizer count of the text minus usage's, when both are known

    @property
    def text(self) -> str:
        return "".join(self.chunk_texts)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["text"] = self.text
        del d["chunk_texts"]  # the text and the per-chunk token counts say it, far shorter
        return d


def _choice_output(choice: dict) -> tuple[str, list[int] | None]:
    """(text, token ids or None) of one streamed choice, completions or chat."""
    text = choice.get("text")
    if text is None:
        delta = choice.get("delta") or {}
        text = delta.get("content")
    ids = choice.get("token_ids")
    return (text or ""), (list(ids) if isinstance(ids, list) else None)


def _error_message(body: bytes) -> str:
    try:
        obj = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return body[:200].decode("utf-8", "replace").strip()
    err = obj.get("error", obj) if isinstance(obj, dict) else obj
    if isinstance(err, dict):
        err = err.get("message") or err.get("detail") or err
    if isinstance(obj, dict) and "detail" in obj and not isinstance(err, str):
        err = obj["detail"]
    return str(err)[:200]


async def _read_stream(response: httpx.Response, rec: RequestRecord, t0: float) -> None:
    """Stamp every ``data:`` line as it arrives and parse them after ``[DONE]``: the client's work per chunk
    stays tiny, so a busy client delays (and bunches) the stamps of the next chunks as little as it can."""
    lines: list[tuple[float, str]] = []
    done = False
    try:
        async for line in response.aiter_lines():
            if line.startswith("data:"):  # skip SSE comments (keep-alives), event names, blank separators
                now = time.perf_counter() - t0
                data = line[5:].strip()
                if data == "[DONE]":
                    rec.done_time, done = now, True
                    break
                lines.append((now, data))
    except BaseException:  # a timeout or a cut connection: keep what arrived, for the record
        _parse(lines, rec, strict=False)
        raise
    _parse(lines, rec, strict=True)
    if not done:
        raise _StreamError(f"truncated stream: ended without [DONE] after {len(rec.chunk_times)} chunks",
                           "truncated")


def _parse(lines: list[tuple[float, str]], rec: RequestRecord, strict: bool) -> None:
    usage_ids_total = 0  # running completion_tokens when every chunk carries usage (continuous usage)
    running_usage = True
    for now, data in lines:
        try:
            obj = json.loads(data)
        except ValueError:
            if not strict:
                continue
            raise _StreamError(f"bad SSE data (not JSON): {data[:80]!r}", "bad_data") from None
        if not isinstance(obj, dict):
            if not strict:
                continue
            raise _StreamError(f"bad SSE data (not an object): {data[:80]!r}", "bad_data")
        if obj.get("error") and strict:
            raise _StreamError(f"error in stream: {_error_message(data.encode())}", "stream_error")
        usage = obj.get("usage")
        if isinstance(usage, dict):
            rec.usage = usage
        if isinstance(obj.get("speculation"), dict):
            rec.speculation = obj["speculation"]
        choices = obj.get("choices") or []
        if not choices:
            continue
        choice = choices[0]
        if choice.get("finish_reason"):
            rec.finish_reason = choice["finish_reason"]
        text, ids = _choice_output(choice)
        if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
            n_usage = usage["completion_tokens"] - usage_ids_total
            usage_ids_total = usage["completion_tokens"]
        else:
            n_usage, running_usage = None, False
        if not text and not ids:
            continue
        rec.chunk_times.append(now)
        rec.chunk_texts.append(text)
        n = len(ids) if ids is not None else (n_usage if running_usage else None)
        if n is None:
            rec.chunk_tokens = None
            rec.chunk_token_source = None
        elif len(rec.chunk_times) == 1 or rec.chunk_tokens is not None:
            rec.chunk_tokens = (rec.chunk_tokens or []) + [n]
            rec.chunk_token_source = "server token_ids" if ids is not None else "server running usage"


class _StreamError(Exception):
    def __init__(self, message: str, kind: str):
        super().__init__(message)
        self.kind = kind


# httpcore trace events: the request's headers written to the connection. The server can see the request from these
# bytes on (speclab serve starts its clock when the kernel receives them); the body follows in a second write, after
# the client's event loop has run once more (at one stream about 0.8 ms later)
WRITTEN = ("http11.send_request_headers.complete", "http2.send_request_headers.complete")


async def _exchange(client: httpx.AsyncClient, endpoint: Endpoint, prompt: str, rec: RequestRecord,
                    t0: float, written: list) -> None:
    async def trace(name: str, info: dict) -> None:
        if name in WRITTEN and not written:
            written.append(time.perf_counter())

    body = endpoint.payload(prompt, rec.max_tokens)
    async with client.stream("POST", endpoint.url, json=body, headers=endpoint.headers(rec.category),
                             extensions={"trace": trace}) as response:
        rec.status = response.status_code
        if response.status_code != 200:
            body = await response.aread()
            raise _StreamError(f"HTTP {response.status_code}: {_error_message(body)}", "http_status")
        await _read_stream(response, rec, written[0] if written else t0)  # times from the request on the wire


async def send(client: httpx.AsyncClient, endpoint: Endpoint, prompt: str, rec: RequestRecord) -> RequestRecord:
    """Send one streaming request and fill ``rec`` (also on failure). Never raises for server faults;
    the per-request timeout covers connecting, waiting and reading (a server that trickles bytes
    forever still times out)."""
    t0 = time.perf_counter()
    written: list[float] = []
    try:
        await asyncio.wait_for(_exchange(client, endpoint, prompt, rec, t0, written), endpoint.timeout)
        if not rec.chunk_times:
            raise _StreamError("no output: the stream finished without any text", "no_output")
        rec.ok = True
    except (asyncio.TimeoutError, httpx.TimeoutException):
        rec.error, rec.error_kind = (f"timeout after {endpoint.timeout:g} s ({len(rec.chunk_times)} chunks "
                                     f"received)"), "timeout"
    except _StreamError as e:
        rec.error, rec.error_kind = str(e), e.kind
    except httpx.ConnectError as e:
        rec.error, rec.error_kind = f"connection failed: {str(e) or type(e).__name__}", "connection"
    except httpx.RemoteProtocolError as e:
        rec.error, rec.error_kind = (f"connection closed mid-stream after {len(rec.chunk_times)} chunks: "
                                     f"{str(e)[:120]}"), "truncated"
    except httpx.HTTPError as e:
        rec.error, rec.error_kind = f"{type(e).__name__}: {str(e)[:160]}", "connection"
    if written:  # the chunks were timed from the request on the wire: so is sent
        rec.send_wait = written[0] - t0
        rec.sent += rec.send_wait
    return rec
