"""Sequence packing (fbos_jax/rl/packing.py): the packed update equals the padded one.

Rows of different lengths (long-tailed responses, prompts of different lengths,
padding rows, off-policy rows, rows whose loss mask is cut short) are packed
into rows of the padded row length with segment ids; one SGD step (lr 1, so the
params move by exactly the gradient) on the packed batches must give the
params and every metric of the padded step, for every term (EPA with GOLF's
mixed on/off-policy rows, ECC, FCP's MLE, the decoupled loss with pi_prox, KL
to a reference and an entropy bonus, the SFT warm start's two MLE terms), for
every aggregation mode, with several micro-batches, and on the 8-device mesh.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import configs
from fbos_jax import buckets
from fbos_jax import sharding as sh
from fbos_jax.model import qwen
from fbos_jax.rl import batch as batch_lib
from fbos_jax.rl import config as C
from fbos_jax.rl import packing
from fbos_jax.rl import update as U
from fbos_jax.rl.state import TrainState
from fbos_jax.testing import toy

CFG = toy.CFG
P_LEN, R_LEN = 8, 24
TOL = 1e-5


def rows(n, seed, *, pad_rows=3, offpolicy=False):
  """n rows (prompts of 1..P_LEN tokens, responses of 1..R_LEN with a long tail,
  a loss mask cut short on some rows, one row with an empty loss mask) plus
  ``pad_rows`` padding rows."""
  rng = np.random.default_rng(seed)
  prompts = [list(rng.integers(3, 40, size=rng.integers(1, P_LEN + 1))) for _ in range(n)]
  lens = np.minimum(np.ceil(rng.lognormal(np.log(4), 1.0, size=n)), R_LEN).astype(int)
  lens[0] = R_LEN
  rt = rng.integers(3, 40, size=(n, R_LEN)).astype(np.int32)
  rm = (np.arange(R_LEN)[None] < lens[:, None]).astype(np.int32)
  lm = rm.astype(np.float32) * rng.uniform(0.5, 1.5, size=(n, 1)).astype(np.float32)
  lm[1, lens[1] // 2:] = 0  # a loss mask cut short (GFPO-like token weights elsewhere)
  lm[2] = 0  # a row that trains nothing
  off = (rng.random(n) < 0.4) if offpolicy else np.zeros(n, bool)
  old = (rng.normal(size=(n, R_LEN)) * 0.1 - 2.0).astype(np.float32)
  return batch_lib.make_policy_batch(prompts, rt, rm, rng.normal(size=n).astype(np.float32), old,
                                     off, prompt_len=P_LEN, num_rows=n + pad_rows, loss_mask=lm)


def test_layout_follows_the_tokens():
  b = rows(13, 0)
  lay = packing.layout(b)
  pk = packing.pack(b, lay, rows=len(lay.bins) + 1, micro_batches=1)
  assert pk.tokens.shape == (len(lay.bins) + 1, P_LEN + R_LEN)
  assert 2 not in lay.rows and len(lay.rows) == 12  # empty loss mask and padding rows dropped
  assert packing.real_tokens(pk) == packing.real_tokens(b) == int(lay.lengths.sum())
  pos = np.asarray(qwen.positions_from_segments(jnp.asarray(pk.segment_ids)))
  for bi, members in enumerate(lay.bins):
    at = 0
    for s, j in enumerate(members):
      i, n_p, n = lay.rows[j], lay.prompt_lens[j], lay.lengths[j]
      assert (pk.segment_ids[bi, at:at + n] == s + 1).all()
      np.testing.assert_array_equal(pos[bi, at:at + n], np.arange(n))
      prompt = b.tokens[i, :P_LEN][b.attn_mask[i, :P_LEN] > 0]
      np.testing.assert_array_equal(pk.tokens[bi, at:at + n_p], prompt)
      n_r = n - n_p
      np.testing.assert_array_equal(pk.tokens[bi, at + n_p:at + n], b.tokens[i, P_LEN:P_LEN + n_r])
      # position at + n_p - 1 + k predicts response token k and carries its fields
      sc = slice(at + n_p - 1, at + n - 1)
      np.testing.assert_array_equal(pk.loss_mask[bi, sc], b.loss_mask[i, :n_r])
      np.testing.assert_array_equal(pk.old_logp[bi, sc], b.old_logp[i, :n_r])
      assert (pk.advantages[bi, sc] == b.advantages[i]).all()
      np.testing.assert_allclose(pk.seq_weight[bi, sc], 1 / b.loss_mask[i].sum(), rtol=1e-6)
      assert b.loss_mask[i, n_r - 1] > 0 and not b.loss_mask[i, n_r:].any()
      at += n
    assert (pk.segment_ids[bi, at:] == 0).all() and (pk.loss_mask[bi, at:] == 0).all()


def test_bucket_count():
  assert [buckets.bucket_count(n) for n in (0, 1, 2, 3, 5, 7, 9, 13, 17)] == \
      [1, 1, 2, 3, 6, 8, 12, 16, 24]


# ----------------------------------------------------------------------------- the update


def _ucfg(terms, lc=C.LossConfig(), micro_batches=1, micro_batch_tokens=0):
  return C.UpdateConfig(terms=tuple(C.Term(*t) for t in terms), loss=lc,
                        micro_batches=micro_batches, micro_batch_tokens=micro_batch_tokens)


_SGD = toy.optimizer("sgd", 1.0)


def _state(params, ref=False):
  ref_params = jax.tree.map(lambda x: x * 1.01, params) if ref else None
  return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=_SGD.init(params),
                    rng=jax.random.key_data(jax.random.key(0)),
                    nonfinite_steps=jnp.zeros((), jnp.int32), ref_params=ref_params)


def _assert_same_step(a, b):
  (sa, ma), (sb, mb) = a, b
  for x, y in zip(jax.tree.leaves(sa.params), jax.tree.leaves(sb.params)):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=TOL, rtol=0)
  for (path, x), y in zip(jax.tree.flatten_with_path(ma)[0], jax.tree.leaves(mb)):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=TOL, atol=1e-6,
                               err_msg=jax.tree_util.keystr(path))


CASES = {  # name: (terms, loss config, attention)
    # EPA with GOLF's mixed on/off-policy rows, ECC on FAPs, FCP's MLE
    "epa_golf_ecc_fcp": ([("epa", "policy_gradient", 1.0), ("ecc", "policy_gradient", 0.5),
                          ("fcp", "mle", 0.3)], C.LossConfig(), "auto"),
    "decoupled_kl_entropy_seq_mean": (
        [("epa", "decoupled", 1.0)],
        C.LossConfig(loss_agg="seq-mean-token-mean", kl_beta=0.1, entropy_coef=0.01), "auto"),
    "seq_sum_norm": ([("epa", "policy_gradient", 1.0), ("ecc", "policy_gradient", 1.0)],
                     C.LossConfig(loss_agg="seq-mean-token-sum-norm"), "auto"),
    # the SFT warm start's two MLE terms, through the blocked (flash) attention's tiles
    "sft_blocked": ([("demos", "mle", 0.75), ("corrections", "mle", 0.25)],
                    C.LossConfig(loss_agg="seq-mean-token-sum"), "blocked"),
}


def _batches(terms, seed=0, n=13):
  return {t[0]: rows(n + 3 * k, seed + k, offpolicy=t[0] == "epa") for k, t in enumerate(terms)}


def _padded_and_packed(terms, lc, shards=1, micro=2, budget=2 * (P_LEN + R_LEN), n=13):
  padded = _batches(terms, n=n)
  ucfg_pad = _ucfg(terms, lc, micro_batches=micro)
  ucfg_pack = _ucfg(terms, lc, micro_batch_tokens=budget)
  rows_mult = micro * shards
  padded = {k: _pad_rows(b, rows_mult) for k, b in padded.items()}
  packed = packing.pack_batches(padded, ucfg_pack, shards)
  return padded, packed, ucfg_pad, ucfg_pack


def _pad_rows(b, multiple):
  """b with fully masked rows added up to a multiple of ``multiple``."""
  n = -(-b.num_rows // multiple) * multiple
  return jax.tree.map(lambda a: np.concatenate([a, np.repeat(a[-1:], n - a.shape[0], 0)]), b)


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.slow  # default suite under 15 min (issue 35): .ci/run runs the slow set too
def test_packed_update_equals_padded(case):
  terms, lc, attention = CASES[case]
  cfg = dataclasses.replace(CFG, attention=attention)
  padded, packed, ucfg_pad, ucfg_pack = _padded_and_packed(terms, lc)
  for name, b in packed.items():
    assert b.micro_batches >= 2, (name, b.micro_batches)  # several micro-batches
    assert b.num_rows * b.row_len < padded[name].tokens.size  # fewer positions
  params = toy.params(3)
  ref = lc.kl_beta > 0
  out_pad = jax.jit(U.make_update_fn(cfg, _SGD, ucfg_pad))(_state(params, ref), padded)
  out_pack = jax.jit(U.make_update_fn(cfg, _SGD, ucfg_pack))(_state(params, ref), packed)
  _assert_same_step(out_pad, out_pack)
  moved = max(float(jnp.max(jnp.abs(a - b))) for a, b in
              zip(jax.tree.leaves(out_pack[0].params), jax.tree.leaves(params)))
  assert moved > 1e-3  # a real step, not two zero gradients


@pytest.mark.slow  # default suite under 15 min (issue 35): .ci/run runs the slow set too
def test_packed_update_equals_padded_on_the_8_device_mesh():
  if jax.device_count() < 8:
    pytest.skip("needs 8 devices (XLA_FLAGS=--xla_force_host_platform_device_count=8)")
  terms, lc, _ = CASES["epa_golf_ecc_fcp"]
  lc = dataclasses.replace(lc, loss_agg="seq-mean-token-mean")
  padded, packed, ucfg_pad, ucfg_pack = _padded_and_packed(terms, lc, shards=8,
                                                           budget=P_LEN + R_LEN, n=40)
  assert all(b.num_rows % 8 == 0 and b.micro_batches >= 2 for b in packed.values())
  mesh = sh.make_mesh({"data": 8}, devices=jax.devices()[:8])
  rows_sharded = lambda tree: jax.tree.map(
      lambda a: jax.device_put(a, NamedSharding(mesh, sh.batch_spec(a.ndim))), tree)
  params = toy.params(5)
  with jax.set_mesh(mesh):
    state = jax.device_put(_state(params), NamedSharding(mesh, P()))
    out_pad = jax.jit(U.make_update_fn(CFG, _SGD, ucfg_pad))(state, rows_sharded(padded))
    state = jax.device_put(_state(params), NamedSharding(mesh, P()))
    b = rows_sharded(packed)
    assert len(b["epa"].tokens.sharding.device_set) == 8
    out_pack = jax.jit(U.make_update_fn(CFG, _SGD, ucfg_pack))(state, b)
  _assert_same_step(out_pad, out_pack)
  # and the same as one device
  single = jax.jit(U.make_update_fn(CFG, _SGD, ucfg_pack))(_state(params), packed)
  _assert_same_step(single, out_pack)


def test_fixed_micro_batches_skip_the_empty_ones(monkeypatch):
  """rl.fixed_row_buckets with packing: every batch has the most micro-batches its
  padded rows can fill (the same shape whatever the lengths), the ones the real
  tokens leave empty are skipped (an objective poisoned to NaN on a micro-batch
  without a loss token must never run on one), and the step equals the padded one."""
  from fbos_jax.rl import objectives
  terms, lc, _ = CASES["epa_golf_ecc_fcp"]
  padded, packed, ucfg_pad, _ = _padded_and_packed(terms, lc)
  ucfg_fixed = dataclasses.replace(_ucfg(terms, lc, micro_batch_tokens=2 * (P_LEN + R_LEN)),
                                   fixed_micro_batches=True)
  fixed = packing.pack_batches(padded, ucfg_fixed, 1)
  for name, b in fixed.items():
    assert b.micro_batches > packed[name].micro_batches, name  # room for every row: empty ones
    assert b.micro_batches == packing.packed_shape(padded[name].num_rows, b.row_len,
                                                   ucfg_fixed.micro_batch_tokens, 1, 1)[0]
  other = packing.pack_batches({k: _pad_rows(b, 2) for k, b in _batches(terms, seed=7).items()},
                               ucfg_fixed, 1)  # other lengths, the same shapes
  assert {n: b.tokens.shape for n, b in other.items()} == \
      {n: b.tokens.shape for n, b in fixed.items()}
  orig = objectives.term_objective

  def poisoned(params, cfg, batch, *a, **k):
    loss, stats = orig(params, cfg, batch, *a, **k)
    return loss + jnp.where(jnp.any(batch.loss_mask != 0), 0.0, jnp.nan), stats

  monkeypatch.setattr(objectives, "term_objective", poisoned)
  params = toy.params(3)
  out_pad = jax.jit(U.make_update_fn(CFG, _SGD, ucfg_pad))(_state(params), padded)
  out_fixed = jax.jit(U.make_update_fn(CFG, _SGD, ucfg_fixed))(_state(params), fixed)
  assert float(out_fixed[1].finite) == 1.0  # no empty micro-batch ran
  _assert_same_step(out_pad, out_fixed)


# ----------------------------------------------------------------------------- bad input


def test_a_row_longer_than_the_budget_is_refused_at_config_build():
  c = configs.load("configs/fbos.py:tiny")
  c.rl.fixed_row_buckets = False
  longest = max(c.sampling.fap_prompt_buckets) + c.sampling.max_new_tokens
  c.rl.micro_batch_tokens = longest - 1
  with pytest.raises(ValueError, match=rf"rl.micro_batch_tokens={longest - 1} .* {longest} "
                                       r"tokens \(sampling.fap_prompt_buckets"):
    C.validate(c, 1, 1)
  c.rl.micro_batch_tokens = longest
  C.validate(c, 1, 1)
  c.rl.micro_batches = 2
  with pytest.raises(ValueError, match="rl.micro_batches=2 with rl.micro_batch_tokens"):
    C.validate(c, 1, 1)
  c.rl.micro_batches, c.rl.fixed_row_buckets = 1, True
  C.validate(c, 1, 1)  # the fixed packed layout: the most micro-batches, empty ones skipped
  c.rl.mini_batches = 2
  with pytest.raises(ValueError, match="rl.fixed_row_buckets=True with rl.micro_batch_tokens="
                                       ".* rl.mini_batches=2"):
    C.validate(c, 1, 1)


def test_pack_refuses_a_budget_below_a_row():
  b = rows(5, 1)
  with pytest.raises(ValueError, match="rl.micro_batch_tokens=10 does not hold one row of 32"):
    packing.pack_batches({"epa": b}, _ucfg([("epa", "policy_gradient", 1.0)],
                                           micro_batch_tokens=10), 1)
