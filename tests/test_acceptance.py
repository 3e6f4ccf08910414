"""Acceptance math on hand-built probabilities, and the statistical test."""

import pytest
import torch

from speclab.engine.acceptance import (
    TreeAcceptResult,
    greedy_accept,
    rejection_sample,
    tree_greedy_accept,
    tree_rejection_sample,
)
from speclab.engine.sampling import (
    SamplingParams,
    fixed_point_weights,
    logits_to_probs,
    sample_from_probs,
    sample_from_weights,
)


def t(x, dtype=torch.long):
    return torch.tensor(x, dtype=dtype)


def test_greedy_accept_hand_built():
    drafts = t([[3, 1, 4], [3, 1, 4], [2, 2, 2], [5, -1, -1]])
    argmax = t([[3, 1, 4, 9], [3, 0, 4, 9], [1, 2, 2, 7], [5, 6, 6, 6]])
    num = t([3, 3, 3, 1])
    r = greedy_accept(drafts, argmax, num)
    assert r.num_accepted.tolist() == [3, 1, 0, 1]
    assert r.next_token.tolist() == [9, 0, 1, 6]  # bonus, recovered, recovered, bonus
    assert r.is_bonus.tolist() == [True, False, False, True]


def test_greedy_accept_respects_num_draft():
    # row drafted 3 but only 2 are allowed (budget): the third match must not count
    r = greedy_accept(t([[1, 2, 3]]), t([[1, 2, 3, 4]]), t([2]))
    assert r.num_accepted.tolist() == [2]
    assert r.next_token.tolist() == [3]  # target's token at slot 2: bonus for this row
    assert r.is_bonus.tolist() == [True]


def test_greedy_k0_is_plain_decoding():
    r = greedy_accept(torch.zeros(2, 0, dtype=torch.long), t([[7], [2]]), t([0, 0]))
    assert r.num_accepted.tolist() == [0, 0] and r.next_token.tolist() == [7, 2]


def _probs(rows):
    return torch.tensor(rows, dtype=torch.float32)


def test_rejection_sample_exact_cases():
    V = 4
    target = _probs([[[0.1, 0.6, 0.2, 0.1], [0.25, 0.25, 0.25, 0.25]]])  # (1, 2, V), k = 1
    draft = _probs([[[0.4, 0.3, 0.2, 0.1]]])  # (1, 1, V)
    # draft token 1: target 0.6 >= draft 0.3 -> accepted for any u
    r = rejection_sample(t([[1]]), draft, target, t([1]), _probs([[0.999]]), _probs([0.0]))
    assert r.num_accepted.tolist() == [1] and r.is_bonus.tolist() == [True]
    assert r.next_token.tolist() == [0]  # u = 0 on the bonus distribution (uniform) -> token 0
    # draft token 0: ratio 0.1/0.4 = 0.25; u = 0.2 accepts, u = 0.3 rejects
    r = rejection_sample(t([[0]]), draft, target, t([1]), _probs([[0.2]]), _probs([0.5]))
    assert r.num_accepted.tolist() == [1]
    r = rejection_sample(t([[0]]), draft, target, t([1]), _probs([[0.3]]), _probs([0.0]))
    assert r.num_accepted.tolist() == [0] and not r.is_bonus.item()
    # residual = max(target - draft, 0) = [0, 0.3, 0, 0] -> only token 1 can be recovered
    for u in (0.0, 0.5, 0.999):
        r = rejection_sample(t([[0]]), draft, target, t([1]), _probs([[0.9]]), _probs([u]))
        assert r.next_token.tolist() == [1]
    assert V == 4


def test_residual_that_sums_to_zero_falls_back_to_target():
    # draft == target: the residual is all zeros; a forced rejection (u ~ 1, ratio 1 -> u < 1 accepts,
    # so force it through a draft that puts a hair more mass on the token) must not produce NaN
    target = _probs([[[0.5, 0.5, 0.0], [0.2, 0.3, 0.5]]])
    draft = _probs([[[0.5 + 1e-12, 0.5 - 1e-12, 0.0]]])
    r = rejection_sample(t([[0]]), draft, target, t([1]), _probs([[0.9999999]]), _probs([0.7]))
    assert r.num_accepted.item() in (0, 1)
    assert 0 <= r.next_token.item() < 3
    assert target[0, r.num_accepted.item(), r.next_token.item()] > 0


def test_deterministic_draft_is_one_hot():
    target = _probs([[[0.2, 0.5, 0.3], [1.0, 0.0, 0.0]]])
    # accept with probability target(d) = 0.5
    assert rejection_sample(t([[1]]), None, target, t([1]), _probs([[0.49]]), _probs([0.0])).num_accepted.item() == 1
    r = rejection_sample(t([[1]]), None, target, t([1]), _probs([[0.51]]), _probs([0.99]))
    assert r.num_accepted.item() == 0
    assert r.next_token.item() == 2  # residual [0.2, 0, 0.3]: u = .99 -> last token


def test_padding_slots_never_accepted():
    target = _probs([[[0.0, 1.0], [0.0, 1.0], [1.0, 0.0]]])
    r = rejection_sample(t([[1, -1]]), None, target, t([1]), _probs([[0.0, 0.0]]), _probs([0.0]))
    assert r.num_accepted.item() == 1 and r.is_bonus.item() and r.next_token.item() == 1


