"""fbos_kernels refuse or report what they cannot do right (issue 14, item 9).

One section per finding of the independent oracle:

1. entropy at large logits (max subtraction);
2. a non-finite reward is an invalid member (it must not touch other groups);
3. masks / valid / keep / flags / companions must match the values' shape exactly;
4. integer inputs are computed in a float dtype;
5. concrete Python hyperparameters are range-checked (ValueError naming the parameter);
6. mask before arithmetic: NaN/inf at masked positions touch neither loss nor gradient,
   including through a real (tiny, random) Qwen3 model.

Plus the loss registry's call contract (``POLICY_LOSSES`` / ``get_policy_loss``).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fbos_kernels as K

MODES = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]


def np_entropy64(z):
  z = np.asarray(z, np.float64)
  m = z.max(-1, keepdims=True)
  p = np.exp(z - m)
  p /= p.sum(-1, keepdims=True)
  return -np.sum(np.where(p > 0, p * np.log(np.where(p > 0, p, 1.0)), 0.0), -1)


# ----------------------------------------------------------------------------
# 1. entropy at large logits
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("shift", [1e4, 3e4])
def test_entropy_accurate_at_large_logits(shift):
  rng = np.random.default_rng(0)
  z = (rng.normal(size=(8, 512)) * 3 + shift).astype(np.float32)
  got = np.asarray(jax.jit(K.entropy_from_logits)(z))
  # the reference sees the same float32 inputs; only the kernel's own rounding remains
  np.testing.assert_allclose(got, np_entropy64(z), rtol=0, atol=2e-5)
  # the gradient is shift-invariant: d H / d z sums to 0 over the vocabulary
  g = jax.jit(jax.grad(lambda x: jnp.sum(K.entropy_from_logits(x))))(jnp.asarray(z))
  np.testing.assert_allclose(np.asarray(g).sum(-1), 0.0, atol=1e-5)


# ----------------------------------------------------------------------------
# 2. non-finite rewards are invalid members
# ----------------------------------------------------------------------------


def _reward_batch():
  rng = np.random.default_rng(1)
  r = rng.normal(size=(5, 6)).astype(np.float32)
  valid = np.ones((5, 6), bool)
  valid[3, 4:] = False
  return r, valid


_adv = jax.jit(K.group_advantages, static_argnames=("estimator",))
_gfpo = jax.jit(K.gfpo_advantages, static_argnames=("estimator",))


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("estimator", ["grpo", "drgrpo", "batch_std", "gfpo"])
def test_one_bad_reward_leaves_everything_else_unchanged(estimator, bad):
  r, valid = _reward_batch()
  r_bad = r.copy()
  r_bad[1, 2] = bad
  v_without = valid.copy()
  v_without[1, 2] = False  # the same batch without that member
  if estimator == "gfpo":
    keep = np.ones_like(valid)
    keep[:, 0] = False
    got = np.asarray(_gfpo(r_bad, valid, keep))
    ref = np.asarray(_gfpo(r, v_without, keep))
  else:
    got = np.asarray(_adv(r_bad, valid, estimator=estimator))
    ref = np.asarray(_adv(r, v_without, estimator=estimator))
  assert np.all(np.isfinite(got))
  assert got[1, 2] == 0.0
  np.testing.assert_array_equal(got, ref)  # exactly, every group (batch_std pools all groups)
  assert np.abs(got).max() < 10  # not the 5e5-sized values of the old bug


def test_batch_std_bad_reward_hand_case():
  """Group 0 has a NaN reward: group 1's advantages are those of the clean batch without it."""
  r = np.array([[0.0, 1.0, np.nan], [0.0, 2.0, 4.0]], np.float32)
  adv = np.asarray(_adv(r, np.ones((2, 3), bool), estimator="batch_std"))
  s = np.std([0.0, 1.0, 0.0, 2.0, 4.0], ddof=1)
  np.testing.assert_allclose(adv, [[-0.5 / (s + 1e-6), 0.5 / (s + 1e-6), 0.0],
                                   [-2 / (s + 1e-6), 0.0, 2 / (s + 1e-6)]], rtol=1e-6)
  stats = jax.jit(K.group_stats)(r, np.ones((2, 3), bool))
  np.testing.assert_array_equal(np.asarray(stats["count"]), [2.0, 3.0])


