"""Sampling through the whole engine: a ragged batch of thousands of rows, T = 0.7, top-p 0.9, k = 3,
against the target's own sampling distribution computed exactly with forward passes over the small
vocabulary; deliberately wrong rules patched into the scheduler must fail the same test. And a row's
samples depend only on its own prompt, settings and seed.

Two exact references, both from the target's HF forward and ``logits_to_probs`` (the definition of
"the target's sampling distribution" at these settings):
- the marginal of each of tokens 2, 3 and 4 (0-based 1..3, the drafted positions of the first round),
  by enumerating every prefix of nonzero probability (top-p keeps a few tokens per step);
- the conditional of each of tokens 1..5 (0-based 0..4) given the row's own sampled prefix: one forward
  over every row's output. Token 5 is the first round's bonus or the second round's, after a rollback.
"""

from __future__ import annotations

import pytest
import torch
from conftest import PROMPTS, make_model
from test_acceptance import FAIL_P, PASS_P, chi_square, mutants

import speclab.engine.scheduler as scheduler
from speclab.drafters import PromptLookupDrafter, make_drafter
from speclab.engine import Request, Scheduler, SpeculativeDecoder, make_policy
from speclab.engine.sampling import SamplingParams, logits_to_probs

PARAMS = SamplingParams(temperature=0.7, top_p=0.9)
K, NEW = 3, 5  # max_new_tokens = k + 2: one full round after the prefill token, and a second round
RAGGED = ["hello wor", "the cat sat on the m", "q"]  # 9, 20 and 1 tokens, interleaved row by row
ROWS = 3000


@pytest.fixture(scope="module")
def near(tiny, target_lm, tmp_path_factory):
    """A draft close to the target (a little weight noise): all k accepted in about a quarter of the first
    rounds, none in about half, so bonus tokens, rejections and ragged rounds are all common."""
    path = tmp_path_factory.mktemp("near") / "draft_near"
    make_model(path, seed=5, base_state=target_lm.hf_model.state_dict(), noise=0.1)
    return str(path)


def _drafter(kind, tiny, near, target):
    if kind == "ngram":
        return PromptLookupDrafter()
    return make_drafter(near if kind == "near" else tiny[kind], target)


@torch.no_grad()
def _next_probs(lm, seqs: list[list[int]]) -> torch.Tensor:
    """(n, V) the target's sampling distribution after each sequence (all of one length)."""
    logits = lm.hf_model(torch.tensor(seqs)).logits[:, -1]  # (n, V)
    return logits_to_probs(logits, PARAMS).double()


def _exact_marginals(lm, prompt_ids: list[int], positions: int = 4) -> torch.Tensor:
    """(positions, V) the exact marginal of generated tokens 0..positions-1: every sequence of nonzero
    probability, level by level."""
    seqs, weight = [[]], torch.ones(1, dtype=torch.float64)
    out = []
    for _ in range(positions):
        p = _next_probs(lm, [prompt_ids + s for s in seqs])  # (S, V)
        out.append((weight[:, None] * p).sum(0))
        joint = weight[:, None] * p  # (S, V)
        nz = joint.nonzero()
        seqs = [seqs[i] + [v] for i, v in nz.tolist()]
        weight = joint[nz[:, 0], nz[:, 1]]
    return torch.stack(out)


@pytest.fixture(scope="module")
def exact(target_lm):
    return {p: _exact_marginals(target_lm, target_lm.encode(p)) for p in RAGGED}


def conditional_chi_square(tokens: torch.Tensor, probs: torch.Tensor) -> tuple[float, int, float]:
    """Were ``tokens`` (n,) each drawn from its own row of ``probs`` (n, V)? The summed one-hot
    observations against the summed probabilities, with their exact covariance sum_b diag(p_b) - p_b p_b^T
    (a Mahalanobis statistic, chi-square with C-1 dof for C categories). Tokens expecting fewer than 5
    draws in all are pooled; a token drawn with probability 0 is p = 0. Returns (stat, dof, p-value)."""
    probs = probs.double()
    n, V = probs.shape
    if bool((probs.gather(1, tokens[:, None]) <= 0).any()):
        return float("inf"), 0, 0.0
    big = probs.sum(0) >= 5
    cats = [torch.nn.functional.one_hot(v, V).double() for v in big.nonzero().squeeze(1)]
    if bool((~big).any()):
        cats.append((~big).double())
    A = torch.stack(cats)  # (C, V) which tokens make up each category
    P = probs @ A.T  # (n, C)
    O = torch.bincount(tokens, minlength=V).double() @ A.T  # (C,)
    E = P.sum(0)
    C = A.shape[0]
    if C < 2:
        return 0.0, 0, 1.0
    cov = torch.diag(E) - P.T @ P  # (C, C)
    d = (O - E)[:-1]  # the last category is implied by the others
    stat = (d @ torch.linalg.solve(cov[:-1, :-1], d)).item()
    p = torch.special.gammaincc(torch.tensor((C - 1) / 2, dtype=torch.float64), torch.tensor(stat / 2)).item()
    return stat, C - 1, p


