"""Self-drafting heads and early exit: greedy identity with every new drafter, chain and tree (random
heads on the tiny target for structure, the shipped heads on the shipped family), the features a head
reads (no extra forward), the training-time-test mask, a short training run end to end, and refusals."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from conftest import PROMPTS

from speclab.drafters import make_drafter
from speclab.drafters.heads import MODULES, HeadConfig, save_head, target_fingerprint
from speclab.engine import SpeculativeDecoder
from speclab.errors import SpeclabError

NEW = 20


def _config(lm, kind, **kw):
    c = lm.config
    return HeadConfig(kind=kind, hidden=lm.hidden_size, vocab=lm.vocab_size, eps=c.rms_norm_eps, n_heads=3,
                      feature_layers=(0, -1), attn_heads=c.num_attention_heads, kv_heads=c.num_key_value_heads,
                      head_dim=lm.hidden_size // c.num_attention_heads, ffn=2 * lm.hidden_size, exit_layer=1,
                      target="tiny", target_fingerprint=target_fingerprint(lm), **kw)


@pytest.fixture(scope="module")
def random_heads(tmp_path_factory, target_lm):
    """An untrained head of each kind (weights perturbed off their identity init) saved like shipped ones."""
    root = tmp_path_factory.mktemp("heads")
    out = {}
    for kind in ("eagle", "medusa", "exit"):
        cfg = _config(target_lm, kind)
        torch.manual_seed(1)
        module = MODULES[kind](cfg)
        with torch.no_grad():
            for p in module.parameters():
                p.add_(torch.randn_like(p) * 0.05)
        save_head(module, cfg, root / kind)
        out[kind] = str(root / kind)
    return out


@pytest.fixture(scope="module")
def plain_out(target_lm):
    dec = SpeculativeDecoder(target_lm, None)
    return {p: dec.generate([p], k=0, max_new_tokens=NEW).output_tokens[0] for p in PROMPTS}


SPECS = ["eagle", "eagle:tree=dynamic:width=2", "eagle:tree=static:branch=2-1",
         "medusa", "medusa:tree=dynamic", "medusa:tree=static:branch=3-2-1", "early-exit:1", "early-exit:1:tuned"]


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("k", [1, 4])
def test_heads_greedy_identity_tiny(target_lm, random_heads, plain_out, spec, k):
    kind = "exit" if spec.startswith("early") else spec.split(":")[0]
    extra = f":head={random_heads[kind]}" if (kind != "exit" or "tuned" in spec) else ""
    dec = SpeculativeDecoder(target_lm, make_drafter(spec.replace(":tuned", "") + extra, target_lm))
    for i in range(0, 9, 3):
        batch = PROMPTS[i:i + 3]
        res = dec.generate(batch, k=k, max_new_tokens=NEW)
        for p, out in zip(batch, res.output_tokens):
            assert out == plain_out[p], (spec, k, p)
        assert res.metrics["drafted_tokens"] > 0


def test_heads_sampled_rows_mixed_with_greedy(target_lm, random_heads):
    """A sampled batch runs (chain: sampled drafts with their distributions; tree: one-hot candidates) and is
    reproducible from its seeds."""
    for spec in ("eagle", "eagle:tree=dynamic", "medusa", "medusa:tree=static"):
        d = make_drafter(f"{spec}:head={random_heads[spec.split(':')[0]]}", target_lm)
        dec = SpeculativeDecoder(target_lm, d)
        a = dec.generate(PROMPTS[:3], k=4, max_new_tokens=12, temperature=0.9, seed=5)
        b = dec.generate(PROMPTS[:3], k=4, max_new_tokens=12, temperature=0.9, seed=5)
        assert a.output_tokens == b.output_tokens


def test_eagle_reads_features_from_the_verify_forward(target_lm, random_heads):
    """The head asks for its feature layers; the scheduler hands them over with no extra target forward:
    one target forward per round (counted on the cache), and the head's cache length trails the row by one."""
    d = make_drafter(f"eagle:head={random_heads['eagle']}", target_lm)
    assert d.features == (0, -1)
    dec = SpeculativeDecoder(target_lm, d)
    from speclab.models.native_llama import StaticKVCache

    calls = []
    orig = StaticKVCache.forward

    def counting(self, tokens, start, **kw):
        calls.append(kw.get("hidden"))
        return orig(self, tokens, start, **kw)

    StaticKVCache.forward = counting
    try:
        res = dec.generate(["hello world"], k=3, max_new_tokens=NEW)
    finally:
        StaticKVCache.forward = orig
    rounds = sum(1 for ev in res.recorder.rounds if ev.phase == "verify")
    assert len(calls) == rounds + 1  # the prefill and one verification per round, each with the features
    assert all(h == (0, -1) for h in calls)
    # the head's cache holds positions < hlen; the target's features of the rest are pending
    assert d.hlen[0] + d.pend_len[0] == len(res.requests[0].context)