@pytest.mark.parametrize("estimator", ["grpo", "drgrpo", "batch_std"])
def test_bad_reward_gradient_is_finite(estimator):
  r, valid = _reward_batch()
  r[0, 1] = np.nan
  g = jax.jit(jax.grad(lambda x: jnp.sum(K.group_advantages(x, valid, estimator=estimator)
                                         * jnp.arange(6.0))))(jnp.asarray(r))
  assert np.all(np.isfinite(np.asarray(g))) and np.asarray(g)[0, 1] == 0.0


# ----------------------------------------------------------------------------
# 3. exact shapes
# ----------------------------------------------------------------------------


def _shape_error(fn, *shapes):
  with pytest.raises(ValueError) as info:
    fn()
  msg = str(info.value)
  for s in shapes:
    assert str(tuple(s)) in msg, (msg, s)


def test_valid_must_match_rewards_exactly():
  r = jnp.ones((4, 3))
  for est in ("grpo", "drgrpo", "batch_std"):
    _shape_error(lambda: K.group_advantages(r, jnp.ones((4, 1), bool), estimator=est), (4, 3), (4, 1))
  _shape_error(lambda: K.group_stats(r, jnp.ones((3,), bool)), (4, 3), (3,))
  _shape_error(lambda: K.gfpo_advantages(r, jnp.ones((4, 3), bool), jnp.ones((4, 1), bool)), (4, 3), (4, 1))
  _shape_error(lambda: K.gfpo_keep_mask(r, jnp.ones((1, 3), bool), 2), (4, 3), (1, 3))
  _shape_error(lambda: K.gfpo_keep_mask(r, jnp.ones((4, 3), bool), jnp.ones((4, 1), jnp.int32)), (4,), (4, 1))
  _shape_error(lambda: K.adaptive_k(K.adaptive_k_init(8), jnp.zeros(3), valid=jnp.ones((3, 1), bool)),
               (3,), (3, 1))


def test_mask_must_match_loss_exactly():
  loss = jnp.ones((4, 5))
  for mode in MODES:
    _shape_error(lambda: K.aggregate(loss, jnp.ones((4, 1), bool), mode), (4, 5), (4, 1))
  _shape_error(lambda: K.aggregate_loss(loss, jnp.ones((5,), bool)), (4, 5), (5,))
  _shape_error(lambda: K.masked_mean(loss, jnp.ones((4, 1), bool)), (4, 5), (4, 1))
  _shape_error(lambda: K.masked_sum(loss, jnp.ones((1, 5), bool)), (4, 5), (1, 5))


def test_loss_companions_must_match_logp_exactly():
  lp = jnp.zeros((4, 5))
  adv = jnp.ones((4,))
  m1 = jnp.ones((4, 1), bool)
  _shape_error(lambda: K.ppo_clip_loss(lp, jnp.zeros((4, 1)), adv), (4, 5), (4, 1))
  _shape_error(lambda: K.ppo_clip_loss(lp, lp, jnp.ones((5,))), (4, 5), (5,))
  _shape_error(lambda: K.ppo_clip_loss(lp, lp, jnp.ones((4, 1))), (4, 5), (4, 1))
  _shape_error(lambda: K.ppo_clip_loss(lp, lp, adv, mask=m1), (4, 5), (4, 1))
  _shape_error(lambda: K.offpolicy_loss(lp, adv, mask=m1), (4, 5), (4, 1))
  _shape_error(lambda: K.policy_loss(lp, lp, adv, jnp.ones((4, 1), bool)), (4,), (4, 1))
  _shape_error(lambda: K.decoupled_ppo_loss(lp, lp, jnp.zeros((1, 5)), adv), (4, 5), (1, 5))
  _shape_error(lambda: K.kl_penalty(lp, jnp.zeros((4, 1))), (4, 5), (4, 1))
  _shape_error(lambda: K.kl_penalty(lp, lp, mask=m1), (4, 5), (4, 1))
  _shape_error(lambda: K.mle_loss(lp, mask=m1), (4, 5), (4, 1))


# ----------------------------------------------------------------------------
# 4. integer inputs
# ----------------------------------------------------------------------------


