"""Formulas of slime_hydra.train.algorithms on small hand-computed tensors, and loss gradients
against loop-based reference implementations."""

import math

import pytest
import torch

from slime_hydra.config.schema import AlgoConfig
from slime_hydra.train.algorithms import (
    ADVANTAGE_ESTIMATORS,
    KL_ESTIMATORS,
    POLICY_LOSSES,
    REDUCTIONS,
    Reducer,
    compute_advantages,
    explained_variance,
    normalize_group_rewards,
    overlong_penalty,
    policy_loss,
    rewards_for_estimator,
    value_loss,
)

torch.manual_seed(0)


def algo(**kw) -> AlgoConfig:
    kw.setdefault("eps_clip_high", kw.get("eps_clip", 0.2))
    return AlgoConfig(name="test", **kw)


# Two samples, T=4: lengths 3 and 2 (right-padded).
MASK = torch.tensor([[1.0, 1, 1, 0], [1, 1, 0, 0]])


def close(a, b, tol=1e-5):
    return torch.allclose(
        torch.as_tensor(a, dtype=torch.float32), torch.as_tensor(b, dtype=torch.float32), atol=tol, rtol=tol
    )


# ----------------------------------------------------------------------------------- registries
def test_registries_have_every_name():
    assert set(ADVANTAGE_ESTIMATORS) == {
        "grpo",
        "gspo",
        "cispo",
        "ppo",
        "reinforce_plus_plus",
        "reinforce_plus_plus_baseline",
        "sft",
        "opd",
    }
    assert set(POLICY_LOSSES) == {"ppo_clip", "gspo", "cispo", "sft"}
    assert set(KL_ESTIMATORS) == {"k1", "k2", "k3", "low_var_kl"}
    assert REDUCTIONS == ("sample_mean", "token_mean", "token_sum")


# ------------------------------------------------------------------------------ group rewards
def test_normalize_group_rewards_hand_computed():
    r = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0])  # groups of 2, 2, 2
    out = normalize_group_rewards(r, 2, subtract_mean=True, divide_std=True)
    s = math.sqrt(0.5)  # unbiased std of {1, 0}
    assert close(out, [0.5 / (s + 1e-6), -0.5 / (s + 1e-6), -0.5 / (s + 1e-6), 0.5 / (s + 1e-6), 0, 0])
    # mean only
    assert close(normalize_group_rewards(r, 3, True, False), [2 / 3, -1 / 3, -1 / 3, 0, 0, 0])
    # std only (no mean subtraction)
    r2 = torch.tensor([2.0, 4.0])
    assert close(normalize_group_rewards(r2, 2, False, True), r2 / (math.sqrt(2) + 1e-6))


def test_normalize_group_rewards_equal_rewards_and_singletons():
    equal = normalize_group_rewards(torch.tensor([0.7, 0.7, 0.7]), 3, True, True)
    assert torch.equal(equal, torch.zeros(3))
    single = normalize_group_rewards(torch.tensor([3.0, -1.0]), 1, True, True)
    assert torch.equal(single, torch.zeros(2)) and not single.isnan().any()
    assert torch.equal(normalize_group_rewards(torch.tensor([3.0]), 1, False, True), torch.tensor([3.0]))
    with pytest.raises(ValueError):
        normalize_group_rewards(torch.ones(5), 2, True, True)


def test_overlong_penalty_hand_computed():
    """DAPO eq. 13 with L_max = 10, L_cache = 4: 0 up to 6 tokens, then -(len - 6) / 4, times the factor."""
    a = algo(overlong_buffer_len=4, overlong_penalty_factor=0.5)
    got = overlong_penalty(a, torch.tensor([3, 6, 7, 8, 10]), 10)
    assert close(got, [0.0, 0.0, -0.125, -0.25, -0.5])
    assert close(overlong_penalty(algo(), torch.tensor([3, 10]), 10), [0.0, 0.0])  # off by default


def test_rewards_for_estimator():
    r = torch.tensor([1.0, 0.0, 3.0, 3.0])
    grpo = rewards_for_estimator(algo(advantage_estimator="grpo"), r, 2)
    assert close(grpo, normalize_group_rewards(r, 2, True, True))
    drgrpo = rewards_for_estimator(algo(advantage_estimator="grpo", normalize_std=False), r, 2)
    assert close(drgrpo, [0.5, -0.5, 0, 0])
    for est in ("gspo", "cispo"):
        assert close(rewards_for_estimator(algo(advantage_estimator=est), r, 2), grpo)
    base = rewards_for_estimator(algo(advantage_estimator="reinforce_plus_plus_baseline"), r, 2)
    assert close(base, [0.5, -0.5, 0, 0])  # mean only, even with normalize_std
    for est in ("ppo", "reinforce_plus_plus"):
        assert close(rewards_for_estimator(algo(advantage_estimator=est), r, 2), r)
    assert close(rewards_for_estimator(algo(normalize_rewards=False), r, 2), r)