def test_sampling_transforms():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    p = logits_to_probs(logits, SamplingParams(1.0, top_k=2))
    assert p[0, 2:].sum() == 0 and abs(p.sum().item() - 1) < 1e-6
    p = logits_to_probs(logits, SamplingParams(1.0, top_p=0.5))
    assert (p[0] > 0).sum() == 1  # top token alone holds > 0.5
    assert sample_from_probs(torch.tensor([[0.0, 1.0, 0.0]]), torch.tensor([0.0])).item() == 1
    assert sample_from_probs(torch.tensor([[0.5, 0.0, 0.5]]), torch.tensor([0.5])).item() == 2



def _blocked_reversed_draw(w: torch.Tensor, u: float, block: int) -> int:
    """Inverse CDF as a blocked kernel might take it: block sums added last block first, and each block's
    own prefix sums in a different association. Same maths, another summation order."""
    V = w.shape[0]
    blocks = [w[i:i + block] for i in range(0, V, block)]
    total = w[:0].sum()
    for b in reversed(blocks):
        total = total + b.flip(0).sum()
    if w.dtype == torch.int64:
        goal = int(u * float(total))  # as sample_from_weights: float64 product, truncated
    else:
        goal = u * total
    prefix = w[:0].sum()
    for i, b in enumerate(blocks):
        c = prefix + b.flip(0).cumsum(0).flip(0)  # suffix sums, then turned into prefix sums below
        c = prefix + (b.sum() - c + prefix + b)  # prefix sums associated differently
        hit = (c > goal).nonzero()
        if len(hit):
            return i * block + int(hit[0])
        prefix = prefix + b.sum()
    return V - 1


def test_fixed_point_draw_does_not_depend_on_summation_order():
    """A float CDF taken in another order picks a neighbouring token for some draws (which is what the fused
    kernel did at 54 of 2e9-element draws on a GPU); the fixed-point CDF picks the same token in every order."""
    g = torch.Generator().manual_seed(0)
    float_diff = fixed_diff = 0
    for _ in range(300):
        p = torch.rand(64, generator=g) ** 6
        p /= p.sum()
        cdf = p.cumsum(0)
        # draws placed at CDF steps, where rounding decides between neighbours
        for j in torch.randint(1, 63, (4,), generator=g).tolist():
            u = float(cdf[j] / cdf[-1])
            seq_float = int(torch.searchsorted(cdf, torch.tensor([u * float(cdf[-1])]), right=True).clamp(max=63))
            float_diff += seq_float != _blocked_reversed_draw(p, u, 8)
            w = fixed_point_weights(p)
            fixed_diff += int(sample_from_weights(w, torch.tensor(u))) != _blocked_reversed_draw(w, u, 8)
    assert float_diff > 0  # the test can tell orders apart
    assert fixed_diff == 0


# ================================================================ exactness by enumeration
# A table language model: next-token logits that depend on the whole prefix, one random row per
# prefix, over a vocabulary small enough to enumerate every sequence. Drafts are the target's table
# plus noise: different target and draft distributions at every position and every context.
class TableLM:
    def __init__(self, V: int, max_len: int, seed: int, scale: float = 1.5, base: "TableLM | None" = None,
                 noise: float = 0.0):
        self.V, self.max_len = V, max_len
        # prefixes of length l take rows offset[l] .. offset[l] + V**l - 1
        self.offset = torch.tensor([sum(V ** j for j in range(l)) for l in range(max_len + 2)])
        rows = int(self.offset[-1])
        g = torch.Generator().manual_seed(seed)
        if base is None:
            self.logits = torch.randn(rows, V, generator=g) * scale  # (rows, V)
        else:
            self.logits = base.logits + torch.randn(rows, V, generator=g) * noise

    def probs(self, seq: torch.Tensor, length: torch.Tensor, params: SamplingParams) -> torch.Tensor:
        """(n, S) token rows whose first ``length[b]`` tokens are the context -> (n, V) next-token probs."""
        assert int(length.max()) <= self.max_len
        pos = torch.arange(seq.shape[1])
        digit = (length[:, None] - 1 - pos).clamp(min=0)  # (n, S) base-V place value of each token
        weight = torch.where(pos[None] < length[:, None], self.V ** digit, 0)
        row = self.offset[length] + (seq.clamp(min=0) * weight).sum(-1)  # (n,)
        return logits_to_probs(self.logits[row], params)


def exact_joint(target: TableLM, params: SamplingParams, m: int) -> torch.Tensor:
    """(V**m,) float64: the target's own probability of each m-token sequence (index: base-V number)."""
    V = target.V
    code = torch.arange(V ** m)
    seqs = torch.stack([code // V ** (m - 1 - i) % V for i in range(m)], 1)  # (V**m, m)
    joint = torch.ones(V ** m, dtype=torch.float64)
    for i in range(m):
        p = target.probs(seqs, torch.full((V ** m,), i), params).double()  # (V**m, V) after the first i tokens
        joint *= p.gather(1, seqs[:, i:i + 1]).squeeze(1)
    return joint


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, int, float]:
    """Pearson's test of ``counts`` (C,) against cell probabilities ``probs`` (C,): (statistic, dof,
    p-value). Cells expecting fewer than 5 are pooled; a count in a cell of probability 0 is p = 0."""
    counts, probs = counts.double(), probs.double()
    n = counts.sum()
    if bool(((probs <= 0) & (counts > 0)).any()):
        return float("inf"), 0, 0.0
    exp = probs * n
    big = exp >= 5
    e = torch.cat([exp[big], exp[~big].sum()[None]])
    o = torch.cat([counts[big], counts[~big].sum()[None]])
    keep = e > 0
    stat = (((o - e) ** 2) / e)[keep].sum()
    dof = int(keep.sum()) - 1
    p = torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), stat / 2).item()
    return stat.item(), dof, p