def test_reshaped_ratio_integer_input():
  log_u = jnp.array([[-2, 0, 3]], jnp.int32)
  got = K.reshaped_ratio(log_u, 0.1)
  expect = 1.0 / (1.0 + 0.1 * np.exp(-np.array([[-2.0, 0.0, 3.0]])))
  assert jnp.issubdtype(got.dtype, jnp.floating)
  np.testing.assert_allclose(np.asarray(got), expect, rtol=1e-6)
  assert abs(float(K.reshaped_ratio(np.log(0.1))) - 0.5) < 1e-7  # a Python float works too


def test_integer_inputs_everywhere():
  lp_i = jnp.array([[-1, -2, 0]], jnp.int32)
  lp_f = lp_i.astype(jnp.float32)
  adv_i = jnp.array([2], jnp.int32)
  np.testing.assert_array_equal(np.asarray(K.ppo_clip_loss(lp_i, lp_i - 1, adv_i)[0]),
                                np.asarray(K.ppo_clip_loss(lp_f, lp_f - 1, 2.0 * jnp.ones(1))[0]))
  np.testing.assert_array_equal(np.asarray(K.offpolicy_loss(lp_i, adv_i)),
                                np.asarray(K.offpolicy_loss(lp_f, 2.0 * jnp.ones(1))))
  np.testing.assert_array_equal(np.asarray(K.kl_penalty(lp_i, lp_i + 1, "k3")),
                                np.asarray(K.kl_penalty(lp_f, lp_f + 1, "k3")))
  np.testing.assert_array_equal(np.asarray(K.mle_loss(lp_i)), np.asarray(-lp_f))
  r_i = jnp.array([[0, 1, 1, 3]], jnp.int32)
  np.testing.assert_array_equal(np.asarray(K.group_advantages(r_i, jnp.ones((1, 4), bool))),
                                np.asarray(K.group_advantages(r_i.astype(jnp.float32), jnp.ones((1, 4), bool))))


# ----------------------------------------------------------------------------
# 5. parameter validation
# ----------------------------------------------------------------------------

_LP = jnp.zeros((2, 3))
_ADV = jnp.ones((2,))
_R = jnp.ones((2, 3))
_V = jnp.ones((2, 3), bool)
_H = jnp.ones((1, 2, 4))
_W = jnp.ones((4, 5))
_Y = jnp.zeros((1, 2), jnp.int32)

BAD_PARAMS = [
    ("dual_clip", lambda: K.ppo_clip_loss(_LP, _LP, _ADV, dual_clip=1.0)),
    ("dual_clip", lambda: K.ppo_clip_loss(_LP, _LP, _ADV, dual_clip=0.5)),
    ("dual_clip", lambda: K.ppo_clip_loss(_LP, _LP, _ADV, dual_clip=-3.0)),
    ("dual_clip", lambda: K.policy_loss(_LP, _LP, _ADV, jnp.zeros(2, bool), dual_clip=1.0)),
    ("dual_clip", lambda: K.decoupled_ppo_loss(_LP, _LP, _LP, _ADV, dual_clip=0.9)),
    ("eps_low", lambda: K.ppo_clip_loss(_LP, _LP, _ADV, eps_low=-0.1)),
    ("eps_low", lambda: K.ppo_clip_loss(_LP, _LP, _ADV, eps_low=1.0)),
    ("eps_high", lambda: K.ppo_clip_loss(_LP, _LP, _ADV, eps_high=-0.2)),
    ("eps_high", lambda: K.decoupled_ppo_loss(_LP, _LP, _LP, _ADV, eps_high=float("nan"))),
    ("lam", lambda: K.offpolicy_loss(_LP, _ADV, lam=0.0)),
    ("lam", lambda: K.reshaped_ratio(_LP, -0.1)),
    ("lam", lambda: K.policy_loss(_LP, _LP, _ADV, jnp.ones(2, bool), lam=0)),
    ("behav_weight_cap", lambda: K.decoupled_ppo_loss(_LP, _LP, _LP, _ADV, behav_weight_cap=0.5)),
    ("denominator", lambda: K.policy_loss(_LP, _LP, _ADV, jnp.ones(2, bool), denominator="old")),
    ("kind", lambda: K.kl_penalty(_LP, _LP, "k4")),
    ("norm_len", lambda: K.aggregate(_LP, _V, "seq-mean-token-sum-norm", norm_len=0)),
    ("norm_len", lambda: K.aggregate_loss(_LP, _V, "seq-mean-token-sum-norm", norm_len=-4)),
    ("mode", lambda: K.aggregate(_LP, _V, "sum")),
    ("eps", lambda: K.group_advantages(_R, _V, eps=-1e-6)),
    ("eps", lambda: K.grpo_advantages(_R, _V, eps=-1.0)),
    ("eps", lambda: K.batch_std_advantages(_R, _V, eps=-1.0)),
    ("eps", lambda: K.gfpo_advantages(_R, _V, _V, eps=-1.0)),
    ("estimator", lambda: K.gfpo_advantages(_R, _V, _V, estimator="ppo")),
    ("metric", lambda: K.gfpo_scores(_R, _R, "longest")),
    ("group_size", lambda: K.adaptive_k(K.adaptive_k_init(8), jnp.zeros(2), group_size=1)),
    ("warmup_steps", lambda: K.adaptive_k(K.adaptive_k_init(8), jnp.zeros(2), warmup_steps=-1)),
    ("history_size", lambda: K.adaptive_k_init(0)),
    ("temperature", lambda: K.token_logprobs_and_entropy(_H, _W, _Y, temperature=0.0)),
    ("temperature", lambda: K.naive_logprobs_and_entropy(_H, _W, _Y, temperature=-1.0)),
    ("temperature", lambda: K.logprob_stats(_H, _W, _Y, temperature=0)),
    ("time_chunk", lambda: K.token_logprobs_and_entropy(_H, _W, _Y, time_chunk=0)),
    ("vocab_chunk", lambda: K.token_logprobs_and_entropy(_H, _W, _Y, vocab_chunk=0)),
]


