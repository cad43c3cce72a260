"""fbos_kernels token losses: NumPy references, hand-computed values, finite-difference grads.

Conventions under test: log-ratio clamp to +-20; dual clip only where A < 0;
f(u) = u/(u+lam) without clipping; AReaL behaviour weight masked (not clipped)
above the cap; verl's k3 clamps; entropy in float32.
"""


import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

import fbos_kernels as K

B, T = 4, 6


# ----------------------------------------------------------------------------
# NumPy references (float64)
# ----------------------------------------------------------------------------


def _np_adv(adv):
  adv = np.asarray(adv, np.float64)
  return adv[:, None] if adv.ndim == 1 else adv


def np_ppo(logp, old, adv, eps_low=0.2, eps_high=0.28, dual_clip=None):
  A = _np_adv(adv)
  ratio = np.exp(np.clip(np.asarray(logp, np.float64) - old, -20, 20))
  l1 = -A * ratio
  l2 = -A * np.clip(ratio, 1 - eps_low, 1 + eps_high)
  loss = np.maximum(l1, l2)
  clipped = l2 > l1
  if dual_clip is not None:
    l3 = -A * dual_clip
    dual = (A < 0) & (l3 < loss)
    loss = np.where(dual, l3, loss)
    clipped = clipped | dual
  return loss, clipped


def np_offpolicy(logp, adv, lam=0.1, behaviour=None):
  logp = np.asarray(logp, np.float64)
  u = np.exp(logp) if behaviour is None else np.exp(np.clip(logp - behaviour, -20, 20))
  return -_np_adv(adv) * u / (u + lam)


def np_decoupled(logp, prox, behav, adv, eps_low=0.2, eps_high=0.28, cap=5.0):
  loss, clipped = np_ppo(logp, prox, adv, eps_low, eps_high)
  w = np.exp(np.clip(np.asarray(prox, np.float64) - behav, -20, 20))
  w = np.where(w > cap, 0.0, w)
  return w * loss, clipped


def np_kl(logp, ref, kind):
  d = np.asarray(logp, np.float64) - ref
  if kind == "k1":
    return d
  if kind == "k2":
    return 0.5 * d**2
  x = np.clip(-d, -20, 20)
  return np.clip(np.exp(x) - x - 1, -10, 10)


def np_entropy(z):
  z = np.asarray(z, np.float64)
  m = z.max(-1, keepdims=True)
  p = np.exp(z - m)
  p /= p.sum(-1, keepdims=True)
  return -np.sum(np.where(p > 0, p * np.log(np.where(p > 0, p, 1)), 0), -1)


def _data(seed, spread=1.0):
  rng = np.random.default_rng(seed)
  logp = (-np.abs(rng.normal(size=(B, T))) * 2).astype(np.float32)
  old = (logp + spread * rng.normal(size=(B, T)) * 0.3).astype(np.float32)
  adv = rng.normal(size=(B,)).astype(np.float32)
  return logp, old, adv


_ppo = jax.jit(K.ppo_clip_loss, static_argnames=("eps_low", "eps_high", "dual_clip"))
_off = jax.jit(K.offpolicy_loss, static_argnames=("lam", "denominator"))
_mixed = jax.jit(K.policy_loss, static_argnames=("eps_low", "eps_high", "dual_clip", "lam", "denominator"))
_dec = jax.jit(K.decoupled_ppo_loss, static_argnames=("eps_low", "eps_high", "behav_weight_cap"))
_kl = jax.jit(K.kl_penalty, static_argnames=("kind",))
_ent = jax.jit(K.entropy_from_logits)


