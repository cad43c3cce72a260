"""Memory-efficient token log-probs and entropy from hidden states.

Given hidden states ``[B, T, D]``, the unembedding ``[D, V]`` and target ids
``[B, T]``, compute ``log softmax(z)[y]`` and the entropy of ``softmax(z)`` with
``z = (hidden @ unembed) / temperature`` without materialising the ``[B, T, V]``
logits (Qwen's V = 151,936 makes those ~5 GB in float32 for B=4, T=2048).

Algorithm (:func:`token_logprobs_and_entropy`):

* The vocabulary is processed in chunks of ``vocab_chunk`` columns (outer
  ``lax.scan``) and time in chunks of ``time_chunk`` steps (inner
  ``lax.scan``, the batch axis is kept whole so batch sharding is untouched).
  Only one ``[B, time_chunk, vocab_chunk]`` float32 logits block is live.
* Per token we keep an online log-sum-exp state ``(m, s, t)`` with
  ``s = sum exp(z - m)`` and ``t = sum exp(z - m) (z - m)``; then
  ``lse = m + log s`` and ``entropy = log s - t / s`` (computed relative to the
  max, which avoids the ``lse - E[z]`` cancellation for peaked distributions).
  The target logit is gathered by comparing column ids inside each block.
* A ``jax.custom_vjp`` recomputes each logits block in the backward pass
  (again vocab-outer / time-inner), so the backward is chunked too: residuals
  are only ``lse`` and ``entropy`` (``[B, T]``). With
  ``dz = g_lse p - g_ent p (z - lse + H) + g_zy onehot(y)`` it accumulates
  ``d hidden`` in a float32 ``[B, T, D]`` buffer and writes ``d unembed`` one
  ``[D, vocab_chunk]`` block at a time. The gradient w.r.t. ``temperature`` is
  exact as well.
* Ragged sizes: when V (or T) is not a multiple of the chunk, the last chunk is
  shifted back to end at V (``dynamic_slice`` clamping) and the columns (rows)
  already covered by the previous chunk are masked out, so neither the
  unembedding nor the hidden states are ever padded or copied.

Numerics: logits are accumulated in float32 (``preferred_element_type``) from
inputs of any dtype (bf16 typically), then divided by ``temperature``. The
returned log-probs and entropy are float32 and **temperature-scaled**: they are
those of ``softmax(z / temperature)``, the distribution the sampler draws from,
so importance ratios against sampler log-probs are consistent.

Targets outside ``[0, V)`` (e.g. -1 padding) give ``logp = -lse`` (a finite
placeholder): mask them.
"""

from __future__ import annotations

import functools
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from ._util import check_range
from .losses import entropy_from_logits

__all__ = [
    "token_logprobs_and_entropy",
    "naive_logprobs_and_entropy",
    "vocab_parallel_logprobs_and_entropy",
    "logprob_stats",
]

DEFAULT_TIME_CHUNK = 256
DEFAULT_VOCAB_CHUNK = 8192

try:  # jax >= 0.7
  _shard_map = jax.shard_map
except AttributeError:  # pragma: no cover - older jax
  from jax.experimental.shard_map import shard_map as _shard_map


def _slice_info(i, chunk, size):
  """Start of chunk i clamped to end at `size`, and a mask of its fresh positions."""
  nominal = i * chunk
  start = jnp.minimum(nominal, size - chunk)
  fresh = (start + jnp.arange(chunk)) >= nominal
  return start, fresh


def _vma(*xs):
  """Mesh axes over which any of ``xs`` varies inside ``shard_map`` (empty outside)."""
  axes = set()
  for x in xs:
    aval = jax.typeof(x)
    vma = getattr(aval, "vma", None)  # jax 0.7 - 0.9
    if vma is None:  # jax >= 0.10: ShapedArray.manual_axis_type.varying
      vma = getattr(getattr(aval, "manual_axis_type", None), "varying", ())
    axes |= set(vma or ())
  return tuple(sorted(axes))