def total_variation(counts: torch.Tensor, probs: torch.Tensor) -> float:
    return 0.5 * (counts.double() / counts.sum() - probs.double()).abs().sum().item()


PASS_P = 1e-3  # the correct rule passes at this level (fixed seeds: the outcome is reproducible)
FAIL_P = 1e-6  # a wrong rule must fail far beyond it


def first_tokens(round_fn, m: int, n: int, seed: int, room: int) -> torch.Tensor:
    """Decode ``n`` rows from an empty context, round after round, until each row has ``m`` tokens;
    ``round_fn(seq, length, gen) -> (emitted (r, W) -1 padded, count (r,))`` runs one round on the rows
    still going (``room``: the most tokens a round emits). Returns the first m tokens (n, m)."""
    g = torch.Generator().manual_seed(seed)
    seq = torch.full((n, m + room), -1, dtype=torch.long)
    length = torch.zeros(n, dtype=torch.long)
    while True:
        act = (length < m).nonzero().squeeze(1)
        if act.numel() == 0:
            return seq[:, :m]
        emitted, count = round_fn(seq[act], length[act], g)
        for j in range(emitted.shape[1]):
            sel = j < count
            seq[act[sel], length[act[sel]] + j] = emitted[sel, j]
        length[act] += count


def chain_round(target: TableLM, draft: TableLM, params: SamplingParams, k: int, rule, deterministic=False):
    """One speculative round on a table LM: k drafts step by step (sampled, or the draft's argmax scored
    as one-hot), the target's k+1 distributions, ``rule`` (the rejection_sample contract)."""
    def round_fn(seq, length, g):
        r = seq.shape[0]
        rows = torch.arange(r)
        u_draft, u_acc = torch.rand(r, k, generator=g), torch.rand(r, k, generator=g)
        u_next = torch.rand(r, generator=g)
        ext = torch.cat([seq, torch.full((r, k), -1)], 1)  # (r, S + k) context, then the drafts
        drafts, dprobs, tprobs = [], [], []
        for i in range(k + 1):
            tprobs.append(target.probs(ext, length + i, params))  # (r, V) after the context and i drafts
            if i < k:
                q = draft.probs(ext, length + i, params)
                d = q.argmax(-1) if deterministic else sample_from_probs(q, u_draft[:, i])
                ext[rows, length + i] = d
                drafts.append(d)
                dprobs.append(q)
        d_tok = torch.stack(drafts, 1)  # (r, k)
        res = rule(d_tok, None if deterministic else torch.stack(dprobs, 1), torch.stack(tprobs, 1),
                   torch.full((r,), k), u_acc, u_next)
        emitted = torch.cat([d_tok, torch.zeros(r, 1, dtype=torch.long)], 1)  # (r, k+1)
        emitted[rows, res.num_accepted] = res.next_token
        return emitted, res.num_accepted + 1
    return round_fn


# ---------------------------------------------------------------- deliberately wrong rules (mutants)
# Each has rejection_sample's contract (the engine tests patch them into the scheduler) and each must
# fail the exactness tests. Each is a bug a real implementation has had or could easily have.
def sample_from_target_on_rejection(draft_tokens, draft_probs, target_probs, num_draft, ua, un):
    """On rejection, the next token comes from the target instead of the residual."""
    r = rejection_sample(draft_tokens, draft_probs, target_probs, num_draft, ua, un)
    fresh = sample_from_probs(target_probs[torch.arange(len(un)), r.num_accepted], un)
    r.next_token = torch.where(r.is_bonus, r.next_token, fresh)
    return r


def bonus_from_previous_slot(draft_tokens, draft_probs, target_probs, num_draft, ua, un):
    """The bonus token is drawn from slot n-1 (the distribution the last draft was checked against)."""
    rows = torch.arange(len(un))
    tp = target_probs.clone()
    prev = target_probs[rows, (num_draft - 1).clamp(min=0)]
    tp[rows, num_draft] = torch.where((num_draft > 0)[:, None], prev, target_probs[rows, num_draft])
    return rejection_sample(draft_tokens, draft_probs, tp, num_draft, ua, un)


def drafts_against_slot0(draft_tokens, draft_probs, target_probs, num_draft, ua, un):
    """Every draft (and its residual) is checked against slot 0's target distribution."""
    rows = torch.arange(len(un))
    k = draft_tokens.shape[1]
    tp = target_probs.clone()
    tp[:, :k] = target_probs[:, :1]
    tp[rows, num_draft] = target_probs[rows, num_draft]  # the bonus slot keeps its own distribution
    return rejection_sample(draft_tokens, draft_probs, tp, num_draft, ua, un)


def _untemper(probs: torch.Tensor, temperature: float) -> torch.Tensor:
    """Probabilities at temperature T -> temperature 1 over the same top-k/top-p set (p_T**T ∝ exp(logits))."""
    p = probs.double() ** temperature
    return (p / p.sum(-1, keepdim=True)).float()


def target_without_temperature(temperature: float):
    """Temperature applied on the draft's side only: the target is scored at temperature 1."""
    def rule(draft_tokens, draft_probs, target_probs, num_draft, ua, un):
        return rejection_sample(draft_tokens, draft_probs, _untemper(target_probs, temperature), num_draft, ua, un)
    return rule


