"""The speculative decoder: draft k tokens, score all k+1 positions with one target forward,
accept, roll back, emit. k = 0 is plain target decoding through the same code.

Bookkeeping per row b (host list and device tensor kept equal):
    lengths[b]  tokens of row b so far (prompt + generated); the newest one, at lengths[b]-1,
                has no K/V in the target cache yet: it is the first input of the next verify.
A round for a row with L = lengths[b] and drafts d1..dk:
    verify input  [tok[L-1], d1, ..., dk] at positions L-1 .. L+k-1 -> target logits for
                  positions L .. L+k (k draft checks + 1 bonus)
    accept n      -> emit d1..dn and one recovered/bonus token; lengths[b] = L + n + 1
    rollback      the target cache now holds positions < L + n = lengths[b] - 1: moving the
                  integer is the whole rollback; slots after it are masked and later overwritten.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from typing import Iterator, Sequence

import torch

from .acceptance import greedy_accept, rejection_sample
from .drafters import DraftContext, Drafter
from .errors import SpeclabError
from .events import Event, HookRegistry, RoundEvent, RowRound, RunFinished, RunStarted, TokenRecord
from .models import LM, context_needed
from .sampling import RowRNG, SamplingParams, logits_to_probs, sample_from_probs

MAX_K = 32
_run_ids = itertools.count(1)


@dataclass
class GenerationResult:
    prompt_tokens: list[list[int]]
    output_tokens: list[list[int]]  # generated tokens per row (EOS included when produced)
    texts: list[str]
    finish_reasons: list[str]
    metrics: dict = field(default_factory=dict)
    tokens: list[list[dict]] = field(default_factory=list)  # per row: {token, text, status, round, ...}
    recorder: object | None = None  # speclab.metrics.Recorder when recorded

    def to_dict(self) -> dict:
        return {"text": self.texts, "tokens": self.tokens, "metrics": self.metrics}


def _rejection_impl(device: torch.device):
    """The fused Triton kernel on CUDA when Triton is installed, else the pure PyTorch reference."""
    if device.type == "cuda":
        try:
            from kernels import fused_rejection_sample, triton_available

            if triton_available(device):
                return fused_rejection_sample
        except ImportError:
            pass
    return rejection_sample


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class SpeculativeDecoder:
    """Exact, batched speculative decoding of ``target`` with ``drafter`` (None: plain decoding)."""

    def __init__(self, target: LM, drafter: Drafter | None = None, hooks: HookRegistry | None = None):
        self.target = target
        self.drafter = drafter
        self.hooks = hooks if hooks is not None else HookRegistry()

    # -------------------------------------------------------------------------------- public API
    def generate(self, prompts: Sequence[str] | Sequence[Sequence[int]] | str, k: int = 4,
                 max_new_tokens: int = 64, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                 seed: int | None = 0, record: bool = True, stop_on_eos: bool = True) -> GenerationResult:
        """Decode every prompt (a batch). ``record`` subscribes a metrics recorder for this run;
        ``record=False`` runs with no subscriber of its own (the fast path; benchmarks measure both)."""
        from .metrics import Recorder

        rec = Recorder(self.target) if record else None
        unsub = self.hooks.subscribe(rec) if rec else None
        try:
            out = None
            for out in self._decode(prompts, k, max_new_tokens, temperature, top_k, top_p, seed, stop_on_eos):
                pass
        finally:
            if unsub:
                unsub()
        assert out is not None
        if rec is not None:
            out.recorder = rec
            out.metrics = rec.summary()
            out.tokens = rec.token_dicts()
        return out

    def stream(self, prompts, k: int = 4, max_new_tokens: int = 64, temperature: float = 0.0, top_k: int = 0,
               top_p: float = 1.0, seed: int | None = 0, stop_on_eos: bool = True) -> Iterator[Event]:
        """Events as they happen (RunStarted, one RoundEvent per round, RunFinished). Stop iterating
        (or close the generator) to cancel the run between rounds."""
        queue: list[Event] = []
        unsub = self.hooks.subscribe(queue.append)
        gen = self._decode(prompts, k, max_new_tokens, temperature, top_k, top_p, seed, stop_on_eos)
        try:
            for _ in gen:
                while queue:
                    yield queue.pop(0)
            while queue:
                yield queue.pop(0)
        finally:
            gen.close()
            unsub()

    # -------------------------------------------------------------------------------- validation
    def _validate(self, prompts, k, max_new_tokens, temperature, top_k, top_p) -> list[list[int]]:
        if isinstance(prompts, str):
            prompts = [prompts]
        if len(prompts) < 1:
            raise SpeclabError("batch size must be at least 1 (no prompts given)")
        if not isinstance(k, int) or k < 0 or k > MAX_K:
            raise SpeclabError(f"k (draft length) must be between 0 and {MAX_K}, got {k}")
        if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise SpeclabError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
        if temperature < 0:
            raise SpeclabError(f"temperature must be >= 0, got {temperature}")
        if not 0.0 < top_p <= 1.0:
            raise SpeclabError(f"top_p must be in (0, 1], got {top_p}")
        if top_k < 0:
            raise SpeclabError(f"top_k must be >= 0, got {top_k}")
        ids = []
        for i, p in enumerate(prompts):
            if isinstance(p, str):
                if not p.strip():
                    raise SpeclabError(f"prompt {i} is empty" if len(prompts) > 1 else "the prompt is empty")
                toks = self.target.encode(p)
            else:
                toks = [int(t) for t in p]
            if not toks:
                raise SpeclabError(f"prompt {i} encodes to no tokens")
            need = len(toks) + max_new_tokens
            if need > self.target.max_context:
                raise SpeclabError(
                    f"prompt ({len(toks)} tokens) + max_new_tokens ({max_new_tokens}) = {need} exceeds the "
                    f"context of '{self.target.name}' ({self.target.max_context} tokens)")
            ids.append(toks)
        return ids

    # -------------------------------------------------------------------------------- the loop
    @torch.inference_mode()
    def _decode(self, prompts, k, max_new_tokens, temperature, top_k, top_p, seed, stop_on_eos):
        prompt_ids = self._validate(prompts, k, max_new_tokens, temperature, top_k, top_p)
        T, drafter, hooks = self.target, self.drafter, self.hooks
        if drafter is None:
            k = 0
        params = SamplingParams(temperature, top_k, top_p)
        dev = T.device
        B = len(prompt_ids)
        eos = T.eos_token_id if stop_on_eos else None
        run_id = next(_run_ids)
        plen = [len(p) for p in prompt_ids]
        max_len = max(context_needed(n, max_new_tokens, k) for n in plen)
        reject = _rejection_impl(dev)
        rng = None if params.greedy else RowRNG([(seed or 0) + b for b in range(B)], dev)

        buf = torch.zeros(B, max_len, dtype=torch.long, device=dev)  # (B, S) all tokens per row
        for b, p in enumerate(prompt_ids):
            buf[b, :len(p)] = torch.tensor(p, device=dev)
        host = [list(p) for p in prompt_ids]
        hlen = list(plen)  # host copy of lengths
        ngen = [0] * B
        finish: list[str | None] = [None] * B
        rows = torch.arange(B, device=dev)

        active = hooks.active
        t_start = time.perf_counter()
        if active:
            hooks.emit(RunStarted(run_id, t_start, B, k, drafter.name if drafter else "none", T.name, plen,
                                  temperature, top_k, top_p, max_new_tokens))

        # ---- prefill: the whole prompt through the target, the first token from its last position
        cache = T.new_cache(B, max_len)
        Lp = max(plen)
        pos = torch.arange(Lp, device=dev)[None].expand(B, Lp)  # (B, Lp)
        lens_t = torch.tensor(plen, device=dev)
        logits = cache.forward(buf[:, :Lp], pos, pos < lens_t[:, None], kv_len=Lp, last_only=lens_t - 1)  # (B,1,V)
        if params.greedy:
            first = logits[:, 0].argmax(-1)
            fprobs = logits[:, 0].float().softmax(-1) if active else None
        else:
            fprobs = logits_to_probs(logits[:, 0], params)
            first = sample_from_probs(fprobs, rng.uniform(1)[:, 0])
        buf[rows, lens_t] = first
        first_h = first.tolist()
        fp_h = fprobs.gather(1, first[:, None]).squeeze(1).tolist() if fprobs is not None else [None] * B
        row_events = []
        for b in range(B):
            host[b].append(first_h[b])
            hlen[b] += 1
            ngen[b] = 1
            if eos is not None and first_h[b] == eos:
                finish[b] = "eos"
            elif max_new_tokens <= 1:
                finish[b] = "length"
            if active:
                row_events.append(RowRound(b, 0, 0, [TokenRecord(first_h[b], "target", None, fp_h[b], 0)],
                                           finish[b] is not None, finish[b]))
        if active:
            _sync(dev)
            now = time.perf_counter()
            hooks.emit(RoundEvent(run_id, 0, now, {"prefill": now - t_start}, row_events))
        yield 0

        lengths = torch.tensor(hlen, device=dev)  # (B,)
        ctx = DraftContext(buf, lengths, hlen, host)
        if drafter is not None and k > 0 and not all(finish):
            drafter.start(ctx, max_len)

        rnd = 0
        cancelled = True
        t_prev = time.perf_counter()
        try:
            while not all(f is not None for f in finish):
                rnd += 1
                t0 = time.perf_counter()
                running = [f is None for f in finish]
                remaining = [max_new_tokens - ngen[b] if running[b] else 0 for b in range(B)]
                # a round emits up to k+1 tokens: never draft past the budget left
                k_r = min(k, max(remaining) - 1)

                # ---- draft
                if drafter is not None and k_r > 0:
                    u_draft = rng.uniform(2 * k_r + 1) if rng is not None else None
                    prop = drafter.propose(ctx, k_r, params, u_draft[:, :k_r] if u_draft is not None else None,
                                           want_probs=active)
                    d_tokens = prop.tokens  # (B, kk)
                    cap = torch.tensor([max(r - 1, 0) for r in remaining], device=dev)
                    num_draft = torch.minimum(prop.lengths, cap)  # (B,)
                else:
                    prop, u_draft = None, (rng.uniform(1) if rng is not None else None)
                    d_tokens = torch.zeros(B, 0, dtype=torch.long, device=dev)
                    num_draft = torch.zeros(B, dtype=torch.long, device=dev)
                kk = d_tokens.shape[1]
                if active:
                    _sync(dev)
                t1 = time.perf_counter()

                # ---- verify: one target forward over [newest token, d1..dk] per row
                last = buf[rows, lengths - 1]  # (B,)
                inp = torch.cat([last[:, None], d_tokens.clamp(min=0)], 1)  # (B, kk+1)
                vpos = (lengths - 1)[:, None] + torch.arange(kk + 1, device=dev)[None]  # (B, kk+1)
                logits = cache.forward(inp, vpos, None, kv_len=max(hlen) + kk)  # (B, kk+1, V)
                if active:
                    _sync(dev)
                t2 = time.perf_counter()

                # ---- accept and roll back
                if params.greedy:
                    res = greedy_accept(d_tokens, logits.argmax(-1), num_draft)
                    tprobs = logits.float().softmax(-1) if active else None
                else:
                    tprobs = logits_to_probs(logits, params)  # (B, kk+1, V)
                    res = reject(d_tokens, prop.probs if prop is not None else None, tprobs, num_draft,
                                           u_draft[:, k_r:k_r + kk] if kk else u_draft[:, :0], u_draft[:, -1])
                # the round's tokens, written at each row's own positions (junk past the new length
                # is harmless: it is beyond every row's length and gets overwritten)
                out = torch.cat([d_tokens.clamp(min=0), torch.zeros(B, 1, dtype=torch.long, device=dev)], 1)  # (B, k+1)
                out[rows, res.num_accepted] = res.next_token
                buf.scatter_(1, vpos + 1, out)
                n_h = res.num_accepted.tolist()
                out_h = out.tolist()
                nd_h = num_draft.tolist()
                if active:
                    d_h = d_tokens.tolist()
                    tp_h = tprobs[:, :kk].gather(2, d_tokens.clamp(min=0)[..., None]).squeeze(-1).tolist()  # (B, kk)
                    tpn_h = tprobs[rows, res.num_accepted, res.next_token].tolist()  # (B,)
                    dp_h = prop.token_probs.tolist() if prop is not None and prop.token_probs is not None else None
                    bonus_h = res.is_bonus.tolist()
                row_events = []
                for b in range(B):
                    if not running[b]:
                        continue
                    n = n_h[b]
                    new = out_h[b][:n + 1]
                    reason = None
                    if eos is not None and eos in new:
                        new = new[:new.index(eos) + 1]
                        reason = "eos"
                    if len(new) >= remaining[b]:
                        new = new[:remaining[b]]
                        reason = reason or "length"
                    host[b].extend(new)
                    hlen[b] += len(new)
                    ngen[b] += len(new)
                    finish[b] = reason
                    if active:
                        recs = []
                        for i in range(min(n, len(new))):
                            recs.append(TokenRecord(new[i], "accepted", dp_h[b][i] if dp_h else None,
                                                    tp_h[b][i], ngen[b] - len(new) + i))
                        if len(new) > n:  # the target's own token made it in
                            st = "target" if nd_h[b] == 0 else ("bonus" if bonus_h[b] else "recovered")
                            recs.append(TokenRecord(new[n], st, None, tpn_h[b], ngen[b] - 1))
                        if n < nd_h[b]:  # the first rejected draft and the discarded ones after it
                            rej = [TokenRecord(d_h[b][i], "rejected", dp_h[b][i] if dp_h else None, tp_h[b][i],
                                               ngen[b] - len(new) + n + (i - n)) for i in range(n, nd_h[b])]
                            recs = recs[:n] + rej + recs[n:]
                        row_events.append(RowRound(b, nd_h[b], n, recs, reason is not None, reason))
                lengths.copy_(torch.tensor(hlen))  # (B,) the rollback: new per-row lengths
                cache.truncate(lengths - 1)
                if drafter is not None and prop is not None:
                    drafter.commit(ctx)
                if active:
                    _sync(dev)
                    t3 = time.perf_counter()
                    hooks.emit(RoundEvent(run_id, rnd, t3, {"draft": t1 - t0, "verify": t2 - t1, "accept": t3 - t2,
                                                            "other": t0 - t_prev}, row_events))
                yield rnd
                t_prev = time.perf_counter()
            cancelled = False
        finally:
            if active:
                now = time.perf_counter()
                hooks.emit(RunFinished(run_id, now, now - t_start, list(ngen), [f or "cancelled" for f in finish],
                                       cancelled))
        texts = [T.decode(h[n:]) for h, n in zip(host, plen)]
        yield GenerationResult(prompt_ids, [h[n:] for h, n in zip(host, plen)], texts,
                               [f or "cancelled" for f in finish])