def _varying(x, axes):
  """Mark ``x`` (a pytree) as varying over ``axes`` (no-op for axes it already varies over)."""
  if not axes:
    return x

  def cast(a):
    missing = tuple(n for n in axes if n not in _vma(a))
    if not missing:
      return a
    if hasattr(lax, "pcast"):  # jax >= 0.8
      return lax.pcast(a, missing, to="varying")
    return lax.pvary(a, missing)  # pragma: no cover - jax 0.7

  return jax.tree.map(cast, x)


def _logits_block(h, w, temperature):
  return jnp.einsum("btd,dv->btv", h, w, preferred_element_type=jnp.float32) / temperature


def _geometry(hidden, unembed, time_chunk, vocab_chunk, vocab_limit=0):
  """Block geometry; with ``vocab_limit`` only the first ``vocab_limit`` columns
  of ``unembed`` are visited (the rest are outside the distribution)."""
  B, T, D = hidden.shape
  D2, V = unembed.shape
  if D != D2:
    raise ValueError(f"hidden last dim {D} != unembed first dim {D2}")
  if vocab_limit and vocab_limit < V:
    V = int(vocab_limit)
  tc = max(1, min(int(time_chunk), T))
  vc = max(1, min(int(vocab_chunk), V))
  return B, T, D, V, tc, -(-T // tc), vc, -(-V // vc)


def _stats_forward(hidden, unembed, targets, temperature, time_chunk, vocab_chunk, want_ent,
                   vocab_limit=0):
  B, T, D, V, tc, nT, vc, nV = _geometry(hidden, unembed, time_chunk, vocab_chunk, vocab_limit)
  f32 = jnp.float32
  init = (
      jnp.full((B, T), -jnp.inf, f32),  # running max m
      jnp.zeros((B, T), f32),  # s = sum exp(z - m)
      jnp.zeros((B, T), f32),  # t = sum exp(z - m) (z - m)
      jnp.zeros((B, T), f32),  # target logit
  )

  def vbody(carry, v):
    vstart, col_fresh = _slice_info(v, vc, V)
    w = lax.dynamic_slice_in_dim(unembed, vstart, vc, axis=1)
    col = vstart + jnp.arange(vc)

    def tbody(carry, i):
      tstart, row_fresh = _slice_info(i, tc, T)
      h = lax.dynamic_slice_in_dim(hidden, tstart, tc, axis=1)
      y = lax.dynamic_slice_in_dim(targets, tstart, tc, axis=1)
      z = jnp.where(col_fresh, _logits_block(h, w, temperature), -jnp.inf)
      mc = jnp.max(z, axis=-1)
      e = jnp.exp(z - mc[..., None])
      sc = jnp.sum(e, axis=-1)
      zyc = jnp.sum(jnp.where(col_fresh & (col == y[..., None]), z, 0.0), axis=-1)
      old = [lax.dynamic_slice_in_dim(c, tstart, tc, axis=1) for c in carry]
      m_o, s_o, t_o, zy_o = old
      m_n = jnp.maximum(m_o, mc)
      a_o = jnp.exp(m_o - m_n)
      a_c = jnp.exp(mc - m_n)
      s_n = a_o * s_o + a_c * sc
      if want_ent:
        tcn = jnp.sum(jnp.where(col_fresh, e * (z - mc[..., None]), 0.0), axis=-1)
        t_n = a_c * (tcn + sc * (mc - m_n))
        t_n = t_n + jnp.where(s_o > 0, a_o * (t_o + s_o * (m_o - m_n)), 0.0)
      else:
        t_n = t_o
      new = (m_n, s_n, t_n, zy_o + zyc)
      new = [jnp.where(row_fresh, n, o) for n, o in zip(new, old)]
      carry = tuple(lax.dynamic_update_slice_in_dim(c, n, tstart, axis=1) for c, n in zip(carry, new))
      return carry, None

    carry, _ = lax.scan(tbody, carry, jnp.arange(nT))
    return carry, None

  init = _varying(init, _vma(hidden, unembed, targets, temperature))
  (m, s, t, zy), _ = lax.scan(vbody, init, jnp.arange(nV))
  log_s = jnp.log(s)
  lse = m + log_s
  ent = (log_s - t / s) if want_ent else jnp.zeros_like(lse)
  return lse, ent, zy


def _stats_backward(hidden, unembed, targets, temperature, lse, ent, g_lse, g_ent, g_zy,
                    time_chunk, vocab_chunk, want_ent, vocab_limit=0):
  B, T, D, V, tc, nT, vc, nV = _geometry(hidden, unembed, time_chunk, vocab_chunk, vocab_limit)
  f32 = jnp.float32

  def vbody(carry, v):
    dh, dw, dtemp = carry
    vstart, col_fresh = _slice_info(v, vc, V)
    w = lax.dynamic_slice_in_dim(unembed, vstart, vc, axis=1)
    col = vstart + jnp.arange(vc)

    def tbody(carry, i):
      dh, dwv, dtemp = carry
      tstart, row_fresh = _slice_info(i, tc, T)
      sl = lambda a: lax.dynamic_slice_in_dim(a, tstart, tc, axis=1)  # noqa: E731
      h, y = sl(hidden), sl(targets)
      lse_c, ent_c = sl(lse)[..., None], sl(ent)[..., None]
      # rows already handled by the previous (overlapping) chunk get zero cotangent
      gl = jnp.where(row_fresh, sl(g_lse), 0.0)[..., None]
      gy = jnp.where(row_fresh, sl(g_zy), 0.0)[..., None]
      z = jnp.where(col_fresh, _logits_block(h, w, temperature), 0.0)
      p = jnp.where(col_fresh, jnp.exp(z - lse_c), 0.0)
      dz = gl * p
      if want_ent:
        ge = jnp.where(row_fresh, sl(g_ent), 0.0)[..., None]
        dz = dz - ge * p * (z - lse_c + ent_c)
      dz = dz + jnp.where(col_fresh & (col == y[..., None]), gy, 0.0)
      # z = a / temperature with a = h @ w, so dL/dtemperature = -sum(dz z) / temperature
      dtemp = dtemp - jnp.sum(dz * z) / temperature
      da = dz / temperature
      dh_c = jnp.einsum("btv,dv->btd", da, w, preferred_element_type=f32)
      dh = lax.dynamic_update_slice_in_dim(dh, sl(dh) + dh_c, tstart, axis=1)
      dwv = dwv + jnp.einsum("btd,btv->dv", h, da, preferred_element_type=f32)
      return (dh, dwv, dtemp), None

    dwv0 = _varying(jnp.zeros((D, vc), f32), vma)
    (dh, dwv, dtemp), _ = lax.scan(tbody, (dh, dwv0, dtemp), jnp.arange(nT))
    old = lax.dynamic_slice_in_dim(dw, vstart, vc, axis=1)
    dw = lax.dynamic_update_slice_in_dim(
        dw, jnp.where(col_fresh, dwv.astype(dw.dtype), old), vstart, axis=1)
    return (dh, dw, dtemp), None

  vma = _vma(hidden, unembed, targets, temperature, lse, ent, g_lse, g_ent, g_zy)
  init = (jnp.zeros((B, T, D), f32), jnp.zeros(unembed.shape, unembed.dtype), jnp.zeros((), f32))
  init = _varying(init, vma)
  (dh, dw, dtemp), _ = lax.scan(vbody, init, jnp.arange(nV))
  return dh.astype(hidden.dtype), dw, dtemp


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7))
def _stats(hidden, unembed, targets, temperature, time_chunk, vocab_chunk, want_ent, vocab_limit):
  return _stats_forward(hidden, unembed, targets, temperature, time_chunk, vocab_chunk, want_ent,
                        vocab_limit)


