"""The OpenAI wire format: request bodies checked and turned into engine settings, and the response,
chunk and error bodies.

Requests are parsed by hand from the JSON body (not by a schema library) so that every mistake is an
OpenAI-style 400 naming the parameter: ``{"error": {"message", "type": "invalid_request_error", "param",
"code"}}``. Ranges are checked by :mod:`speclab.limits`, the one place for limits.

Every error the server sends, whatever its status, has that one shape, and ``code`` is always a string
(:data:`CODES` names the default for each status; OpenAI's own codes where it has one: ``invalid_api_key``,
``model_not_found``, ``context_length_exceeded``, ``rate_limit_exceeded``).

Parameters (both endpoints): ``model`` (optional; must be the served name), ``max_tokens`` (completions:
default 16, as OpenAI and vLLM; chat: ``max_completion_tokens`` or ``max_tokens``, default the rest of
the context, as vLLM), ``temperature`` (default 1.0; 0 = greedy), ``top_p`` (default 1), ``top_k`` (default
0 = off; -1 also means off, as vLLM), ``seed`` (default: a fresh one), ``stop`` (a string or a list),
``stream``, ``stream_options.include_usage`` and ``stream_options.continuous_usage_stats`` (vLLM's: a running
``usage`` in every chunk), ``n`` (must be 1), ``ignore_eos`` and ``return_token_ids``
(vLLM extensions: keep going past EOS; add the token ids to every choice). ``prompt`` is a string, a
list of token ids, or a one-element list of either. Chat ``messages`` are rendered by the model's chat
template (:meth:`speclab.models.LM.apply_chat`; the family has none and uses
:data:`speclab.models.PLAIN_CHAT_TEMPLATE`: ``role: content`` lines, then ``assistant:``).

Responses carry ``usage`` (exact token counts: ``completion_tokens`` counts every generated token,
the EOS token included) and, next to it, ``speculation``: the request's own figures
(:meth:`speclab.engine.Request.spec_stats` plus ``num_drafts``, the rounds that drafted at least one
token, and the raw per-position counts ``draft_tokens_per_pos`` / ``accepted_tokens_per_pos``). Streams
put both in the last chunk (``choices: []``) when ``stream_options.include_usage`` is set.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass

from ..engine.sampling import SamplingParams
from ..errors import SpeclabError
from ..limits import check_context, check_max_new_tokens, check_sampling, check_seed

# parameters we do not implement: refused unless they carry their do-nothing value
UNSUPPORTED = {"best_of": (None, 1), "logprobs": (None, False, 0), "top_logprobs": (None, 0), "echo": (None, False),
               "suffix": (None, ""), "presence_penalty": (None, 0, 0.0), "frequency_penalty": (None, 0, 0.0),
               "repetition_penalty": (None, 1, 1.0), "logit_bias": (None, {}), "min_tokens": (None, 0),
               "tools": (None, []), "response_format": (None, {"type": "text"})}
FINISH = {"eos": "stop", "stop": "stop", "length": "length", "cancelled": "abort"}
ROLES = ("system", "user", "assistant", "tool", "developer")


# an error's default (type, code) by HTTP status
CODES = {400: ("invalid_request_error", "invalid_value"), 401: ("authentication_error", "invalid_api_key"),
         404: ("invalid_request_error", "not_found"), 405: ("invalid_request_error", "method_not_allowed"),
         413: ("invalid_request_error", "request_too_large"), 422: ("invalid_request_error", "invalid_value"),
         429: ("rate_limit_error", "rate_limit_exceeded"), 500: ("server_error", "internal_error"),
         503: ("server_error", "service_unavailable"), 504: ("timeout_error", "request_timeout")}


class APIError(Exception):
    """An HTTP error with an OpenAI-style body; ``type`` and ``code`` default by status (:data:`CODES`)."""

    def __init__(self, status: int, message: str, type: str | None = None, param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        default_type, default_code = CODES.get(status, ("server_error" if status >= 500 else "invalid_request_error",
                                                        f"http_{status}"))
        self.status, self.message, self.param = status, message, param
        self.type, self.code = type or default_type, str(code or default_code)

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str = "invalid_value") -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def bad(message: str, param: str | None = None, code: str = "invalid_value") -> APIError:
    return APIError(400, message, "invalid_request_error", param, code)


@dataclass(frozen=True)
class ModelInfo:
    """What request parsing needs to know about the served model."""

    served_name: str
    lm: object  # speclab.models.LM: encode, apply_chat, vocab_size, name
    context: int  # tokens per request: prompt + completion


@dataclass
class GenRequest:
    """A checked request, ready for the engine."""

    kind: str  # "completion" | "chat"
    prompt_ids: list[int]
    max_tokens: int
    params: SamplingParams
    seed: int | None
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    ignore_eos: bool
    return_token_ids: bool
    continuous_usage: bool = False  # stream_options.continuous_usage_stats: usage so far in every chunk


TAG_HEADER = "x-workload"  # a request's workload tag, as a header (e.g. set by a gateway per endpoint)
TAG_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-.:/")
TAG_MAX = 64


def workload_tag(header: str | None, body: dict) -> str | None:
    """A request's workload (or endpoint) tag: OpenAI's ``metadata`` field, ``{"workload": TAG}``, or the
    ``X-Workload`` header (the body wins when both are given); None without one. A tag is 1-64 characters of
    letters, digits and ``_-.:/``, so that it can be a Prometheus label value as it is."""
    meta = body.get("metadata")
    if meta is not None and not isinstance(meta, dict):
        raise bad("'metadata' must be an object of string values", "metadata")
    tag, param = (meta.get("workload"), "metadata") if meta and "workload" in meta else (header, TAG_HEADER)
    if tag is None:
        return None
    if not isinstance(tag, str) or not 0 < len(tag) <= TAG_MAX or not set(tag) <= TAG_CHARS:
        raise bad(f"the workload tag must be 1-{TAG_MAX} characters of letters, digits and _-.:/, got "
                  f"{json.dumps(tag)[:80]}", param)
    return tag


def parse_body(raw: bytes) -> dict:
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise bad(f"the request body is not valid JSON: {e}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object")
    return body


def _typed(body: dict, name: str, types: tuple, what: str, default=None):
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) and bool not in types or not isinstance(v, types):
        raise bad(f"'{name}' must be {what}, got {json.dumps(v)[:80]}", name)
    return v


def _limit(param: str, fn, *args, **kw):
    """Run a :mod:`speclab.limits` check; its one-line error becomes a 400 naming ``param``."""
    try:
        return fn(*args, **kw)
    except SpeclabError as e:
        raise bad(str(e), param) from None


def _common(body: dict, info: ModelInfo, prompt_ids: list[int], prompt_param: str, max_tokens, kind: str):
    model = _typed(body, "model", (str,), "a string")
    if model is not None and model != info.served_name:
        raise APIError(400, f"the model '{model}' does not exist here (served: '{info.served_name}')",
                       param="model", code="model_not_found")
    for name, ok in UNSUPPORTED.items():
        if name in body and body[name] not in ok:
            raise bad(f"'{name}' is not supported by this server", name, "unsupported_parameter")
    n = _typed(body, "n", (int,), "an integer", 1)
    if n != 1:
        raise bad(f"only n = 1 is supported, got {n}", "n")
    num = (int, float)
    temperature = _typed(body, "temperature", num, "a number", 1.0)
    top_p = _typed(body, "top_p", num, "a number", 1.0)
    top_k = _typed(body, "top_k", (int,), "an integer", 0)
    top_k = 0 if top_k == -1 else top_k
    _limit("temperature", check_sampling, temperature, 1.0, 0)
    _limit("top_p", check_sampling, 1.0, top_p, 0)
    _limit("top_k", check_sampling, 1.0, 1.0, top_k, info.lm.vocab_size)
    seed = _limit("seed", check_seed, _typed(body, "seed", (int,), "an integer"))
    stop = body.get("stop")
    if stop is None:
        stop = []
    elif isinstance(stop, str):
        stop = [stop]
    elif not (isinstance(stop, list) and all(isinstance(s, str) for s in stop)):
        raise bad("'stop' must be a string or a list of strings", "stop")
    stream = _typed(body, "stream", (bool,), "true or false", False)
    opts = _typed(body, "stream_options", (dict,), "an object", {})
    include_usage = _typed(opts, "include_usage", (bool,), "true or false", False)
    continuous = _typed(opts, "continuous_usage_stats", (bool,), "true or false", False)
    ignore_eos = _typed(body, "ignore_eos", (bool,), "true or false", False)
    return_ids = _typed(body, "return_token_ids", (bool,), "true or false", False)
    if max_tokens is None:  # chat: the rest of the context
        max_tokens = info.context - len(prompt_ids)
        if max_tokens < 1:
            raise bad(f"the {prompt_param} ({len(prompt_ids)} tokens) fills the context of '{info.served_name}' "
                      f"({info.context} tokens)", prompt_param, "context_length_exceeded")
    max_tokens = _limit("max_tokens", check_max_new_tokens, max_tokens, name="'max_tokens'")  # as the client sent it
    param = prompt_param if len(prompt_ids) >= info.context else "max_tokens"
    try:
        check_context(len(prompt_ids), max_tokens, info.context, info.served_name)
    except SpeclabError as e:
        raise bad(str(e), param, "context_length_exceeded") from None
    return GenRequest(kind, prompt_ids, max_tokens, SamplingParams(float(temperature), int(top_k), float(top_p)),
                      seed, tuple(s for s in stop if s), stream, include_usage, ignore_eos, return_ids, continuous)


def _token_ids(ids: list, info: ModelInfo) -> list[int]:
    V = info.lm.vocab_size
    if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < V for t in ids):
        raise bad(f"'prompt' token ids must be integers in [0, {V})", "prompt")
    return list(ids)


def parse_completion(body: dict, info: ModelInfo) -> GenRequest:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        if not prompt:
            raise bad("the prompt is empty", "prompt")
        ids = info.lm.encode(prompt)
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        ids = _token_ids(prompt, info)
    elif isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, (str, list)) for p in prompt):
        raise bad("batched prompts are not supported: send one request per prompt", "prompt")
    elif prompt is None:
        raise bad("'prompt' is required", "prompt")
    else:
        raise bad("'prompt' must be a string or a list of token ids", "prompt")
    if not ids:
        raise bad("the prompt encodes to no tokens", "prompt")
    max_tokens = _typed(body, "max_tokens", (int,), "an integer", 16)
    return _common(body, info, ids, "prompt", max_tokens, "completion")


def parse_chat(body: dict, info: ModelInfo) -> GenRequest:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad("'messages' must be a non-empty list", "messages")
    clean = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise bad(f"messages[{i}] must be an object with a 'role' in {', '.join(ROLES)}", "messages")
        content = m.get("content")
        if isinstance(content, list):  # content parts: only text
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise bad(f"messages[{i}].content: only text parts are supported", "messages")
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise bad(f"messages[{i}].content must be a string", "messages")
        clean.append({"role": m["role"], "content": content})
    try:
        text = info.lm.apply_chat(clean)
    except Exception as e:  # noqa: BLE001 - a template failure is the request's problem
        raise bad(f"the chat template failed on these messages: {e}", "messages") from None
    ids = info.lm.encode(text)
    if not ids:
        raise bad("the messages render to no tokens", "messages")
    max_tokens = _typed(body, "max_completion_tokens", (int,), "an integer")
    if max_tokens is None:
        max_tokens = _typed(body, "max_tokens", (int,), "an integer")
    return _common(body, info, ids, "messages", max_tokens, "chat")


# ---------------------------------------------------------------------------------------------- responses
def new_id(kind: str) -> str:
    return ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex


def usage(req) -> dict:
    n_prompt, n_out = len(req.prompt_ids), len(req.generated)
    return {"prompt_tokens": n_prompt, "completion_tokens": n_out, "total_tokens": n_prompt + n_out}


def speculation(req) -> dict:
    """The request's speculation figures (raw counts and the ratios derived from them)."""
    s = req.spec_stats()
    s["num_drafts"] = sum(1 for d, _ in req.history if d > 0)
    s["draft_tokens_per_pos"] = list(req.pos_drafted)
    s["accepted_tokens_per_pos"] = list(req.pos_accepted)
    return s