def test_ttt_mask_matches_the_drafting_chain():
    from speclab.family.heads import ttt_mask

    m = ttt_mask(4, 1).int().tolist()
    assert m == [[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 1, 1]]
    m = ttt_mask(4, 3).int()  # (4, 12): [step 1 | step 2 | step 3]
    # query at p = 3, step 3: true keys 0..1, its step-2 key at 2, its step-3 key at 3
    assert m[3, :4].tolist() == [1, 1, 0, 0]
    assert m[3, 4:8].tolist() == [0, 0, 1, 0] and m[3, 8:].tolist() == [0, 0, 0, 1]
    assert bool(m.any(1).all())  # every query sees at least itself


def test_short_training_run_gives_a_working_head(tmp_path, target_lm, plain_out):
    """train_head end to end on the tiny target (a few steps): it saves a head that loads and drafts exactly."""
    from speclab.family.data import Data
    from speclab.family.heads import HeadSpec, HeadTrainConfig, train_head

    rng = np.random.default_rng(0)
    V = target_lm.vocab_size
    stream = rng.integers(0, V, 4000).astype(np.uint16)
    data = Data(stream, stream[:600], {}, None, None)
    cfg = HeadTrainConfig(out_dir=tmp_path / "out", runs_dir=tmp_path / "runs", eval_tokens=64, log_every=1000)
    hf = target_lm.hf_model
    fp = target_fingerprint(target_lm)
    for kind in ("eagle", "medusa", "exit"):
        spec = HeadSpec(f"tiny-{kind}", kind, tokens=4 * 32 * 3, lr=1e-3, batch=4, seq=32, warmup=1,
                        feature_layers=(0, -1), ttt=2, n_heads=2, exit_layer=1, copy_schedule=(), code_schedule=())
        entry = train_head(spec, cfg, hf, data, fp, log=lambda s: None)
        assert entry["steps"] == 3
        assert len(entry["heldout_top1_agreement"]) == {"eagle": 2, "medusa": 2, "exit": 1}[kind]
        name = "early-exit:1" if kind == "exit" else kind
        d = make_drafter(f"{name}:head={tmp_path / 'out' / spec.name}", target_lm)
        out = SpeculativeDecoder(target_lm, d).generate(PROMPTS[:2], k=3, max_new_tokens=NEW).output_tokens
        assert out == [plain_out[p] for p in PROMPTS[:2]]