def draft_without_temperature(temperature: float):
    """The draft sampled at temperature T but reports its probabilities at temperature 1."""
    def rule(draft_tokens, draft_probs, target_probs, num_draft, ua, un):
        dp = _untemper(draft_probs, temperature) if draft_probs is not None else None
        return rejection_sample(draft_tokens, dp, target_probs, num_draft, ua, un)
    return rule


def _rejected_next(rule_residual):
    """A mutant that recomputes the recovered token from ``rule_residual(target (B, V), draft (B, V))``."""
    def rule(draft_tokens, draft_probs, target_probs, num_draft, ua, un):
        r = rejection_sample(draft_tokens, draft_probs, target_probs, num_draft, ua, un)
        if draft_tokens.shape[1] == 0:  # nothing drafted: nothing rejected
            return r
        rows = torch.arange(len(un))
        slot = r.num_accepted.clamp(max=draft_tokens.shape[1] - 1)
        tok = draft_tokens[rows, slot].clamp(min=0)
        t = target_probs[rows, r.num_accepted].float()  # (B, V)
        d = (draft_probs[rows, slot].float() if draft_probs is not None
             else torch.zeros_like(t).scatter_(1, tok[:, None], 1.0))
        r.next_token = torch.where(r.is_bonus, r.next_token, rule_residual(t, d, un))
        return r
    return rule


def _inverse_cdf_assuming_sum_one(probs, u):
    cdf = probs.cumsum(-1)
    return torch.searchsorted(cdf, u[:, None], right=True).squeeze(1).clamp(max=probs.shape[-1] - 1)


# the residual max(target - draft, 0) sampled as if it summed to 1: the missing mass lands on the last token
residual_unnormalised = _rejected_next(lambda t, d, u: _inverse_cdf_assuming_sum_one((t - d).clamp(min=0), u))
# a residual that looks plausible and is normalised, but is not max(target - draft, 0)
residual_target_times_one_minus_draft = _rejected_next(lambda t, d, u: sample_from_probs(t * (1 - d), u))


def mutants(temperature: float) -> dict:
    return {
        "sample_from_target_on_rejection": sample_from_target_on_rejection,
        "bonus_from_previous_slot": bonus_from_previous_slot,
        "drafts_against_slot0": drafts_against_slot0,
        "target_without_temperature": target_without_temperature(temperature),
        "draft_without_temperature": draft_without_temperature(temperature),
        "residual_unnormalised": residual_unnormalised,
        "residual_target_times_one_minus_draft": residual_target_times_one_minus_draft,
    }


# ---------------------------------------------------------------- the chain test
V_SMALL, K, M = 5, 3, 4  # vocabulary, drafts per round, emitted tokens inspected (k + 1: 625 sequences)
N_CHAIN = 200_000
CHAIN_CASES = {
    # name: (draft noise, sampling params, deterministic draft)
    "mixed": (1.0, SamplingParams(0.7), False),
    "bonus_heavy": (0.15, SamplingParams(0.7), False),  # draft ~ target: all k accepted ~half the rounds
    "top_k_top_p": (0.8, SamplingParams(0.9, top_k=4, top_p=0.8), False),  # both sides filtered
    "deterministic_draft": (0.5, SamplingParams(0.7), True),  # the draft's argmax, probs=None
}


def _chain_models(noise):
    target = TableLM(V_SMALL, M - 1 + K, seed=11)
    return target, TableLM(V_SMALL, M - 1 + K, seed=12, base=target, noise=noise)


def chain_exactness(rule, case: str, n: int = N_CHAIN, seed: int = 0):
    """The first k+1 emitted tokens of speculative sampling with ``rule`` against the target's exact joint.
    Returns (p-value, total variation, fraction of rounds that accepted all k drafts)."""
    noise, params, det = CHAIN_CASES[case]
    target, draft = _chain_models(noise)
    rounds = []

    def counting(*args):
        r = rule(*args)
        rounds.append(r.is_bonus)
        return r

    toks = first_tokens(chain_round(target, draft, params, K, counting, det), M, n, seed, room=K + 1)
    p, tv = joint_test(toks, target, params, M)
    return p, tv, torch.cat(rounds).float().mean().item()


def joint_test(toks, target, params, m):
    """Chi-square p-value and total variation of the sampled first-m-token sequences (rows of ``toks``)
    against the target's exact joint."""
    code = (toks * (V_SMALL ** torch.arange(m - 1, -1, -1))).sum(-1)  # each sequence as one integer
    counts = torch.bincount(code, minlength=V_SMALL ** m)
    exact = exact_joint(target, params, m)
    _, _, p = chi_square(counts, exact)
    return p, total_variation(counts, exact)


@pytest.mark.parametrize("case", list(CHAIN_CASES))
def test_rejection_sampling_matches_exact_joint(case):
    p, tv, bonus = chain_exactness(rejection_sample, case)
    assert p > PASS_P, (case, p, tv)
    if case == "bonus_heavy":
        assert bonus > 0.4, bonus  # the bonus token really decides many sequences


# the case each mutant is run on (test_wrong_rules_fail_every_case runs them all)
MUTANT_CASES = {
    "sample_from_target_on_rejection": "mixed",
    "bonus_from_previous_slot": "bonus_heavy",
    "drafts_against_slot0": "bonus_heavy",
    "target_without_temperature": "mixed",
    "draft_without_temperature": "mixed",
    "residual_unnormalised": "mixed",
    "residual_target_times_one_minus_draft": "mixed",
}