# --------------------------------------------------------------------------------- advantages
def test_grpo_advantages_broadcast_over_unequal_lengths():
    a = algo(advantage_estimator="grpo")
    adv, ret = compute_advantages(a, rewards=torch.tensor([0.5, -2.0]), loss_mask=MASK, old_log_probs=torch.zeros(2, 4))
    assert close(adv, [[0.5, 0.5, 0.5, 0], [-2, -2, 0, 0]])
    assert close(ret, adv)
    assert not adv.requires_grad


def test_grpo_group_of_equal_rewards_gives_zero_advantage():
    a = algo(advantage_estimator="grpo")
    r = rewards_for_estimator(a, torch.tensor([1.0, 1.0]), 2)
    adv, _ = compute_advantages(a, rewards=r, loss_mask=MASK, old_log_probs=torch.zeros(2, 4))
    assert torch.equal(adv, torch.zeros(2, 4))


def test_grpo_ignores_kl_coef_but_needs_ref():
    a = algo(advantage_estimator="grpo", kl_coef=0.1)
    with pytest.raises(ValueError):
        compute_advantages(a, rewards=torch.ones(2), loss_mask=MASK, old_log_probs=torch.zeros(2, 4))
    adv, _ = compute_advantages(
        a, rewards=torch.ones(2), loss_mask=MASK, old_log_probs=torch.zeros(2, 4), ref_log_probs=torch.ones(2, 4)
    )
    assert close(adv, MASK)


# ---------------------------------------------------------------------------------------- KL
def test_kl_estimators_hand_computed():
    lp, ref = torch.tensor([0.0, -1.0]), torch.tensor([-0.5, -1.0])
    lr = torch.tensor([0.5, 0.0])
    assert close(KL_ESTIMATORS["k1"](lp, ref), lr)
    assert close(KL_ESTIMATORS["k2"](lp, ref), lr**2 / 2)
    assert close(KL_ESTIMATORS["k3"](lp, ref), torch.exp(-lr) - 1 + lr)
    assert close(KL_ESTIMATORS["low_var_kl"](lp, ref), torch.exp(-lr) - 1 + lr)
    big = KL_ESTIMATORS["low_var_kl"](torch.tensor([-30.0]), torch.tensor([0.0]))
    assert big.item() == 10.0


# ----------------------------------------------------------------------------------- reducer
def _reference_reduce(kind, x, m, max_len):
    n, tokens = x.shape[0], m.sum()
    if kind == "sample_mean":
        return sum((x[i] * m[i]).sum() / m[i].sum() for i in range(n)) / n
    if kind == "token_mean":
        return (x * m).sum() / tokens
    return (x * m).sum() / (n * max_len)


@pytest.mark.parametrize("kind", REDUCTIONS)
def test_reducer_micro_batch_sums_equal_full_batch(kind):
    x = torch.randn(5, 6)
    m = torch.tensor(
        [[1.0, 1, 1, 1, 1, 1], [1, 1, 0, 0, 0, 0], [1, 1, 1, 0, 0, 0], [1, 0, 0, 0, 0, 0], [0, 1, 1, 1, 1, 0]]
    )
    x_pad = x.masked_fill(m == 0, float("nan"))  # padding garbage must not leak
    full = Reducer.for_step(kind, [m], max_len=8)
    assert full.num_samples == 5 and full.num_tokens == int(m.sum())
    value = full(x_pad, m)
    assert close(value, _reference_reduce(kind, x, m, 8))
    for splits in ([2, 3], [1, 1, 1, 1, 1], [4, 1]):
        red = Reducer.for_step(kind, list(m.split(splits)), max_len=8)
        parts = sum(red(xs, ms) for xs, ms in zip(x_pad.split(splits), m.split(splits)))
        assert close(parts, value)


def test_reducer_metric_is_token_mean_for_token_sum():
    red = Reducer("token_sum", num_samples=2, num_tokens=5, max_len=10)
    assert red.metric.kind == "token_mean"
    assert close(red.metric(torch.ones(2, 4), MASK), 1.0)
    same = Reducer("sample_mean", 2, 5, 10)
    assert same.metric is same
    with pytest.raises(ValueError):
        Reducer("mean", 1, 1, 1)