def test_short_eagle3_training_writes_a_speculators_head(tmp_path, target_lm, plain_out):
    """The eagle3 kind trains EAGLE-3's own layer (per-feature norms before fc, the target's LM head frozen) and
    writes a speculators directory that speclab drafts from exactly; other target weights are refused."""
    import json

    from safetensors.torch import load_file

    from speclab.family.data import Data
    from speclab.family.heads import HeadSpec, HeadTrainConfig, train_head

    rng = np.random.default_rng(0)
    stream = rng.integers(0, target_lm.vocab_size, 4000).astype(np.uint16)
    data = Data(stream, stream[:600], {}, None, None)
    cfg = HeadTrainConfig(out_dir=tmp_path / "out", runs_dir=tmp_path / "runs", eval_tokens=64, log_every=1000)
    spec = HeadSpec("tiny-eagle3", "eagle3", tokens=4 * 32 * 3, lr=1e-3, batch=4, seq=32, warmup=1,
                    feature_layers=(0, 1, 1), ttt=2, copy_schedule=(), code_schedule=())
    hf = target_lm.hf_model
    lm_before = hf.lm_head.weight.detach().clone()
    entry = train_head(spec, cfg, hf, data, target_fingerprint(target_lm), log=lambda s: None)
    assert entry["steps"] == 3 and len(entry["heldout_top1_agreement"]) == 2
    d = tmp_path / "out" / "tiny-eagle3"
    conf = json.loads((d / "config.json").read_text())
    assert conf["fc_norm"] is True and conf["eagle_aux_hidden_state_layer_ids"] == [1, 2, 2]
    w = load_file(str(d / "model.safetensors"))
    assert {"fc_norm.0.weight", "fc_norm.2.weight"} <= set(w)
    assert "d2t" not in w and "t2d" not in w  # the whole vocabulary: vLLM refuses an identity d2t
    assert torch.equal(w["lm_head.weight"], lm_before)
    assert not torch.equal(w["fc_norm.0.weight"], torch.ones_like(w["fc_norm.0.weight"]))  # trained: fuse uses them
    out = SpeculativeDecoder(target_lm, make_drafter(str(d), target_lm)).generate(PROMPTS[:2], k=3,
                                                                                  max_new_tokens=NEW).output_tokens
    assert out == [plain_out[p] for p in PROMPTS[:2]]
    (d / "speclab.json").write_text(json.dumps({"target_fingerprint": "0" * 16}))
    with pytest.raises(SpeclabError, match="trained on other weights") as e:
        make_drafter(str(d), target_lm)
    assert "\n" not in str(e.value)


def test_refusals(tmp_path, target_lm, random_heads, tiny):
    with pytest.raises(SpeclabError, match="no trained head"):
        make_drafter("eagle:head=/nonexistent/dir", target_lm)
    with pytest.raises(SpeclabError, match="not medusa"):
        make_drafter(f"medusa:head={random_heads['eagle']}", target_lm)
    from speclab.models import load_model

    other = load_model(tiny["draft_close"], device="cpu")  # same shapes, other weights
    with pytest.raises(SpeclabError, match="trained on target"):
        make_drafter(f"eagle:head={random_heads['eagle']}", other)
    hf = load_model(tiny["target"], device="cpu", backend="hf")
    with pytest.raises(SpeclabError, match="native backend"):
        make_drafter("early-exit:1", hf)
    with pytest.raises(SpeclabError, match="does not take"):
        make_drafter(f"eagle:head={random_heads['eagle']}:colour=red", target_lm)
    cfg = dataclasses.replace(_config(target_lm, "eagle"), hidden=32)
    save_head(MODULES["eagle"](cfg), cfg, tmp_path / "small")
    with pytest.raises(SpeclabError, match="hidden size"):
        make_drafter(f"eagle:head={tmp_path / 'small'}", target_lm)


# ----------------------------------------------------------------------------------------------- shipped
def _shipped():
    from speclab.drafters.heads import head_dir
    from speclab.nb import family_available

    return family_available("target") and all(head_dir(h) is not None for h in ("eagle", "medusa", "exit-3"))


@pytest.mark.skipif(not _shipped(), reason="the shipped heads are not trained yet")
def test_shipped_heads_greedy_identity():
    from speclab.analysis.sweep import cached_model
    from speclab.workloads import load_workload

    target = cached_model("target", device="cpu", role="target")
    prompts = [load_workload("code")[0].prompt, load_workload("json")[0].prompt]
    ref = SpeculativeDecoder(target, None).generate(prompts, k=0, max_new_tokens=24).output_tokens
    for spec in ("eagle", "eagle:tree=dynamic:nodes=8", "eagle3", "eagle+suffix:head=eagle3", "medusa",
                 "medusa:tree=dynamic", "early-exit", "early-exit:3:tuned"):
        res = SpeculativeDecoder(target, make_drafter(spec, target)).generate(prompts, k=6, max_new_tokens=24)
        assert res.output_tokens == ref, spec
        assert res.metrics["accepted_tokens"] > 0, spec  # trained heads do get tokens accepted


