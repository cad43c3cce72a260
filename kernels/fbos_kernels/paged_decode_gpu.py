"""Paged decode attention for GPUs (Pallas, Triton lowering): one query token per
row reads its keys and values from the page pool in place.

The pool layout is the engine's (``fbos_jax/model/paged_attention.py``, the layout
of JAX's TPU ragged paged attention)::

    pages       [N, page_size, 2K, Dh]   combined head 2i = key of kv head i, 2i + 1 its value
    page_table  [B, pb] int32            row b's logical page j is physical page page_table[b, j]
    kv_lens     [B] int32                row b attends to positions [0, kv_lens[b])
    q           [B, H, Dh]               H = K * G query heads, head i reads kv head i // G
    out         [B, H, Dh]

JAX ships a Pallas GPU paged attention (``jax.experimental.pallas.ops.gpu.paged_attention``),
but for a pool laid out ``[K, N, page_size, Dh]`` per k and v: on the engine's combined
pool it would need a transposed copy of every layer's pool each decode step. This
kernel reads the combined heads where they are: program (b, h) walks row b's pages
``page_table[b, :ceil(kv_lens[b] / page_size)]``, loads kv head h's key and value
rows of each page (``pages[page, :, 2h]`` and ``pages[page, :, 2h + 1]``) and keeps
an online softmax (flash decoding without the split over the sequence).

Arithmetic: scores ``q . k`` in q's dtype accumulated in float32 and scaled after
the product (as ``attend_xla``'s); the online softmax (page by page) and its
product with v in float32 (``attend_xla`` rounds the normalised probabilities to
the compute dtype first: an online softmax would round unnormalised ones, which
moved a bf16 log-prob by 1.4 ulp in the engine test), the output cast to q's dtype.

Triton's dot needs every dimension >= 16: the G query heads of a kv head are padded
to 16 (or the next power of two) and ``page_size`` and ``Dh`` must be powers of two
>= 16. ``interpret=True`` runs the kernel in Pallas's interpreter on any platform
(the tests run it on CPU).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)
MIN_DIM = 16  # Triton's smallest dot operand dimension


def _pow2(n: int) -> int:
  return 1 << max(0, (int(n) - 1).bit_length())


def check_shapes(page_size: int, head_dim: int, *, names=("page_size", "head_dim")) -> None:
  """Raises ValueError unless the kernel can run this page size and head dim
  (``names``: how the message names the two, e.g. the config fields)."""
  for name, n in zip(names, (page_size, head_dim)):
    if n < MIN_DIM or n & (n - 1):
      raise ValueError(f"the Pallas GPU paged decode kernel needs {name} a power of two "
                       f">= {MIN_DIM} (Triton's dot); got {name}={n}.")


def _kernel(lens_ref, table_ref, q_ref, pages_ref, o_ref, *, page_size: int, sm_scale: float):
  h = pl.program_id(1)
  length = lens_ref[0]
  q = q_ref[...]  # [Gp, Dh]
  gp, dh = q.shape

  def body(j, carry):
    m, l, acc = carry
    page = table_ref[j]
    k = pages_ref[page, :, 2 * h, :]  # [page_size, Dh]
    v = pages_ref[page, :, 2 * h + 1, :].astype(jnp.float32)
    s = plgpu.dot(q, k.astype(q.dtype), trans_b=True).astype(jnp.float32) * sm_scale  # [Gp, ps]
    pos = j * page_size + jax.lax.broadcasted_iota(jnp.int32, (gp, page_size), 1)
    s = jnp.where(pos < length, s, MASK_VALUE)
    m_new = jnp.maximum(m, s.max(axis=1))
    alpha = jnp.exp(m - m_new)
    p = jnp.exp(s - m_new[:, None])
    l = alpha * l + p.sum(axis=1)
    acc = alpha[:, None] * acc + plgpu.dot(p, v)  # float32: p unrounded (a decode step's
    # product is [G, page_size] x [page_size, Dh], its cost is the page's load)
    return m_new, l, acc

  init = (jnp.full((gp,), MASK_VALUE, jnp.float32), jnp.zeros((gp,), jnp.float32),
          jnp.zeros((gp, dh), jnp.float32))
  _, l, acc = jax.lax.fori_loop(0, pl.cdiv(length, page_size), body, init)
  o_ref[...] = (acc / l[:, None]).astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("interpret", "num_warps", "num_stages"))
def paged_decode_attention(q, pages, page_table, kv_lens, *, interpret: bool = False,
                           num_warps: int = 4, num_stages: int = 2):
  """Decode attention of q [B, H, Dh] over the pages of each row (module docstring);
  rows with ``kv_lens`` 0 must not be read (their output is undefined)."""
  b, h, dh = q.shape
  n, ps, kk2, dh_p = pages.shape
  if dh_p != dh or kk2 % 2 or h % (kk2 // 2):
    raise ValueError(f"q {q.shape} and pages {pages.shape}: expected pages "
                     "[N, page_size, 2K, Dh] with K dividing q's heads and the same Dh.")
  check_shapes(ps, dh)
  kk = kk2 // 2
  g = h // kk
  gp = max(MIN_DIM, _pow2(g))
  qg = q.reshape(b, kk, g, dh)
  if gp != g:
    qg = jnp.pad(qg, ((0, 0), (0, 0), (0, gp - g), (0, 0)))
  pb = page_table.shape[1]
  table = page_table.astype(jnp.int32)
  if _pow2(pb) != pb:  # the table's block: a power of two (entries past the row's pages unread)
    table = jnp.pad(table, ((0, 0), (0, _pow2(pb) - pb)))
  kwargs = {}
  if not interpret:
    from jax.experimental.pallas import triton as pltr
    kwargs["compiler_params"] = pltr.CompilerParams(num_warps=num_warps, num_stages=num_stages)
  out = pl.pallas_call(
      functools.partial(_kernel, page_size=ps, sm_scale=1.0 / math.sqrt(dh)),
      grid=(b, kk),
      in_specs=[
          pl.BlockSpec((1,), lambda i, j: (i,)),  # kv_lens
          pl.BlockSpec((None, table.shape[1]), lambda i, j: (i, 0)),  # page_table
          pl.BlockSpec((None, None, gp, dh), lambda i, j: (i, j, 0, 0)),  # q
          pl.BlockSpec((n, ps, kk2, dh), lambda i, j: (0, 0, 0, 0)),  # the whole pool
      ],
      out_specs=pl.BlockSpec((None, None, gp, dh), lambda i, j: (i, j, 0, 0)),
      out_shape=jax.ShapeDtypeStruct((b, kk, gp, dh), q.dtype),
      interpret=interpret,
      name="fbos_paged_decode",
      **kwargs,
  )(kv_lens.astype(jnp.int32), table, qg, pages)
  return out[:, :, :g].reshape(b, h, dh)