def _sample(lm, drafter, rows=ROWS, seed=0):
    dec = SpeculativeDecoder(lm, drafter)
    prompts = [RAGGED[i % len(RAGGED)] for i in range(rows)]
    return dec.generate(prompts, k=K, max_new_tokens=NEW, temperature=PARAMS.temperature, top_p=PARAMS.top_p,
                        seed=seed, record=False, stop_on_eos=False)


def _p_values(lm, res, exact) -> dict[str, float]:
    """Marginals of tokens 2..4 (enumeration) and conditionals of tokens 1..5 (each row's own prefix)."""
    out = {}
    by_prompt = {p: [r for r in res.requests if r.prompt_ids == lm.encode(p)] for p in RAGGED}
    for i in (1, 2, 3):  # rows of different prompts are independent: their statistics add up
        stats = [chi_square(torch.bincount(torch.tensor([r.generated[i] for r in reqs]), minlength=lm.vocab_size),
                            exact[p][i]) for p, reqs in by_prompt.items()]
        stat, dof = sum(s for s, _, _ in stats), sum(d for _, d, _ in stats)
        out[f"marginal t{i}"] = (0.0 if stat == float("inf") else
                                 torch.special.gammaincc(torch.tensor(dof / 2.0, dtype=torch.float64),
                                                         torch.tensor(stat / 2.0, dtype=torch.float64)).item())
    toks, probs = [], []
    for p, reqs in by_prompt.items():
        ids = lm.encode(p)
        gen = torch.tensor([r.generated for r in reqs])  # (n, NEW)
        with torch.no_grad():
            logits = lm.hf_model(torch.cat([torch.tensor(ids).expand(len(reqs), -1), gen[:, :-1]], 1)).logits
        probs.append(logits_to_probs(logits[:, len(ids) - 1:], PARAMS))  # (n, NEW, V): before each token
        toks.append(gen)
    toks, probs = torch.cat(toks), torch.cat(probs)
    for i in range(NEW):
        out[f"conditional t{i}"] = conditional_chi_square(toks[:, i], probs[:, i])[2]
    return out


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["near", "draft_far", "ngram"])
def test_engine_samples_follow_the_target(tiny, near, target_lm, exact, kind):
    """A model draft with many bonus tokens, one with many rejections, and prompt lookup (one-hot drafts)."""
    res = _sample(target_lm, _drafter(kind, tiny, near, target_lm))
    assert all(len(r.generated) == NEW for r in res.requests)
    pv = _p_values(target_lm, res, exact)
    assert min(pv.values()) > PASS_P, pv
    first = [r.history[0] for r in res.requests]  # (drafted, accepted) of each row's first round
    assert len({a for _, a in first}) > 1  # ragged: rows accepted different counts in the same round
    rolled_back = [r for r, (d, a) in zip(res.requests, first) if a < d]
    assert len(rolled_back) > 100  # rejected drafts rolled back ...
    assert all(len(r.history) >= 2 for r in rolled_back)  # ... and those rows sampled again after it
    if kind == "near":
        assert sum(a == d == K for d, a in first) > ROWS // 10  # bonus tokens in the first round


# the four (bonus from slot n-1, every draft against slot 0, temperature on one side only, an
# unnormalised residual) and the classic one (the target instead of the residual); test_acceptance.py
# runs every mutant on the pure functions
ENGINE_MUTANTS = ["bonus_from_previous_slot", "drafts_against_slot0", "target_without_temperature",
                  "residual_unnormalised", "sample_from_target_on_rejection"]