@pytest.mark.parametrize("name,call", BAD_PARAMS, ids=[f"{n}-{i}" for i, (n, _) in enumerate(BAD_PARAMS)])
def test_meaningless_parameter_raises_naming_it(name, call):
  with pytest.raises(ValueError, match=name):
    call()


def test_boundary_values_and_traced_parameters_are_accepted():
  # dual clip off (None or 0), eps 0, eps_low just below 1
  for dc in (None, 0, 0.0):
    a, ca = K.ppo_clip_loss(_LP + 3, _LP, -_ADV, dual_clip=dc)
    b, cb = K.ppo_clip_loss(_LP + 3, _LP, -_ADV)
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    np.testing.assert_array_equal(np.asarray(ca), np.asarray(cb))
  K.ppo_clip_loss(_LP, _LP, _ADV, eps_low=0.0, eps_high=0.0)
  K.group_advantages(_R, _V, eps=0.0)
  K.decoupled_ppo_loss(_LP, _LP, _LP, _ADV, behav_weight_cap=1.0)
  # traced values pass through (they cannot be checked in Python)
  f = jax.jit(lambda lp, c, t: K.ppo_clip_loss(lp, _LP, -_ADV, dual_clip=c)[0] * t)
  np.testing.assert_allclose(np.asarray(f(_LP + np.log(10.0), 3.0, 1.0)), 3.0, rtol=1e-6)
  # a traced dual_clip of 0 means "off", as the concrete 0 does
  np.testing.assert_allclose(np.asarray(f(_LP + np.log(10.0), 0.0, 1.0)), 10.0, rtol=1e-6)
  g = jax.jit(lambda t: K.token_logprobs_and_entropy(_H, _W, _Y, temperature=t)[0])(2.0)
  assert np.all(np.isfinite(np.asarray(g)))


# ----------------------------------------------------------------------------
# 6. mask before arithmetic
# ----------------------------------------------------------------------------


def _poisoned_batch(seed=0):
  rng = np.random.default_rng(seed)
  B, T = 4, 5
  logp = (-np.abs(rng.normal(size=(B, T)))).astype(np.float32)
  old = (logp + 0.3 * rng.normal(size=(B, T))).astype(np.float32)
  ref = (logp + 0.3 * rng.normal(size=(B, T))).astype(np.float32)
  adv = rng.normal(size=(B,)).astype(np.float32)
  mask = np.arange(T)[None, :] < np.array([5, 3, 0, 2])[:, None]  # row 2 is padding
  poison = lambda x, vals: np.where(mask, x, np.resize(np.array(vals, np.float32), x.shape))  # noqa: E731
  bad = dict(old=poison(old, [np.nan, np.inf, -np.inf]), ref=poison(ref, [np.inf, np.nan]),
             logp=poison(logp, [np.nan, -np.inf, np.inf]), adv=adv.copy())
  bad["adv"][2] = np.nan
  clean = dict(old=np.where(mask, old, 0), ref=np.where(mask, ref, 0), logp=np.where(mask, logp, 0),
               adv=np.where(mask.any(1), adv, 0))
  return bad, clean, mask


