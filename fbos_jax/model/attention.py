"""Causal grouped-query attention: one home for the three implementations.

Shapes (B batch, T query steps, S key slots, H query heads, K kv heads,
G = H // K query heads per kv head, Dh head dim)::

    q                 [B, T, H, Dh]   head h reads kv head h // G
    k, v  (training)  [B, S, K, Dh]   S = T
    k     (cache)     [B, K, Dh, S]   keys stored transposed (qwen.KVCache)
    v     (cache)     [B, K, S, Dh]
    kv_valid          [B, S]          1 where slot j holds a real (non-pad) token
    segment_ids       [B, T]          (training only) rows packing several sequences
    out               [B, T, H, Dh]

Query i sits in slot ``q_offset + i`` (``q_offset`` = ``cache_index`` for the
cache, 0 for training) and may attend to key j iff ``j <= q_offset + i`` and
both are in the same segment. Without ``segment_ids`` every query is in
segment 1 and key j in segment ``kv_valid[b, j]`` (1 real, 0 pad): a training
batch of left-padded prompts + right-padded responses passes its attention
mask. With ``segment_ids`` (packed rows: 1, 2, ... for the sequences laid end
to end in a row, 0 for its padding) query i and key j carry
``segment_ids[b, i]`` and ``segment_ids[b, j]``: a token never attends to
another sequence, in every implementation (one rule, :func:`_segments`), and
a padding query attends to padding keys. Query rows with no allowed key give
an unspecified finite output; callers must not read them.

Implementations (``ModelConfig.attention``):

- :func:`dense`: the reference. float32 scores ``[B, K, G, T, S]`` scaled after
  the product, masked with ``finfo(float32).min``, float32 softmax, probabilities
  cast to the compute dtype before the product with v.
- :func:`blocked`: portable XLA flash attention. A ``lax.scan`` over query
  blocks, an inner loop over the key blocks up to the causal diagonal with an
  online softmax; a ``jax.custom_vjp`` whose backward recomputes each
  ``[B, K, G, block_q, block_kv]`` score tile (FlashAttention-2), so neither
  pass holds more than a few tiles of scores. Saves (q, k, v, out, logsumexp).
- :func:`pallas`: the Pallas TPU splash-attention kernel
  (``jax.experimental.pallas.ops.tpu.splash_attention``; its own custom vjp),
  key padding as segment ids, causality as its static ``CausalMask``. Under a
  mesh in context (``jax.set_mesh``) it runs inside ``jax.shard_map`` over the
  batch axes (dcn, data, fsdp) and the head axis (tensor), since GSPMD does not
  partition Pallas calls.

``auto`` (:func:`choose`): ``dense`` while the whole score matrix is one tile
(``T * S <= block_q * block_kv``) or for a decode step (T = 1); otherwise
``pallas`` when the program targets TPU and ``blocked`` elsewhere. The target
is read from the mesh in context: ``jax.sharding.get_abstract_mesh()`` under
``jax.set_mesh(mesh)`` carries the devices' platform (``jax.default_backend()``
says nothing about a program compiled for another platform, e.g. an abstract
TPU topology on a CPU host). A mesh without devices (``AbstractMesh``) leaves
the choice to XLA lowering (``lax.platform_dependent``: only the branch of the
platform being compiled for is lowered). With no mesh in context ``auto`` uses
``blocked``: a Pallas kernel outside ``shard_map`` cannot be partitioned
("Mosaic kernels cannot be automatically partitioned"), and inside a jit the
trace cannot see how many devices the program spans. So trace TPU programs
under ``jax.set_mesh(mesh)`` to get the kernel.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Optional

import jax
import jax.numpy as jnp

from fbos_jax import sharding as sh

IMPLEMENTATIONS = ("auto", "dense", "blocked", "pallas")
HEAD_MESH_AXIS = "tensor"
LANES = 128  # splash attention tiles are multiples of the TPU lane width
_NEG = float(jnp.finfo(jnp.float32).min)


def _segments(kv_valid, segment_ids, t: int):
  """(query segments [B, T], key segments [B, S]) int32 of one call: both the
  packed rows' ``segment_ids`` when given, else every query in segment 1 and
  key j in segment 1 (``kv_valid``) or 0 (pad). Query i may attend key j only
  when their segments are equal (and j is in its causal reach)."""
  if segment_ids is not None:
    seg = segment_ids.astype(jnp.int32)
    return seg, seg
  kv = (kv_valid != 0).astype(jnp.int32)
  return jnp.ones((kv.shape[0], t), jnp.int32), kv


def _allowed(q_seg, kv_seg, q_offset):
  """[B, T, S] bool: key j allowed for query i (slot q_offset + i)."""
  t, s = q_seg.shape[1], kv_seg.shape[1]
  qpos = jnp.arange(t)[:, None]
  kpos = jnp.arange(s)[None, :]
  return (kpos <= qpos + q_offset)[None] & (q_seg[:, :, None] == kv_seg[:, None, :])


def _check_segments(segment_ids, q, cache_layout: bool, q_offset):
  if segment_ids is None:
    return
  if cache_layout or _static_int(q_offset) != 0:
    raise ValueError("attention: segment_ids are for a training batch (no cache, q_offset 0)")
  if segment_ids.shape != q.shape[:2]:
    raise ValueError(f"attention: segment_ids {segment_ids.shape} must be [B, T] = {q.shape[:2]}")


def _kv_len(k, cache_layout: bool) -> int:
  return k.shape[-1] if cache_layout else k.shape[1]


# ----------------------------------------------------------------------------- dense


def dense(q, k, v, kv_valid, *, q_offset: Any = 0, cache_layout: bool = False, dtype=None,
          segment_ids=None):
  """Reference attention: materialises float32 scores [B, K, G, T, S].

  q [B, T, H, Dh]; k, v [B, S, K, Dh] (training) or, with ``cache_layout``,
  k [B, K, Dh, S] and v [B, K, S, Dh]; kv_valid [B, S]; segment_ids [B, T]
  (packed training rows, or None) -> [B, T, H, Dh].
  """
  dtype = jnp.dtype(dtype or q.dtype)
  b, t, h, dh = q.shape
  s = _kv_len(k, cache_layout)
  _check_segments(segment_ids, q, cache_layout, q_offset)
  mask = _allowed(*_segments(kv_valid, segment_ids, t), q_offset)
  if not cache_layout:
    kv = k.shape[2]
    qg = q.reshape(b, t, kv, h // kv, dh)
    scores = jnp.einsum("btkgd,bskd->bkgts", qg, k,
                        preferred_element_type=jnp.float32) / math.sqrt(dh)
    scores = jnp.where(mask[:, None, None, :, :], scores, _NEG)
    probs = jax.nn.softmax(scores, axis=-1).astype(dtype)
    out = jnp.einsum("bkgts,bskd->btkgd", probs, v)
    return out.reshape(b, t, h, dh)
  # cache layout: the G query heads of a group and the T query steps share one
  # matmul against the cache (no transpose of k).
  kv = k.shape[1]
  g = h // kv
  qg = q.reshape(b, t, kv, g, dh).transpose(0, 2, 3, 1, 4).reshape(b, kv, g * t, dh)
  scores = jnp.einsum("bkqd,bkds->bkqs", qg, k,
                      preferred_element_type=jnp.float32) / math.sqrt(dh)
  scores = scores.reshape(b, kv, g, t, s)
  scores = jnp.where(mask[:, None, None, :, :], scores, _NEG)
  probs = jax.nn.softmax(scores, axis=-1).astype(dtype).reshape(b, kv, g * t, s)
  out = jnp.einsum("bkqs,bksd->bkqd", probs, v)
  return out.reshape(b, kv, g, t, dh).transpose(0, 3, 1, 2, 4).reshape(b, t, h, dh)


# ----------------------------------------------------------------------------- blocked


def _split(n: int, block: int, align: int) -> tuple[int, int]:
  """(block length, number of blocks): ceil(n / block) equal blocks, each a
  multiple of ``align``, covering n with less than one block of padding."""
  nb = max(1, -(-n // block))
  return -(-(-(-n // nb)) // align) * align, nb


def _tile_scores(qi, kj, k_spec: str, dh: int):
  """qi [B, K, G, bq, Dh], kj (k_spec) -> float32 scores [B, K, G, bq, bkv]."""
  return jnp.einsum(f"bkgqd,{k_spec}->bkgqs", qi, kj,
                    preferred_element_type=jnp.float32) / math.sqrt(dh)


def _tile_allowed(row0, col0, bq: int, bkv: int, q_offset, seg_i, seg_j):
  """[B, 1, 1, bq, bkv] bool for the tile whose first query row / key slot are
  row0 / col0; seg_i [B, bq] / seg_j [B, bkv]: the tile's query / key segments."""
  rows = row0 + jnp.arange(bq)[:, None] + q_offset
  cols = col0 + jnp.arange(bkv)[None, :]
  same = seg_i[:, :, None] == seg_j[:, None, :]
  return (cols <= rows)[None, None, None] & same[:, None, None]