@pytest.mark.slow
@pytest.mark.parametrize("spec", ["eagle", "medusa", "early-exit:1"])
def test_head_chain_samples_follow_target_distribution(target_lm, random_heads, monkeypatch, spec):
    """Sampled chains from the heads (drafts drawn from the head's own distributions, which the rule is
    given) keep the target's exact second-token marginal; the chain rule that samples from the target on a
    rejection (instead of the residual) fails the same test."""
    from test_acceptance import sample_from_target_on_rejection
    from test_trees import chi2, chi2_quantile, second_token_dist

    import speclab.engine.scheduler as scheduler

    temperature, n, prompt = 1.0, 6000, "hello wor"
    exact = second_token_dist(target_lm, prompt, temperature)
    kind = spec.split(":")[0]
    head = "" if kind == "early-exit" else f":head={random_heads[kind]}"

    def empirical():
        dec = SpeculativeDecoder(target_lm, make_drafter(spec + head, target_lm))
        res = dec.generate([prompt] * n, k=2, max_new_tokens=3, temperature=temperature, seed=0, record=False,
                           stop_on_eos=False)
        return torch.bincount(torch.tensor([o[1] for o in res.output_tokens]), minlength=target_lm.vocab_size
                              ).double() / n

    stat, dof = chi2(empirical(), exact, n)
    assert stat < chi2_quantile(dof, 3.09), (spec, stat, dof)
    monkeypatch.setattr(scheduler, "rejection_impl", lambda device: sample_from_target_on_rejection)
    stat_bad, dof = chi2(empirical(), exact, n)
    assert stat_bad > chi2_quantile(dof, 5.0), (spec, stat_bad, dof)


def test_bench_heads_smoke(tiny, tmp_path, capsys):
    """`speclab bench heads` end to end on the tiny target (heads trained on other weights are left out):
    a table, the targets, a JSON report with every method identical to plain decoding."""
    import json

    from speclab.cli import main

    out = tmp_path / "heads.json"
    rc = main(["bench", "heads", "--target", tiny["target"], "--workload", "json",  # default prompts and reps
               "--max-new-tokens", "6", "--budget", "3", "--k", "2", "--threads", "1", "--quiet",
               "--out", str(tmp_path)])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "ngram tree 3" in printed and "all_identical" in printed
    rep = json.loads(out.read_text())
    names = {r["method"] for r in rep["rows"]}
    assert {"plain", "early-exit k=2", "ngram chain 3", "ngram tree 3"} <= names and "eagle k=2" not in names
    assert all(r["identical"] for r in rep["rows"]) and rep["targets"]["all_identical"]["met"]
    assert all(r["cost_per_round_ms"] > 0 for r in rep["rows"])
    assert (rep["prompts_per_workload"], rep["reps"]) == (4, 3)  # --heads' own defaults, not --compare's


def test_bench_heads_targets_from_rows():
    from speclab.analysis.bench_heads import targets

    def row(method, w, length, cost, speedup, group="", pair="", k=4):
        return dict(method=method, workload=w, mean_accepted_length=length, cost_per_round_ms=cost, speedup=speedup,
                    group=group, pair=pair, k=k, identical=True)

    rows = [row("eagle k=4", "json", 3.0, 5.0, 1.6), row("draft-distill k=4", "json", 3.1, 9.0, 1.2),
            row("draft-xs-distill k=4", "json", 2.9, 6.0, 1.4), row("eagle k=4", "code", 3.5, 5.0, 1.55),
            row("draft-distill k=4", "code", 2.5, 9.0, 0.9), row("draft-xs-distill k=4", "code", 2.0, 6.0, 1.0),
            row("eagle chain 8", "code", 4.0, 8.0, 1.4, "chain", "eagle", 8),
            row("eagle tree 8", "code", 4.2, 8.5, 1.45, "tree", "eagle", 8),
            row("eagle chain 8", "json", 4.0, 8.0, 1.4, "chain", "eagle", 8),
            row("eagle tree 8", "json", 4.0, 8.5, 1.45, "tree", "eagle", 8)]
    t = targets(rows, ["json", "code"], 4, 8)
    assert not t["eagle_len_json"]["met"] and t["eagle_round_cost_json"]["met"]  # 3.0 < 3.1, 5 ms < 9 ms
    assert t["eagle_len_code"]["met"] and t["eagle_speedup_code"]["met"]
    assert t["eagle_speedup_code"]["method"] == "eagle k=4"
    assert not t["tree_beats_chain_eagle"]["met"]  # a tie on json is not a win


