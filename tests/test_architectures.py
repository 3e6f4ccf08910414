"""The generic Hugging Face backend is exact on every architecture it accepts, and refuses the rest.

Tiny random-weight models of each architecture are built from transformers config classes, saved
with a character tokenizer, and loaded through ``load_model(path)`` as a user's model would be. For
each, speclab's greedy output must equal a cache-free greedy loop over the same weights (the whole
context through the model's plain forward every step, argmax of the last position: no cache, no
mask but the model's own) on every prompt: k in {0, 1, 4, 8}, batch 1 and a ragged batch of 3, with
a model draft (a perturbed copy of the target: acceptance is partial) and with prompt lookup.
Sliding windows are 8 positions and contexts are longer than 30, so the window really cuts in (a
test checks that it changes the output). Qwen2 and Qwen3 windows follow ``max_window_layers`` or an
explicit ``layer_types``; Gemma-2/3 interleave sliding and global layers and soft-cap logits.
Architectures whose cache cannot be rolled back exactly are refused at load, in one line.
"""

from __future__ import annotations

import pytest
import torch
from conftest import make_tokenizer

from speclab.drafters import ModelDrafter, PromptLookupDrafter, make_drafter
from speclab.engine import Fixed, Request, Scheduler, SpeculativeDecoder
from speclab.errors import SpeclabError
from speclab.models import load_model
from speclab.models.hf_backend import TESTED_MODEL_TYPES, HFKVCache
from speclab.testing import tiny_from_config

NEW = 24
WINDOW = 8
# lengths 11, 22, 15, 27: every context (prompt + 24 new) is more than twice the window
PROMPTS = ["hello world", "the cat sat on the mat", "abc abc abc abc", "speculative decoding works"]
RAGGED = [PROMPTS[0], PROMPTS[3], PROMPTS[2]]  # three different prompt lengths in one batch
DIMS = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=256, initializer_range=0.2)


def _config(arch: str, vocab: int, eos: int):
    """A tiny config per architecture (special ids inside the tiny vocabulary, untied heads)."""
    import transformers as tf

    ids = dict(vocab_size=vocab, eos_token_id=eos, bos_token_id=None, pad_token_id=None, tie_word_embeddings=False)
    if arch in ("llama", "llama-hf"):
        return tf.LlamaConfig(**DIMS, **ids)
    if arch == "gpt2":
        return tf.GPT2Config(n_embd=64, n_layer=2, n_head=4, n_positions=256, initializer_range=0.2, **ids)
    if arch == "qwen2":
        return tf.Qwen2Config(**DIMS, **ids)
    if arch == "qwen2-sliding":  # layer 0 full attention, layer 1 a sliding window
        return tf.Qwen2Config(**DIMS, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1, **ids)
    if arch == "qwen2-all-sliding":  # max_window_layers = 0: every layer slides
        return tf.Qwen2Config(**DIMS, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=0, **ids)
    if arch == "qwen2-layer-types":  # an explicit layer_types wins over max_window_layers: layer 0 slides
        return tf.Qwen2Config(**DIMS, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1,
                              layer_types=["sliding_attention", "full_attention"], **ids)
    if arch == "qwen3":
        return tf.Qwen3Config(**DIMS, head_dim=16, **ids)
    if arch == "qwen3-sliding":  # layer 0 full attention, layer 1 a sliding window
        return tf.Qwen3Config(**DIMS, head_dim=16, use_sliding_window=True, sliding_window=WINDOW,
                              max_window_layers=1, **ids)
    if arch == "mistral":  # every layer slides
        return tf.MistralConfig(**DIMS, sliding_window=WINDOW, **ids)
    if arch == "phi3":  # every layer slides
        return tf.Phi3Config(**DIMS, sliding_window=WINDOW, original_max_position_embeddings=256, **ids)
    if arch == "gemma2":  # sliding and full layers alternate; attention and final logit softcapping
        return tf.Gemma2Config(**DIMS, head_dim=16, sliding_window=WINDOW, **ids)
    if arch == "gemma3":  # sliding (local rotary base) then global; soft-capped attention and final logits
        return tf.Gemma3TextConfig(**DIMS, head_dim=16, sliding_window=WINDOW, attn_logit_softcapping=20.0,
                                   final_logit_softcapping=15.0,
                                   layer_types=["sliding_attention", "full_attention"], **ids)
    raise ValueError(arch)