# ----------------------------------------------------------------------------
# PPO clip
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("dual_clip", [None, 3.0])
@pytest.mark.parametrize("per_token_adv", [False, True])
def test_ppo_clip_matches_numpy(dual_clip, per_token_adv):
  logp, old, adv = _data(0, spread=3.0)  # many tokens outside the clip range
  if per_token_adv:
    adv = np.random.default_rng(9).normal(size=(B, T)).astype(np.float32) * 2
  loss, clipped = _ppo(logp, old, adv, eps_low=0.2, eps_high=0.28, dual_clip=dual_clip)
  ref_loss, ref_clipped = np_ppo(logp, old, adv, dual_clip=dual_clip)
  np.testing.assert_allclose(np.asarray(loss), ref_loss, rtol=1e-5, atol=1e-6)
  np.testing.assert_array_equal(np.asarray(clipped), ref_clipped)
  assert clipped.dtype == jnp.bool_ and 0 < ref_clipped.sum() < ref_clipped.size


def test_ppo_clip_higher_is_asymmetric():
  A = jnp.ones((1,))
  # ratio 1.25: inside [0.8, 1.28] -> not clipped with eps_high=0.28, clipped with symmetric 0.2
  lp, old = jnp.log(jnp.array([[1.25]])), jnp.zeros((1, 1))
  l_hi, c_hi = _ppo(lp, old, A, eps_low=0.2, eps_high=0.28, dual_clip=None)
  l_sym, c_sym = _ppo(lp, old, A, eps_low=0.2, eps_high=0.2, dual_clip=None)
  np.testing.assert_allclose([float(l_hi[0, 0]), float(l_sym[0, 0])], [-1.25, -1.2], rtol=1e-6)
  assert not bool(c_hi[0, 0]) and bool(c_sym[0, 0])


def test_dual_clip_only_for_negative_advantage():
  lp = jnp.log(jnp.array([[10.0, 10.0]]))  # ratio 10
  old = jnp.zeros((1, 2))
  adv = jnp.array([[-1.0, 1.0]])
  loss, clipped = _ppo(lp, old, adv, eps_low=0.2, eps_high=0.28, dual_clip=3.0)
  # A<0: max(10, 1.28) = 10 -> min(10, 3) = 3 ; A>0: max(-10, -1.28) = -1.28 (no dual clip)
  np.testing.assert_allclose(np.asarray(loss), [[3.0, -1.28]], rtol=1e-6)
  assert np.asarray(clipped).tolist() == [[True, True]]
  g = jax.jit(jax.grad(lambda x: jnp.sum(K.ppo_clip_loss(x, old, adv, dual_clip=3.0)[0])))(lp)
  np.testing.assert_array_equal(np.asarray(g), [[0.0, 0.0]])


def test_log_ratio_clamp_20():
  lp = jnp.array([[0.0, 0.0, -1.0]])
  old = jnp.array([[-30.0, -20.5, -1.0]])  # log ratios 30, 20.5 -> clamped to 20
  adv = jnp.array([-1.0])
  loss, _ = _ppo(lp, old, adv, eps_low=0.2, eps_high=0.28, dual_clip=None)
  np.testing.assert_allclose(np.asarray(loss), [[np.exp(20.0), np.exp(20.0), 1.0]], rtol=1e-6)
  g = jax.jit(jax.grad(lambda x: jnp.sum(K.ppo_clip_loss(x, old, adv)[0])))(lp)
  # outside the clamp the ratio is constant: no gradient; inside: -A * ratio = 1
  np.testing.assert_allclose(np.asarray(g), [[0.0, 0.0, 1.0]], atol=1e-6)
  assert np.all(np.isfinite(np.asarray(g)))


# ----------------------------------------------------------------------------
# off-policy f(u)
# ----------------------------------------------------------------------------