@pytest.mark.parametrize("spec", ["eagle", "medusa", "early-exit:1", "eagle:tree=dynamic"])
def test_heads_under_adaptive_policies(target_lm, random_heads, plain_out, spec):
    """The policies treat the new drafters like any other: a confidence stop inside the draft, and the
    per-row k of an adaptive policy (a tree's node budget), still exactly plain decoding."""
    kind = spec.split(":")[0]
    head = f":head={random_heads[kind]}" if kind in random_heads else ""
    dec = SpeculativeDecoder(target_lm, make_drafter(spec + head, target_lm))
    for policy in ("confidence", "ema", "heuristic"):
        res = dec.generate(PROMPTS[:3], k=4, max_new_tokens=NEW, policy=policy)
        assert res.output_tokens == [plain_out[p] for p in PROMPTS[:3]], (spec, policy)


class Alternating:
    """k = 0 every other round for every row: rounds without drafts, whose features the drafters must
    still receive (EAGLE's pending features grow over them)."""

    name = "alternating"
    k_max = 3

    def __init__(self):
        self.calls = 0

    def choose(self, view):
        from speclab.engine import Choice

        self.calls += 1
        k = 0 if self.calls % 2 else 3
        return [Choice(k, f"alternating k={k}")] * len(view.rows)

    def draft_stop(self):
        return None


@pytest.mark.parametrize("spec", ["eagle", "eagle:tree=dynamic", "medusa"])
def test_rounds_without_drafts_keep_feature_drafters_in_step(target_lm, random_heads, plain_out, spec):
    d = make_drafter(f"{spec}:head={random_heads[spec.split(':')[0]]}", target_lm)
    res = SpeculativeDecoder(target_lm, d).generate(PROMPTS[3:6], k=3, max_new_tokens=NEW, policy=Alternating())
    assert res.output_tokens == [plain_out[p] for p in PROMPTS[3:6]]
    ks = [rr.k for ev in res.recorder.rounds if ev.phase == "verify" for rr in ev.rows]
    assert 0 in ks and 3 in ks


# ----------------------------------------------------------------------------------------------- speculators
def _eagle3(target_lm, draft_vocab: int):
    from speclab.drafters.speculators import random_eagle3

    head, cfg = random_eagle3(target_lm, (0, 1, 1), draft_vocab=draft_vocab, ffn=96, seed=3, scale=1.0)
    Vd = head.lm_head.weight.shape[0]
    with torch.no_grad():  # draft id i is target id 2i: the mapping really maps
        head.d2t.copy_(torch.arange(Vd))
        head.t2d.zero_()
        head.t2d[2 * torch.arange(Vd)] = True
    return head, cfg