def _stats_fwd(hidden, unembed, targets, temperature, time_chunk, vocab_chunk, want_ent,
               vocab_limit):
  lse, ent, zy = _stats_forward(hidden, unembed, targets, temperature, time_chunk, vocab_chunk,
                                want_ent, vocab_limit)
  return (lse, ent, zy), (hidden, unembed, targets, temperature, lse, ent)


def _stats_bwd(time_chunk, vocab_chunk, want_ent, vocab_limit, res, cts):
  hidden, unembed, targets, temperature, lse, ent = res
  g_lse, g_ent, g_zy = cts
  dh, dw, dtemp = _stats_backward(hidden, unembed, targets, temperature, lse, ent,
                                  g_lse, g_ent, g_zy, time_chunk, vocab_chunk, want_ent,
                                  vocab_limit)
  return dh, dw, None, dtemp.astype(temperature.dtype)


_stats.defvjp(_stats_fwd, _stats_bwd)


def _check_params(temperature, time_chunk, vocab_chunk):
  """Range-check concrete parameters: temperature > 0, chunks >= 1 (None = default/unused)."""
  check_range("temperature", temperature, gt=0)
  for name, value in (("time_chunk", time_chunk), ("vocab_chunk", vocab_chunk)):
    if value is None:
      continue
    if isinstance(value, bool) or not hasattr(value, "__index__"):
      raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    check_range(name, int(value.__index__()), ge=1)


