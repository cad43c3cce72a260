"""The combined EPA+ECC update step on hand-built batches."""

import jax
import jax.numpy as jnp
import ml_collections as mlc
import numpy as np
import optax
import pytest

from fbos_jax.model import qwen
from fbos_jax.rl import assemble
from fbos_jax.testing import toy
from fbos_jax.rl import batch as batch_lib
from fbos_jax.rl import config as C
from fbos_jax.rl import objectives as O
from fbos_jax.rl import update as U
from fbos_jax.rl.state import TrainState

CFG, P_LEN, R_LEN = toy.CFG, toy.P_LEN, toy.R_LEN
_params, _batch, _empty, _state = toy.params, toy.batch, toy.empty, toy.state
_step, _grads = toy.step, toy.grads


def test_all_equal_rewards_give_zero_update():
  rewards = np.ones((2, 4), np.float32)
  adv = assemble.advantages(rewards, np.ones_like(rewards, bool), "grpo", 1e-6).reshape(-1)
  assert np.all(adv == 0)
  params = _params()
  step = _step()
  epa = _batch(8, 1, adv=adv)
  ecc = _batch(4, 2, adv=np.zeros(4, np.float32))
  new, m = step(_state(params), epa, ecc)
  for a, b in zip(jax.tree.leaves(new.params), jax.tree.leaves(params)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert float(m.grad_norm) == 0.0


def test_w_ecc_zero_gives_ecc_batch_no_gradient():
  params = _params()
  epa = _batch(6, 3)
  g_a = _grads(params, epa, _batch(4, 4), [1.0, 0.0])
  g_b = _grads(params, epa, _batch(4, 5), [1.0, 0.0])  # a different ECC batch
  for a, b in zip(jax.tree.leaves(g_a), jax.tree.leaves(g_b)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  # and the ECC batch does matter once its weight is on
  g_c = _grads(params, epa, _batch(4, 4), [1.0, 1.0])
  assert any(not np.allclose(a, c) for a, c in zip(jax.tree.leaves(g_a), jax.tree.leaves(g_c)))


@pytest.mark.parametrize("denominator", ["one", "behaviour"])
def test_offpolicy_gradient_has_f_u_form(denominator):
  """∇L = Σ_t −A·λ·u_t/(u_t+λ)² ∇log π_t / D for an off-policy row (no clipping)."""
  params = _params()
  lam = 0.1
  lc = C.LossConfig(offpolicy_lambda=lam, offpolicy_ratio_denominator=denominator)
  epa = _batch(6, 7, adv=np.asarray([1.5, -0.7, 0.4, 0.9, -1.2, 0.3], np.float32),
               offpolicy=np.ones(6, bool))
  ecc = _batch(4, 8)  # weight 0: no gradient (test_w_ecc_zero_gives_ecc_batch_no_gradient)
  g = _grads(params, epa, ecc, [1.0, 0.0], lc)

  def logp_fn(p):
    return O.sequence_logprobs(p, CFG, epa, compute_entropy=False)[0]

  logp, vjp = jax.vjp(logp_fn, params)
  logp = np.asarray(logp, np.float64)
  mask = np.asarray(epa.loss_mask, np.float64)
  log_u = logp - (np.asarray(epa.old_logp) if denominator == "behaviour" else 0.0)
  u = np.exp(log_u)
  a = np.asarray(epa.advantages, np.float64)[:, None]
  # d f(u) / d log π = u * f'(u) = u * λ / (u + λ)^2
  coeff = -a * lam * u / (u + lam) ** 2 * mask / mask.sum()
  (g_ref,) = vjp(jnp.asarray(coeff, jnp.float32))
  for x, y in zip(jax.tree.leaves(g), jax.tree.leaves(g_ref)):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=2e-4, atol=1e-7)


def test_grpo_step_matches_from_scratch_reference():
  """One GRPO step through assemble + make_policy_batch + update_step equals a
  hand-written GRPO step (full logits, log_softmax, unbiased-std advantages,
  PPO clip, token-mean, AdamW)."""
  rng = np.random.default_rng(0)
  P, G = 3, 4
  rewards = rng.integers(0, 2, size=(P, G)).astype(np.float32)
  rewards[0] = [1, 0, 0, 1]
  b0 = _batch(P * G, 11)
  params = _params(1)
  # the "sampler" log-probs: current params slightly perturbed, so ratios != 1
  noisy = jax.tree.map(lambda x: x + 0.01 * jax.random.normal(jax.random.key(5), x.shape), params)
  old_logp = np.asarray(O.sequence_logprobs(noisy, CFG, b0, compute_entropy=False)[0])
  adv = assemble.advantages(rewards, np.ones((P, G), bool), "grpo", 1e-6).reshape(-1)
  epa = batch_lib.PolicyBatch(tokens=b0.tokens, attn_mask=b0.attn_mask, loss_mask=b0.loss_mask,
                              advantages=jnp.asarray(adv), old_logp=jnp.asarray(old_logp),
                              is_offpolicy=b0.is_offpolicy)
  ecc = _empty(2)
  sgd = ("sgd", 1.0)  # plain SGD: Adam's g/|g| would amplify float noise in tiny grads
  opt = toy.optimizer(*sgd)
  step = _step(sgd, lc=C.LossConfig(eps_low=0.2, eps_high=0.28))
  new, _ = step(_state(params, sgd), epa, ecc)

  # ---- from scratch
  r = rewards.astype(np.float64)
  ref_adv = (r - r.mean(1, keepdims=True)) / (r.std(1, ddof=1, keepdims=True) + 1e-6)
  ref_adv = np.where(r.std(1, keepdims=True) == 0, 0.0, ref_adv).reshape(-1)
  np.testing.assert_allclose(adv, ref_adv, rtol=1e-6)
  toks = np.asarray(b0.tokens)
  mask = np.asarray(b0.loss_mask)

  def ref_loss(p):
    logits = qwen.apply(p, jnp.asarray(toks), jnp.asarray(b0.attn_mask), CFG)
    lp = jax.nn.log_softmax(logits[:, P_LEN - 1:P_LEN - 1 + R_LEN], -1)
    lp = jnp.take_along_axis(lp, jnp.asarray(toks[:, P_LEN:])[..., None], -1)[..., 0]
    ratio = jnp.exp(lp - old_logp)
    A = jnp.asarray(ref_adv, jnp.float32)[:, None]
    obj = jnp.minimum(ratio * A, jnp.clip(ratio, 0.8, 1.28) * A)
    return -(obj * mask).sum() / mask.sum()

  g = jax.grad(ref_loss)(params)
  upd, _ = opt.update(g, opt.init(params), params)
  ref_params = optax.apply_updates(params, upd)
  for a, b in zip(jax.tree.leaves(new.params), jax.tree.leaves(ref_params)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_micro_batch_accumulation_is_exact(agg):
  params = _params()
  epa, ecc = _batch(8, 21), _batch(4, 22)
  outs = []
  for m in (1, 4):
    step = _step(w=(1.0, 0.5), lc=C.LossConfig(loss_agg=agg), micro_batches=m)
    new, met = step(_state(params), epa, ecc)
    outs.append((new, met))
  for new, met in outs[1:]:
    np.testing.assert_allclose(met.loss, outs[0][1].loss, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(met.grad_norm, outs[0][1].grad_norm, rtol=1e-5)


def test_nonfinite_step_is_skipped():
  params = _params()
  epa = _batch(8, 31, adv=np.asarray([np.nan, 1, 1, 1, 1, 1, 1, 1], np.float32))
  ecc = _batch(4, 32)
  step = _step(skip_nonfinite=True)
  new, m = step(_state(params), epa, ecc)
  assert float(m.finite) == 0.0
  # a skipped step is still a loop step (issue 14): counted, params untouched
  assert int(new.step) == 1 and int(new.nonfinite_steps) == 1
  for a, b in zip(jax.tree.leaves(new.params), jax.tree.leaves(params)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