def _slice_k(k, j, bkv: int, k_spec: str):
  return jax.lax.dynamic_slice_in_dim(k, j * bkv, bkv, axis=3 if k_spec == "bkds" else 2)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8))
def _flash(q, k, v, q_seg, kv_seg, q_offset, k_spec, bq, bkv):
  return _flash_fwd(q, k, v, q_seg, kv_seg, q_offset, k_spec, bq, bkv)[0]


def _flash_fwd(q, k, v, q_seg, kv_seg, q_offset, k_spec, bq, bkv):
  """q [B, K, G, Tp, Dh]; k [B, K, Sp, Dh] ("bksd") or [B, K, Dh, Sp] ("bkds");
  v [B, K, Sp, Dh]; q_seg [B, Tp] / kv_seg [B, Sp] int32 segments (:func:`_segments`);
  q_offset int32 scalar.
  -> out [B, K, G, Tp, Dh] (q.dtype) and residuals incl. logsumexp [B, K, G, Tp]."""
  b, kh, g, tp, dh = q.shape
  sp = v.shape[2]
  nq, nk = tp // bq, sp // bkv

  def q_block(_, i):
    qi = jax.lax.dynamic_slice_in_dim(q, i * bq, bq, axis=3)
    seg_i = jax.lax.dynamic_slice_in_dim(q_seg, i * bq, bq, axis=1)
    # key blocks past the causal reach of this query block are skipped
    hi = jnp.clip((q_offset + (i + 1) * bq + bkv - 1) // bkv, 0, nk)

    def kv_block(j, carry):
      m, l, acc = carry
      kj = _slice_k(k, j, bkv, k_spec)
      vj = jax.lax.dynamic_slice_in_dim(v, j * bkv, bkv, axis=2)
      seg_j = jax.lax.dynamic_slice_in_dim(kv_seg, j * bkv, bkv, axis=1)
      s = _tile_scores(qi, kj, k_spec, dh)
      s = jnp.where(_tile_allowed(i * bq, j * bkv, bq, bkv, q_offset, seg_i, seg_j), s, _NEG)
      m_new = jnp.maximum(m, s.max(axis=-1))
      alpha = jnp.exp(m - m_new)
      p = jnp.exp(s - m_new[..., None])
      l = alpha * l + p.sum(axis=-1)
      pv = jnp.einsum("bkgqs,bksd->bkgqd", p.astype(q.dtype), vj,
                      preferred_element_type=jnp.float32)
      return m_new, l, alpha[..., None] * acc + pv

    init = (jnp.full((b, kh, g, bq), _NEG, jnp.float32), jnp.zeros((b, kh, g, bq), jnp.float32),
            jnp.zeros((b, kh, g, bq, dh), jnp.float32))
    m, l, acc = jax.lax.fori_loop(0, hi, kv_block, init)
    l = jnp.maximum(l, 1e-30)  # only a block with no visited key (never: key 0 is in reach)
    return None, ((acc / l[..., None]).astype(q.dtype), m + jnp.log(l))

  _, (o, lse) = jax.lax.scan(q_block, None, jnp.arange(nq))
  o = jnp.moveaxis(o, 0, 3).reshape(b, kh, g, tp, dh)
  lse = jnp.moveaxis(lse, 0, 3).reshape(b, kh, g, tp)
  return o, (q, k, v, q_seg, kv_seg, q_offset, o, lse)


def _flash_bwd(k_spec, bq, bkv, res, do):
  q, k, v, q_seg, kv_seg, q_offset, o, lse = res
  b, kh, g, tp, dh = q.shape
  sp = v.shape[2]
  nq, nk = tp // bq, sp // bkv
  dt = q.dtype
  delta = jnp.sum(do.astype(jnp.float32) * o.astype(jnp.float32), axis=-1)  # [B, K, G, Tp]

  def kv_block(dq, j):
    kj = _slice_k(k, j, bkv, k_spec)
    vj = jax.lax.dynamic_slice_in_dim(v, j * bkv, bkv, axis=2)
    seg_j = jax.lax.dynamic_slice_in_dim(kv_seg, j * bkv, bkv, axis=1)
    # query blocks before the first one that reaches key block j are skipped
    lo = jnp.clip((j * bkv - q_offset) // bq, 0, nq)

    def q_block(i, carry):
      dq, dk_j, dv_j = carry
      qi = jax.lax.dynamic_slice_in_dim(q, i * bq, bq, axis=3)
      doi = jax.lax.dynamic_slice_in_dim(do, i * bq, bq, axis=3)
      lse_i = jax.lax.dynamic_slice_in_dim(lse, i * bq, bq, axis=3)
      delta_i = jax.lax.dynamic_slice_in_dim(delta, i * bq, bq, axis=3)
      seg_i = jax.lax.dynamic_slice_in_dim(q_seg, i * bq, bq, axis=1)
      allowed = _tile_allowed(i * bq, j * bkv, bq, bkv, q_offset, seg_i, seg_j)
      s = _tile_scores(qi, kj, k_spec, dh)
      p = jnp.where(allowed, jnp.exp(s - lse_i[..., None]), 0.0)  # [B, K, G, bq, bkv]
      dv_j = dv_j + jnp.einsum("bkgqs,bkgqd->bksd", p.astype(dt), doi,
                               preferred_element_type=jnp.float32)
      dp = jnp.einsum("bkgqd,bksd->bkgqs", doi, vj, preferred_element_type=jnp.float32)
      ds = (p * (dp - delta_i[..., None]) / math.sqrt(dh)).astype(dt)  # d(q.k)
      dq_i = jnp.einsum(f"bkgqs,{k_spec}->bkgqd", ds, kj, preferred_element_type=jnp.float32)
      dq = jax.lax.dynamic_update_slice_in_dim(
          dq, jax.lax.dynamic_slice_in_dim(dq, i * bq, bq, axis=3) + dq_i, i * bq, axis=3)
      dk_j = dk_j + jnp.einsum(f"bkgqs,bkgqd->{k_spec}", ds, qi,
                               preferred_element_type=jnp.float32)
      return dq, dk_j, dv_j

    dk0 = jnp.zeros(kj.shape, jnp.float32)
    dv0 = jnp.zeros(vj.shape, jnp.float32)
    dq, dk_j, dv_j = jax.lax.fori_loop(lo, nq, q_block, (dq, dk0, dv0))
    return dq, (dk_j, dv_j)

  dq, (dk, dv) = jax.lax.scan(kv_block, jnp.zeros(q.shape, jnp.float32), jnp.arange(nk))
  # dk, dv: [nk, B, K, bkv, Dh] (or [nk, B, K, Dh, bkv] for "bkds")
  dk = jnp.moveaxis(dk, 0, 3 if k_spec == "bkds" else 2)
  dk = dk.reshape(k.shape)
  dv = jnp.moveaxis(dv, 0, 2).reshape(v.shape)
  return (dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, None, None)


_flash.defvjp(_flash_fwd, _flash_bwd)


def blocked(q, k, v, kv_valid, *, q_offset: Any = 0, cache_layout: bool = False,
            block_q: int = 512, block_kv: int = 512, dtype=None, segment_ids=None):
  """Flash attention in plain XLA (see the module docstring). Same arguments as
  :func:`dense`; ``q_offset`` may be traced. Memory: a few float32 tiles
  [B, K, G, block_q, block_kv] in the forward and in the backward, plus the
  saved (q, k, v, out) and logsumexp [B, K, G, T]."""
  del dtype  # the compute dtype is q's; scores and softmax are float32
  _check_segments(segment_ids, q, cache_layout, q_offset)
  b, t, h, dh = q.shape
  s = _kv_len(k, cache_layout)
  kh = k.shape[1] if cache_layout else k.shape[2]
  g = h // kh
  bq, _ = _split(t, block_q, 8)
  tp = -(-t // bq) * bq
  bkv, _ = _split(s, block_kv, 8)
  sp = -(-s // bkv) * bkv
  qc = q.reshape(b, t, kh, g, dh).transpose(0, 2, 3, 1, 4)  # [B, K, G, T, Dh]
  qc = jnp.pad(qc, ((0, 0),) * 3 + ((0, tp - t), (0, 0)))
  if cache_layout:
    kc, vc, k_spec = k, v, "bkds"
    kc = jnp.pad(kc, ((0, 0),) * 3 + ((0, sp - s),))
  else:
    kc, vc, k_spec = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3), "bksd"
    kc = jnp.pad(kc, ((0, 0), (0, 0), (0, sp - s), (0, 0)))
  vc = jnp.pad(vc, ((0, 0), (0, 0), (0, sp - s), (0, 0)))
  # padded query rows / key slots are in segments no real slot has (never attended)
  q_seg, kv_seg = _segments(kv_valid, segment_ids, t)
  q_seg = jnp.pad(q_seg, ((0, 0), (0, tp - t)), constant_values=-2)
  kv_seg = jnp.pad(kv_seg, ((0, 0), (0, sp - s)), constant_values=-1)
  offset = jnp.asarray(q_offset, jnp.int32)
  out = _flash(qc, kc, vc, q_seg, kv_seg, offset, k_spec, bq, bkv)  # [B, K, G, Tp, Dh]
  return out[:, :, :, :t].transpose(0, 3, 1, 2, 4).reshape(b, t, h, dh)


# ----------------------------------------------------------------------------- pallas


def _static_int(x) -> Optional[int]:
  """x as a Python int if it is known at trace time, else None."""
  try:
    return int(x)
  except (TypeError, jax.errors.ConcretizationTypeError, jax.errors.TracerIntegerConversionError):
    return None


def _splash(q, k, v, kv_seg, q_offset: int, cache_layout: bool, block_q: int,
            block_kv: int, interpret: bool):
  """Unsharded splash attention (per-device shapes); arguments as :func:`pallas`,
  ``kv_seg`` [B, S] the segment of each key slot (a query in slot i has slot
  i's): ``kv_valid`` (0 pad / 1 real) or a packed batch's ``segment_ids``."""
  from jax.experimental.pallas.ops.tpu import splash_attention as sa

  b, t, h, dh = q.shape
  s = _kv_len(k, cache_layout)
  # keys past the causal reach of the last query are never attended: drop them
  s_used = min(s, q_offset + t)
  bq, _ = _split(t, block_q, LANES)
  tp = -(-t // bq) * bq
  bkv, _ = _split(s_used, block_kv, LANES)
  sp = -(-s_used // bkv) * bkv
  # the kernel takes no scale: q is scaled (in float32) before the product
  qh = (q.transpose(0, 2, 1, 3).astype(jnp.float32) * (1.0 / math.sqrt(dh))).astype(q.dtype)
  qh = jnp.pad(qh, ((0, 0), (0, 0), (0, tp - t), (0, 0)))  # [B, H, Tp, Dh]
  if cache_layout:  # k [B, K, Dh, S]: the kernel reads it as is (SEQ_MINOR)
    kh = jnp.pad(k[..., :s_used], ((0, 0),) * 3 + ((0, sp - s_used),)).swapaxes(-1, -2)
    vh = v[:, :, :s_used]
    k_layout = sa.QKVLayout.SEQ_MINOR
  else:
    kh = k[:, :s_used].transpose(0, 2, 1, 3)
    vh = v[:, :s_used].transpose(0, 2, 1, 3)
    kh = jnp.pad(kh, ((0, 0), (0, 0), (0, sp - s_used), (0, 0)))
    k_layout = sa.QKVLayout.HEAD_DIM_MINOR
  vh = jnp.pad(vh, ((0, 0), (0, 0), (0, sp - s_used), (0, 0)))
  # segment ids: a query in slot q_offset + i carries that slot's segment (its
  # validity, or its packed sequence), so a pad query attends pad keys (at least
  # itself) and no row is empty; padded key slots get -1 (never attended),
  # padded query rows -2.
  seg = kv_seg[:, :s_used].astype(jnp.int32)
  q_seg = jnp.pad(seg[:, q_offset:q_offset + t], ((0, 0), (0, tp - t)), constant_values=-2)
  kv_seg = jnp.pad(seg, ((0, 0), (0, sp - s_used)), constant_values=-1)
  blocks = sa.BlockSizes(
      block_q=bq, block_kv=bkv, block_kv_compute=bkv,
      block_q_dkv=bq, block_kv_dkv=bkv, block_kv_dkv_compute=bkv,
      block_q_dq=bq, block_kv_dq=bkv, k_layout=k_layout)
  mask = sa.MultiHeadMask([sa.CausalMask((tp, sp), offset=q_offset)] * h)
  kernel = sa.make_splash_mha(mask, block_sizes=blocks, head_shards=1, q_seq_shards=1,
                              interpret=interpret)
  out = jax.vmap(kernel)(qh, kh, vh, segment_ids=sa.SegmentIds(q_seg, kv_seg))  # [B, H, Tp, Dh]
  return out[:, :, :t].transpose(0, 2, 1, 3)


def _fit_axes(mesh, axes, *dims) -> Any:
  """The mesh axes among ``axes`` (size > 1, in order) whose product divides every dim."""
  kept = [a for a in axes if a in mesh.axis_names and mesh.shape[a] > 1]
  while kept and any(d % math.prod(mesh.shape[a] for a in kept) for d in dims):
    kept.pop()
  return tuple(kept) if len(kept) > 1 else (kept[0] if kept else None)


def pallas(q, k, v, kv_valid, *, q_offset: Any = 0, cache_layout: bool = False,
           block_q: int = 512, block_kv: int = 512, dtype=None, interpret: bool = False,
           segment_ids=None):
  """Splash attention (Pallas TPU kernel). Same arguments as :func:`dense`;
  ``q_offset`` must be static (a Python int). ``interpret=True`` runs the kernel
  in the Pallas interpreter (any backend, slow: for tests). The kernel takes
  ``segment_ids`` as they are (packed rows); without them, ``kv_valid``.

  With a mesh in context the kernel runs under ``jax.shard_map``: batch over the
  mesh axes (dcn, data, fsdp) that divide B, heads over ``tensor`` when it divides
  both H and K (otherwise heads are replicated); sequences are not sharded."""
  del dtype
  offset = _static_int(q_offset)
  if offset is None:
    raise ValueError("model.attention='pallas' needs a static cache_index (a Python int); "
                     "use model.attention='blocked' (or 'auto') for a traced one.")
  _check_segments(segment_ids, q, cache_layout, offset)
  kv_seg = kv_valid if segment_ids is None else segment_ids
  s = _kv_len(k, cache_layout)
  if offset < 0 or offset + q.shape[1] > s:
    raise ValueError(f"attention: queries in slots [{offset}, {offset + q.shape[1]}) do not "
                     f"fit the {s} key slots.")
  run = functools.partial(_splash, q_offset=offset, cache_layout=cache_layout,
                          block_q=block_q, block_kv=block_kv, interpret=interpret)
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or math.prod(mesh.shape.values()) == 1:
    return run(q, k, v, kv_seg)
  from jax.sharding import PartitionSpec as P
  b, _, h, _ = q.shape
  kh = k.shape[1] if cache_layout else k.shape[2]
  bat = _fit_axes(mesh, sh.batch_axes(), b)  # the default rules' batch axes
  hd = _fit_axes(mesh, (HEAD_MESH_AXIS,), h, kh)
  q_spec = P(bat, None, hd, None)
  if cache_layout:
    k_spec = v_spec = P(bat, hd, None, None)
  else:
    k_spec = v_spec = P(bat, None, hd, None)
  fn = jax.shard_map(run, mesh=mesh, in_specs=(q_spec, k_spec, v_spec, P(bat, None)),
                     out_specs=q_spec, check_vma=False)
  return fn(q, k, v, kv_seg)


# ----------------------------------------------------------------------------- selection


def mesh_platform() -> Optional[str]:
  """Platform of the devices of the mesh in context ("tpu", "gpu", "cpu"), or
  None when no mesh is set or it carries no device (a bare AbstractMesh)."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or mesh.abstract_device is None:
    return None
  return mesh.abstract_device.platform


def choose(impl: str, q_len: int, kv_len: int, *, q_offset: Any = 0, block_q: int = 512,
           block_kv: int = 512) -> str:
  """Resolve ``model.attention`` for one call (see the module docstring): "dense",
  "blocked", "pallas", or "platform" (pallas on TPU, blocked elsewhere, decided
  when XLA lowers; only under a mesh without devices).

  A decode step (q_len == 1) always runs dense: its scores [B, K, G, 1, S] are one row."""
  if impl not in IMPLEMENTATIONS:
    raise ValueError(f"model.attention={impl!r}; expected one of {IMPLEMENTATIONS}.")
  if q_len == 1:
    return "dense"
  if impl != "auto":
    return impl
  if q_len * kv_len <= block_q * block_kv:
    return "dense"
  if _static_int(q_offset) is None:
    return "blocked"
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return "blocked"
  platform = mesh_platform()
  if platform is None:
    return "platform"
  return "pallas" if platform == "tpu" else "blocked"


def attention(q, k, v, kv_valid, *, q_offset: Any = 0, cache_layout: bool = False,
              impl: str = "auto", block_q: int = 512, block_kv: int = 512, dtype=None,
              segment_ids=None):
  """Causal GQA attention with the implementation :func:`choose` picks.

  q [B, T, H, Dh]; training k, v [B, S, K, Dh]; cache (``cache_layout``)
  k [B, K, Dh, S], v [B, K, S, Dh]; kv_valid [B, S]; segment_ids [B, T]
  (packed training rows: a token attends only within its segment) or None
  -> [B, T, H, Dh]."""
  s = _kv_len(k, cache_layout)
  which = choose(impl, q.shape[1], s, q_offset=q_offset, block_q=block_q, block_kv=block_kv)
  common = dict(q_offset=q_offset, cache_layout=cache_layout, segment_ids=segment_ids)
  if which == "dense":
    return dense(q, k, v, kv_valid, dtype=dtype, **common)
  blocks = dict(block_q=block_q, block_kv=block_kv, **common)
  if which == "blocked":
    return blocked(q, k, v, kv_valid, **blocks)
  if which == "pallas":
    return pallas(q, k, v, kv_valid, **blocks)
  blocks.pop("segment_ids")  # an array: a branch operand, not a closure
  seg = () if segment_ids is None else (segment_ids,)
  with_seg = lambda fn: lambda *a: fn(*a[:4], segment_ids=a[4] if seg else None, **blocks)
  return jax.lax.platform_dependent(q, k, v, kv_valid, *seg, tpu=with_seg(pallas),
                                    default=with_seg(blocked))