def _check_inputs(hidden, unembed, targets):
  hidden, unembed, targets = jnp.asarray(hidden), jnp.asarray(unembed), jnp.asarray(targets)
  if hidden.ndim != 3 or unembed.ndim != 2 or targets.shape != hidden.shape[:2]:
    raise ValueError(
        f"expected hidden [B,T,D], unembed [D,V], targets [B,T]; got {hidden.shape}, "
        f"{unembed.shape}, {targets.shape}")
  if not jnp.issubdtype(targets.dtype, jnp.integer):
    raise ValueError(f"targets must be integer ids, got {targets.dtype}")
  return hidden, unembed, targets.astype(jnp.int32)


def logprob_stats(hidden, unembed, targets, *, temperature=1.0, time_chunk: int = DEFAULT_TIME_CHUNK,
                  vocab_chunk: int = DEFAULT_VOCAB_CHUNK, compute_entropy: bool = True,
                  vocab_limit: int = 0):
  """Chunked per-token ``(lse, entropy, target_logit)`` over the given vocabulary slice.

  Differentiable (custom VJP, chunked backward) in ``hidden``, ``unembed`` and
  ``temperature``. Targets outside ``[0, V)`` contribute ``target_logit = 0``,
  which is what makes vocabulary sharding work (each shard sees only its ids).

  Returns three ``[B, T]`` float32 arrays (entropy is zeros when
  ``compute_entropy=False``). ``temperature`` must be > 0 and the chunks >= 1
  (``ValueError`` naming the parameter otherwise). ``vocab_limit`` > 0: the
  distribution is over the first ``vocab_limit`` columns only (ids a tokenizer
  has; the unembedding's extra rows are never visited and get zero gradient).
  """
  _check_params(temperature, time_chunk, vocab_chunk)
  hidden, unembed, targets = _check_inputs(hidden, unembed, targets)
  if isinstance(vocab_limit, bool) or not hasattr(vocab_limit, "__index__") or vocab_limit < 0:
    raise ValueError(f"vocab_limit must be an int >= 0 (0 = every column), got {vocab_limit!r}")
  temperature = jnp.asarray(temperature, jnp.float32)
  return _stats_call(hidden, unembed, targets, temperature, time_chunk, vocab_chunk, compute_entropy,
                     int(vocab_limit))


