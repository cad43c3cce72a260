"""fbos_kernels chunked log-probs/entropy: values and grads vs naive, vocab-parallel, no [B,T,V] buffer.

Conventions under test: logits = (hidden @ unembed) / temperature accumulated in
float32; log-probs and entropy are of the temperature-scaled distribution;
vocabulary/time sizes need not be multiples of the chunks.
"""

import functools
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType

import fbos_kernels as K

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
B, T, D = 2, 7, 16


def np_logprobs_entropy(h, w, y, temperature):
  """Float64 NumPy reference."""
  z = np.einsum("btd,dv->btv", np.asarray(h, np.float64), np.asarray(w, np.float64)) / temperature
  m = z.max(-1, keepdims=True)
  lse = (m + np.log(np.exp(z - m).sum(-1, keepdims=True)))[..., 0]
  logp = np.take_along_axis(z, y[..., None], -1)[..., 0] - lse
  p = np.exp(z - lse[..., None])
  return logp, lse - (p * z).sum(-1)


def np_grads(h, w, y, temperature, g_logp, g_ent):
  """Float64 NumPy gradients of sum(logp * g_logp + entropy * g_ent) w.r.t. (hidden, unembed, temperature)."""
  h, w = np.asarray(h, np.float64), np.asarray(w, np.float64)
  z = np.einsum("btd,dv->btv", h, w) / temperature
  m = z.max(-1, keepdims=True)
  lse = m + np.log(np.exp(z - m).sum(-1, keepdims=True))
  p = np.exp(z - lse)
  ent = lse - (p * z).sum(-1, keepdims=True)
  onehot = np.arange(z.shape[-1]) == y[..., None]
  # d logp / dz = onehot - p ;  d H / dz = -p (log p + H) = -p (z - lse + H)
  dz = g_logp[..., None] * (onehot - p) - g_ent[..., None] * p * (z - lse + ent)
  da = dz / temperature  # z = a / temperature
  return (np.einsum("btv,dv->btd", da, w), np.einsum("btd,btv->dv", h, da),
          float(np.sum(dz * -z / temperature)))


def _inputs(V, seed=0, dtype=np.float32, scale=0.5):
  rng = np.random.default_rng(seed)
  h = rng.normal(size=(B, T, D)).astype(dtype)
  w = (rng.normal(size=(D, V)) * scale).astype(dtype)
  y = rng.integers(0, V, size=(B, T)).astype(np.int32)
  return h, w, y


# cotangent weights so both outputs and every position matter
G_LOGP = np.cos(np.arange(B * T)).reshape(B, T).astype(np.float32)
G_ENT = np.sin(np.arange(B * T) + 0.5).reshape(B, T).astype(np.float32)


def _value_and_grads(impl, h, w, y, temperature, **kw):
  def loss(h, w, t):
    logp, ent = impl(h, w, y, temperature=t, **kw)
    return jnp.sum(logp * G_LOGP) + jnp.sum(ent * G_ENT), (logp, ent)

  (_, (logp, ent)), grads = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(h, w, temperature)
  return logp, ent, grads


_chunked_vg = jax.jit(functools.partial(_value_and_grads, K.token_logprobs_and_entropy),
                      static_argnames=("time_chunk", "vocab_chunk"))
_naive_vg = jax.jit(functools.partial(_value_and_grads, K.naive_logprobs_and_entropy))