@pytest.mark.parametrize("name", list(MUTANT_CASES))
def test_wrong_rules_fail_the_exact_joint_test(name):
    rule = mutants(CHAIN_CASES[MUTANT_CASES[name]][1].temperature)[name]
    p, tv, _ = chain_exactness(rule, MUTANT_CASES[name])
    assert p < FAIL_P, (name, p, tv)


HARMLESS = {("draft_without_temperature", "deterministic_draft"),  # a one-hot draft has no temperature
            ("residual_target_times_one_minus_draft", "deterministic_draft")}  # p * (1 - one-hot) ∝ max(p - one-hot, 0)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(MUTANT_CASES))
def test_wrong_rules_fail_every_case(name):
    """Each mutant on every case: it fails wherever it differs from the rule, and passes where it is the rule."""
    for case, (_, params, _) in CHAIN_CASES.items():
        p, tv, _ = chain_exactness(mutants(params.temperature)[name], case)
        if (name, case) in HARMLESS:
            assert p > PASS_P, (name, case, p, tv)
        else:
            assert p < FAIL_P, (name, case, p, tv)


# ================================================================ trees
def _tree_example():
    """The worked example in acceptance.py: root -> 7 (node 0) -> {5 (2), 9 (3)}; root -> 3 (node 1) -> 2 (4)."""
    return t([[7, 3, 5, 9, 2]]), t([[-1, -1, 0, 0, 1]])


def test_tree_greedy_hand_built():
    tokens, parents = _tree_example()
    tokens, parents = tokens.expand(5, 5), parents.expand(5, 5)
    argmax = t([
        [7, 9, 0, 0, 4, 0],  # 7 then 9 (a leaf): bonus = argmax after node 3 = 4
        [3, 0, 2, 0, 0, 6],  # 3 then 2 (a leaf): bonus 6
        [8, 0, 0, 0, 0, 0],  # no root child matches: the root's argmax 8 is recovered
        [7, 1, 0, 0, 0, 0],  # 7, then neither 5 nor 9: recovered 1
        [7, 5, 2, 1, 1, 1],  # 7 then 5 (node 2; node 4's 2 is not under node 0): bonus 1
    ])
    r = tree_greedy_accept(tokens, parents, argmax)
    assert r.path.tolist() == [[0, 3, -1, -1, -1], [1, 4, -1, -1, -1], [-1] * 5, [0, -1, -1, -1, -1],
                               [0, 2, -1, -1, -1]]
    assert r.num_accepted.tolist() == [2, 2, 0, 1, 2]
    assert r.next_token.tolist() == [4, 6, 8, 1, 1]
    assert r.is_bonus.tolist() == [True, True, False, False, True]


def test_tree_greedy_padding_duplicates_and_empty():
    # padding nodes (-1) never match; siblings with the same token: the deeper path wins
    r = tree_greedy_accept(t([[4, 4, 6, -1]]), t([[-1, -1, 1, -1]]), t([[4, 0, 6, 9, 0]]))
    assert r.path.tolist() == [[1, 2, -1, -1]] and r.num_accepted.tolist() == [2]
    assert r.next_token.tolist() == [9] and r.is_bonus.tolist() == [True]
    # an empty tree is plain decoding
    r = tree_greedy_accept(torch.zeros(2, 0, dtype=torch.long), torch.zeros(2, 0, dtype=torch.long), t([[5], [2]]))
    assert r.num_accepted.tolist() == [0, 0] and r.next_token.tolist() == [5, 2] and r.path.shape == (2, 0)
    assert r.is_bonus.tolist() == [True, True]


# root p = [.2, .5, .2, .1]; root children drawn i.i.d. from q_root = [.3, .2, .4, .1]: node 0 = token 0,
# node 1 = token 2; node 2 = token 2 under node 0, drawn from q_0 = [.1, .1, .6, .2]
_P_ROOT, _Q_ROOT, _Q_0 = [0.2, 0.5, 0.2, 0.1], [0.3, 0.2, 0.4, 0.1], [0.1, 0.1, 0.6, 0.2]
_P_AFTER = [[0.25, 0.25, 0.25, 0.25], [0.0, 0.0, 0.0, 1.0], [0.1, 0.2, 0.3, 0.4]]  # after nodes 0, 1, 2


def _sampled_tree(ua, un):
    tokens, parents = t([[0, 2, 2]]), t([[-1, -1, 0]])
    dp = _probs([[_Q_ROOT, _Q_ROOT, _Q_0]])
    tp = _probs([[_P_ROOT] + _P_AFTER])
    return tree_rejection_sample(tokens, parents, dp, tp, _probs([ua]), _probs([un]))