def test_reshaped_ratio_hand_computed():
  lam = 0.1
  log_u = jnp.log(jnp.float32(0.1))
  f_and_grad = jax.jit(jax.value_and_grad(K.reshaped_ratio), static_argnums=1)
  f, df = f_and_grad(log_u, lam)
  assert abs(float(f) - 0.5) < 1e-7
  assert abs(float(df) - 0.25) < 1e-7
  # through the loss: -A f(u) with A = 1 -> -0.5, d/dlogp = -0.25
  lp = jnp.full((1, 1), jnp.log(0.1))
  assert abs(float(_off(lp, jnp.ones(1), lam=0.1, denominator="one")[0, 0]) + 0.5) < 1e-7
  g = jax.jit(jax.grad(lambda x: K.offpolicy_loss(x, jnp.ones(1), lam=0.1)[0, 0]))(lp)
  assert abs(float(g[0, 0]) + 0.25) < 1e-7


@pytest.mark.parametrize("denominator", ["one", "behaviour"])
def test_offpolicy_matches_numpy_and_grad_formula(denominator):
  logp, behav, adv = _data(1, spread=20.0)  # some |logp - behav| > 20 for the clamp
  kw = dict(lam=0.1, denominator=denominator)
  beh = behav if denominator == "behaviour" else None
  loss = _off(logp, adv, behaviour_logp=beh, **kw)
  np.testing.assert_allclose(np.asarray(loss), np_offpolicy(logp, adv, 0.1, beh), rtol=1e-5, atol=1e-7)
  g = jax.jit(jax.grad(lambda x: jnp.sum(K.offpolicy_loss(x, adv, behaviour_logp=beh, **kw))))(logp)
  lr = logp.astype(np.float64) - (0 if beh is None else beh)
  u = np.exp(np.clip(lr, -20, 20))
  expect = -adv[:, None] * 0.1 * u / (u + 0.1) ** 2 * (np.abs(lr) < 20)  # no clipping, only the clamp
  np.testing.assert_allclose(np.asarray(g), expect, rtol=1e-4, atol=1e-7)


def test_offpolicy_behaviour_requires_logp():
  with pytest.raises(ValueError, match="behaviour_logp"):
    K.offpolicy_loss(jnp.zeros((1, 1)), jnp.ones(1), denominator="behaviour")
  with pytest.raises(ValueError, match="denominator"):
    K.offpolicy_loss(jnp.zeros((1, 1)), jnp.ones(1), denominator="two")


@pytest.mark.parametrize("denominator", ["one", "behaviour"])
def test_policy_loss_selects_per_sample(denominator):
  logp, old, adv = _data(2, spread=3.0)
  flag = np.array([True, False, True, False])
  loss, clipped = _mixed(logp, old, adv, flag, eps_low=0.2, eps_high=0.28, dual_clip=3.0, lam=0.1,
                         denominator=denominator)
  on, on_c = np_ppo(logp, old, adv, dual_clip=3.0)
  off = np_offpolicy(logp, adv, 0.1, old if denominator == "behaviour" else None)
  np.testing.assert_allclose(np.asarray(loss), np.where(flag[:, None], off, on), rtol=1e-5, atol=1e-7)
  np.testing.assert_array_equal(np.asarray(clipped), on_c & ~flag[:, None])
  # float flags behave like bool flags
  loss_f, _ = _mixed(logp, old, adv, flag.astype(np.float32), eps_low=0.2, eps_high=0.28, dual_clip=3.0,
                     lam=0.1, denominator=denominator)
  np.testing.assert_array_equal(np.asarray(loss_f), np.asarray(loss))


# ----------------------------------------------------------------------------
# AReaL decoupled
# ----------------------------------------------------------------------------


def test_decoupled_matches_numpy_and_masks_weight_above_cap():
  logp, prox, adv = _data(3, spread=2.0)
  rng = np.random.default_rng(3)
  behav = (prox - rng.normal(size=(B, T)) * 1.5).astype(np.float32)  # w = exp(N(0, 1.5)): some > 5
  loss, clipped = _dec(logp, prox, behav, adv, eps_low=0.2, eps_high=0.28, behav_weight_cap=5.0)
  ref, ref_c = np_decoupled(logp, prox, behav, adv)
  np.testing.assert_allclose(np.asarray(loss), ref, rtol=1e-5, atol=1e-6)
  np.testing.assert_array_equal(np.asarray(clipped), ref_c)
  w = np.exp(prox.astype(np.float64) - behav)
  assert np.any(w > 5) and np.all(np.asarray(loss)[w > 5] == 0.0)


