"""Acceptance math on hand-built probabilities, and the statistical test."""

import torch

from speclab.engine.acceptance import greedy_accept, rejection_sample
from speclab.engine.sampling import SamplingParams, logits_to_probs, sample_from_probs


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


# ------------------------------------------------------------------------- statistical test
def _wrong_rule(draft_tokens, draft_probs, target_probs, num_draft, ua, un):
    """A plausible bug: on rejection, sample from the target instead of the residual."""
    r = rejection_sample(draft_tokens, draft_probs, target_probs, num_draft, ua, un)
    B = draft_tokens.shape[0]
    rows = torch.arange(B)
    fresh = sample_from_probs(target_probs[rows, r.num_accepted], un)
    r.next_token = torch.where(r.is_bonus, r.next_token, fresh)
    return r


def _emitted_first_token(rule, n=200_000, seed=0):
    g = torch.Generator().manual_seed(seed)
    V, k = 6, 3
    target = torch.tensor([0.30, 0.05, 0.25, 0.10, 0.20, 0.10])
    draft = torch.tensor([0.05, 0.40, 0.10, 0.25, 0.10, 0.10])
    dprobs = draft.expand(n, k, V)
    tprobs = target.expand(n, k + 1, V)
    drafts = sample_from_probs(dprobs, torch.rand(n, k, generator=g))
    r = rule(drafts, dprobs, tprobs, torch.full((n,), k), torch.rand(n, k, generator=g), torch.rand(n, generator=g))
    first = torch.where(r.num_accepted > 0, drafts[:, 0], r.next_token)  # the first emitted token
    emp = torch.bincount(first, minlength=V).float() / n
    return (emp - target).abs().sum().item() / 2, r  # total-variation distance


def test_rejection_sampling_matches_target_distribution():
    tv, r = _emitted_first_token(rejection_sample)
    assert tv < 0.006, tv  # sampling noise at n = 200k is ~0.002
    # acceptance probability of one draft = sum_x min(draft, target) = .05+.05+.1+.1+.1+.1 = 0.5
    acc = (r.num_accepted > 0).float().mean().item()
    assert abs(acc - 0.50) < 0.01


def test_wrong_rule_fails_the_same_test():
    tv, _ = _emitted_first_token(_wrong_rule)
    assert tv > 0.03, tv
