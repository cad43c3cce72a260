"""A NumPy oracle of the conventions in shared/ALGORITHMS.md, compared with fbos_kernels.

Written from the specification, not from the kernels' code: explicit loops in
float64, one function per rule. Every comparison runs with float32 inputs and
again with float64 inputs under ``jax.enable_x64`` (the kernels keep float64).

Conventions checked: unbiased std with eps added to the std; single-sample group
A = 0; all-equal group A = 0; non-finite rewards are invalid members; log-ratio
clamp +-20; clip-higher; dual clip only where A < 0; f(u) = u/(u+lam) and its
gradient -A lam u/(u+lam)^2; AReaL weight masked above the cap; k1/k2/k3 with
verl's clamps; entropy; GFPO kept-subset baseline and loss-mask rule; the four
aggregation modes and the empty-row rule.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fbos_kernels as K

EPS = 1e-6
TOL = {np.float32: dict(rtol=2e-5, atol=2e-6), np.float64: dict(rtol=1e-10, atol=1e-12)}


@pytest.fixture(params=[np.float32, np.float64], ids=["f32", "f64"])
def dt(request):
  if request.param is np.float64:
    with jax.enable_x64(True):
      yield np.float64
  else:
    yield np.float32


def _close(got, want, dt):
  got = np.asarray(got)
  assert got.dtype == dt, (got.dtype, dt)
  np.testing.assert_allclose(got, np.asarray(want, np.float64), **TOL[dt])


# ----------------------------------------------------------------------------
# oracle: advantages (section 1)
# ----------------------------------------------------------------------------


def oracle_std(xs):
  """Unbiased (n - 1) sample std, by hand."""
  n = len(xs)
  mu = sum(xs) / n
  return math.sqrt(sum((x - mu) ** 2 for x in xs) / (n - 1))


def oracle_advantages(rewards, valid, estimator):
  P, G = len(rewards), len(rewards[0])
  out = [[0.0] * G for _ in range(P)]
  member = [[bool(valid[p][g]) and math.isfinite(float(rewards[p][g])) for g in range(G)] for p in range(P)]
  pooled = [float(rewards[p][g]) for p in range(P) for g in range(G) if member[p][g]]
  batch_std = oracle_std(pooled) if len(pooled) >= 2 else 0.0
  for p in range(P):
    idx = [g for g in range(G) if member[p][g]]
    xs = [float(rewards[p][g]) for g in idx]
    if len(xs) < 2 or min(xs) == max(xs):  # single sample or all equal: no signal
      continue
    mu = sum(xs) / len(xs)
    for g, x in zip(idx, xs):
      if estimator == "grpo":
        out[p][g] = (x - mu) / (oracle_std(xs) + EPS)
      elif estimator == "drgrpo":
        out[p][g] = x - mu
      else:
        out[p][g] = (x - mu) / (batch_std + EPS)
  return out


def _rewards(dt):
  rng = np.random.default_rng(0)
  r = rng.normal(size=(7, 5)).astype(dt)
  v = rng.random((7, 5)) < 0.8
  v[0] = True
  v[1] = False
  v[1, 3] = True  # single-sample group
  r[2] = dt(0.1)  # all-equal group, 0.1 is not exact in binary
  v[2] = True
  r[3, 1] = np.nan  # non-finite rewards: invalid members
  r[4, 0] = np.inf
  v[3, 1] = v[4, 0] = True
  r[5] = [0.0, 1.0, 0.0, 1.0, 0.0]  # binary rewards
  v[5] = True
  return r, v


@pytest.mark.parametrize("estimator", ["grpo", "drgrpo", "batch_std"])
def test_advantages_oracle(dt, estimator):
  r, v = _rewards(dt)
  got = jax.jit(K.group_advantages, static_argnames="estimator")(r, v, estimator=estimator)
  want = oracle_advantages(r.tolist(), v.tolist(), estimator)
  _close(got, want, dt)
  got = np.asarray(got)
  assert np.all(got[1] == 0) and np.all(got[2] == 0)  # exactly 0, not ~1e-8
  assert got[3, 1] == 0 and got[4, 0] == 0


def test_unbiased_std_eps_on_std_hand_value(dt):
  adv = np.asarray(K.grpo_advantages(np.array([[0.0, 1.0]], dt), np.ones((1, 2), bool)))
  s = math.sqrt(0.5)  # unbiased std of [0, 1]; the biased one would be 0.5 and give +-1
  np.testing.assert_allclose(adv, [[-0.5 / (s + EPS), 0.5 / (s + EPS)]], **TOL[dt])
  # eps is added to the std, not under the square root: (r - mu) / sqrt(var + eps) differs at this spread
  tiny = np.array([[0.0, 1e-3]], dt)
  a = np.asarray(K.grpo_advantages(tiny, np.ones((1, 2), bool)))[0, 1]
  s = 1e-3 * math.sqrt(0.5)
  assert abs(a - 5e-4 / (s + EPS)) < 1e-4 * abs(a)
  assert abs(a - 5e-4 / math.sqrt(s * s + EPS)) > 0.1


# ----------------------------------------------------------------------------
# oracle: token losses (sections 2, 3, 8)
# ----------------------------------------------------------------------------


def oracle_ppo(lp, old, A, el=0.2, eh=0.28, c=None):
  """(loss, d loss / d lp) of one token."""
  lr = lp - old
  inside = -20 < lr < 20
  r = math.exp(min(max(lr, -20.0), 20.0))
  dr = r if inside else 0.0
  l1, l2 = -A * r, -A * min(max(r, 1 - el), 1 + eh)
  if l2 > l1:
    loss, grad = l2, 0.0
  else:
    loss, grad = l1, -A * dr
  if c is not None and A < 0 and -A * c < loss:
    loss, grad = -A * c, 0.0
  return loss, grad


def oracle_fu(lp, A, lam=0.1, behaviour=None):
  lr = lp if behaviour is None else min(max(lp - behaviour, -20.0), 20.0)
  u = math.exp(lr)
  inside = behaviour is None or -20 < lp - behaviour < 20
  return -A * u / (u + lam), (-A * lam * u / (u + lam) ** 2 if inside else 0.0)


def oracle_kl(lp, ref, kind):
  d = lp - ref
  if kind == "k1":
    return d, 1.0
  if kind == "k2":
    return 0.5 * d * d, d
  x = -d
  xc = min(max(x, -20.0), 20.0)
  k = math.exp(xc) - xc - 1
  if k > 10:
    return 10.0, 0.0
  return k, (-(math.exp(xc) - 1) if -20 < x < 20 else 0.0)


def _token_data(dt, spread=2.0, seed=1):
  rng = np.random.default_rng(seed)
  B, T = 5, 6
  old = (-np.abs(rng.normal(size=(B, T))) * 2).astype(dt)
  lp = (old + spread * rng.normal(size=(B, T))).astype(dt)
  lp[0, :3] = old[0, :3] + np.array([25.0, -25.0, 19.0], dt)  # beyond the +-20 clamp and inside it
  adv = rng.normal(size=(B,)).astype(dt)
  adv[1] = -abs(adv[1]) - 0.5  # a negative advantage row with large ratios for the dual clip
  lp[1] = old[1] + np.log(np.array([5.0, 2.0, 1.1, 0.5, 3.5, 0.9], dt))
  return lp, old, adv


def _loss_and_grad(fn, lp):
  return jax.jit(lambda x: (fn(x), jax.grad(lambda y: jnp.sum(fn(y)))(x)))(jnp.asarray(lp))


@pytest.mark.parametrize("dual_clip", [None, 3.0])
def test_ppo_clip_oracle(dt, dual_clip):
  lp, old, adv = _token_data(dt)
  loss, grad = _loss_and_grad(lambda x: K.ppo_clip_loss(x, old, adv, dual_clip=dual_clip)[0], lp)
  want = [[oracle_ppo(float(lp[b, t]), float(old[b, t]), float(adv[b]), c=dual_clip)
           for t in range(lp.shape[1])] for b in range(lp.shape[0])]
  _close(loss, [[w[0] for w in row] for row in want], dt)
  _close(grad, [[w[1] for w in row] for row in want], dt)
  if dual_clip is not None:  # only A < 0 rows are affected by the dual clip
    base = np.asarray(K.ppo_clip_loss(lp, old, adv)[0])
    changed = np.asarray(loss) != base
    assert changed.any() and np.all(adv[np.nonzero(changed)[0]] < 0)


@pytest.mark.parametrize("denominator", ["one", "behaviour"])
def test_offpolicy_oracle_value_and_gradient(dt, denominator):
  lp, beh, adv = _token_data(dt, seed=2)
  lp = np.minimum(lp, 0).astype(dt)
  b_arg = beh if denominator == "behaviour" else None
  loss, grad = _loss_and_grad(
      lambda x: K.offpolicy_loss(x, adv, lam=0.1, behaviour_logp=b_arg, denominator=denominator), lp)
  want = [[oracle_fu(float(lp[b, t]), float(adv[b]), 0.1, None if b_arg is None else float(beh[b, t]))
           for t in range(lp.shape[1])] for b in range(lp.shape[0])]
  _close(loss, [[w[0] for w in row] for row in want], dt)
  _close(grad, [[w[1] for w in row] for row in want], dt)
  # no clipping of f(u): the gradient never vanishes inside the clamp
  assert np.all(np.asarray(grad)[np.abs(lp - (0 if b_arg is None else beh)) < 20] != 0)


def test_reshaped_ratio_hand_values(dt):
  # f(0.1) = 0.5, f'(log u) = lam u/(u+lam)^2 = 0.25 at u = lam
  f, g = jax.value_and_grad(lambda x: K.reshaped_ratio(x, 0.1))(jnp.asarray(np.log(0.1), dt))
  _close(f, 0.5, dt)
  _close(g, 0.25, dt)


def test_decoupled_oracle(dt):
  lp, prox, adv = _token_data(dt, spread=0.5, seed=3)
  rng = np.random.default_rng(3)
  behav = (prox - 1.5 * rng.normal(size=prox.shape)).astype(dt)
  loss, grad = _loss_and_grad(lambda x: K.decoupled_ppo_loss(x, prox, behav, adv, behav_weight_cap=5.0)[0], lp)
  want_l, want_g = np.zeros(lp.shape), np.zeros(lp.shape)
  for b in range(lp.shape[0]):
    for t in range(lp.shape[1]):
      w = math.exp(min(max(float(prox[b, t]) - float(behav[b, t]), -20.0), 20.0))
      w = 0.0 if w > 5.0 else w  # masked, not clipped
      l, g = oracle_ppo(float(lp[b, t]), float(prox[b, t]), float(adv[b]))
      want_l[b, t], want_g[b, t] = w * l, w * g
  assert np.any(np.exp(prox.astype(np.float64) - behav) > 5)
  _close(loss, want_l, dt)
  _close(grad, want_g, dt)


@pytest.mark.parametrize("kind", ["k1", "k2", "k3"])
def test_kl_oracle_with_clamps(dt, kind):
  rng = np.random.default_rng(4)
  lp = (rng.normal(size=(4, 6)) * 3).astype(dt)
  ref = (rng.normal(size=(4, 6)) * 3).astype(dt)
  lp[0, :4] = [0.0, 0.0, -25.0, 0.0]
  ref[0, :4] = [-30.0, 3.0, 0.0, -2.0]  # x = -30 (both clamps), -3, 25 (k3 clamp), -2
  loss, grad = _loss_and_grad(lambda x: K.kl_penalty(x, ref, kind), lp)
  want = [[oracle_kl(float(lp[b, t]), float(ref[b, t]), kind) for t in range(6)] for b in range(4)]
  _close(loss, [[w[0] for w in row] for row in want], dt)
  _close(grad, [[w[1] for w in row] for row in want], dt)


def test_entropy_oracle(dt):
  rng = np.random.default_rng(5)
  z = (rng.normal(size=(3, 40)) * 4).astype(dt)
  z[1] += dt(1e4)  # large logits: relative to the max
  z[2, 30:] = -np.inf  # masked vocabulary entries contribute 0
  want = []
  for row in z.astype(np.float64):
    m = max(x for x in row if x > -np.inf)
    e = [math.exp(x - m) if x > -np.inf else 0.0 for x in row]
    s = sum(e)
    want.append(-sum(ei / s * math.log(ei / s) for ei in e if ei > 0))
  got = jax.jit(K.entropy_from_logits)(z)
  assert np.asarray(got).dtype == dt
  np.testing.assert_allclose(np.asarray(got), want, rtol=0, atol=2e-5 if dt is np.float32 else 1e-9)


# ----------------------------------------------------------------------------
# oracle: GFPO (section 4)
# ----------------------------------------------------------------------------


def oracle_gfpo(rewards, lengths, valid, k):
  """Top-k shortest valid members (ties: lower index), A over the kept subset, rejected rows A = 0."""
  P, G = len(rewards), len(rewards[0])
  keep = [[False] * G for _ in range(P)]
  for p in range(P):
    order = sorted((g for g in range(G) if valid[p][g]), key=lambda g: (lengths[p][g], g))
    for g in order[:k]:
      keep[p][g] = True
  adv = oracle_advantages(rewards, [[valid[p][g] and keep[p][g] for g in range(G)] for p in range(P)], "grpo")
  return keep, adv


def test_gfpo_oracle_and_loss_mask_rule(dt):
  rng = np.random.default_rng(6)
  P, G, T = 4, 6, 5
  r = rng.integers(0, 3, size=(P, G)).astype(dt)
  lengths = rng.integers(1, T + 1, size=(P, G))
  valid = rng.random((P, G)) < 0.9
  keep_want, adv_want = oracle_gfpo(r.tolist(), lengths.tolist(), valid.tolist(), 3)
  keep = np.asarray(K.gfpo_keep_mask(K.gfpo_scores(r, lengths, "length"), valid, 3))
  np.testing.assert_array_equal(keep, keep_want)
  _close(K.gfpo_advantages(r, valid, keep), adv_want, dt)
  # loss-mask rule: rejected rows leave the mask, so token-mean counts kept tokens only
  response_mask = (np.arange(T)[None, None, :] < lengths[..., None]) & valid[..., None]
  lm = np.asarray(K.gfpo_loss_mask(response_mask.reshape(P * G, T), keep))
  kept_tokens = sum(int(lengths[p, g]) for p in range(P) for g in range(G) if keep_want[p][g])
  loss = np.ones((P * G, T), dt)
  s, d = K.aggregate(loss, lm, "token-mean")
  assert float(d) == kept_tokens == float(s)
  assert float(d) < response_mask.sum()  # the test can fail: some tokens were rejected


# ----------------------------------------------------------------------------
# oracle: aggregation (section 2)
# ----------------------------------------------------------------------------


def oracle_aggregate(loss, mask, mode, norm_len):
  """Whole-batch loss by the definitions; empty rows are not sequences; all-masked -> 0."""
  rows = []
  tok_sum, tok_cnt = 0.0, 0.0
  for lrow, mrow in zip(loss, mask):
    cnt = sum(mrow)
    s = sum(l * m for l, m in zip(lrow, mrow) if m)
    tok_sum, tok_cnt = tok_sum + s, tok_cnt + cnt
    if cnt == 0:
      continue
    rows.append({"seq-mean-token-mean": s / cnt, "seq-mean-token-sum": s,
                 "seq-mean-token-sum-norm": s / norm_len}.get(mode))
  if mode == "token-mean":
    return tok_sum / tok_cnt if tok_cnt else 0.0
  return sum(rows) / len(rows) if rows else 0.0


@pytest.mark.parametrize("mode", K.AGGREGATION_MODES)
def test_aggregation_oracle_and_empty_rows(dt, mode):
  rng = np.random.default_rng(7)
  B, T = 6, 5
  loss = rng.normal(size=(B, T)).astype(dt)
  mask = np.arange(T)[None, :] < np.array([5, 0, 3, 1, 0, 4])[:, None]  # rows 1 and 4 are empty
  loss[~mask] = np.nan  # garbage in padding
  got = K.aggregate_loss(loss, mask, mode, norm_len=8)
  want = oracle_aggregate(np.where(mask, loss, 0).tolist(), mask.tolist(), mode, 8)
  _close(got, want, dt)
  if mode != "token-mean":
    assert float(K.aggregate(loss, mask, mode, norm_len=8)[1]) == 4.0  # empty rows are not counted
  empty = K.aggregate_loss(loss, np.zeros((B, T), bool), mode, norm_len=8)
  assert float(empty) == 0.0