def test_decoupled_hand_computed_mask_not_clip():
  lp = jnp.zeros((1, 3))
  prox = jnp.zeros((1, 3))
  behav = -jnp.log(jnp.array([[4.9, 5.0, 5.1]]))  # w = 4.9, 5.0 (kept, <= cap), 5.1 (masked)
  loss, _ = _dec(lp, prox, behav, jnp.array([1.0]), eps_low=0.2, eps_high=0.28, behav_weight_cap=5.0)
  np.testing.assert_allclose(np.asarray(loss), [[-4.9, -5.0, 0.0]], rtol=1e-5)
  # cap None: no masking
  loss, _ = _dec(lp, prox, behav, jnp.array([1.0]), eps_low=0.2, eps_high=0.28, behav_weight_cap=None)
  np.testing.assert_allclose(np.asarray(loss), [[-4.9, -5.0, -5.1]], rtol=1e-5)


def test_decoupled_equals_ppo_when_prox_is_behaviour():
  logp, old, adv = _data(4, spread=2.0)
  a, ca = _dec(logp, old, old, adv, eps_low=0.2, eps_high=0.28, behav_weight_cap=5.0)
  b, cb = _ppo(logp, old, adv, eps_low=0.2, eps_high=0.28, dual_clip=None)
  np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  np.testing.assert_array_equal(np.asarray(ca), np.asarray(cb))


# ----------------------------------------------------------------------------
# KL and entropy
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["k1", "k2", "k3"])
def test_kl_matches_numpy_with_clamps(kind):
  rng = np.random.default_rng(5)
  logp = rng.normal(size=(B, T)).astype(np.float32) * 3
  ref = rng.normal(size=(B, T)).astype(np.float32) * 3
  logp[0, :3] = [0.0, 0.0, -25.0]
  ref[0, :3] = [-30.0, 3.0, 0.0]  # d = 30 (x clamped -> k3 = e^-20 + 19 -> clamp 10), -3, -25
  got = np.asarray(_kl(logp, ref, kind=kind))
  np.testing.assert_allclose(got, np_kl(logp, ref, kind), rtol=1e-5, atol=1e-6)
  if kind == "k3":
    assert got[0, 0] == 10.0 and got[0, 2] == 10.0 and np.all(got >= 0) and np.all(got <= 10)


def test_kl_aliases_and_errors():
  a, b = jnp.array([[0.3]]), jnp.array([[-0.2]])
  for alias, kind in [("kl", "k1"), ("mse", "k2"), ("low_var_kl", "k3")]:
    assert float(_kl(a, b, kind=alias)[0, 0]) == float(_kl(a, b, kind=kind)[0, 0])
  with pytest.raises(ValueError, match="k1"):
    K.kl_penalty(a, b, "k4")


def test_entropy_from_logits_matches_numpy():
  rng = np.random.default_rng(6)
  z = rng.normal(size=(3, 5, 11)).astype(np.float32) * 4
  got = _ent(z)
  assert got.dtype == jnp.float32 and got.shape == (3, 5)
  np.testing.assert_allclose(np.asarray(got), np_entropy(z), rtol=1e-5, atol=1e-6)
  # bf16 logits are upcast; -inf (masked vocab) contributes nothing
  zb = jnp.asarray(z, jnp.bfloat16)
  np.testing.assert_allclose(np.asarray(_ent(zb)), np_entropy(np.asarray(zb, np.float32)),
                             rtol=1e-5, atol=1e-5)
  zm = z.copy()
  zm[..., 7:] = -np.inf
  np.testing.assert_allclose(np.asarray(_ent(zm)), np_entropy(z[..., :7]), rtol=1e-5, atol=1e-6)
  assert abs(float(_ent(jnp.zeros(8)) - np.log(8))) < 1e-6