# ------------------------------------------------------------------------ policy loss (ppo_clip)
def _ref_ppo_clip_loss(lp, old, adv, m, eps_lo, eps_hi, c=None):
    """Loop-based PPO clip loss, per-sample token mean averaged over samples."""
    total = 0.0
    for i in range(lp.shape[0]):
        s, n = 0.0, 0
        for t in range(lp.shape[1]):
            if m[i, t] == 0:
                continue
            ratio = torch.exp(lp[i, t] - old[i, t])
            a = adv[i, t]
            loss = torch.maximum(-ratio * a, -torch.clamp(ratio, 1 - eps_lo, 1 + eps_hi) * a)
            if c is not None and a < 0:
                loss = torch.minimum(loss, -c * a)
            s, n = s + loss, n + 1
        total = total + s / n
    return total / lp.shape[0]


@pytest.mark.parametrize("dual", [None, 3.0])
def test_ppo_clip_loss_and_gradient_match_reference(dual):
    old = torch.log(torch.tensor([[0.5, 0.5, 0.5, 0.5], [0.5, 0.5, 0.5, 0.5]]))
    # ratios: 2.0 (clipped when A>0), 0.5 (clipped when A<0), 1.1 (inside), pad; 5.0 (A<0: dual clip), 1.0
    ratios = torch.tensor([[2.0, 0.5, 1.1, 1.0], [5.0, 1.0, 1.0, 1.0]])
    adv = torch.tensor([[1.0, -1.0, 1.0, 0.0], [-1.0, 2.0, 0.0, 0.0]])
    lp = (old + ratios.log()).requires_grad_(True)
    a = algo(eps_clip=0.2, eps_clip_high=0.3, eps_clip_c=dual)
    red = Reducer.for_step("sample_mean", [MASK], max_len=4)
    loss, metrics = policy_loss(a, red, log_probs=lp, old_log_probs=old, advantages=adv, loss_mask=MASK)
    lp_ref = lp.detach().clone().requires_grad_(True)
    ref = _ref_ppo_clip_loss(lp_ref, old, adv, MASK, 0.2, 0.3, dual)
    assert close(loss, ref)
    (g,) = torch.autograd.grad(loss, lp)
    (g_ref,) = torch.autograd.grad(ref, lp_ref)
    assert close(g, g_ref)
    # clipped tokens have zero gradient; the dual-clipped one too
    assert g[0, 0] == 0 and g[0, 1] == 0 and g[0, 2] != 0
    assert (g[1, 0] == 0) == (dual is not None)
    # clipfrac: sample 0 has 2 of 3 tokens clipped; sample 1 none (ratio 5 with A<0: the unclipped
    # term 5 beats the clamped 1.3, so only the dual clip acts on it)
    cf = (2 / 3 + 0 / 2) / 2
    assert close(metrics["pg_clipfrac"], cf)
    assert close(metrics["pg_loss"], ref) and close(metrics["loss"], ref)
    ppo_kl = ((-ratios.log()) * MASK).sum(-1) / MASK.sum(-1)
    assert close(metrics["ppo_kl"], ppo_kl.mean())


def test_asymmetric_clip_bounds():
    old = torch.zeros(1, 2)
    lp = torch.tensor([[math.log(1.25), math.log(0.75)]])
    adv = torch.tensor([[1.0, -1.0]])
    m = torch.ones(1, 2)
    red = Reducer("token_mean", 1, 2, 2)
    # eps_high 0.28 leaves 1.25 unclipped; eps_low 0.2 clips 0.75 -> 0.8 for A<0 (pessimistic term)
    _, met = policy_loss(
        algo(eps_clip=0.2, eps_clip_high=0.28), red, log_probs=lp, old_log_probs=old, advantages=adv, loss_mask=m
    )
    assert close(met["pg_loss"], (-1.25 + 0.8) / 2) and close(met["pg_clipfrac"], 0.5)
    _, met = policy_loss(
        algo(eps_clip=0.2, eps_clip_high=0.2), red, log_probs=lp, old_log_probs=old, advantages=adv, loss_mask=m
    )
    assert close(met["pg_loss"], (-1.2 + 0.8) / 2) and close(met["pg_clipfrac"], 1.0)


