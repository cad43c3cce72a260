"""fbos_kernels aggregation: (sum, denom) pairs, empty rows, exactness across micro-batches/shards.

Conventions under test: empty rows drop out of every denominator; an all-masked
batch gives 0 (no NaN, zero gradient); adding the pairs of pieces and dividing
once reproduces the whole-batch loss and gradient (to 1e-6) for every mode.
"""


import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import fbos_kernels as K

MODES = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]
B, T, F = 8, 6, 5


def np_aggregate(loss, mask, mode, norm_len=None):
  """Whole-batch loss, written from the definitions (float64, explicit loops)."""
  loss = np.asarray(loss, np.float64)
  mask = np.asarray(mask, np.float64)
  if mode == "token-mean":
    d = mask.sum()
    return (loss * mask).sum() / d if d > 0 else 0.0
  per_row = []
  for b in range(loss.shape[0]):
    cnt = mask[b].sum()
    if cnt == 0:
      continue  # empty rows drop out
    rs = (loss[b] * mask[b]).sum()
    if mode == "seq-mean-token-mean":
      per_row.append(rs / cnt)
    elif mode == "seq-mean-token-sum":
      per_row.append(rs)
    else:
      per_row.append(rs / (norm_len or loss.shape[1]))
  return float(np.mean(per_row)) if per_row else 0.0


def _batch(seed):
  rng = np.random.default_rng(seed)
  loss = rng.normal(size=(B, T)).astype(np.float32)
  lengths = rng.integers(0, T + 1, size=B)
  lengths[2] = 0  # an empty row
  lengths[5] = T
  mask = np.arange(T)[None, :] < lengths[:, None]
  loss[~mask] = np.where(rng.random((~mask).sum()) < 0.5, np.nan, 1e30)  # garbage in padding
  return loss, mask


_agg = jax.jit(K.aggregate, static_argnames=("mode", "norm_len"))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("float_mask", [False, True])
def test_aggregate_matches_numpy(mode, float_mask):
  loss, mask = _batch(0)
  m = mask.astype(np.float32) if float_mask else mask
  s, d = _agg(loss, m, mode=mode)
  assert np.isfinite(float(s)) and np.isfinite(float(d))
  np.testing.assert_allclose(float(K.safe_divide(s, d)), np_aggregate(np.where(mask, loss, 0), mask, mode),
                             rtol=1e-6, atol=1e-7)
  if mode != "token-mean":
    assert float(d) == (mask.sum(1) > 0).sum()  # the empty row is not counted


def test_norm_len_and_hand_values():
  loss = jnp.array([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0], [9.0, 9.0, 9.0]])
  mask = jnp.array([[1, 1, 1], [1, 0, 0], [0, 0, 0]], bool)
  vals = {m: float(K.aggregate_loss(loss, mask, m)) for m in MODES}
  assert vals["token-mean"] == pytest.approx(10 / 4)
  assert vals["seq-mean-token-mean"] == pytest.approx((2.0 + 4.0) / 2)
  assert vals["seq-mean-token-sum"] == pytest.approx((6.0 + 4.0) / 2)
  assert vals["seq-mean-token-sum-norm"] == pytest.approx((6.0 + 4.0) / 3 / 2)
  assert float(K.aggregate_loss(loss, mask, "seq-mean-token-sum-norm", norm_len=10)) == pytest.approx(0.5)
  with pytest.raises(ValueError, match="token-mean"):
    K.aggregate(loss, mask, "mean")


@pytest.mark.parametrize("mode", MODES)
def test_all_masked_gives_zero_and_finite_zero_grad(mode):
  loss = jnp.full((3, 4), jnp.nan)
  mask = jnp.zeros((3, 4), bool)

  def f(x):
    return K.safe_divide(*K.aggregate(x, mask, mode))

  v, g = jax.jit(jax.value_and_grad(f))(loss)
  assert float(v) == 0.0
  assert np.all(np.asarray(g) == 0.0)