LOSS_KERNELS = {
    "ppo_clip": lambda lp, d, m: K.ppo_clip_loss(lp, d["old"], d["adv"], dual_clip=3.0, mask=m)[0],
    "offpolicy_one": lambda lp, d, m: K.offpolicy_loss(lp, d["adv"], mask=m),
    "offpolicy_behaviour": lambda lp, d, m: K.offpolicy_loss(lp, d["adv"], behaviour_logp=d["old"],
                                                             denominator="behaviour", mask=m),
    "policy_loss": lambda lp, d, m: K.policy_loss(lp, d["old"], d["adv"], np.array([0, 1, 0, 1]),
                                                  denominator="behaviour", mask=m)[0],
    "decoupled": lambda lp, d, m: K.decoupled_ppo_loss(lp, d["ref"], d["old"], d["adv"], mask=m)[0],
    "k1": lambda lp, d, m: K.kl_penalty(lp, d["ref"], "k1", mask=m),
    "k2": lambda lp, d, m: K.kl_penalty(lp, d["ref"], "k2", mask=m),
    "k3": lambda lp, d, m: K.kl_penalty(lp, d["ref"], "k3", mask=m),
    "mle": lambda lp, d, m: K.mle_loss(lp, mask=m),
}


@pytest.mark.parametrize("name", list(LOSS_KERNELS))
@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_masked_nan_inf_touch_neither_loss_nor_gradient(name, mode):
  bad, clean, mask = _poisoned_batch()
  fn = LOSS_KERNELS[name]

  def total(lp, d):
    return K.aggregate_loss(fn(lp, d, mask), mask, mode)

  vg = jax.jit(jax.value_and_grad(total))
  v_bad, g_bad = vg(jnp.asarray(bad["logp"]), bad)
  v_clean, g_clean = vg(jnp.asarray(clean["logp"]), clean)
  assert np.isfinite(float(v_bad)) and np.all(np.isfinite(np.asarray(g_bad)))
  assert float(v_bad) == float(v_clean)
  np.testing.assert_array_equal(np.asarray(g_bad), np.asarray(g_clean))
  assert np.any(np.asarray(g_bad) != 0)
  # masked positions: loss exactly 0
  per_token = np.asarray(jax.jit(fn)(jnp.asarray(bad["logp"]), bad, mask))
  assert np.all(per_token[~mask] == 0.0)


def test_without_mask_argument_a_masked_nan_poisons_the_gradient():
  """Why the rule exists (and that the test above can fail): aggregate alone keeps the value clean."""
  bad, _, mask = _poisoned_batch()

  def total(lp):
    return K.aggregate_loss(K.ppo_clip_loss(lp, bad["old"], bad["adv"])[0], mask)

  v, g = jax.jit(jax.value_and_grad(total))(jnp.asarray(np.where(mask, bad["logp"], 0)))
  assert np.isfinite(float(v))
  assert not np.all(np.isfinite(np.asarray(g)))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("float_mask", [False, True])
def test_aggregate_nan_safe_forward_and_backward(mode, float_mask):
  rng = np.random.default_rng(3)
  mask = rng.random((4, 6)) < 0.6
  mask[1] = False
  loss = rng.normal(size=(4, 6)).astype(np.float32)
  loss_bad = np.where(mask, loss, np.resize(np.array([np.nan, np.inf, -np.inf], np.float32), loss.shape))
  m = mask.astype(np.float32) * 0.5 if float_mask else mask
  # the gradient w.r.t. the loss itself; arithmetic upstream of aggregate (e.g. x * x with x = inf
  # at a masked position) gives 0 * inf = NaN in its own backward: that is the loss kernels' job (mask=)
  vg = jax.jit(jax.value_and_grad(lambda x: K.aggregate_loss(x, m, mode, norm_len=6)))
  v_bad, g_bad = vg(jnp.asarray(loss_bad))
  v_clean, g_clean = vg(jnp.asarray(np.where(mask, loss, 0)))
  assert float(v_bad) == float(v_clean)
  np.testing.assert_array_equal(np.asarray(g_bad), np.asarray(g_clean))
  assert np.all(np.asarray(g_bad)[~mask] == 0.0)