def test_entropy_and_kl_loss_terms_and_gradient():
    old = torch.randn(2, 4)
    lp = (old + 0.1 * torch.randn(2, 4)).requires_grad_(True)
    ref = old + 0.2 * torch.randn(2, 4)
    ent = torch.rand(2, 4, requires_grad=True)
    adv = torch.randn(2, 4) * MASK
    a = algo(entropy_coef=0.01, kl_loss_coef=0.04, kl_loss_type="low_var_kl")
    red = Reducer.for_step("sample_mean", [MASK], 4)
    loss, met = policy_loss(
        a, red, log_probs=lp, old_log_probs=old, advantages=adv, loss_mask=MASK, ref_log_probs=ref, entropy=ent
    )
    lp2 = lp.detach().clone().requires_grad_(True)
    ent2 = ent.detach().clone().requires_grad_(True)
    pg = _ref_ppo_clip_loss(lp2, old, adv, MASK, 0.2, 0.2)
    lr = lp2 - ref
    k3 = torch.exp(-lr) - 1 + lr

    def smean(x):
        return sum((x[i] * MASK[i]).sum() / MASK[i].sum() for i in range(2)) / 2

    expected = pg - 0.01 * smean(ent2) + 0.04 * smean(k3)
    assert close(loss, expected)
    assert close(met["kl_loss"], smean(k3)) and close(met["entropy"], smean(ent2))
    g = torch.autograd.grad(loss, [lp, ent])
    g_ref = torch.autograd.grad(expected, [lp2, ent2])
    assert close(g[0], g_ref[0]) and close(g[1], g_ref[1])
    # missing inputs
    with pytest.raises(ValueError):
        policy_loss(a, red, log_probs=lp, old_log_probs=old, advantages=adv, loss_mask=MASK, entropy=ent)
    with pytest.raises(ValueError):
        policy_loss(a, red, log_probs=lp, old_log_probs=old, advantages=adv, loss_mask=MASK, ref_log_probs=ref)


# ------------------------------------------------------------------------- ppo / GAE advantages
def _ref_gae(rewards, values, mask, kl, kl_coef, gamma, lambd):
    """Hand loop: per sample, over its response t < L (L = 1 + last masked position)."""
    B, T = mask.shape
    adv, ret = torch.zeros(B, T), torch.zeros(B, T)
    for i in range(B):
        L = max(t + 1 for t in range(T) if mask[i, t] != 0)
        r = [-kl_coef * float(kl[i, t] * mask[i, t]) for t in range(L)]
        r[L - 1] += float(rewards[i])
        last = 0.0
        for t in reversed(range(L)):
            v_next = float(values[i, t + 1]) if t + 1 < L else 0.0
            delta = r[t] + gamma * v_next - float(values[i, t])
            last = delta + gamma * lambd * last
            adv[i, t] = last
            ret[i, t] = last + float(values[i, t])
    return adv * mask, ret * mask


def test_gae_matches_hand_loop():
    mask = torch.tensor([[1.0, 1, 0, 1, 0, 0], [1, 1, 1, 1, 1, 1], [1, 0, 0, 0, 0, 0]])  # interior 0, full, length 1
    values = torch.randn(3, 6)
    values[0, 4:] = 99.0  # values on padding must be ignored
    old, ref = torch.randn(3, 6), torch.randn(3, 6)
    rewards = torch.tensor([1.0, -0.5, 2.0])
    a = algo(advantage_estimator="ppo", gamma=0.9, lambd=0.8, kl_coef=0.1, kl_loss_type="k1")
    adv, ret = compute_advantages(
        a, rewards=rewards, loss_mask=mask, old_log_probs=old, ref_log_probs=ref, values=values
    )
    exp_adv, exp_ret = _ref_gae(rewards, values, mask, old - ref, 0.1, 0.9, 0.8)
    assert close(adv, exp_adv) and close(ret, exp_ret)
    # gamma = lambda = 1 and V = 0: the advantage is the reward-to-go
    a1 = algo(advantage_estimator="ppo")
    adv, ret = compute_advantages(a1, rewards=rewards, loss_mask=mask, old_log_probs=old, values=torch.zeros(3, 6))
    assert close(adv, rewards[:, None] * mask) and close(ret, adv)


def test_ppo_needs_values():
    with pytest.raises(ValueError):
        compute_advantages(
            algo(advantage_estimator="ppo"), rewards=torch.ones(2), loss_mask=MASK, old_log_probs=torch.zeros(2, 4)
        )