# name -> the model_type it covers on the generic backend (None: the native Llama path)
ARCHS = {"llama": None, "llama-hf": "llama", "gpt2": "gpt2", "qwen2": "qwen2", "qwen2-sliding": "qwen2",
         "qwen2-all-sliding": "qwen2", "qwen2-layer-types": "qwen2", "qwen3": "qwen3", "qwen3-sliding": "qwen3",
         "mistral": "mistral", "phi3": "phi3", "gemma2": "gemma2", "gemma3": "gemma3_text"}
SLIDING = ("qwen2-sliding", "qwen2-all-sliding", "qwen2-layer-types", "qwen3-sliding", "mistral", "phi3", "gemma2",
           "gemma3")


def _save(path, cfg, tokenizer, seed: int, base=None, noise: float = 0.0, head_scale: float = 4.0):
    """A random model with a sharp LM head (argmax is never a near-tie) and EOS never the argmax (rows run
    their whole budget, so sliding windows matter); ``base`` + ``noise``: a perturbed copy of it."""
    return tiny_from_config(path, cfg, tokenizer, seed=seed, base_state=base.state_dict() if base is not None
                            else None, noise=noise, head_scale=head_scale, never_eos=True)


class Zoo:
    """Target, perturbed draft and unrelated draft per architecture, built on first use."""

    def __init__(self, root):
        self.root = root
        self.tok = make_tokenizer()
        self.eos = len(self.tok) - 1
        self.paths: dict[str, dict[str, str]] = {}
        self.loaded: dict[str, object] = {}
        self.refs: dict[str, dict[str, list[int]]] = {}

    def build(self, arch: str) -> dict[str, str]:
        if arch not in self.paths:
            d = self.root / arch
            cfg = _config(arch, len(self.tok), self.eos)
            tgt = _save(d / "target", cfg, self.tok, seed=0)
            _save(d / "draft", cfg, self.tok, seed=1, base=tgt, noise=0.25)
            _save(d / "far", cfg, self.tok, seed=2)
            self.paths[arch] = {p.name: str(p) for p in d.iterdir()}
        return self.paths[arch]

    def target(self, arch: str):
        if arch not in self.loaded:
            self.loaded[arch] = load_model(self.build(arch)["target"], device="cpu",
                                           backend="hf" if arch == "llama-hf" else "auto")
        return self.loaded[arch]

    def reference(self, arch: str) -> dict[str, list[int]]:
        """A cache-free greedy loop per prompt, on the very model speclab loaded."""
        if arch not in self.refs:
            self.refs[arch] = greedy_loop(self.target(arch), PROMPTS)
        return self.refs[arch]


@torch.no_grad()
def greedy_loop(lm, prompts, new: int = NEW) -> dict[str, list[int]]:
    """The definition of greedy decoding: the whole context through the model's own forward at every step (no
    cache, no attention mask of ours: the model builds its causal and sliding masks itself), argmax of the last
    position; EOS stops a row."""
    out = {}
    for p in prompts:
        ctx, gen = lm.encode(p), []
        for _ in range(new):
            logits = lm.hf_model(torch.tensor([ctx]), use_cache=False).logits[0, -1, :lm.vocab_size]  # (V,)
            tok = int(logits.argmax())
            ctx.append(tok)
            gen.append(tok)
            if tok == lm.eos_token_id:
                break
        out[p] = gen
    return out


@pytest.fixture(scope="module")
def zoo(tmp_path_factory):
    return Zoo(tmp_path_factory.mktemp("archs"))


def test_suite_covers_exactly_the_accepted_types():
    """The backend accepts exactly the model types this suite checks (no more, no fewer)."""
    assert set(TESTED_MODEL_TYPES) == {t for t in ARCHS.values() if t is not None}


@pytest.mark.parametrize("arch", list(ARCHS))
def test_loads_on_the_expected_backend(zoo, arch):
    lm = zoo.target(arch)
    assert lm.backend == ("native" if ARCHS[arch] is None else "hf")
    assert lm.config.model_type == (ARCHS[arch] or "llama")
    if arch in ("gemma2", "gemma3"):  # sdpa cannot softcap attention logits: the loader falls back to eager
        assert lm.hf_model.config._attn_implementation == "eager"


@pytest.mark.parametrize("arch", list(ARCHS))
def test_reference_is_sharp_and_windows_matter(zoo, arch):
    """The reference is a fair test: no near-ties on its greedy path, and every sliding window changes it."""
    lm, ref = zoo.target(arch), zoo.reference(arch)
    for p in PROMPTS:
        assert len(ref[p]) == NEW  # EOS is never the argmax: every row runs its whole budget
        ids = torch.tensor([lm.encode(p) + ref[p]])
        with torch.no_grad():
            logits = lm.hf_model(ids).logits[0, -NEW - 1:-1]  # (NEW, V) the logits each new token was chosen from
        top2 = logits.topk(2, -1).values
        assert (top2[:, 0] - top2[:, 1]).min() > 1e-3, p
    if arch in SLIDING:
        cfg = lm.hf_model.config
        saved, cfg.sliding_window = cfg.sliding_window, 10 ** 6
        try:
            unwindowed = greedy_loop(lm, PROMPTS)
        finally:
            cfg.sliding_window = saved
        assert any(unwindowed[p] != ref[p] for p in PROMPTS), "the window never changed the output"