def _qwen3_problem():
  """A tiny random Qwen3 and a batch whose masked positions carry NaN/inf (and its clean twin)."""
  from fbos_jax.model import qwen

  cfg = qwen.ModelConfig(vocab_size=48, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2,
                         num_kv_heads=1, head_dim=16)
  # jitted, with an rbg key: eager / threefry init compiles for ~10 s on a small CPU
  params = jax.jit(qwen.init_params, static_argnums=0)(cfg, jax.random.key(0, impl="rbg"))
  rng = np.random.default_rng(0)
  B, T = 4, 7
  R = T - 1
  tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, size=(B, T)), jnp.int32)
  attn = jnp.ones((B, T), bool)
  mask = np.arange(R)[None, :] < np.array([6, 4, 0, 2])[:, None]  # row 2: fully masked padding row
  is_off = np.array([False, True, False, True])
  # log-probs of a near-uniform random model are ~ -log(48) = -3.9; perturb them for the old/ref policies
  old = (-np.log(cfg.vocab_size) + 0.2 * rng.normal(size=(B, R))).astype(np.float32)
  ref = (-np.log(cfg.vocab_size) + 0.2 * rng.normal(size=(B, R))).astype(np.float32)
  adv = rng.normal(size=(B,)).astype(np.float32)
  fill = lambda x, vals: np.where(mask, x, np.resize(np.array(vals, np.float32), x.shape))  # noqa: E731
  bad = (fill(old, [np.nan, np.inf, -np.inf]), fill(ref, [np.inf, np.nan]), adv.copy())
  bad[2][2] = np.nan
  clean = (np.where(mask, old, 0), np.where(mask, ref, 0), np.where(mask.any(1), adv, 0))

  def objective(p, old_logp, ref_logp, a, use_mask):
    hidden, _ = qwen.forward(p, tokens, attn, cfg)
    logp, ent = K.token_logprobs_and_entropy(hidden[:, :-1], qwen.unembed_matrix(p, cfg), tokens[:, 1:],
                                             time_chunk=4, vocab_chunk=16)
    m = mask if use_mask else None
    loss, _ = K.policy_loss(logp, old_logp, a, is_off, dual_clip=3.0, denominator="behaviour", mask=m)
    kl = K.kl_penalty(logp, ref_logp, "k3", mask=m)
    pg = K.safe_divide(*K.aggregate(loss, mask, "seq-mean-token-mean"))
    return pg + 0.1 * K.aggregate_loss(kl, mask) - 0.01 * K.aggregate_loss(ent, mask)

  return objective, params, bad, clean


def test_masked_nan_through_a_real_qwen3_gives_finite_equal_gradients():
  """Tiny random Qwen3: NaN/inf old_logp/ref_logp and a NaN advantage of a padding row, all masked."""
  objective, params, bad, clean = _qwen3_problem()
  grads = jax.jit(jax.value_and_grad(lambda p, *batch: objective(p, *batch, True)))
  v_bad, g_bad = grads(params, *bad)
  v_clean, g_clean = grads(params, *clean)  # same shapes and dtypes: no second compile
  assert np.isfinite(float(v_bad)) and float(v_bad) == float(v_clean)
  leaves_bad, leaves_clean = jax.tree.leaves(g_bad), jax.tree.leaves(g_clean)
  assert len(leaves_bad) == len(leaves_clean) > 5
  for lb, lc in zip(leaves_bad, leaves_clean):
    assert np.all(np.isfinite(np.asarray(lb)))
    np.testing.assert_array_equal(np.asarray(lb), np.asarray(lc))
  assert max(float(jnp.abs(x).max()) for x in leaves_bad) > 0


@pytest.mark.slow
def test_without_mask_argument_a_masked_nan_poisons_every_qwen3_parameter():
  """The hazard the rule removes: the same batch without ``mask=`` in the loss kernels."""
  objective, params, bad, _ = _qwen3_problem()
  v, g = jax.jit(jax.value_and_grad(lambda p, *batch: objective(p, *batch, False)))(params, *bad)
  assert np.isfinite(float(v))  # aggregate keeps the value clean ...
  assert all(not np.all(np.isfinite(np.asarray(x))) for x in jax.tree.leaves(g))  # ... not the gradient