# --------------------------------------------------------------------------------- REINFORCE++
def test_reinforce_plus_plus_discounted_returns():
    mask = torch.tensor([[1.0, 1, 1, 0], [1, 0, 1, 0]])
    old = torch.tensor([[0.1, 0.2, 0.3, 5.0], [0.4, 5.0, 0.6, 5.0]])
    ref = torch.zeros(2, 4)
    a = algo(advantage_estimator="reinforce_plus_plus", kl_coef=0.5, kl_loss_type="k1", gamma=0.5)
    adv, ret = compute_advantages(
        a, rewards=torch.tensor([1.0, 2.0]), loss_mask=mask, old_log_probs=old, ref_log_probs=ref
    )
    # sample 0: r = [-0.05, -0.1, -0.15 + 1]; G2 = 0.85, G1 = -0.1 + 0.425, G0 = -0.05 + 0.5 * 0.325
    # sample 1: r = [-0.2, 0 (masked), -0.3 + 2]; G2 = 1.7, G1 = 0.85 (masked out), G0 = -0.2 + 0.425
    assert close(adv, [[-0.05 + 0.1625, 0.325, 0.85, 0], [0.225, 0, 1.7, 0]])
    assert close(ret, adv)


def test_reinforce_plus_plus_baseline_and_whitening():
    mask = MASK
    old, ref = torch.zeros(2, 4), torch.zeros(2, 4)
    old[0, 0] = 0.2
    a = algo(advantage_estimator="reinforce_plus_plus_baseline", kl_coef=0.5, kl_loss_type="k1")
    adv, ret = compute_advantages(
        a, rewards=torch.tensor([0.5, -0.5]), loss_mask=mask, old_log_probs=old, ref_log_probs=ref
    )
    assert close(adv, [[0.4, 0.5, 0.5, 0], [-0.5, -0.5, 0, 0]]) and close(ret, adv)
    # whitening: masked mean 0, unbiased masked variance 1, padding stays 0
    a.normalize_advantages = True
    w, ret_w = compute_advantages(
        a, rewards=torch.tensor([0.5, -0.5]), loss_mask=mask, old_log_probs=old, ref_log_probs=ref
    )
    vals = w[mask.bool()]
    raw = adv[mask.bool()]
    assert close(vals, (raw - raw.mean()) / torch.sqrt(raw.var() + 1e-8))
    assert close(vals.mean(), 0) and close(vals.std(), 1, 1e-4)
    assert torch.all(w[~mask.bool()] == 0)
    assert close(ret_w, adv)  # returns are not whitened


# ------------------------------------------------------------------------------------- GSPO
def test_gspo_geometric_mean_ratio_broadcast_and_gradient():
    old = torch.log(torch.tensor([[0.5, 0.4, 0.3, 0.9], [0.2, 0.6, 0.9, 0.9]]))
    lp = (old + torch.tensor([[0.1, -0.3, 0.05, 7.0], [0.02, -0.01, 3.0, 3.0]])).requires_grad_(True)
    adv = torch.tensor([[1.0, 1.0, 1.0, 0.0], [-1.0, -1.0, 0.0, 0.0]])
    a = algo(policy_loss="gspo", advantage_estimator="gspo", eps_clip=0.03, eps_clip_high=0.04)
    red = Reducer.for_step("sample_mean", [MASK], 4)
    loss, met = policy_loss(a, red, log_probs=lp, old_log_probs=old, advantages=adv, loss_mask=MASK)

    lp2 = lp.detach().clone().requires_grad_(True)
    total = 0.0
    clipped = []
    for i in range(2):
        L = int(MASK[i].sum())
        s = torch.exp(sum(lp2[i, t] - old[i, t] for t in range(L)) / L)  # geometric mean of token ratios
        per_token = [torch.maximum(-s * adv[i, t], -s.clamp(0.97, 1.04) * adv[i, t]) for t in range(L)]
        clipped.append(float((-s.clamp(0.97, 1.04) * adv[i, 0]) > (-s * adv[i, 0])))
        total = total + sum(per_token) / L
    expected = total / 2
    assert close(loss, expected)
    (g,) = torch.autograd.grad(loss, lp)
    (g_ref,) = torch.autograd.grad(expected, lp2)
    assert close(g, g_ref)
    assert torch.all(g[~MASK.bool()] == 0)
    # sample 0: s = exp(-0.05) ~ 0.951 < 0.97 with A>0 -> not clipped (pessimistic); sample 1: s = exp(0.005) inside
    assert close(met["pg_clipfrac"], sum(clipped) / 2)
    seq_kl = torch.tensor([0.05, -0.005])
    assert close(met["ppo_kl"], seq_kl.mean())