def test_masked_mean_and_sum():
  x = jnp.array([[1.0, jnp.nan, 3.0], [2.0, 2.0, jnp.inf]])
  m = jnp.array([[True, False, True], [False, False, False]])
  assert float(K.masked_mean(x, m)) == 2.0
  np.testing.assert_array_equal(np.asarray(K.masked_mean(x, m, axis=1)), [2.0, 0.0])
  assert float(K.masked_sum(x, m)) == 4.0
  assert float(K.safe_divide(1.0, 0.0)) == 0.0
  g = jax.grad(lambda d: K.safe_divide(3.0, d))(0.0)
  assert float(g) == 0.0


# ----------------------------------------------------------------------------
# exactness across micro-batches (gradient accumulation) and shards
# ----------------------------------------------------------------------------


def _problem(seed=0):
  rng = np.random.default_rng(seed)
  feats = rng.normal(size=(B, T, F)).astype(np.float32)
  old = (-np.abs(rng.normal(size=(B, T)))).astype(np.float32)
  adv = rng.normal(size=(B,)).astype(np.float32)
  lengths = rng.integers(0, T + 1, size=B)
  lengths[[1, 6]] = [0, T]
  mask = np.arange(T)[None, :] < lengths[:, None]
  theta = rng.normal(size=(F,)).astype(np.float32) * 0.3
  return feats, old, adv, mask, theta


def _token_loss(theta, feats, old, adv):
  logp = -jax.nn.softplus(feats @ theta)  # a toy policy's token log-probs
  return K.ppo_clip_loss(logp, old, adv)[0]


def _all_modes_sum_and_grad(theta, feats, old, adv, mask):
  """{mode: (sum, denom, d sum / d theta)} for one piece; one compile covers every mode."""
  out = {}
  for mode in MODES:
    def s(th, mode=mode):
      return K.aggregate(_token_loss(th, feats, old, adv), mask, mode, norm_len=T)

    tot, g = jax.value_and_grad(lambda th: s(th)[0])(theta)
    out[mode] = (tot, s(theta)[1], g)  # the denominator depends on the mask only
  return out


def _all_modes_whole(theta, feats, old, adv, mask):
  return {mode: jax.value_and_grad(
      lambda th, mode=mode: K.safe_divide(*K.aggregate(_token_loss(th, feats, old, adv), mask, mode,
                                                        norm_len=T)))(theta) for mode in MODES}


_pieces = jax.jit(_all_modes_sum_and_grad)


def _accumulate(results):
  acc = {}
  for res in results:
    for mode, (t_, d_, g_) in res.items():
      t0, d0, g0 = acc.get(mode, (0.0, 0.0, 0.0))
      acc[mode] = (t0 + t_, d0 + d_, g0 + g_)
  # divide once: loss = sum / denom, grad = (sum of piece grads) / denom
  return {mode: (K.safe_divide(t, d), g / d) for mode, (t, d, g) in acc.items()}


def test_micro_batches_exact():
  feats, old, adv, mask, theta = _problem()
  whole = jax.jit(_all_modes_whole)(theta, feats, old, adv, mask)
  loss = np.asarray(jax.jit(_token_loss)(theta, feats, old, adv))
  assert (mask[:4].sum(1) > 0).sum() != (mask[4:].sum(1) > 0).sum() or mask[:4].sum() != mask[4:].sum()
  splits = [slice(0, 4), slice(4, 8)]  # row splits with different token counts; row 1 is empty
  acc = _accumulate([_pieces(theta, feats[sl], old[sl], adv[sl], mask[sl]) for sl in splits])
  for mode in MODES:
    v_whole, g_whole = whole[mode]
    v_acc, g_acc = acc[mode]
    np.testing.assert_allclose(float(v_acc), float(v_whole), rtol=0, atol=1e-6, err_msg=mode)
    np.testing.assert_allclose(np.asarray(g_acc), np.asarray(g_whole), rtol=0, atol=1e-6, err_msg=mode)
    assert np.abs(np.asarray(g_whole)).max() > 1e-3  # a non-trivial gradient
    np.testing.assert_allclose(float(v_whole), np_aggregate(loss, mask, mode), rtol=1e-6, atol=1e-7)
  # token-mean is also exact under splits along time
  acc_t = _accumulate([_pieces(theta, feats[:, sl], old[:, sl], adv, mask[:, sl])
                       for sl in [slice(0, 3), slice(3, 6)]])
  np.testing.assert_allclose(float(acc_t["token-mean"][0]), float(whole["token-mean"][0]), rtol=0, atol=1e-6)
  np.testing.assert_allclose(np.asarray(acc_t["token-mean"][1]), np.asarray(whole["token-mean"][1]),
                             rtol=0, atol=1e-6)