# ----------------------------------------------------------------------------
# the loss registry
# ----------------------------------------------------------------------------


def test_registry_entries_and_contract():
  for name in ("policy_gradient", "mixed", "ppo_clip", "offpolicy", "decoupled", "mle"):
    assert K.get_policy_loss(name) is K.POLICY_LOSSES[name]
  with pytest.raises(ValueError, match="mle.*policy_gradient"):
    K.get_policy_loss("grpo")
  bad, clean, mask = _poisoned_batch(1)
  lp = jnp.asarray(clean["logp"])
  old, adv, prox = clean["old"], clean["adv"], clean["ref"]
  flag = np.array([0, 1, 0, 1], bool)
  hp = dict(eps_low=0.2, eps_high=0.28, dual_clip=3.0, lam=0.1, denominator="behaviour", behav_weight_cap=5.0)

  def check(name, expect_loss, expect_clipped, **kw):
    loss, clipped = K.get_policy_loss(name)(lp, old, adv, mask=mask, **hp, **kw)
    assert loss.shape == lp.shape and clipped.dtype == jnp.bool_
    np.testing.assert_array_equal(np.asarray(loss), np.asarray(expect_loss))
    np.testing.assert_array_equal(np.asarray(clipped), np.asarray(expect_clipped))

  pg = K.policy_loss(lp, old, adv, flag, mask=mask, dual_clip=3.0, denominator="behaviour")
  check("policy_gradient", *pg, is_offpolicy=flag)
  check("mixed", *pg, is_offpolicy=flag)
  check("ppo_clip", *K.ppo_clip_loss(lp, old, adv, dual_clip=3.0, mask=mask))
  off = K.offpolicy_loss(lp, adv, behaviour_logp=old, denominator="behaviour", mask=mask)
  check("offpolicy", off, jnp.zeros(lp.shape, bool))
  dec, dec_c = K.decoupled_ppo_loss(lp, prox, old, adv, dual_clip=3.0, mask=mask)
  check("decoupled", jnp.where(flag[:, None], off, dec), dec_c & ~flag[:, None], is_offpolicy=flag,
        prox_logp=prox)
  check("decoupled", dec, dec_c, prox_logp=prox)
  check("mle", jnp.where(mask, -lp, 0.0), jnp.zeros(lp.shape, bool))
  # mle needs nothing but logp; its gradient is -mask
  g = jax.grad(lambda x: jnp.sum(K.get_policy_loss("mle")(x, mask=mask)[0]))(lp)
  np.testing.assert_array_equal(np.asarray(g), -mask.astype(np.float32))
  # policy_gradient without flags = PPO clip everywhere
  a, _ = K.get_policy_loss("policy_gradient")(lp, old, adv, mask=mask)
  np.testing.assert_array_equal(np.asarray(a), np.asarray(K.ppo_clip_loss(lp, old, adv, mask=mask)[0]))


def test_registry_refuses_inputs_it_would_drop():
  lp = jnp.zeros((2, 3))
  adv = jnp.ones((2,))
  with pytest.raises(ValueError, match="prox_logp"):
    K.get_policy_loss("decoupled")(lp, lp, adv)
  with pytest.raises(ValueError, match="prox_logp"):
    K.get_policy_loss("policy_gradient")(lp, lp, adv, prox_logp=lp)
  with pytest.raises(ValueError, match="is_offpolicy"):
    K.get_policy_loss("ppo_clip")(lp, lp, adv, is_offpolicy=jnp.ones(2, bool))
  with pytest.raises(ValueError, match="old_logp"):
    K.get_policy_loss("ppo_clip")(lp, None, adv)
  with pytest.raises(ValueError, match="adv"):
    K.get_policy_loss("policy_gradient")(lp, lp, None)
  with pytest.raises(TypeError, match="eps_hi"):
    K.get_policy_loss("ppo_clip")(lp, lp, adv, eps_hi=0.3)
  with pytest.raises(ValueError, match="dual_clip"):
    K.get_policy_loss("mle")(lp, dual_clip=0.5)
