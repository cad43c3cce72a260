"""fbos_kernels advantages and GFPO: NumPy references, hand-computed cases, properties.

Conventions under test (kernels/README.md): unbiased std (ddof=1) with eps added
to the std; groups with < 2 valid members -> 0; all-equal groups -> exactly 0;
invalid entries -> 0; GFPO statistics over the kept subset only, rejected rows
get A = 0 and are removed from the loss mask.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import fbos_kernels as K

EPS = 1e-6


# ----------------------------------------------------------------------------
# independent NumPy references (float64, explicit loops)
# ----------------------------------------------------------------------------


def np_group_adv(r, valid, estimator="grpo", eps=EPS):
  r = np.asarray(r, np.float64)
  valid = np.asarray(valid).astype(bool)
  out = np.zeros_like(r)
  allv = r[valid]
  batch_std = np.std(allv, ddof=1) if allv.size >= 2 else 0.0
  for p in range(r.shape[0]):
    idx = np.nonzero(valid[p])[0]
    vals = r[p, idx]
    if len(vals) < 2 or np.all(vals == vals[0]):
      continue
    mu = vals.mean()
    if estimator == "grpo":
      out[p, idx] = (vals - mu) / (np.std(vals, ddof=1) + eps)
    elif estimator == "drgrpo":
      out[p, idx] = vals - mu
    elif estimator == "batch_std":
      out[p, idx] = (vals - mu) / (batch_std + eps)
    else:
      raise ValueError(estimator)
  return out


def np_keep_mask(scores, valid, k):
  scores = np.asarray(scores, np.float64)
  valid = np.asarray(valid).astype(bool)
  P, G = scores.shape
  k = np.broadcast_to(np.asarray(k), (P,))
  keep = np.zeros((P, G), bool)
  for p in range(P):
    idx = [g for g in range(G) if valid[p, g]]
    # stable descending sort by score: ties keep index order
    idx = sorted(idx, key=lambda g: -scores[p, g])
    for g in idx[: max(int(k[p]), 0)]:
      keep[p, g] = True
  return keep


def _random_batch(rng, P=6, G=5, p_valid=0.75, discrete=False):
  if discrete:
    r = rng.integers(0, 3, size=(P, G)).astype(np.float32) / 2.0
  else:
    r = rng.normal(size=(P, G)).astype(np.float32)
  valid = rng.random((P, G)) < p_valid
  valid[0] = True  # a full group
  valid[1] = False
  valid[1, 2] = True  # a single-sample group
  r[2] = 0.3  # an all-equal group (0.3 is not exactly representable)
  return r, valid


# jit everything: eager dispatch compiles op by op and is slow on a 2-core CPU
_adv = jax.jit(K.group_advantages, static_argnames=("estimator",))
_keep = jax.jit(K.gfpo_keep_mask)
_gfpo_adv = jax.jit(K.gfpo_advantages)
_loss_mask = jax.jit(K.gfpo_loss_mask)
_adk = jax.jit(K.adaptive_k, static_argnames=("group_size", "k_map", "warmup_steps", "warmup_k"))
_pct = jax.jit(K.masked_percentile)


# ----------------------------------------------------------------------------
# hand-computed cases
# ----------------------------------------------------------------------------


def test_hand_computed_unbiased_std():
  adv = np.asarray(_adv(np.array([[0.0, 1.0]], np.float32), np.ones((1, 2), bool)))
  # unbiased std of [0, 1] is sqrt(1/2); biased would give +-1.0
  expected = 0.5 / (np.sqrt(0.5) + EPS)
  np.testing.assert_allclose(adv, [[-expected, expected]], rtol=1e-6)
  assert abs(abs(adv[0, 0]) - 0.70710) < 1e-5 and abs(adv[0, 1] - 0.70710) < 1e-5
  assert adv[0, 0] < 0 < adv[0, 1]


@pytest.mark.parametrize("estimator", ["grpo", "drgrpo", "batch_std"])
def test_all_equal_group_is_exactly_zero(estimator):
  # one row per case: (value, number of valid members); 0.1 and 0.3 are not exact in binary
  cases = [(0.1, 3), (0.3, 5), (1.0, 8), (-7.3, 7), (0.0, 2), (1e-3, 6)]
  G = 8
  r = np.zeros((len(cases) + 1, G), np.float32)
  v = np.zeros_like(r, bool)
  for i, (value, n) in enumerate(cases):
    r[i, :n] = value
    r[i, n:] = 123.0  # invalid members must not matter
    v[i, :n] = True
  r[-1] = np.arange(G)
  v[-1] = True
  adv = np.asarray(_adv(r, v, estimator=estimator))
  assert np.all(adv[:-1] == 0.0)
  assert np.all(adv[-1] != 0.0)  # the non-degenerate group is not zeroed


def test_float_mask_equals_bool_mask():
  rng = np.random.default_rng(1)
  r, valid = _random_batch(rng)
  a = _adv(r, valid)
  b = _adv(r, valid.astype(np.float32))
  np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_unknown_estimator_lists_valid_names():
  with pytest.raises(ValueError, match="batch_std.*drgrpo.*grpo"):
    K.group_advantages(jnp.zeros((1, 2)), jnp.ones((1, 2)), estimator="ppo")
  assert K.get_advantage_estimator("drgrpo") is K.drgrpo_advantages


# ----------------------------------------------------------------------------
# against the NumPy reference
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("estimator", ["grpo", "drgrpo", "batch_std"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_matches_numpy_reference(estimator, seed):
  rng = np.random.default_rng(seed)
  r, valid = _random_batch(rng, discrete=seed == 2)
  got = np.asarray(_adv(r, valid, estimator=estimator))
  np.testing.assert_allclose(got, np_group_adv(r, valid, estimator), rtol=1e-5, atol=1e-6)


def test_vmap_and_leading_dims():
  rng = np.random.default_rng(3)
  rs, vs = zip(*[_random_batch(rng) for _ in range(3)])
  rs, vs = np.stack(rs), np.stack(vs)
  batched = jax.jit(jax.vmap(functools.partial(K.group_advantages, estimator="grpo")))(rs, vs)
  for i in range(3):
    np.testing.assert_allclose(np.asarray(batched[i]), np_group_adv(rs[i], vs[i]), rtol=1e-5, atol=1e-6)
  # [..., G] without vmap gives the same for per-group estimators
  np.testing.assert_allclose(np.asarray(_adv(rs, vs)), np.asarray(batched), rtol=0, atol=0)


def test_gradient_is_finite_including_degenerate_groups():
  rng = np.random.default_rng(4)
  r, valid = _random_batch(rng)
  for est in ("grpo", "drgrpo", "batch_std"):
    g = jax.jit(jax.grad(lambda x: jnp.sum(K.group_advantages(x, valid, estimator=est) * jnp.arange(5.0))))(
        jnp.asarray(r))
    assert np.all(np.isfinite(np.asarray(g)))
    if est != "batch_std":  # (batch_std: the group still moves the batch-wide std)
      assert np.all(np.asarray(g)[2] == 0.0)  # all-equal group: constant 0


# ----------------------------------------------------------------------------
# hypothesis properties
# ----------------------------------------------------------------------------

G_PROP = 6
_group = st.lists(st.floats(0.0, 1.0, width=32), min_size=G_PROP, max_size=G_PROP)
_mask = st.lists(st.booleans(), min_size=G_PROP, max_size=G_PROP)


def _spread_ok(r, v, min_std=0.05):
  vals = np.asarray(r, np.float64)[np.asarray(v)]
  return vals.size >= 2 and np.std(vals, ddof=1) >= min_std


@settings(max_examples=30, deadline=None)
@given(r=_group, v=_mask, c=st.floats(-8.0, 8.0), est=st.sampled_from(["grpo", "drgrpo"]))
def test_shift_invariance(r, v, c, est):
  assume(_spread_ok(r, v))
  r = np.asarray([r], np.float32)
  v = np.asarray([v])
  a0 = np.asarray(_adv(r, v, estimator=est))
  a1 = np.asarray(_adv(r + np.float32(c), v, estimator=est))
  # float32 rounding of r + c (|r + c| <= 9) is <= 6e-7 per entry; divided by std >= 0.05
  np.testing.assert_allclose(a1, a0, atol=5e-5, rtol=0)


@settings(max_examples=30, deadline=None)
@given(r=_group, v=_mask, a=st.floats(0.5, 4.0), c=st.floats(-2.0, 2.0))
def test_grpo_scale_invariance(r, v, a, c):
  assume(_spread_ok(r, v))
  r = np.asarray([r], np.float32)
  v = np.asarray([v])
  a0 = np.asarray(_adv(r, v, estimator="grpo"))
  a1 = np.asarray(_adv(np.float32(a) * r + np.float32(c), v, estimator="grpo"))
  # Exact statement: A(a r + c; eps) = A(r; eps / a). The eps-induced deviation
  # from invariance is |A| * eps |1 - 1/a| / (std + eps) <= |A| * 1e-6 * 1 / 0.05.
  std = np.std(r[v], ddof=1)
  eps_dev = np.abs(a0) * EPS * abs(1 - 1 / a) / std
  np.testing.assert_array_less(np.abs(a1 - a0), eps_dev + 5e-5)
  np.testing.assert_allclose(a1, np_group_adv(r, v, "grpo", eps=EPS / a), atol=5e-5, rtol=0)


@settings(max_examples=20, deadline=None)
@given(value=st.floats(-100, 100, width=32), n=st.integers(1, G_PROP), est=st.sampled_from(["grpo", "drgrpo", "batch_std"]))
def test_all_equal_property(value, n, est):
  r = np.full((1, G_PROP), value, np.float32)
  v = np.arange(G_PROP)[None] < n
  assert np.all(np.asarray(_adv(r, v, estimator=est)) == 0.0)


# ----------------------------------------------------------------------------
# GFPO
# ----------------------------------------------------------------------------


def test_gfpo_scores():
  r = jnp.array([[1.0, 0.0, 1.0]])
  lengths = jnp.array([[10, 5, 0]])
  np.testing.assert_array_equal(np.asarray(K.gfpo_scores(r, lengths, "length")), [[-10.0, -5.0, -0.0]])
  np.testing.assert_allclose(np.asarray(K.gfpo_scores(r, lengths, "token_efficiency")), [[0.1, 0.0, 1.0]])
  user = K.gfpo_scores(r, lengths, lambda rr, ll: rr * 100 - ll)
  np.testing.assert_array_equal(np.asarray(user), [[90.0, -5.0, 100.0]])
  with pytest.raises(ValueError, match="length"):
    K.gfpo_scores(r, lengths, "shortest")


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_gfpo_keep_mask_matches_numpy(seed):
  rng = np.random.default_rng(seed)
  P, G = 7, 8
  scores = rng.integers(0, 4, size=(P, G)).astype(np.float32)  # many ties
  valid = rng.random((P, G)) < 0.8
  for k in [0, 1, 3, G, rng.integers(0, G + 1, size=P)]:
    got = np.asarray(_keep(scores, valid, jnp.asarray(k)))
    np.testing.assert_array_equal(got, np_keep_mask(scores, valid, k))


def test_gfpo_keep_mask_ties_by_index_and_shortest_first():
  lengths = jnp.array([[30, 10, 20, 10, 50]])
  valid = jnp.array([[True, True, True, True, False]])
  keep = _keep(K.gfpo_scores(None, lengths, "length"), valid, 2)
  assert np.asarray(keep).tolist() == [[False, True, False, True, False]]
  keep = _keep(K.gfpo_scores(None, lengths, "length"), valid, 3)
  assert np.asarray(keep).tolist() == [[False, True, True, True, False]]
  # tie at the cut: lower index wins
  keep = _keep(jnp.array([[1.0, 2.0, 2.0, 2.0]]), jnp.ones((1, 4), bool), 2)
  assert np.asarray(keep).tolist() == [[False, True, True, False]]


def np_gfpo_adv(r, valid, keep, eps=EPS):
  return np_group_adv(r, np.asarray(valid) & np.asarray(keep), "grpo", eps)


@pytest.mark.parametrize("seed", [0, 1])
def test_gfpo_advantages_use_kept_subset_only(seed):
  rng = np.random.default_rng(seed)
  P, G = 5, 8
  r = rng.normal(size=(P, G)).astype(np.float32)
  valid = rng.random((P, G)) < 0.9
  lengths = rng.integers(1, 100, size=(P, G))
  keep = _keep(K.gfpo_scores(r, lengths, "token_efficiency"), valid, 4)
  adv = np.asarray(_gfpo_adv(r, valid, keep))
  np.testing.assert_allclose(adv, np_gfpo_adv(r, valid, np.asarray(keep)), rtol=1e-5, atol=1e-6)
  assert np.all(adv[~np.asarray(keep)] == 0.0)
  # differs from the full-group baseline (the rejected rewards moved mean/std)
  assert not np.allclose(adv, np_group_adv(r, valid) * np.asarray(keep), atol=1e-3)


def test_gfpo_hand_computed():
  r = jnp.array([[1.0, 0.0, 0.0, 1.0]])
  lengths = jnp.array([[5, 8, 100, 200]])
  keep = _keep(K.gfpo_scores(r, lengths, "length"), jnp.ones((1, 4), bool), 2)
  adv = np.asarray(_gfpo_adv(r, jnp.ones((1, 4), bool), keep))
  e = 0.5 / (np.sqrt(0.5) + EPS)  # kept = [1.0, 0.0] -> +-0.7071
  np.testing.assert_allclose(adv, [[e, -e, 0.0, 0.0]], rtol=1e-6)


def test_gfpo_loss_mask_removes_rejected_rows():
  keep = jnp.array([[True, False], [False, True]])
  rm = jnp.array([[[1, 1, 0], [1, 1, 1]], [[1, 0, 0], [1, 1, 0]]], jnp.float32)
  out = _loss_mask(rm, keep)
  assert out.dtype == rm.dtype
  np.testing.assert_array_equal(np.asarray(out), [[[1, 1, 0], [0, 0, 0]], [[0, 0, 0], [1, 1, 0]]])
  flat = _loss_mask(rm.reshape(4, 3).astype(bool), keep)
  assert flat.dtype == jnp.bool_
  np.testing.assert_array_equal(np.asarray(flat), np.asarray(out).reshape(4, 3).astype(bool))
  # token-mean denominators then count kept tokens only
  s, d = jax.jit(K.aggregate, static_argnames="mode")(jnp.ones((4, 3)), flat, mode="token-mean")
  assert float(d) == 4.0 and float(s) == 4.0
  with pytest.raises(ValueError):
    _loss_mask(jnp.ones((3, 3)), keep)


# ----------------------------------------------------------------------------
# adaptive-difficulty k
# ----------------------------------------------------------------------------


class NpAdaptiveK:
  """Reference: push the batch means, then bucket by np.percentile of the last H values."""

  def __init__(self, H, G=16, k_map=(8, 8, 6, 4), warmup_steps=10, warmup_k=8):
    self.H, self.G, self.k_map, self.ws, self.wk = H, G, k_map, warmup_steps, warmup_k
    self.hist, self.step = [], 0

  def __call__(self, means):
    self.hist = (self.hist + [float(np.float32(m)) for m in means])[-self.H:]
    p25, p50, p75 = np.percentile(np.asarray(self.hist), [25, 50, 75])
    ks = []
    for m in np.asarray(means, np.float32):
      b = int(m > p25) + int(m > p50) + int(m > p75)
      k = self.wk if self.step < self.ws else self.k_map[b]
      ks.append(min(max(k, 1), self.G - 1))
    self.step += 1
    return np.asarray(ks)


def test_adaptive_k_matches_numpy_reference_with_ring_wrap():
  rng = np.random.default_rng(0)
  H, P = 20, 6
  state = K.adaptive_k_init(history_size=H)
  ref = NpAdaptiveK(H, warmup_steps=2)
  step = functools.partial(_adk, group_size=16, warmup_steps=2)
  for t in range(9):  # 54 pushes: wraps the ring buffer twice
    means = (rng.integers(0, 9, size=P) / 8.0).astype(np.float32)  # ties, like binary rewards
    k, state = step(state, means)
    assert k.dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(k), ref(means))
    if t < 2:
      assert np.all(np.asarray(k) == 8)
  assert int(state.step) == 9 and int(state.count) == 54
  assert len(jax.tree.leaves(state)) == 3  # a pytree of arrays: checkpointable


def test_adaptive_k_buckets_and_clamp():
  state = K.adaptive_k_init(history_size=64)
  means = jnp.array([0.0, 0.3, 0.6, 0.9])
  # percentiles of [0, .3, .6, .9] are .225/.45/.675 -> one prompt per bucket
  k, state = _adk(state, means, warmup_steps=0)
  assert np.asarray(k).tolist() == [8, 8, 6, 4]
  # clamp to [1, G-1]
  k, _ = _adk(K.adaptive_k_init(64), means, group_size=5, k_map=(9, 9, 0, -3), warmup_steps=0)
  assert np.asarray(k).tolist() == [4, 4, 1, 1]
  # zero-reward prompts are 'very hard' even when they fill several quantiles
  k, _ = _adk(K.adaptive_k_init(64), jnp.array([0.0, 0.0, 0.0, 1.0]), warmup_steps=0)
  assert np.asarray(k).tolist() == [8, 8, 8, 4]


def test_adaptive_k_valid_mask_and_errors():
  state = K.adaptive_k_init(history_size=8)
  k, state = _adk(state, jnp.array([0.5, 9.0, 0.25]), valid=jnp.array([True, False, True]))
  assert int(state.count) == 2
  np.testing.assert_array_equal(np.asarray(state.history[:2]), [0.5, 0.25])
  with pytest.raises(ValueError, match="history_size"):
    _adk(K.adaptive_k_init(2), jnp.zeros(3))


def test_masked_percentile_matches_numpy():
  rng = np.random.default_rng(5)
  for n in [1, 2, 5, 17]:
    buf = np.full(20, np.inf, np.float32)
    buf[:n] = rng.normal(size=n)
    got = np.asarray(_pct(jnp.asarray(buf), n, jnp.array([0.0, 25.0, 50.0, 75.0, 100.0])))
    np.testing.assert_allclose(got, np.percentile(buf[:n], [0, 25, 50, 75, 100]), rtol=1e-6, atol=1e-6)