def test_mean_of_micro_batch_means_is_not_exact():
  """Sanity check that the test above can fail: averaging per-piece means is biased."""
  feats, old, adv, mask, theta = _problem()
  loss = np.asarray(jax.jit(_token_loss)(theta, feats, old, adv))
  whole = np_aggregate(loss, mask, "token-mean")
  pieces = [np_aggregate(loss[sl], mask[sl], "token-mean") for sl in [slice(0, 4), slice(4, 8)]]
  assert abs(np.mean(pieces) - whole) > 1e-3


def test_data_parallel_shards_exact():
  """psum of per-shard (sum, denom) pairs over 8 devices equals the whole batch, every mode."""
  assert jax.device_count() >= 8, "tests expect XLA_FLAGS=--xla_force_host_platform_device_count=8"
  feats, old, adv, mask, theta = _problem(1)
  mesh = jax.make_mesh((8,), ("data",))

  def shard_losses(th, f, o, a, m):
    out = []
    for mode in MODES:
      s, d = K.aggregate(_token_loss(th, f, o, a), m, mode, norm_len=T)
      out.append(K.safe_divide(jax.lax.psum(s, "data"), jax.lax.psum(d, "data")))
    return jnp.stack(out)

  sharded = jax.shard_map(shard_losses, mesh=mesh, in_specs=(P(), P("data"), P("data"), P("data"), P("data")),
                          out_specs=P())
  put = lambda x, spec: jax.device_put(x, jax.sharding.NamedSharding(mesh, spec))  # noqa: E731
  args = (put(theta, P()), put(feats, P("data")), put(old, P("data")), put(adv, P("data")), put(mask, P("data")))
  v_dp, jac_dp = jax.jit(lambda *a: (sharded(*a), jax.jacrev(sharded)(*a)))(*args)
  whole = jax.jit(_all_modes_whole)(theta, feats, old, adv, mask)
  for i, mode in enumerate(MODES):
    np.testing.assert_allclose(float(v_dp[i]), float(whole[mode][0]), rtol=0, atol=1e-6, err_msg=mode)
    np.testing.assert_allclose(np.asarray(jac_dp[i]), np.asarray(whole[mode][1]), rtol=0, atol=1e-6,
                               err_msg=mode)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("float_mask", [False, True])
def test_seq_weight_gives_the_pair_of_the_rows_it_packs(mode, float_mask):
  """Rows laid end to end in one row (with ``seq_weight`` = 1 / the sequence's mask
  sum) aggregate to the pair of the rows themselves, in every mode."""
  loss, mask = _batch(3)
  m = np.where(mask, np.random.default_rng(4).uniform(0.5, 2.0, mask.shape), 0.0) if float_mask \
      else mask.astype(np.float64)
  m = m.astype(np.float32)
  count = m.sum(1, keepdims=True)
  w = np.where(count > 0, 1.0 / np.where(count > 0, count, 1.0), 0.0) * (m != 0)
  packed = lambda x: x.reshape(1, -1)
  s_rows, d_rows = _agg(loss, m, mode=mode, norm_len=T)
  s_pack, d_pack = K.aggregate(packed(loss), packed(m), mode, norm_len=T,
                               seq_weight=packed(w.astype(np.float32)))
  np.testing.assert_allclose(float(s_pack), float(s_rows), rtol=1e-6)
  np.testing.assert_allclose(float(d_pack), float(d_rows), rtol=1e-6)
  if mode != "token-mean":  # without the weights, the packed row is one sequence
    _, d_one = K.aggregate(packed(loss), packed(m), mode, norm_len=T)
    assert float(d_one) == 1.0 != float(d_rows)