def _drafter(kind: str, zoo: Zoo, arch: str, target):
    if kind == "plain":
        return None
    if kind == "ngram":
        return PromptLookupDrafter()
    if arch == "llama-hf":  # the draft on the generic backend too
        return ModelDrafter(load_model(zoo.build(arch)[kind], device="cpu", backend="hf", role="draft"),
                            target.vocab_size)
    return make_drafter(zoo.build(arch)[kind], target)


CASES = [("plain", 0)] + [(kind, k) for kind in ("draft", "ngram") for k in (1, 4, 8)]


@pytest.mark.parametrize("kind,k", CASES, ids=[f"{kind}-k{k}" for kind, k in CASES])
@pytest.mark.parametrize("arch", list(ARCHS))
def test_greedy_equals_cache_free_loop(zoo, arch, kind, k):
    """Batch 1 on every prompt and a ragged batch of 3: each row equals its own cache-free greedy loop."""
    target, ref = zoo.target(arch), zoo.reference(arch)
    drafter = _drafter(kind, zoo, arch, target)
    dec = SpeculativeDecoder(target, drafter)
    drafted = accepted = 0
    for p in PROMPTS:
        res = dec.generate([p], k=k, max_new_tokens=NEW)
        assert res.output_tokens[0] == ref[p], (arch, kind, k, p)
        drafted += res.metrics["drafted_tokens"]
        accepted += res.metrics["accepted_tokens"]
    res = dec.generate(RAGGED, k=k, max_new_tokens=NEW)
    for p, out in zip(RAGGED, res.output_tokens):
        assert out == ref[p], (arch, kind, k, "ragged", p)
    if kind != "plain":
        assert drafted > 0  # the drafter really proposed
    if kind == "draft":
        assert 0 < accepted < drafted  # partial acceptance: rollback really happened


@pytest.mark.parametrize("arch", ["llama-hf", "gpt2", "qwen2-sliding", "gemma2"])
def test_rows_join_and_leave_mid_run(zoo, arch):
    """Continuous batching on the generic backend: at most 2 rows run; as one finishes the other moves
    into its slot and a waiting request is prefilled beside the running row (its cache joins the
    running one's). Every request still equals its own greedy loop (a prefix of it: shorter budgets)."""
    target, ref = zoo.target(arch), zoo.reference(arch)
    sched = Scheduler(target, _drafter("draft", zoo, arch, target), Fixed(4), max_running=2)
    budgets = [7, NEW, 13, NEW]
    reqs = [sched.submit(Request(target.encode(p), b)) for p, b in zip(PROMPTS, budgets)]
    joined = []  # prefills of rows beside running ones, in the target's cache and the draft's
    for cache in (sched.cache, sched.drafter.cache):
        def watched(*a, _fwd=cache.forward, **kw):
            joined.append(kw["rows"].start > 0 and kw.get("valid") is not None)
            return _fwd(*a, **kw)

        cache.forward = watched
    sched.run_until_idle()
    for p, b, r in zip(PROMPTS, budgets, reqs):
        assert r.generated == ref[p][:b], (arch, p)
    assert sum(joined) >= 4  # requests really joined while another was running (2 x target and draft)