def test_naive_matches_numpy():
  h, w, y = _inputs(37)
  logp, ent, _ = _naive_vg(h, w, y, jnp.float32(0.7))
  ref_logp, ref_ent = np_logprobs_entropy(h, w, y, 0.7)
  np.testing.assert_allclose(np.asarray(logp), ref_logp, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(np.asarray(ent), ref_ent, rtol=1e-5, atol=1e-5)


# (V, time_chunk, vocab_chunk): V divisible / not divisible by the chunk, T=7 not divisible,
# single-chunk, chunk larger than the axis
CASES = [(37, 3, 8), (40, 2, 5), (40, 4, 16), (37, 64, 64)]


@pytest.mark.parametrize("V,tc,vc", CASES)
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_chunked_matches_naive_values_and_grads(V, tc, vc, temperature):
  h, w, y = _inputs(V, seed=V + tc)
  t = jnp.float32(temperature)
  logp, ent, (gh, gw, gt) = _chunked_vg(h, w, y, t, time_chunk=tc, vocab_chunk=vc)
  n_logp, n_ent, (nh, nw, nt) = _naive_vg(h, w, y, t)
  assert logp.dtype == jnp.float32 and ent.dtype == jnp.float32 and logp.shape == (B, T)
  np.testing.assert_allclose(np.asarray(logp), np.asarray(n_logp), rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(np.asarray(ent), np.asarray(n_ent), rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(np.asarray(gh), np.asarray(nh), rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(np.asarray(gw), np.asarray(nw), rtol=1e-5, atol=1e-5)
  ref_logp, ref_ent = np_logprobs_entropy(h, w, y, temperature)
  np.testing.assert_allclose(np.asarray(logp), ref_logp, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(np.asarray(ent), ref_ent, rtol=1e-5, atol=1e-5)
  ref_h, ref_w, ref_t = np_grads(h, w, y, temperature, G_LOGP, G_ENT)
  np.testing.assert_allclose(np.asarray(gh), ref_h, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(np.asarray(gw), ref_w, rtol=1e-5, atol=1e-5)
  # d/d temperature is a single sum over B*T*V float32 terms (naive autodiff is itself off by up
  # to 4e-5 relative here, the chunked sum likewise), so it is held to 1e-4 relative
  np.testing.assert_allclose(float(gt), ref_t, rtol=1e-4, atol=1e-6)
  np.testing.assert_allclose(float(gt), float(nt), rtol=1e-4, atol=1e-6)


def test_temperature_changes_the_distribution():
  h, w, y = _inputs(37)
  a, ea, _ = _chunked_vg(h, w, y, jnp.float32(1.0), time_chunk=3, vocab_chunk=8)
  b, eb, _ = _chunked_vg(h, w, y, jnp.float32(0.5), time_chunk=3, vocab_chunk=8)
  assert np.abs(np.asarray(a) - np.asarray(b)).max() > 1e-2
  assert np.all(np.asarray(eb) < np.asarray(ea))  # sharper at lower temperature


def test_bf16_inputs_and_peaked_logits():
  h, w, y = _inputs(37, dtype=np.float32, scale=3.0)  # peaked distributions (tiny entropies)
  hb, wb = jnp.asarray(h, jnp.bfloat16), jnp.asarray(w, jnp.bfloat16)
  logp, ent, (gh, gw, _) = _chunked_vg(hb, wb, y, jnp.float32(1.0), time_chunk=3, vocab_chunk=8)
  n_logp, n_ent, (nh, nw, _) = _naive_vg(hb, wb, y, jnp.float32(1.0))
  assert gh.dtype == jnp.bfloat16 and gw.dtype == jnp.bfloat16
  assert logp.dtype == jnp.float32
  np.testing.assert_allclose(np.asarray(logp), np.asarray(n_logp), rtol=1e-5, atol=1e-4)
  np.testing.assert_allclose(np.asarray(ent), np.asarray(n_ent), rtol=1e-4, atol=1e-5)
  np.testing.assert_allclose(np.asarray(gh, np.float32), np.asarray(nh, np.float32), rtol=2e-2, atol=2e-2)
  np.testing.assert_allclose(np.asarray(gw, np.float32), np.asarray(nw, np.float32), rtol=2e-2, atol=2e-2)


def test_no_entropy_and_out_of_range_targets():
  h, w, y = _inputs(37)

  @jax.jit
  def no_entropy(h, w, y):
    def loss(h):
      logp, ent = K.token_logprobs_and_entropy(h, w, y, time_chunk=3, vocab_chunk=8, compute_entropy=False)
      assert ent is None
      return jnp.sum(logp * G_LOGP), logp
    return jax.grad(loss, has_aux=True)(h)

  @jax.jit
  def naive(h, w, y):
    return jax.grad(lambda h: (jnp.sum(K.naive_logprobs_and_entropy(h, w, y)[0] * G_LOGP),
                               K.naive_logprobs_and_entropy(h, w, y)[0]), has_aux=True)(h)

  g, logp = no_entropy(h, w, y)
  gn, n_logp = naive(h, w, y)
  np.testing.assert_allclose(np.asarray(logp), np.asarray(n_logp), rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(np.asarray(g), np.asarray(gn), rtol=1e-5, atol=1e-5)
  y_pad = y.copy()
  y_pad[:, -2:] = -1  # padding ids: finite placeholder -lse, same in both implementations
  a, _, (ga, gwa, gta) = _chunked_vg(h, w, y_pad, jnp.float32(0.7), time_chunk=3, vocab_chunk=8)
  b, _, (gb, gwb, gtb) = _naive_vg(h, w, y_pad, jnp.float32(0.7))
  np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(np.asarray(ga), np.asarray(gb), rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(np.asarray(gwa), np.asarray(gwb), rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(float(gta), float(gtb), rtol=1e-4, atol=1e-6)
  assert np.all(np.isfinite(np.asarray(a)))
  with pytest.raises(ValueError, match="targets"):
    K.token_logprobs_and_entropy(h, w, y.astype(np.float32))


def test_vmap_over_leading_axis():
  h, w, y = _inputs(37)
  f = jax.jit(jax.vmap(lambda h, y: K.token_logprobs_and_entropy(h[None], w, y[None], time_chunk=3,
                                                                   vocab_chunk=8)[0][0]))
  n_logp, _, _ = _naive_vg(h, w, y, jnp.float32(1.0))
  np.testing.assert_allclose(np.asarray(f(h, y)), np.asarray(n_logp), rtol=1e-5, atol=1e-5)


def _all_avals(jaxpr):
  for eqn in jaxpr.eqns:
    for v in eqn.outvars:
      yield v.aval
    for p in eqn.params.values():
      subs = p if isinstance(p, (list, tuple)) else [p]
      for sub in subs:
        if hasattr(sub, "jaxpr") and hasattr(sub, "consts"):  # ClosedJaxpr
          yield from _all_avals(sub.jaxpr)
        elif hasattr(sub, "eqns"):  # Jaxpr
          yield from _all_avals(sub)


def test_never_builds_a_btv_array_forward_or_backward():
  Bb, Tt, Dd, V = 2, 64, 8, 1000
  h = jax.ShapeDtypeStruct((Bb, Tt, Dd), jnp.float32)
  w = jax.ShapeDtypeStruct((Dd, V), jnp.float32)
  y = jax.ShapeDtypeStruct((Bb, Tt), jnp.int32)

  def loss(impl, h, w, y):
    logp, ent = impl(h, w, y, time_chunk=16, vocab_chunk=128)
    return jnp.sum(logp) + jnp.sum(ent)

  def biggest(impl):
    jaxpr = jax.make_jaxpr(jax.grad(functools.partial(loss, impl), argnums=(0, 1)))(h, w, y)
    return max(int(np.prod(a.shape)) for a in _all_avals(jaxpr.jaxpr) if hasattr(a, "shape"))

  assert biggest(K.naive_logprobs_and_entropy) >= Bb * Tt * V  # the check can fail
  # largest intermediate: one [B, time_chunk, vocab_chunk] block or the [D, V] gradient
  assert biggest(K.token_logprobs_and_entropy) <= max(Bb * 16 * 128, Dd * V)
  assert max(Bb * 16 * 128, Dd * V) * 8 <= Bb * Tt * V


# ----------------------------------------------------------------------------
# vocab-parallel (8 fake CPU devices)
# ----------------------------------------------------------------------------


def _mesh(shape, names, types):
  assert jax.device_count() >= 8, "tests expect XLA_FLAGS=--xla_force_host_platform_device_count=8"
  return jax.make_mesh(shape, names, axis_types=(types,) * len(names))


@pytest.mark.parametrize("mesh_shape,names,batch_axes,types", [
    ((2, 4), ("data", "tensor"), ("data",), AxisType.Explicit),
    ((1, 8), ("data", "tensor"), (), AxisType.Auto),
    ((2, 2, 2), ("data", "fsdp", "tensor"), ("data",), AxisType.Auto),
])
def test_vocab_parallel_matches_naive(mesh_shape, names, batch_axes, types):
  mesh = _mesh(mesh_shape, names, types)
  V = 40  # 5 (or 10, 20) columns per shard; vocab_chunk 4 leaves a ragged chunk per shard
  h, w, y = _inputs(V, seed=11)
  vp = functools.partial(K.vocab_parallel_logprobs_and_entropy, mesh=mesh, vocab_axis="tensor",
                         batch_axes=batch_axes, time_chunk=3, vocab_chunk=4)
  y[0, :4] = [0, 39, 20, 19]  # ids on the first, last and neighbouring shards
  logp, ent, (gh, gw, gt) = jax.jit(functools.partial(_value_and_grads, vp))(h, w, y, jnp.float32(0.8))
  n_logp, n_ent, (nh, nw, nt) = _naive_vg(h, w, y, jnp.float32(0.8))
  np.testing.assert_allclose(np.asarray(logp), np.asarray(n_logp), rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(np.asarray(ent), np.asarray(n_ent), rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(np.asarray(gh), np.asarray(nh), rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(np.asarray(gw), np.asarray(nw), rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(float(gt), np_grads(h, w, y, 0.8, G_LOGP, G_ENT)[2], rtol=1e-4, atol=1e-6)


def test_vocab_parallel_no_entropy_and_errors():
  mesh = _mesh((2, 4), ("data", "tensor"), AxisType.Explicit)
  h, w, y = _inputs(40, seed=12)
  f = jax.jit(lambda h, w, y: K.vocab_parallel_logprobs_and_entropy(
      h, w, y, mesh=mesh, batch_axes=("data",), vocab_chunk=4, compute_entropy=False))
  logp, ent = f(h, w, y)
  assert ent is None
  n_logp, _, _ = _naive_vg(h, w, y, jnp.float32(1.0))
  np.testing.assert_allclose(np.asarray(logp), np.asarray(n_logp), rtol=1e-5, atol=1e-5)
  with pytest.raises(ValueError, match="divisible"):
    K.vocab_parallel_logprobs_and_entropy(h, w[:, :37], y % 37, mesh=mesh)


# ----------------------------------------------------------------------------
# memory: the benchmark script and the 1/8 target
# ----------------------------------------------------------------------------


def test_memory_target_at_qwen_vocab():
  """Compiled temp bytes at B=4, T=2048, D=1024, V=151,936 (abstract shapes: nothing allocated)."""
  args = (jax.ShapeDtypeStruct((4, 2048, 1024), jnp.float32), jax.ShapeDtypeStruct((1024, 151936), jnp.float32),
          jax.ShapeDtypeStruct((4, 2048), jnp.int32))

  def temp(impl):
    def f(h, w, y):
      return jax.value_and_grad(lambda h, w: sum(map(jnp.sum, impl(h, w, y))), argnums=(0, 1))(h, w)
    return jax.jit(f).lower(*args).compile().memory_analysis().temp_size_in_bytes

  naive, chunked = temp(K.naive_logprobs_and_entropy), temp(K.token_logprobs_and_entropy)
  assert naive >= 4 * 2048 * 151936 * 4  # at least one f32 [B,T,V] buffer
  assert chunked * 8 <= naive, (chunked, naive)


def test_bench_script_runs_and_prints_json():
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  out = subprocess.run(
      [sys.executable, os.path.join(ROOT, "launch", "bench_logprobs.py"), "--batch=2", "--time=256",
       "--hidden=64", "--vocab=20000", "--time_chunk=64", "--vocab_chunk=2048", "--dtype=float32",
       "--grad=false"],
      capture_output=True, text=True, env=env, timeout=120, cwd=ROOT)
  assert out.returncode == 0, out.stderr[-2000:]
  result = json.loads(out.stdout.strip().splitlines()[-1])
  assert "fwd+bwd" not in result  # --grad=false; test_memory_target_at_qwen_vocab covers the backward
  for name in ("forward",):
    r = result[name]
    assert r["chunked_temp_bytes"] * 8 <= r["naive_temp_bytes"], r
    assert r["meets_target"] is True