def _stats_call(hidden, unembed, targets, temperature, time_chunk, vocab_chunk, compute_entropy,
                vocab_limit=0):
  # Under shard_map (check_vma) give every input the union of the inputs' varying
  # axes, so the custom-VJP cotangents have the inputs' types; the transpose of
  # that cast psums e.g. the replicated hidden's gradient over the vocab axis.
  hidden, unembed, targets, temperature = _varying(
      (hidden, unembed, targets, temperature), _vma(hidden, unembed, targets, temperature))
  return _stats(hidden, unembed, targets, temperature, int(time_chunk), int(vocab_chunk),
                bool(compute_entropy), int(vocab_limit))


def token_logprobs_and_entropy(hidden, unembed, targets, *, temperature=1.0,
                               time_chunk: int = DEFAULT_TIME_CHUNK,
                               vocab_chunk: int = DEFAULT_VOCAB_CHUNK,
                               compute_entropy: bool = True, vocab_limit: int = 0):
  """Per-token log-probs and entropy without materialising ``[B, T, V]`` logits.

  Args:
    hidden: ``[B, T, D]`` final hidden states (any float dtype).
    unembed: ``[D, V]`` unembedding (LM head) matrix.
    targets: ``[B, T]`` int target ids (the token at t+1 for position t).
    temperature: float > 0 (or scalar array, unchecked); logits are
      ``(hidden @ unembed) / temperature``.
    time_chunk: time steps per block (batch is kept whole), int >= 1.
    vocab_chunk: vocabulary columns per block, int >= 1; V need not be a multiple.
    compute_entropy: if False, entropy is skipped and ``None`` is returned for it.
    vocab_limit: > 0: the distribution is over ids ``[0, vocab_limit)`` only
      (a checkpoint's padded embedding rows beyond its tokenizer; a target id at
      or above it is an error of the caller's).

  Returns:
    ``(logp [B, T] float32, entropy [B, T] float32 or None)``, both of the
    temperature-scaled distribution. Peak extra memory is one
    ``[B, time_chunk, vocab_chunk]`` float32 block (plus a few of its
    elementwise temporaries) and, under ``grad``, a float32 ``[B, T, D]``
    accumulator.
  """
  lse, ent, zy = logprob_stats(hidden, unembed, targets, temperature=temperature, time_chunk=time_chunk,
                               vocab_chunk=vocab_chunk, compute_entropy=compute_entropy,
                               vocab_limit=vocab_limit)
  return zy - lse, (ent if compute_entropy else None)


def naive_logprobs_and_entropy(hidden, unembed, targets, *, temperature=1.0, time_chunk: Optional[int] = None,
                               vocab_chunk: Optional[int] = None, compute_entropy: bool = True):
  """Reference implementation that materialises the full ``[B, T, V]`` logits.

  Same signature and conventions as :func:`token_logprobs_and_entropy`
  (``time_chunk``/``vocab_chunk`` are accepted and ignored); plain autodiff.
  """
  _check_params(temperature, time_chunk, vocab_chunk)
  del time_chunk, vocab_chunk
  hidden, unembed, targets = _check_inputs(hidden, unembed, targets)
  V = unembed.shape[1]
  z = _logits_block(hidden, unembed, jnp.asarray(temperature, jnp.float32))
  lse = jax.nn.logsumexp(z, axis=-1)
  in_range = (targets >= 0) & (targets < V)
  zy = jnp.take_along_axis(z, jnp.clip(targets, 0, V - 1)[..., None], axis=-1)[..., 0]
  logp = jnp.where(in_range, zy, 0.0) - lse
  return logp, (entropy_from_logits(z) if compute_entropy else None)


def _place(x, mesh, spec):
  """Put ``x`` on ``mesh`` with ``spec`` (Explicit axes: ``jax.reshard``; Auto: a sharding constraint)."""
  sharding = jax.sharding.NamedSharding(mesh, spec)
  types = getattr(mesh, "axis_types", ())
  explicit = getattr(getattr(jax.sharding, "AxisType", None), "Explicit", None)
  if explicit is not None and any(t == explicit for t in types):
    return jax.reshard(x, sharding)
  if isinstance(x, jax.core.Tracer):
    return jax.lax.with_sharding_constraint(x, sharding)
  return jax.device_put(x, sharding)