def test_tree_rejection_hand_built():
    # node 0: ratio .2/.3 = .667, u = .5 accepts; node 2: ratio .25/.6 = .417, u = .4 accepts; node 2 is a
    # leaf: bonus from [.1, .2, .3, .4] with u = .65 -> token 3
    r = _sampled_tree([0.5, 0.0, 0.4], 0.65)
    assert (r.path.tolist(), r.num_accepted.item(), r.next_token.item(), r.is_bonus.item()) == ([[0, 2, -1]], 2, 3,
                                                                                               True)
    # node 2 rejected (u = .45 > .417): residual max([.25]*4 - q_0, 0) = [.15, .15, 0, .05] / .35,
    # cdf [.43, .86, .86, 1]: u = .5 -> token 1, recovered
    r = _sampled_tree([0.5, 0.0, 0.45], 0.5)
    assert (r.path.tolist(), r.num_accepted.item(), r.next_token.item(), r.is_bonus.item()) == ([[0, -1, -1]], 1, 1,
                                                                                               False)
    # node 0 rejected (u = .9): p becomes max(p - q_root, 0) = [0, .3, 0, 0] -> token 2 (node 1) now has
    # probability 0 and is rejected for any u (against the root's p it would pass with u = .1: .1 < .2/.4);
    # the next residual is [0, 1, 0, 0] -> token 1 whatever u_next
    for un in (0.0, 0.5, 0.99):
        r = _sampled_tree([0.9, 0.1, 0.0], un)
        assert (r.num_accepted.item(), r.next_token.item(), r.is_bonus.item()) == (0, 1, False)


def test_tree_rejection_deterministic_siblings():
    # top-2 children of the root, scored one-hot: token 1 (accepted iff u < p(1) = .5), then token 0
    # against p without token 1: [.2, 0, .2, .1] / .5 -> accepted iff u < .4
    tokens, parents = t([[1, 0]]), t([[-1, -1]])
    tp = _probs([[_P_ROOT, [0.0, 1.0, 0.0, 0.0], [0.0, 0.0, 1.0, 0.0]]])

    def run(ua, un):
        r = tree_rejection_sample(tokens, parents, None, tp, _probs([ua]), _probs([un]))
        return r.path[0].tolist(), r.next_token.item(), r.is_bonus.item()

    assert run([0.49, 0.0], 0.3) == ([0, -1], 1, True)  # token 1 accepted, bonus from its distribution
    assert run([0.6, 0.35], 0.3) == ([1, -1], 2, True)  # token 1 rejected, token 0 accepted
    # both rejected: p without tokens 1 and 0 = [0, 0, .2, .1] / .3 -> u = .7 is past 2/3: token 3
    assert run([0.6, 0.45], 0.7) == ([-1, -1], 3, False)
    assert run([0.6, 0.45], 0.6) == ([-1, -1], 2, False)


def test_tree_empty_and_padding():
    tp = _probs([[[0.0, 1.0, 0.0]], [[0.0, 0.0, 1.0]]])
    r = tree_rejection_sample(torch.zeros(2, 0, dtype=torch.long), torch.zeros(2, 0, dtype=torch.long), None, tp,
                              torch.zeros(2, 0), _probs([0.5, 0.5]))
    assert r.next_token.tolist() == [1, 2] and r.num_accepted.tolist() == [0, 0] and r.is_bonus.all()
    # a padding node under the root is never tried, even with u = 0
    tp = _probs([[[0.0, 1.0, 0.0], [1.0, 0.0, 0.0], [1.0, 0.0, 0.0]]])
    r = tree_rejection_sample(t([[1, -1]]), t([[-1, -1]]), None, tp, _probs([[0.0, 0.0]]), _probs([0.0]))
    assert r.path.tolist() == [[0, -1]] and r.next_token.item() == 0 and r.is_bonus.item()


def _random_chains(n, k, V, seed):
    g = torch.Generator().manual_seed(seed)
    tp = torch.rand(n, k + 1, V, generator=g) ** 3
    tp /= tp.sum(-1, keepdim=True)
    dp = torch.rand(n, k, V, generator=g) ** 3
    dp /= dp.sum(-1, keepdim=True)
    drafts = sample_from_probs(dp, torch.rand(n, k, generator=g))
    num = torch.randint(0, k + 1, (n,), generator=g)
    drafts = torch.where(torch.arange(k)[None] < num[:, None], drafts, -1)
    return drafts, dp, tp, num, torch.rand(n, k, generator=g), torch.rand(n, generator=g), g


def test_chain_as_tree_equals_chain_rules():
    """A chain is the tree parents = [-1, 0, 1, ...]: the same uniforms give the same tokens."""
    n, k, V = 4000, 4, 6
    drafts, dp, tp, num, ua, un, g = _random_chains(n, k, V, seed=3)
    parents = (torch.arange(k) - 1).expand(n, k)
    for probs in (dp, None):
        a = rejection_sample(drafts, probs, tp, num, ua, un)
        b = tree_rejection_sample(drafts, parents, probs, tp, ua, un)
        assert torch.equal(a.num_accepted, b.num_accepted) and torch.equal(a.next_token, b.next_token)
        assert torch.equal(a.is_bonus, b.is_bonus)
        assert torch.equal(b.path, torch.where(torch.arange(k) < b.num_accepted[:, None], torch.arange(k), -1))
        assert 0 < (a.num_accepted > 0).float().mean() < 1 and a.is_bonus.any()
    argmax = tp.argmax(-1)
    hits = torch.rand(n, k, generator=g) < 0.7  # most drafts equal the argmax: long accepted runs
    greedy_drafts = torch.where(hits & (drafts >= 0), argmax[:, :k], drafts)
    a = greedy_accept(greedy_drafts, argmax, num)
    b = tree_greedy_accept(greedy_drafts, parents, argmax)
    assert torch.equal(a.num_accepted, b.num_accepted) and torch.equal(a.next_token, b.next_token)
    assert torch.equal(a.is_bonus, b.is_bonus) and (a.num_accepted >= 2).any()