def test_gspo_sequence_ratio_clips_whole_sequence():
    old = torch.zeros(1, 3)
    lp = torch.tensor([[0.3, 0.3, 0.3]], requires_grad=True)  # s = exp(0.3) > 1.04
    a = algo(policy_loss="gspo", eps_clip=0.03, eps_clip_high=0.04)
    loss, met = policy_loss(
        a,
        Reducer("token_mean", 1, 3, 3),
        log_probs=lp,
        old_log_probs=old,
        advantages=torch.ones(1, 3),
        loss_mask=torch.ones(1, 3),
    )
    assert close(met["pg_clipfrac"], 1.0) and close(loss, -1.04)
    (g,) = torch.autograd.grad(loss, lp)
    assert torch.all(g == 0)


# ------------------------------------------------------------------------------------- CISPO
def test_cispo_stop_gradient_semantics():
    old = torch.zeros(2, 4)
    ratios = torch.tensor([[6.0, 0.5, 1.2, 1.0], [0.1, 2.0, 1.0, 1.0]])
    lp = ratios.log().requires_grad_(True)
    adv = torch.tensor([[1.0, -2.0, 0.5, 0.0], [1.0, -1.0, 0.0, 0.0]])
    a = algo(policy_loss="cispo", advantage_estimator="cispo", eps_clip=1.0, eps_clip_high=4.0)
    red = Reducer.for_step("token_mean", [MASK], 4)
    loss, met = policy_loss(a, red, log_probs=lp, old_log_probs=old, advantages=adv, loss_mask=MASK)
    w = ratios.clamp(0.0, 5.0)  # only 6.0 is truncated
    expected = -(w * adv * lp.detach() * MASK).sum() / 5
    assert close(loss, expected)
    (g,) = torch.autograd.grad(loss, lp)
    # d/d logp of -sg(w) A logp is -w A: clipped tokens keep a gradient (unlike PPO)
    assert close(g, -(w * adv * MASK) / 5)
    assert g[0, 0] != 0
    assert close(met["pg_clipfrac"], 1 / 5)
    # a lower bound is active when eps_clip < 1
    a.eps_clip = 0.5
    _, met = policy_loss(a, red, log_probs=lp, old_log_probs=old, advantages=adv, loss_mask=MASK)
    assert close(met["pg_clipfrac"], 2 / 5)  # 6.0 and 0.1


# --------------------------------------------------------------------------------------- TIS
def test_tis_clamps_weights_and_scales_loss():
    old = torch.log(torch.tensor([[0.5, 0.5, 0.5, 0.5], [0.5, 0.5, 0.5, 0.5]]))
    rollout = old - torch.log(
        torch.tensor([[3.0, 0.5, 1.0, 9.0], [0.05, 1.5, 1.0, 9.0]])
    )  # tis = [3, .5, 1 | .05, 1.5]
    lp = old.clone().requires_grad_(True)
    adv = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0]])
    a = algo(use_tis=True, tis_clip=2.0, tis_clip_low=0.1)
    red = Reducer.for_step("sample_mean", [MASK], 4)
    loss, met = policy_loss(
        a, red, log_probs=lp, old_log_probs=old, advantages=adv, loss_mask=MASK, rollout_log_probs=rollout
    )
    w = torch.tensor([[2.0, 0.5, 1.0, 0.0], [0.1, 1.5, 0.0, 0.0]])
    # ratio 1: pg_t = -A_t, times w_t
    expected = ((-(w * adv)[0, :3]).mean() + (-(w * adv)[1, :2]).mean()) / 2
    assert close(loss, expected)
    assert close(met["tis"], ((3 + 0.5 + 1) / 3 + (0.05 + 1.5) / 2) / 2)
    assert close(met["tis_clipfrac"], (1 / 3 + 1 / 2) / 2)
    (g,) = torch.autograd.grad(loss, lp)
    assert close(g[0, :3], -w[0, :3] / 3 / 2)
    with pytest.raises(ValueError):
        policy_loss(a, red, log_probs=lp, old_log_probs=old, advantages=adv, loss_mask=MASK)