@pytest.mark.slow
@pytest.mark.parametrize("name", ENGINE_MUTANTS)
def test_wrong_rules_fail_in_the_engine(tiny, near, target_lm, exact, monkeypatch, name):
    wrong = mutants(PARAMS.temperature)[name]
    monkeypatch.setattr(scheduler, "rejection_impl", lambda device: wrong)
    res = _sample(target_lm, _drafter("near", tiny, near, target_lm))
    pv = _p_values(target_lm, res, exact)
    assert min(pv.values()) < FAIL_P, pv


# ----------------------------------------------------------------------------- a row is its own
@pytest.mark.parametrize("kind", ["draft_close", "ngram"])
@pytest.mark.parametrize("k", [2, 4])
def test_row_output_does_not_depend_on_batch_mates(tiny, target_lm, kind, k):
    """The same prompt, settings and seed give the same tokens alone and as row 1 of 4 whose mates have
    other prompts, seeds, budgets and sampling settings (one greedy), and leave before or after it (the
    greedy mate outlives it, so the batch's widest draft is wider than the row's own in its last rounds)."""
    params = SamplingParams(0.8, top_k=20, top_p=0.95)
    prompt, seed, new = PROMPTS[1], 11, 24
    ids = target_lm.encode(prompt)

    def run(reqs):
        drafter = PromptLookupDrafter() if kind == "ngram" else make_drafter(tiny[kind], target_lm)
        sched = Scheduler(target_lm, drafter, make_policy(None, k), max_running=len(reqs))
        for r in reqs:
            sched.submit(r)
        sched.run_until_idle()
        return reqs

    solo = run([Request(ids, new, params, seed, ignore_eos=True)])[0]
    mates = [Request(target_lm.encode(PROMPTS[0]), 7, SamplingParams(1.0), 3, ignore_eos=True),
             Request(ids, new, params, seed, ignore_eos=True),
             Request(target_lm.encode(PROMPTS[4]), 40, SamplingParams(0.0), None, ignore_eos=True),
             Request(target_lm.encode(PROMPTS[9]), 13, SamplingParams(0.6, top_p=0.8), 12, ignore_eos=True)]
    batch = run(mates)
    assert batch[1].generated == solo.generated
    assert len(solo.generated) == new
    assert len({len(r.generated) for r in batch}) > 1  # mates left at other times
    assert solo.drafted > 0 and batch[1].history == solo.history  # same rounds, same draft lengths


@pytest.mark.parametrize("kind", ["draft_close", "ngram"])
@pytest.mark.parametrize("k", [2, 4])
def test_row_seed_is_its_own_in_generate(tiny, target_lm, kind, k):
    """Through SpeculativeDecoder.generate: row b samples with seed + b, so prompt P at seed s alone equals
    row 2 of a batch of 4 (other prompts) started at seed s - 2."""
    drafter = PromptLookupDrafter() if kind == "ngram" else make_drafter(tiny[kind], target_lm)
    dec = SpeculativeDecoder(target_lm, drafter)
    kw = dict(k=k, max_new_tokens=20, temperature=0.9, top_p=0.95, record=False)
    solo = dec.generate([PROMPTS[2]], seed=40, **kw)
    batch = dec.generate([PROMPTS[5], PROMPTS[0], PROMPTS[2], PROMPTS[7]], seed=38, **kw)
    assert batch.seeds[2] == solo.seeds[0] == 40
    assert batch.output_tokens[2] == solo.output_tokens[0]


def test_fresh_seed_is_reported_and_reproduces(tiny, target_lm):
    dec = SpeculativeDecoder(target_lm, make_drafter(tiny["draft_close"], target_lm))
    kw = dict(k=3, max_new_tokens=16, temperature=1.0, record=False, stop_on_eos=False)
    a = dec.generate([PROMPTS[3]], seed=None, **kw)
    b = dec.generate([PROMPTS[3]], seed=None, **kw)
    assert a.seeds[0] != b.seeds[0]  # fresh seeds (two equal draws out of 2**31 - 1: chance 5e-10)
    assert dec.generate([PROMPTS[3]], seed=a.seeds[0], **kw).output_tokens == a.output_tokens
    assert dec.generate([PROMPTS[3]], seed=b.seeds[0], **kw).output_tokens == b.output_tokens
    two = dec.generate([PROMPTS[3], PROMPTS[3]], seed=None, **kw)
    assert two.seeds[0] != two.seeds[1]  # a fresh seed per row, each reported
    assert dec.generate([PROMPTS[3]], seed=two.seeds[1], **kw).output_tokens[0] == two.output_tokens[1]