# ---------------------------------------------------------------- a plain-Python statement of the tree rule
def tree_rule_reference(tokens, parents, draft_probs, target_probs, ua, un, update_residual=True):
    """One row, lists in: the recursive rule as the papers state it. ``update_residual=False`` is a
    mutant: every sibling is checked against its parent's own target distribution (the residual is not
    carried from sibling to sibling), the recovered token comes from the last sibling's residual."""
    V = len(target_probs[0])
    p, cur, path, rejected = list(target_probs[0]), -1, [], False
    while True:
        p_node, child = p, None
        for c in [i for i in range(len(tokens)) if tokens[i] >= 0 and parents[i] == cur]:
            x = tokens[c]
            q = draft_probs[c] if draft_probs is not None else [float(v == x) for v in range(V)]
            check = p if update_residual else p_node
            if ua[c] * q[x] < check[x]:  # u < min(1, p(x) / q(x)), q(x) > 0 for a drawn token
                child = c
                break
            rejected = True
            residual = [max(a - b, 0.0) for a, b in zip(check, q)]
            if sum(residual) > 1e-9:
                p = [r / sum(residual) for r in residual]
        if child is None:
            cdf = [sum(p[:i + 1]) for i in range(V)]
            return path, next((i for i in range(V) if cdf[i] > un * cdf[-1]), V - 1), not rejected
        path, cur, p, rejected = path + [child], child, list(target_probs[child + 1]), False


def reference_rule(update_residual=True):
    """:func:`tree_rule_reference` over rows, with tree_rejection_sample's contract."""
    def rule(tokens, parents, draft_probs, target_probs, ua, un):
        n, N = tokens.shape
        args = (tokens.tolist(), parents.tolist(), draft_probs.tolist() if draft_probs is not None else None,
                target_probs.tolist(), ua.tolist(), un.tolist())
        path = torch.full((n, N), -1, dtype=torch.long)
        num, nxt, bonus = torch.zeros(n, dtype=torch.long), torch.zeros(n, dtype=torch.long), torch.zeros(n, dtype=bool)
        for b in range(n):
            pb, nb, bb = tree_rule_reference(args[0][b], args[1][b], None if args[2] is None else args[2][b],
                                             args[3][b], args[4][b], args[5][b], update_residual)
            path[b, :len(pb)] = torch.tensor(pb, dtype=torch.long)
            num[b], nxt[b], bonus[b] = len(pb), nb, bb
        return TreeAcceptResult(path, num, nxt, bonus)
    return rule


def _random_trees(n, N, V, seed):
    """Random shapes (any earlier node as parent), padding, duplicate siblings, tokens drawn from their q."""
    g = torch.Generator().manual_seed(seed)
    parents = (torch.rand(n, N, generator=g) * (torch.arange(N) + 1)).long() - 1  # (n, N) uniform in [-1, i-1]
    dp = torch.rand(n, N, V, generator=g) ** 2
    dp /= dp.sum(-1, keepdim=True)
    tokens = sample_from_probs(dp, torch.rand(n, N, generator=g))
    tokens = torch.where(torch.rand(n, N, generator=g) < 0.15, -1, tokens)
    tp = torch.rand(n, N + 1, V, generator=g) ** 2
    tp /= tp.sum(-1, keepdim=True)
    return tokens, parents, dp, tp, torch.rand(n, N, generator=g), torch.rand(n, generator=g)


def test_tree_rejection_matches_plain_python_reference():
    tokens, parents, dp, tp, ua, un = _random_trees(3000, 8, 4, seed=5)
    for probs in (dp, None):
        a = tree_rejection_sample(tokens, parents, probs, tp, ua, un)
        b = reference_rule()(tokens, parents, probs, tp, ua, un)
        for f in ("path", "num_accepted", "next_token", "is_bonus"):
            assert torch.equal(getattr(a, f), getattr(b, f)), f
        assert (a.num_accepted >= 2).any() and (~a.is_bonus).any() and a.is_bonus.any()


def tree_round(target: TableLM, draft: TableLM, params: SamplingParams, shape: tuple[int, int], rule,
               deterministic: bool = False, prune: float = 0.0, without_replacement: bool = False):
    """One round with a depth-2 tree: c1 children of the root and c2 under each, drawn i.i.d. from the draft
    (siblings share their parent's distribution), or the draft's top-c scored one-hot (``deterministic``).
    ``prune`` (deterministic trees): second-level nodes whose path probability under the draft is below it
    are padding, as in a dynamic (EAGLE-2-style) tree, whose shape depends on the draft alone.
    ``without_replacement``: distinct sampled siblings (Gumbel top-c) still scored with q, which the rule
    does not allow: a proposal bug that the exactness test must catch."""
    c1, c2 = shape
    N = c1 + c1 * c2
    parents = torch.tensor([-1] * c1 + [i for i in range(c1) for _ in range(c2)])  # (N,)
    V = target.V

    def round_fn(seq, length, g):
        r = seq.shape[0]
        rows = torch.arange(r)
        u_draft, u_acc = torch.rand(r, N, generator=g), torch.rand(r, N, generator=g)
        u_next = torch.rand(r, generator=g)
        ext = torch.cat([seq, torch.full((r, 2), -1)], 1)  # (r, S + 2) context, then the path to a node

        def pick(q, nodes):  # (r, V) -> (r, len(nodes)) children tokens
            if deterministic:
                return q.topk(len(nodes), -1).indices
            if without_replacement:
                gumbel = -torch.log(-torch.log(torch.rand(r, V, generator=g).clamp(min=1e-12)))
                return (q.log() + gumbel).topk(len(nodes), -1).indices
            return sample_from_probs(q[:, None].expand(r, len(nodes), V), u_draft[:, nodes])

        tokens = torch.zeros(r, N, dtype=torch.long)
        dprobs, tprobs = torch.zeros(r, N, V), torch.zeros(r, N + 1, V)
        q0 = draft.probs(ext, length, params)  # (r, V)
        tprobs[:, 0] = target.probs(ext, length, params)
        first = pick(q0, list(range(c1)))
        for i in range(c1):
            tokens[:, i], dprobs[:, i] = first[:, i], q0
            e1 = ext.clone()
            e1[rows, length] = first[:, i]
            tprobs[:, i + 1] = target.probs(e1, length + 1, params)
            qi = draft.probs(e1, length + 1, params)
            kids = list(range(c1 + i * c2, c1 + (i + 1) * c2))
            second = pick(qi, kids)
            for j, node in enumerate(kids):
                tok = second[:, j]
                if prune:
                    tok = torch.where(q0[rows, first[:, i]] * qi[rows, tok] >= prune, tok, -1)
                tokens[:, node], dprobs[:, node] = tok, qi
                e2 = e1.clone()
                e2[rows, length + 1] = tok.clamp(min=0)
                tprobs[:, node + 1] = target.probs(e2, length + 2, params)
        res = rule(tokens, parents.expand(r, N), None if deterministic else dprobs, tprobs, u_acc, u_next)
        emitted = torch.cat([tokens.gather(1, res.path.clamp(min=0)), torch.zeros(r, 1, dtype=torch.long)], 1)
        emitted[rows, res.num_accepted] = res.next_token
        return emitted, res.num_accepted + 1
    return round_fn