def vocab_parallel_logprobs_and_entropy(hidden, unembed, targets, *, mesh, vocab_axis: str = "tensor",
                                        batch_axes: Sequence[str] = (), temperature=1.0,
                                        time_chunk: int = DEFAULT_TIME_CHUNK,
                                        vocab_chunk: int = DEFAULT_VOCAB_CHUNK,
                                        compute_entropy: bool = True):
  """Chunked log-probs/entropy with the vocabulary sharded over a mesh axis.

  ``shard_map`` over ``mesh``: ``unembed`` is split as ``P(None, vocab_axis)``,
  ``hidden``/``targets`` as ``P(batch_axes, ...)`` (replicated over
  ``vocab_axis``). Each shard runs the chunked kernel on its vocabulary slice
  (targets shifted by the shard offset; foreign ids contribute 0), then

  * ``lse = M + log psum(exp(lse_l - M))`` with ``M = pmax(lse_l)`` (no gradient
    through ``M``; the result does not depend on it),
  * ``logp = psum(target_logit_l) - lse``,
  * ``entropy = psum(w_l (H_l - log w_l))`` with ``w_l = exp(lse_l - lse)``
    (entropy of a mixture of the per-shard softmaxes),

  all differentiable (the gradient of the replicated ``hidden`` is psum'd over
  ``vocab_axis`` by ``shard_map``'s transpose).

  Args:
    hidden: ``[B, T, D]``; unembed: ``[D, V]`` with ``V`` divisible by the size
      of ``vocab_axis``; targets: ``[B, T]`` global ids.
    mesh: a ``jax.sharding.Mesh`` containing ``vocab_axis`` (and ``batch_axes``).
    vocab_axis: mesh axis that shards the vocabulary.
    batch_axes: mesh axes that shard the batch dimension (B divisible by their product).

  Returns:
    ``(logp [B, T], entropy [B, T] or None)`` float32, sharded ``P(batch_axes, None)``.
  """
  _check_params(temperature, time_chunk, vocab_chunk)
  hidden, unembed, targets = _check_inputs(hidden, unembed, targets)
  n_shards = mesh.shape[vocab_axis]
  V = unembed.shape[1]
  if V % n_shards:
    raise ValueError(f"vocab size {V} is not divisible by mesh axis {vocab_axis!r} of size {n_shards}; "
                     "pad the unembedding (padded columns must be masked by the caller)")
  batch_axes = tuple(batch_axes)
  b = (batch_axes if len(batch_axes) > 1 else batch_axes[0]) if batch_axes else None
  temperature = jnp.asarray(temperature, jnp.float32)
  want_ent = bool(compute_entropy)

  def local(h, w, y, temp):
    v_local = w.shape[1]
    y_local = y - lax.axis_index(vocab_axis) * v_local
    lse_l, ent_l, zy_l = _stats_call(h, w, y_local, temp, time_chunk, vocab_chunk, want_ent)
    m = lax.pmax(lax.stop_gradient(lse_l), vocab_axis)
    lse = m + jnp.log(lax.psum(jnp.exp(lse_l - m), vocab_axis))
    logp = lax.psum(zy_l, vocab_axis) - lse
    if not want_ent:
      return logp, jnp.zeros_like(logp)
    log_w = lse_l - lse
    ent = lax.psum(jnp.exp(log_w) * (ent_l - log_w), vocab_axis)
    return logp, ent

  in_specs = (P(b, None, None), P(None, vocab_axis), P(b, None), P())
  fn = _shard_map(local, mesh=mesh, in_specs=in_specs, out_specs=(P(b, None), P(b, None)))
  args = [_place(x, mesh, spec) for x, spec in zip((hidden, unembed, targets, temperature), in_specs)]
  logp, ent = fn(*args)
  return logp, (ent if want_ent else None)