def test_hidden_states_match_native(zoo):
    """Target features (a layer's output, -1 = final normed) mean the same on both backends."""
    paths = zoo.build("llama")
    native, generic = zoo.target("llama"), load_model(paths["target"], device="cpu", backend="hf")
    ids = torch.tensor([native.encode(PROMPTS[1])[:12], native.encode(PROMPTS[3])[:12]])  # (2, 12)
    start = torch.zeros(2, dtype=torch.long)
    outs = []
    for lm in (native, generic):
        cache = lm.new_cache(2, 64)
        outs.append(cache.forward(ids, start, kv_len=12, hidden=(0, 1, -1)))
    for i in (0, 1, -1):
        torch.testing.assert_close(outs[0].hidden[i], outs[1].hidden[i], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(outs[0].logits, outs[1].logits, atol=1e-4, rtol=1e-4)


# ---------------------------------------------------------------------- positions past the model's table
def test_learned_positions_never_see_junk_positions(zoo, tmp_path):
    """GPT-2 has a learned table of n_positions. A row ending exactly at n_positions shares rounds
    with a row drafting k = 8, so the padded block reaches past the table: junk positions must be
    clamped for the model call (and stay invisible), and each row must still equal its solo run."""
    import transformers as tf

    tok = make_tokenizer()
    eos = len(tok) - 1
    P = 48
    cfg = tf.GPT2Config(n_embd=64, n_layer=2, n_head=4, n_positions=P, initializer_range=0.2, vocab_size=len(tok),
                        eos_token_id=eos, bos_token_id=None, pad_token_id=None, tie_word_embeddings=False)
    tgt = _save(tmp_path / "target", cfg, tok, seed=0)
    _save(tmp_path / "draft", cfg, tok, seed=1, base=tgt, noise=0.25)
    target = load_model(str(tmp_path / "target"), device="cpu")
    long_p, short_p = "the cat sat on the mat and the dog", "hi"
    budgets = {long_p: P - len(long_p), short_p: 40}
    refs = {p: greedy_loop(target, [p], new)[p] for p, new in budgets.items()}
    for drafter in (make_drafter(str(tmp_path / "draft"), target), PromptLookupDrafter()):
        sched = Scheduler(target, drafter, Fixed(8), max_running=2)
        reqs = [sched.submit(Request(target.encode(p), new)) for p, new in budgets.items()]
        sched.run_until_idle()
        for p, r in zip(budgets, reqs):
            assert r.generated == refs[p], p


# ---------------------------------------------------------------------- a bounded cache
def _occupied(cache: HFKVCache) -> list[int]:
    return (cache.slot_pos >= 0).sum(1).tolist()


@pytest.mark.parametrize("arch", ["llama-hf", "gemma2"])
@pytest.mark.slow
def test_cache_stays_bounded(zoo, arch):
    """A long run at k = 8 with a draft that is mostly wrong: after every round each row holds exactly
    its committed context, and no forward ever holds more than the longest context plus k + 1 slots,
    in the target's cache and in the draft's."""
    k, new = 8, 160
    target = zoo.target(arch)
    drafter = _drafter("far", zoo, arch, target)
    sched = Scheduler(target, drafter, Fixed(k), max_running=2)
    caches = {"target": sched.cache, "draft": drafter.cache}
    assert all(isinstance(c, HFKVCache) for c in caches.values())
    peak = {name: 0 for name in caches}
    for name, cache in caches.items():
        fwd = cache.forward

        def watched(*a, _fwd=fwd, _name=name, _cache=cache, **kw):
            out = _fwd(*a, **kw)
            peak[_name] = max(peak[_name], _cache.slot_pos.shape[1])
            return out

        cache.forward = watched
    reqs = [sched.submit(Request(target.encode(p), new)) for p in ("hello world", "abc abc abc abc abc")]
    rounds = 0
    while not sched.idle:
        sched.step()
        rounds += 1
        ctx = [len(r.context) for r in sched.rows]
        if not ctx:
            break
        # the target holds every position but the newest token's; the draft at most as much
        assert _occupied(sched.cache) == [c - 1 for c in ctx]
        assert sched.cache.slot_pos.shape[1] == max(ctx) - 1
        assert all(o <= c - 1 for o, c in zip(_occupied(drafter.cache), ctx))
        assert drafter.cache.slot_pos.shape[1] <= max(ctx) - 1
    assert all(r.finish_reason == "length" and len(r.generated) == new for r in reqs)
    longest = max(len(r.prompt_ids) for r in reqs) + new
    assert peak["target"] <= longest + k + 1 and peak["draft"] <= longest + k + 1
    drafted = sum(r.drafted for r in reqs)
    accepted = sum(r.accepted for r in reqs)
    assert rounds > 20 and accepted < 0.5 * drafted  # long, and mostly rejected: rollback every round


# ---------------------------------------------------------------------- refused at load
def _save_config(path, cfg):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(path)
    make_tokenizer().save_pretrained(path)
    return str(path)


def test_refuses_recurrent_and_hybrid(tmp_path):
    import transformers as tf

    V = len(make_tokenizer())
    mamba = _save_config(tmp_path / "tiny-mamba", tf.MambaConfig(vocab_size=V, hidden_size=32, state_size=4,
                                                                 num_hidden_layers=2, expand=2, conv_kernel=4))
    with pytest.raises(SpeclabError, match=r"tiny-mamba' \(mamba\).*recurrent") as e:
        load_model(mamba, device="cpu")
    assert "\n" not in str(e.value)
    hybrid = _save_config(tmp_path / "tiny-jamba", tf.JambaConfig(
        vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1,
        num_experts=2, mamba_d_state=4, mamba_d_conv=4, mamba_expand=2, mamba_dt_rank=4,
        pad_token_id=None, bos_token_id=None, eos_token_id=V - 1))
    with pytest.raises(SpeclabError, match=r"tiny-jamba' \(jamba\).*recurrent") as e:
        load_model(hybrid, device="cpu")
    assert "\n" not in str(e.value)


def test_refuses_untested_types_and_batch_dependent_rope(tmp_path):
    import transformers as tf

    V = len(make_tokenizer())
    path = _save_config(tmp_path / "tiny-neox", tf.GPTNeoXConfig(
        vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=64, bos_token_id=None, eos_token_id=V - 1, pad_token_id=None))
    with pytest.raises(SpeclabError, match=r"tiny-neox' \(gpt_neox\).*not in speclab's exactness suite"):
        load_model(path, device="cpu")
    # a tested type with a batch-dependent rotary scaling is refused too
    cfg = tf.Phi3Config(**{**DIMS, "max_position_embeddings": 512}, original_max_position_embeddings=256,
                        vocab_size=V, eos_token_id=V - 1, bos_token_id=None, pad_token_id=None,
                        rope_parameters={"rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8,
                                         "rope_theta": 10000.0})
    path = _save_config(tmp_path / "tiny-phi3-long", cfg)
    with pytest.raises(SpeclabError, match=r"tiny-phi3-long' \(phi3\).*longrope"):
        load_model(path, device="cpu")


@pytest.mark.parametrize("arch", ["llama", "llama-hf", "gpt2", "qwen2-sliding"])
def test_draft_taken_in_late_beside_a_lagging_row(zoo, arch):
    """Rows reach the draft's cache at different times: a row that ran plain rounds lags by many tokens while a row
    that moved into a finished row's slot is taken in late, ahead of a row already held (so the generic backend's
    cache gets a row that is not its newest). Each draft's first token equals the draft model's own greedy choice
    on the row's whole context, computed afresh, and every request equals its greedy loop."""
    from speclab.engine.policies import Choice

    class Script:  # round 1: draft (rows taken in); 2-9: plain (rows lag); then draft again
        name, k_max = "script", 2

        def __init__(self):
            self.rounds = 0

        def choose(self, view):
            self.rounds += 1
            return [Choice(2 if self.rounds == 1 or self.rounds > 9 else 0, "test")] * len(view.rows)

        def draft_stop(self):
            return None

    target, ref = zoo.target(arch), zoo.reference(arch)
    drafter = _drafter("draft", zoo, arch, target)
    lm = drafter.lm
    checked = []
    real = drafter.propose

    def propose(ctx, ks, *a, **kw):
        want = []
        for b in range(ctx.n):
            ids = torch.tensor([ctx.host[b]])
            cache = lm.new_cache(1, ids.shape[1] + 1)
            out = cache.forward(ids, torch.zeros(1, dtype=torch.long), kv_len=ids.shape[1], rows=slice(0, 1),
                                last_only=torch.tensor([ids.shape[1] - 1]))
            top = out.logits[0, -1, :target.vocab_size].topk(2)
            want.append((int(top.indices[0]), float(top.values[0] - top.values[1])))
        prop = real(ctx, ks, *a, **kw)
        for b, (tok, margin) in enumerate(want):
            if ks[b] > 0 and margin > 1e-3:
                checked.append((ctx.request_ids[b], int(prop.tokens[b, 0]) == tok))
        return prop

    drafter.propose = propose
    sched = Scheduler(target, drafter, Script(), max_running=4)
    budgets = [5, NEW, NEW, NEW]
    reqs = [Request(target.encode(p), b, request_id=str(i)) for i, (p, b) in enumerate(zip(PROMPTS, budgets))]
    for r in reqs[:2]:
        sched.submit(r)
    sched.step()  # rows 0 and 1 prefilled and taken into the draft
    for r in reqs[2:]:
        sched.submit(r)  # rows 2 and 3 join during the plain rounds; when 0 finishes, 3 moves into its slot
    sched.run_until_idle()
    for p, b, r in zip(PROMPTS, budgets, reqs):
        assert r.generated == ref[p][:b], (arch, p)
    assert all(r.history[0] == (0, 0) and r.drafted > 0 for r in reqs[2:])  # taken in late
    assert {i for i, _ in checked} >= {"1", "2", "3"} and all(ok for _, ok in checked), checked