M_TREE, N_TREE = 3, 100_000  # first three emitted tokens (125 sequences): the tree's path and its bonus
TREE_CASES = {
    # name: (draft noise, sampling params, tree shape, deterministic, prune)
    "iid_siblings": (1.0, SamplingParams(0.8), (3, 2), False, 0.0),
    "iid_bonus_heavy": (0.2, SamplingParams(0.8), (2, 3), False, 0.0),
    "top_k_children": (0.7, SamplingParams(0.8, top_p=0.9), (2, 3), True, 0.0),
    "dynamic_pruned": (0.7, SamplingParams(0.8), (3, 3), True, 0.1),
}


def tree_exactness(rule, case: str, n: int = N_TREE, seed: int = 1, without_replacement: bool = False):
    """The first three emitted tokens of tree speculative sampling with ``rule`` against the target's
    exact joint. Returns (p-value, total variation, mean accepted path length of a round)."""
    noise, params, shape, det, prune = TREE_CASES[case]
    target = TableLM(V_SMALL, M_TREE - 1 + 2, seed=21)
    draft = TableLM(V_SMALL, M_TREE - 1 + 2, seed=22, base=target, noise=noise)
    accepted = []

    def counting(*args):
        r = rule(*args)
        accepted.append(r.num_accepted)
        return r

    round_fn = tree_round(target, draft, params, shape, counting, det, prune, without_replacement)
    toks = first_tokens(round_fn, M_TREE, n, seed, room=3)
    p, tv = joint_test(toks, target, params, M_TREE)
    return p, tv, torch.cat(accepted).float().mean().item()


@pytest.mark.parametrize("case", list(TREE_CASES))
def test_tree_rejection_sampling_matches_exact_joint(case):
    p, tv, mean_path = tree_exactness(tree_rejection_sample, case)
    assert p > PASS_P, (case, p, tv)
    assert mean_path > 0.5, mean_path  # the tree's nodes really get accepted


def test_sampled_siblings_may_be_scored_one_hot():
    """Not a bug: a candidate scored as one-hot is exact however it was chosen (accept with p(x), else p
    without x); it only accepts less often than scoring it with the q it was drawn from."""
    def one_hot(tokens, parents, draft_probs, target_probs, ua, un):
        return tree_rejection_sample(tokens, parents, None, target_probs, ua, un)

    p, tv, mean_path = tree_exactness(one_hot, "iid_siblings")
    assert p > PASS_P, (p, tv)
    assert mean_path < tree_exactness(tree_rejection_sample, "iid_siblings")[2]


def node_target_from_parent(tokens, parents, draft_probs, target_probs, ua, un):
    """Each node's children (and its bonus) are checked against its parent's distribution: an off-by-one level."""
    tp = target_probs.clone()
    tp[:, 1:] = target_probs.gather(1, (parents + 1)[..., None].expand(-1, -1, target_probs.shape[-1]))
    return tree_rejection_sample(tokens, parents, draft_probs, tp, ua, un)


# name: (case, rule, rows, siblings drawn without replacement). The plain-Python mutant runs on fewer rows
TREE_MUTANTS = {
    "residual_not_updated_between_siblings": ("iid_siblings", reference_rule(update_residual=False), 30_000, False),
    "node_target_from_parent": ("iid_bonus_heavy", node_target_from_parent, N_TREE, False),
    "siblings_without_replacement_scored_with_q": ("iid_siblings", tree_rejection_sample, N_TREE, True),
}


@pytest.mark.parametrize("name", list(TREE_MUTANTS))
def test_wrong_tree_rules_fail_the_exact_joint_test(name):
    case, rule, n, without_replacement = TREE_MUTANTS[name]
    p, tv, _ = tree_exactness(rule, case, n=n, without_replacement=without_replacement)
    assert p < FAIL_P, (name, p, tv)