def stop_reason(req, text_full: str | None = None):
    """vLLM's ``stop_reason``: the stop string that ended the output (None for EOS and length)."""
    if req.finish_reason != "stop" or req.stop_at is None or text_full is None:
        return None
    rest = text_full[req.stop_at:]
    return next((s for s in req.stop if rest.startswith(s)), None)


class Formatter:
    """Builds one request's response body or SSE chunks (completion or chat)."""

    def __init__(self, kind: str, rid: str, model: str, return_ids: bool, prompt_ids: list[int] | None = None):
        self.kind, self.id, self.model, self.return_ids = kind, rid, model, return_ids
        # vLLM's return_token_ids: the prompt's ids once (completions: in the choice; chat: top level), in the
        # response or the first chunk
        self.prompt_ids = list(prompt_ids) if return_ids and prompt_ids is not None else None
        self.created = int(time.time())
        self.object = "chat.completion" if kind == "chat" else "text_completion"
        # the chunks sent while the request runs differ only in their text (and token ids): build them
        # from fixed pieces, one json.dumps of the text per chunk (see _chunk for the general shape)
        head = json.dumps({"id": rid, "object": "chat.completion.chunk" if kind == "chat" else "text_completion",
                           "created": self.created, "model": model}, ensure_ascii=False, separators=(",", ":"))
        if kind == "chat":
            self._pre = "data: " + head[:-1] + ',"choices":[{"index":0,"delta":{"content":'
            self._mid = '},"logprobs":null,"finish_reason":null'
        else:
            self._pre = "data: " + head[:-1] + ',"choices":[{"index":0,"text":'
            self._mid = ',"logprobs":null,"finish_reason":null'

    def _choice(self, text: str, ids: list[int] | None, finish: str | None, stop_reason=None, final=False) -> dict:
        if self.kind == "chat":
            key, msg = ("message", {"role": "assistant", "content": text}) if final else ("delta", {"content": text})
            c = {"index": 0, key: msg, "logprobs": None, "finish_reason": finish}
        else:
            c = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        if finish is not None:
            c["stop_reason"] = stop_reason
        if self.return_ids and ids is not None:
            c["token_ids"] = ids
        if self.prompt_ids is not None and self.kind != "chat":
            c["prompt_token_ids"], self.prompt_ids = self.prompt_ids, None
        return c

    def response(self, req, text: str, stop_reason=None) -> dict:
        body = {"id": self.id, "object": self.object, "created": self.created, "model": self.model}
        if self.prompt_ids is not None and self.kind == "chat":
            body["prompt_token_ids"], self.prompt_ids = self.prompt_ids, None
        body["choices"] = [self._choice(text, list(req.generated), FINISH.get(req.finish_reason, "abort"),
                                        stop_reason, final=True)]
        body["usage"], body["speculation"] = usage(req), speculation(req)
        return body

    def _chunk(self, choices: list, **extra) -> str:
        obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        d = {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices, **extra}
        if self.prompt_ids is not None and self.kind == "chat":
            d["prompt_token_ids"], self.prompt_ids = self.prompt_ids, None
        return "data: " + json.dumps(d, ensure_ascii=False, separators=(",", ":")) + "\n\n"

    def role_chunk(self) -> str:
        """Chat streams open with the assistant's role (as OpenAI and vLLM do)."""
        return self._chunk([{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                             "finish_reason": None}])

    def chunk(self, text: str, ids: list[int] | None, finish: str | None = None, stop_reason=None,
              usage: dict | None = None) -> str:
        """One chunk; with ``usage`` (continuous usage stats) the request's token counts so far ride along."""
        if finish is not None or self.prompt_ids is not None:
            return self._chunk([self._choice(text, ids, finish, stop_reason)], **({"usage": usage} if usage else {}))
        out = self._pre + json.dumps(text, ensure_ascii=False) + self._mid
        if self.return_ids and ids is not None:
            out += ',"token_ids":[' + ",".join(map(str, ids)) + "]"
        if usage is not None:
            return out + '}],"usage":' + json.dumps(usage, separators=(",", ":")) + "}\n\n"
        return out + "}]}\n\n"

    def usage_chunk(self, req) -> str:
        return self._chunk([], usage=usage(req), speculation=speculation(req))

    @staticmethod
    def error_event(err: APIError) -> str:
        return "data: " + json.dumps(err.body()) + "\n\n"


DONE = "data: [DONE]\n\n"