# ----------------------------------------------------------------------------
# finite-difference gradient checks (float64)
# ----------------------------------------------------------------------------


def _away_from_kinks(logp, old, margin=0.02):
  """Move log-ratios away from the clip boundaries, where the loss is not differentiable."""
  lr = logp - old
  for edge in (np.log(0.8), np.log(1.28), np.log(3.0)):
    lr = np.where(np.abs(lr - edge) < margin, lr + 3 * margin, lr)
  return old + lr


@pytest.mark.parametrize("name", ["ppo", "ppo_dual", "offpolicy_one", "offpolicy_behaviour", "mixed",
                                  "decoupled", "k1", "k2", "k3", "entropy"])
def test_gradients_match_finite_differences(name):
  with jax.enable_x64(True):
    rng = np.random.default_rng(7)
    old = -np.abs(rng.normal(size=(B, T))) * 2
    logp = _away_from_kinks(old + rng.normal(size=(B, T)) * 0.3, old)
    adv = rng.normal(size=(B,))
    behav = old + rng.normal(size=(B, T)) * 0.5
    w = np.cos(np.arange(B * T)).reshape(B, T)  # random-ish projection of the [B,T] output
    fns = {
        "ppo": lambda x: K.ppo_clip_loss(x, old, adv)[0],
        "ppo_dual": lambda x: K.ppo_clip_loss(x, old, adv, dual_clip=3.0)[0],
        "offpolicy_one": lambda x: K.offpolicy_loss(x, adv),
        "offpolicy_behaviour": lambda x: K.offpolicy_loss(x, adv, behaviour_logp=behav, denominator="behaviour"),
        "mixed": lambda x: K.policy_loss(x, old, adv, np.array([1, 0, 1, 0]))[0],
        "decoupled": lambda x: K.decoupled_ppo_loss(x, old, behav, adv)[0],
        "k1": lambda x: K.kl_penalty(x, behav, "k1"),
        "k2": lambda x: K.kl_penalty(x, behav, "k2"),
        "k3": lambda x: K.kl_penalty(x, behav, "k3"),
        "entropy": lambda x: K.entropy_from_logits(x.reshape(B, 2, 3)).reshape(B, 2).repeat(3, axis=1),
    }
    f = fns[name]
    x = jnp.asarray(logp, jnp.float64)
    assert f(x).dtype == jnp.float64
    scalar = jax.jit(lambda x: jnp.sum(f(x) * w))
    check_grads(scalar, (x,), order=1, modes=("rev",), eps=1e-6, atol=1e-6, rtol=1e-6)
    g = jax.jit(jax.grad(scalar))(x)
    assert np.any(np.asarray(g) != 0)


@pytest.mark.parametrize("name", ["policy_gradient", "decoupled"])
def test_per_token_offpolicy_flag_equals_per_row(name):
  """``is_offpolicy`` [B, T] (rows packing several sequences) gives what the
  per-row flag [B] gives when every token of a row carries its row's flag; a
  flag of another shape is refused."""
  logp, old, adv = _data(5, spread=3.0)
  flag = np.array([True, False, True, False])
  kw = dict(old_logp=old, adv=adv, mask=np.ones_like(logp))
  if name == "decoupled":
    kw["prox_logp"] = old + 0.1
  fn = K.get_policy_loss(name)
  row = fn(logp, is_offpolicy=flag, **kw)
  tok = fn(logp, is_offpolicy=np.broadcast_to(flag[:, None], logp.shape), **kw)
  for a, b in zip(row, tok):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  with pytest.raises(ValueError, match="is_offpolicy"):
    fn(logp, is_offpolicy=flag[:, None], **kw)