def test_unbiased_kl_weights_kl_by_ratio():
    old = torch.zeros(1, 2)
    lp = torch.tensor([[0.2, -0.1]], requires_grad=True)
    ref = torch.tensor([[0.0, 0.3]])
    a = algo(kl_loss_coef=1.0, kl_loss_type="k2", use_unbiased_kl=True)
    red = Reducer("token_mean", 1, 2, 2)
    loss, met = policy_loss(
        a,
        red,
        log_probs=lp,
        old_log_probs=old,
        advantages=torch.zeros(1, 2),
        loss_mask=torch.ones(1, 2),
        ref_log_probs=ref,
    )
    lp2 = lp.detach().clone().requires_grad_(True)
    expected = (torch.exp(lp2 - old) * (lp2 - ref) ** 2 / 2).mean()
    assert close(met["kl_loss"], expected) and close(loss, expected)
    assert close(torch.autograd.grad(loss, lp)[0], torch.autograd.grad(expected, lp2)[0])


def _expected_kl_loss_grad(kl_loss_type: str, unbiased: bool, logits, ref_log_probs):
    """E_{a ~ pi}[grad of the KL loss term at token a], on-policy (old = pi), exact over a small vocabulary."""
    theta = logits.clone().requires_grad_(True)
    log_pi = theta.log_softmax(-1)
    pi = log_pi.exp().detach()
    a = algo(kl_loss_coef=1.0, kl_loss_type=kl_loss_type, use_unbiased_kl=unbiased)
    total = 0.0
    for tok in range(len(pi)):
        lp = log_pi[tok].reshape(1, 1)
        loss, _ = policy_loss(a, Reducer("token_mean", 1, 1, 1), log_probs=lp, old_log_probs=lp.detach(),
                              advantages=torch.zeros(1, 1), loss_mask=torch.ones(1, 1),
                              ref_log_probs=ref_log_probs[tok].reshape(1, 1))
        total = total + pi[tok] * loss
    return torch.autograd.grad(total, theta)[0]


def test_kl_loss_gradients_in_expectation():
    """Why algo.kl_loss_type=k1 is refused as a loss (train/algorithms/rules.py) unless use_unbiased_kl: its
    expected gradient is 0. k2 and k1 with the ratio weight give grad KL(pi || ref); low_var_kl (k3) gives
    grad KL(ref || pi), also a pull towards the reference."""
    logits = torch.tensor([1.0, 0.2, -0.5])
    ref = torch.tensor([0.1, 0.7, -0.3]).log_softmax(-1)
    theta = logits.clone().requires_grad_(True)
    log_pi = theta.log_softmax(-1)
    forward_kl = torch.autograd.grad((log_pi.exp() * (log_pi - ref)).sum(), theta)[0]
    theta = logits.clone().requires_grad_(True)
    reverse_kl = torch.autograd.grad((ref.exp() * (ref - theta.log_softmax(-1))).sum(), theta)[0]
    assert forward_kl.abs().max() > 0.05
    assert close(_expected_kl_loss_grad("k1", False, logits, ref), torch.zeros(3), tol=1e-6)
    assert close(_expected_kl_loss_grad("k1", True, logits, ref), forward_kl)
    assert close(_expected_kl_loss_grad("k2", False, logits, ref), forward_kl)
    assert close(_expected_kl_loss_grad("low_var_kl", False, logits, ref), reverse_kl)


@pytest.mark.parametrize("kind", REDUCTIONS)
def test_policy_loss_micro_batches_sum_to_full_step(kind):
    B, T = 6, 5
    mask = (torch.rand(B, T) > 0.3).float()
    mask[:, 0] = 1
    old, ref, rollout = torch.randn(B, T), torch.randn(B, T), torch.randn(B, T)
    lp = (old + 0.2 * torch.randn(B, T)).requires_grad_(True)
    adv, ent = torch.randn(B, T), torch.rand(B, T)
    a = algo(loss_reduction=kind, kl_loss_coef=0.1, entropy_coef=0.01, use_tis=True, eps_clip_c=3.0)
    kw = dict(
        old_log_probs=old, advantages=adv, loss_mask=mask, ref_log_probs=ref, rollout_log_probs=rollout, entropy=ent
    )
    full_red = Reducer.for_step(kind, [mask], max_len=T + 3)
    full, full_met = policy_loss(a, full_red, log_probs=lp, **kw)
    (g_full,) = torch.autograd.grad(full, lp)
    split = [2, 1, 3]
    red = Reducer.for_step(kind, list(mask.split(split)), max_len=T + 3)
    total, sums = 0.0, {}
    for idx in torch.arange(B).split(split):
        part, met = policy_loss(a, red, log_probs=lp[idx], **{k: v[idx] for k, v in kw.items()})
        total = total + part
        for k, v in met.items():
            sums[k] = sums.get(k, 0.0) + v
    (g_split,) = torch.autograd.grad(total, lp)
    assert close(total, full) and close(g_split, g_full)
    assert (
        set(sums)
        == set(full_met)
        == {"pg_loss", "pg_clipfrac", "ppo_kl", "entropy", "kl_loss", "tis", "tis_clipfrac", "loss"}
    )
    for k in sums:
        assert close(sums[k], full_met[k]), k
    assert close(full_met["loss"], full_met["pg_loss"] - 0.01 * full_red(ent, mask) + 0.1 * full_met["kl_loss"])