def test_eagle3_speculators_round_trip(target_lm, tmp_path):
    """An EAGLE-3 head written in the speculators layout reads back identically, drafts through speclab's EAGLE
    drafter from a draft vocabulary mapped into the target's, and decodes exactly the target's greedy output."""
    import json

    from safetensors.torch import load_file

    from speclab.drafters.speculators import is_speculators_dir, load_speculators, save_speculators

    V = target_lm.vocab_size
    head, cfg = _eagle3(target_lm, draft_vocab=V // 2)
    d = save_speculators(head, cfg, tmp_path / "eagle3", verifier="tiny/target", verifier_architectures=["Llama"],
                         num_target_layers=2)
    conf = json.loads((d / "config.json").read_text())
    assert conf["speculators_model_type"] == "eagle3" and conf["draft_vocab_size"] == V // 2
    assert conf["eagle_aux_hidden_state_layer_ids"] == [1, 2, 2]
    assert conf["transformer_layer_config"]["num_hidden_layers"] == 1
    assert conf["speculators_config"]["verifier"]["name_or_path"] == "tiny/target"
    names = set(load_file(str(d / "model.safetensors")))
    assert {"fc.weight", "layers.0.self_attn.q_proj.weight", "layers.0.hidden_norm.weight", "lm_head.weight",
            "d2t", "t2d", "norm.weight"} <= names
    assert is_speculators_dir(d)

    back, cfg2 = load_speculators(d, target_lm)
    assert cfg2.feature_layers == cfg.feature_layers and cfg2.hidden == cfg.hidden
    for k, v in head.state_dict().items():
        assert torch.equal(back.state_dict()[k], v), k

    drafter = make_drafter(str(d), target_lm)
    assert drafter.name == "eagle3"
    prompts = PROMPTS[:3]
    ref = SpeculativeDecoder(target_lm, None).generate(prompts, k=0, max_new_tokens=NEW).output_tokens
    proposed = []
    real = drafter.propose

    def watch(ctx, ks, *a, **kw):
        prop = real(ctx, ks, *a, **kw)
        proposed.extend(prop.tokens[prop.tokens >= 0].tolist())
        return prop

    drafter.propose = watch
    res = SpeculativeDecoder(target_lm, drafter).generate(prompts, k=4, max_new_tokens=NEW)
    assert res.output_tokens == ref
    assert proposed and all(t % 2 == 0 for t in proposed)  # only ids the draft vocabulary maps to


def _eagle3_reference(head, feats, emb, cos, sin) -> list[torch.Tensor]:
    """EAGLE-3's layer written out with one nn.Linear call per projection, as vLLM's llama_eagle3 has it."""
    import torch.nn.functional as F

    from speclab.drafters.heads import rms, rope

    c = head.cfg
    n, T, _ = emb.shape
    g = head.fc(torch.cat([rms(f, c.eps, w) for f, w in zip(feats, head.fc_norm)], -1))
    gn = rms(g, c.eps, head.hidden_norm)
    x = torch.cat([rms(emb, c.eps, head.input_layernorm), gn], -1)
    q = rope(head.q_proj(x).view(n, T, c.attn_heads, c.head_dim).transpose(1, 2), cos, sin)
    k = rope(head.k_proj(x).view(n, T, c.kv_heads, c.head_dim).transpose(1, 2), cos, sin)
    v = head.v_proj(x).view(n, T, c.kv_heads, c.head_dim).transpose(1, 2)
    y = F.scaled_dot_product_attention(q, k, v, enable_gqa=c.kv_heads != c.attn_heads)
    h = g + head.o_proj(y.transpose(1, 2).reshape(n, T, -1))
    z = rms(h, c.eps, head.post_attention_layernorm)
    h = h + head.down_proj(F.silu(head.gate_proj(z)) * head.up_proj(z))
    return [g, q, k, v, h, head.lm_head(rms(h, c.eps, head.norm))]


def test_eagle3_matmuls_compute_the_published_layer(target_lm):
    """Eagle3Head fuses q/k/v and gate/up into one matmul each (after freeze(): transposed, and packed where the
    few-row kernel runs): before and after freeze, every output is what one nn.Linear per projection gives."""
    from speclab.drafters.heads import rope_tables
    from speclab.drafters.speculators import Eagle3Head

    base, cfg = _eagle3(target_lm, draft_vocab=target_lm.vocab_size // 2)
    head = Eagle3Head(cfg, base.lm_head.weight.shape[0], fc_norm=True)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in head.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
        head.d2t.copy_(base.d2t)
    C, T = cfg.hidden, 5
    feats = [torch.randn(1, T, C, generator=g) for _ in cfg.feature_layers]
    emb = torch.randn(1, T, C, generator=g)
    cos, sin = rope_tables(cfg.head_dim, cfg.rope_theta, T)
    ids = torch.arange(head.lm_head.weight.shape[0]) + head.d2t

    def run():
        gg = head.fuse(feats)
        x, q, k, v = head.qkv(emb, gg, cos, sin)
        h = head.finish(x, q, k, v, None)
        return [gg, q, k, v, h, head.logits(h)[..., ids]]

    with torch.no_grad():
        ref = _eagle3_reference(head, feats, emb, cos, sin)
        for frozen in (False, True):
            if frozen:
                head.freeze()
            for name, a, b in zip(("g", "q", "k", "v", "h", "logits"), ref, run()):
                torch.testing.assert_close(b, a, atol=1e-4, rtol=1e-4, msg=f"{name} (frozen: {frozen})")


@pytest.mark.skipif(not _shipped(), reason="the shipped heads are not trained yet")
def test_the_family_eagle3_head_round_trips_through_the_speculators_format(tmp_path):
    """The shipped EAGLE-3 head reads back from the speculators directory vLLM serves and writes out to the same
    config and weights (no d2t / t2d: it covers the whole vocabulary)."""
    import json

    from safetensors.torch import load_file

    from speclab.analysis.sweep import cached_model
    from speclab.drafters.heads import HEADS_DIR
    from speclab.drafters.speculators import load_speculators, save_speculators, speculators_dir

    if speculators_dir("eagle3") is None:
        pytest.skip("the family's EAGLE-3 head is not shipped")
    target = cached_model("target", device="cpu", role="target")
    src = HEADS_DIR / "eagle3"
    head, cfg = load_speculators(src, target)
    conf = json.loads((src / "config.json").read_text())
    out = save_speculators(head.half(), cfg, tmp_path / "eagle3", verifier="target",
                           verifier_architectures=conf["speculators_config"]["verifier"]["architectures"],
                           num_target_layers=conf["num_target_layers"], speculative_tokens=4)
    assert json.loads((out / "config.json").read_text()) == conf
    a, b = load_file(str(src / "model.safetensors")), load_file(str(out / "model.safetensors"))
    assert set(a) == set(b) and "d2t" not in a and all(torch.equal(a[k], b[k]) for k in a)


def test_speculators_refusals_are_one_line(target_lm, tmp_path):
    import json

    from speclab.drafters.heads import EagleHead
    from speclab.drafters.speculators import load_speculators, save_speculators

    head, cfg = _eagle3(target_lm, draft_vocab=target_lm.vocab_size // 2)
    d = save_speculators(head, cfg, tmp_path / "ok", num_target_layers=2)
    conf = json.loads((d / "config.json").read_text())
    bad = {"kind": {**conf, "speculators_model_type": "medusa"},
           "layers": {**conf, "eagle_aux_hidden_state_layer_ids": [1, 2, 9]},
           "width": {**conf, "transformer_layer_config": {**conf["transformer_layer_config"], "hidden_size": 32,
                                                          "num_attention_heads": 2}}}
    want = {"kind": "'medusa'; speclab loads eagle3", "layers": "reads target layers", "width": "hidden size 32"}
    for name, c in bad.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(c))
        (tmp_path / name / "model.safetensors").write_bytes((d / "model.safetensors").read_bytes())
        with pytest.raises(SpeclabError, match=want[name]) as e:
            load_speculators(tmp_path / name, target_lm)
        assert "\n" not in str(e.value)
    # the family's own EAGLE head computes something EAGLE-3 weights cannot: refused, not written lossily
    own = EagleHead(_config(target_lm, "eagle"))
    with pytest.raises(SpeclabError, match="RMS normalisation is not linear") as e:
        save_speculators(own, own.cfg, tmp_path / "family")
    assert "\n" not in str(e.value) and not (tmp_path / "family").exists()


def test_self_generated_rows_are_the_targets_greedy_text(tmp_path, target_lm):
    """Each self-generated row is a prompt cut from a source, then the target's own greedy continuation (what
    a solo greedy decode of that prompt gives, end-of-text not stopping it); the rows are built once and read
    back from the cache after."""
    from speclab.family.selfgen import PROMPT_TOKENS, self_generated

    rng = np.random.default_rng(0)
    V = target_lm.vocab_size
    sources = [rng.integers(0, V, 3000).astype(np.uint16), rng.integers(0, V, 3000).astype(np.uint16)]
    hf = target_lm.hf_model
    seq = PROMPT_TOKENS[1] + 12
    rows = self_generated(hf, sources, 6, seq, 0, tmp_path, "fp", batch=4, log=None)
    assert rows.shape == (6, seq + 1) and rows.dtype == np.uint16
    for i, row in enumerate(rows):
        head = row[:PROMPT_TOKENS[0]].tobytes()
        assert head in sources[i // 4].tobytes()  # cut from its batch's source (one per batch, in turn)
        ids = torch.from_numpy(row[:PROMPT_TOKENS[1]].astype(np.int64))[None]  # at least the whole prompt
        with torch.no_grad():  # greedy without a cache, one token at a time
            while ids.shape[1] < seq + 1:
                ids = torch.cat([ids, hf(input_ids=ids).logits[:, -1].argmax(-1, keepdim=True)], 1)
        assert ids[0].tolist() == row.tolist()
    cached = list(tmp_path.glob("selfgen-*.npy"))
    assert len(cached) == 1
    np.save(cached[0], np.zeros_like(rows))  # a second call reads the cache, builds nothing
    assert not self_generated(hf, sources, 6, seq, 0, tmp_path, "fp", batch=4, log=None).any()
    assert self_generated(hf, sources, 6, seq, 1, tmp_path, "fp", batch=4, log=None).any()  # another seed: built


def test_head_batches_mix_in_self_generated_rows():
    """A head's batch: copy rows, code rows, general rows, and the self-generated rows last, by the spec's shares."""
    from speclab.family.data import Data
    from speclab.family.heads import HeadSpec, _batch

    general = np.full(5000, 1, dtype=np.uint16)
    data = Data(general, general[:100], {}, np.full(5000, 2, dtype=np.uint16), np.full(5000, 3, dtype=np.uint16))
    data.selfgen = np.full((10, 33), 4, dtype=np.uint16)
    spec = HeadSpec("t", "eagle", tokens=1, lr=1e-3, batch=8, seq=32, copy_schedule=((0, 0.25),),
                    code_schedule=((0, 0.125),), self_schedule=((0, 0.5),), self_rows=10)
    x = _batch(spec, data, 0, 0)
    assert x.shape == (8, 32)
    assert x[:, 0].tolist() == [2, 2, 3, 1, 4, 4, 4, 4]
    data.selfgen = None  # no rows built: the general stream fills in
    assert _batch(spec, data, 0, 0)[:, 0].tolist() == [2, 2, 3, 1, 1, 1, 1, 1]


def test_other_head_recipes_train_only_when_named():
    """A bare `speclab train --heads` trains the shipped heads; the other recipes only by name; the shipped
    heads' recorded spec keys still name their specs."""
    import json

    from speclab.family import MANIFEST
    from speclab.family.heads import HEAD_SPECS, RECIPE_SPECS, specs_to_train

    assert specs_to_train(None) == HEAD_SPECS
    assert [s.name for s in specs_to_train(["eagle-selfgen"])] == ["eagle-selfgen"]
    assert [s.name for s in specs_to_train(["eagle", "eagle-packages"])] == ["eagle", "eagle-packages"]
    with pytest.raises(SystemExit, match="unknown head"):
        specs_to_train(["eagle-nope"])
    shipped = {h["name"]: h["spec_key"] for h in json.loads(MANIFEST.read_text())["heads"]}
    assert {s.name: s.key() for s in HEAD_SPECS} == shipped
    assert len({s.key() for s in HEAD_SPECS + RECIPE_SPECS}) == len(HEAD_SPECS) + len(RECIPE_SPECS)