# ------------------------------------------------------------------------------------- critic
def test_value_loss_clipping_and_gradient():
    old = torch.tensor([[0.0, 0.0, 0.0, 0.0], [1.0, 1.0, 0.0, 0.0]])
    values = torch.tensor([[0.5, 0.1, -0.3, 7.0], [1.05, 0.5, 0.0, 0.0]], requires_grad=True)
    returns = torch.tensor([[1.0, 0.0, -1.0, 0.0], [0.0, 2.0, 0.0, 0.0]])
    a = algo(value_clip=0.2)
    red = Reducer.for_step("sample_mean", [MASK], 4)
    loss, met = value_loss(a, red, values=values, old_values=old, returns=returns, loss_mask=MASK)
    v2 = values.detach().clone().requires_grad_(True)
    per = []
    for i in range(2):
        s = 0.0
        for t in range(int(MASK[i].sum())):
            vc = old[i, t] + torch.clamp(v2[i, t] - old[i, t], -0.2, 0.2)
            s = s + torch.maximum((vc - returns[i, t]) ** 2, (v2[i, t] - returns[i, t]) ** 2)
        per.append(s / MASK[i].sum())
    expected = sum(per) / 2
    assert close(loss, expected) and close(met["value_loss"], expected)
    assert close(torch.autograd.grad(loss, values)[0], torch.autograd.grad(expected, v2)[0])
    # |V - V_old| > 0.2 at [0,0] (0.5), [0,2] (0.3) and [1,1] (0.5 - 1 = -0.5)
    assert close(met["value_clipfrac"], (2 / 3 + 1 / 2) / 2)


def test_explained_variance():
    ret = torch.tensor([[1.0, 2.0, 3.0, 100.0], [4.0, 5.0, -100.0, 0.0]])
    assert close(explained_variance(ret, ret, MASK), 1.0)
    const = torch.full_like(ret, 3.0)
    assert close(explained_variance(const, ret, MASK), 0.0)
    v = ret + torch.tensor([[1.0, -1.0, 1.0, 0.0], [-1.0, 1.0, 0.0, 0.0]])
    # Var[R] over {1..5} = 2, residuals {1,-1,1,-1,1}: mean 0.2, var 0.96
    assert close(explained_variance(v, ret, MASK), 1 - 0.96 / 2)
    assert explained_variance(ret, torch.ones(2, 4), MASK).isnan()


def test_bool_mask_bf16_inputs_and_helpers():
    from slime_hydra.train.algorithms import needs_critic, needs_ref

    lp = torch.zeros(2, 4, dtype=torch.bfloat16, requires_grad=True)
    red = Reducer.for_step("sample_mean", [MASK.bool()], 4)
    loss, _ = policy_loss(
        algo(), red, log_probs=lp, old_log_probs=torch.zeros(2, 4), advantages=MASK, loss_mask=MASK.bool()
    )
    assert loss.dtype == torch.float32 and close(loss, -1.0)
    loss.backward()
    assert lp.grad.dtype == torch.bfloat16
    assert needs_ref(algo(kl_loss_coef=0.1)) and needs_ref(algo(kl_coef=0.1)) and not needs_ref(algo())
    assert needs_critic(algo(advantage_estimator="ppo")) and not needs_critic(algo())


def test_whitening_an_equal_batch_gives_zeros_not_nan():
    """REINFORCE++ on a batch where every sample got the same reward: variance 0, the eps keeps it finite."""
    a = algo(advantage_estimator="reinforce_plus_plus_baseline", normalize_advantages=True, normalize_rewards=False)
    adv, _ = compute_advantages(a, rewards=torch.tensor([1.0, 1.0]), loss_mask=MASK, old_log_probs=torch.zeros(2, 4))
    assert torch.equal(adv, torch.zeros(2, 4))
