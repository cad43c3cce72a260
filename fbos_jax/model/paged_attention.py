"""Attention over a paged KV cache: the one home of the page layout, the cache
write and the implementations (portable XLA, Pallas ragged kernel on TPU, Pallas
decode kernel on GPU).

Layout (the layout of ``jax.experimental.pallas.ops.tpu.ragged_paged_attention``)::

    pages        [N, page_size, 2K, Dh]   one layer's pool; combined head 2i = key of kv
                                          head i, 2i + 1 = its value (k/v interleaved)
    page_table   [B, pb]  int32           row b's logical page j is physical page
                                          page_table[b, j]; token at position p lives in
                                          page page_table[b, p // page_size], slot p % page_size
    q            [B, T, H, Dh]            T new tokens per row (1 = decode, C = a prefill chunk)
    q_pos        [B, T]   int32           each query's absolute position in its row
    out          [B, T, H, Dh]

(B rows, T query steps, N pages, H query heads, K kv heads, G = H // K query
heads per kv head, Dh head dim.) Query i of row b attends to every position
``p <= q_pos[b, i]`` of its row: the callers write a token's key/value
(:func:`write`) before attending, and positions past a row's last written
token are never attended (their slots may hold stale data from an earlier
owner of the page). Page 0 is the **null page**: writes of padding tokens and
of idle rows go there, and nothing real is ever read from it.

Implementations (``impl``):

- ``"xla"`` (:func:`attend_xla`): gather the row's pages
  ``pages[page_table] -> [B, pb * page_size, K, Dh]`` and run masked
  attention in float32 (scores scaled after the product, masked with
  ``finfo(float32).min``, probabilities cast to the compute dtype before the
  product with v: the arithmetic of :func:`fbos_jax.model.attention.dense`).
  Cost follows ``pb`` (the page-table width the caller buckets), not the pool.
- ``"pallas"`` (:func:`attend_pallas`): the TPU ragged paged attention kernel
  reads the pages in place (no gather). Its queries must be the last ``T``
  positions of each row (``q_pos[b] = kv_len[b] - T + arange(T)``), which is
  how the engine calls it (decode steps and prefill chunks); ``head_dim`` a
  multiple of 128. The kernel is ``fbos_kernels.ragged_paged_attention``: JAX's
  shipped kernel with three load/store changes that let the Pallas TPU
  interpreter run it (the shipped one reshapes a VMEM ref, which this JAX's
  interpreter rejects); tests/test_paged_attention.py checks that it differs
  from the shipped kernel in those lines only, compiles for TPU (libtpu, no TPU
  needed) and matches :func:`attend_xla` in the interpreter.
- ``"pallas_interpret"``: the same kernel in the Pallas TPU interpreter
  (``pltpu.force_tpu_interpret_mode()``) on any platform: the engine's TPU path
  (per-step page writes, attention in place) run on CPU, for tests; slow.
  ``"pallas"`` itself is refused on a platform other than TPU (:func:`choose`).
- ``"pallas_gpu"`` (:func:`attend_pallas_gpu`): on GPU, decode steps (T = 1) run
  ``fbos_kernels.paged_decode_gpu`` (Pallas, Triton lowering), which reads each
  row's pages in place from this combined layout (JAX's shipped GPU paged kernel
  wants separate ``[K, N, page_size, Dh]`` k and v pools); prefill chunks (T > 1)
  run :func:`attend_xla` (one gather of the chunk's rows' pages). ``head_dim`` and
  ``page_size`` powers of two >= 16. ``"pallas_gpu_interpret"``: the same kernel in
  Pallas's interpreter on any platform (tests); ``"pallas_gpu"`` is refused off GPU.

Neither function knows about the mesh: the engine calls them per batch shard
inside ``jax.shard_map`` (each shard owns its rows and its pages).
"""

from __future__ import annotations

import contextlib
import math
from typing import Optional

import jax
import jax.numpy as jnp

IMPLEMENTATIONS = ("auto", "xla", "pallas", "pallas_interpret", "pallas_gpu",
                   "pallas_gpu_interpret")
TPU_KERNEL_IMPLS = ("pallas", "pallas_interpret")  # the ragged TPU kernel (compiled / interpreted)
GPU_KERNEL_IMPLS = ("pallas_gpu", "pallas_gpu_interpret")  # the GPU decode kernel
KERNEL_IMPLS = TPU_KERNEL_IMPLS + GPU_KERNEL_IMPLS  # pages read in place, one pool array per layer
INTERPRET_DEVICE_KIND = "TPU v5"  # the chip whose block sizes the interpreter runs with
NULL_PAGE = 0
_NEG = float(jnp.finfo(jnp.float32).min)


def choose(impl: str, platform: str, head_dim: Optional[int] = None,
           page_size: Optional[int] = None) -> str:
  """Resolve ``impl`` (``engine.attention``) for a program compiled for
  ``platform``: auto = pallas on TPU (when ``head_dim`` is a multiple of 128, the
  kernel's lane width), pallas_gpu on GPU (when ``head_dim`` and ``page_size`` are
  powers of two >= 16, Triton's dot), xla elsewhere; pallas is refused off TPU and
  pallas_gpu off GPU, a kernel for shapes it cannot tile."""
  if impl not in IMPLEMENTATIONS:
    raise ValueError(f"engine.attention={impl!r}; expected one of {IMPLEMENTATIONS}.")
  fits = head_dim is None or int(head_dim) % 128 == 0
  if impl == "auto":
    if platform == "tpu" and fits:
      return "pallas"
    return "pallas_gpu" if platform == "gpu" and not _gpu_misfit(head_dim, page_size) else "xla"
  if impl in GPU_KERNEL_IMPLS:
    gpu_misfit = _gpu_misfit(head_dim, page_size)
    if gpu_misfit:
      raise ValueError(f"engine.attention={impl!r}: {gpu_misfit} Use engine.attention=xla "
                       "(or auto).")
    if impl == "pallas_gpu" and platform != "gpu":
      raise ValueError(
          f"engine.attention='pallas_gpu' is a Pallas GPU (Triton) kernel, which platform "
          f"{platform!r} cannot run: use engine.attention=xla (or auto) on {platform!r}, or "
          "engine.attention=pallas_gpu_interpret to run the same kernel in the Pallas "
          "interpreter (slow; for tests).")
    return impl
  if impl in TPU_KERNEL_IMPLS and not fits:
    raise ValueError(f"engine.attention={impl!r}: the Pallas paged kernel needs a head_dim "
                     f"that is a multiple of 128; model.head_dim={head_dim}. Use "
                     "engine.attention=xla (or auto).")
  if impl == "pallas" and platform != "tpu":
    raise ValueError(
        f"engine.attention='pallas' is a Pallas TPU (Mosaic) kernel, which platform "
        f"{platform!r} cannot run: use engine.attention=xla (or auto) on {platform!r}, or "
        "engine.attention=pallas_interpret to run the same kernel in the Pallas TPU "
        "interpreter (slow; for tests).")
  return impl


def _gpu_misfit(head_dim: Optional[int], page_size: Optional[int]) -> str:
  """Why the GPU decode kernel cannot run these shapes ('' if it can)."""
  from fbos_kernels import paged_decode_gpu as G
  try:
    G.check_shapes(page_size or G.MIN_DIM, head_dim or G.MIN_DIM,
                   names=("engine.page_size", "model.head_dim"))
  except ValueError as e:
    return str(e)
  return ""


def interleave(k, v):
  """k, v [..., K, Dh] -> [..., 2K, Dh] with k at even and v at odd combined heads."""
  return jnp.stack([k, v], axis=-2).reshape(k.shape[:-2] + (2 * k.shape[-2], k.shape[-1]))


def write(pages, k, v, page, slot, layer=None):
  """Write new keys / values into the pool.

  pages [N, ps, 2K, Dh] (or [L, N, ps, 2K, Dh] with a ``layer`` index);
  k, v [B, T, K, Dh]; page, slot [B, T] int32 (padding and idle rows: page 0).
  Returns the updated pages (an in-place scatter when the buffer is donated or
  loop-carried)."""
  kv = interleave(k, v).astype(pages.dtype)
  if layer is None:
    return pages.at[page, slot].set(kv)
  lidx = jnp.broadcast_to(jnp.asarray(layer, jnp.int32), page.shape)
  return pages.at[lidx, page, slot].set(kv)


def gather(pages, page_table, layer=None):
  """The rows' keys and values, contiguous: (k, v) [B, pb * ps, K, Dh]."""
  g = pages[page_table] if layer is None else pages[layer][page_table]
  b, pb, ps, kk, dh = g.shape
  g = g.reshape(b, pb * ps, kk // 2, 2, dh)
  return g[..., 0, :], g[..., 1, :]


def attend_xla(q, pages, page_table, q_pos, *, layer=None, dtype=None):
  """Masked attention over gathered pages (see the module docstring).

  q [B, T, H, Dh]; pages [N, ps, 2K, Dh] (or stacked with ``layer``);
  page_table [B, pb]; q_pos [B, T] -> [B, T, H, Dh] in ``dtype`` (default q's)."""
  dtype = jnp.dtype(dtype or q.dtype)
  b, t, h, dh = q.shape
  k, v = gather(pages, page_table, layer)
  k, v = k.astype(dtype), v.astype(dtype)
  s, kv = k.shape[1], k.shape[2]
  qg = q.reshape(b, t, kv, h // kv, dh)
  scores = jnp.einsum("btkgd,bskd->bkgts", qg, k,
                      preferred_element_type=jnp.float32) / math.sqrt(dh)
  allowed = jnp.arange(s, dtype=jnp.int32)[None, None, :] <= q_pos[:, :, None]  # [B, T, S]
  scores = jnp.where(allowed[:, None, None], scores, _NEG)
  probs = jax.nn.softmax(scores, axis=-1).astype(dtype)
  out = jnp.einsum("bkgts,bskd->btkgd", probs, v)
  return out.reshape(b, t, h, dh)


KV_BLOCK_VMEM_BYTES = 8 * 2 ** 20  # the kernel's two KV page buffers together


def kernel_block_sizes(device_kind: str, q, pages, pages_per_seq: int) -> tuple[int, int]:
  """(kv pages, queries) per kernel block for a program compiled for ``device_kind``
  (e.g. "TPU v5"): the kernel's own tuned table, looked up for the target chip
  (``get_tuned_block_sizes`` reads ``jax.devices()``, i.e. the host's CPU when
  compiling for a TPU topology), else its defaults."""
  from fbos_kernels import ragged_paged_attention as K
  from jax.experimental.pallas.ops.tpu.ragged_paged_attention import tuned_block_sizes as T
  n_tokens, h, dh = q.shape
  _, ps, kk, _ = pages.shape
  qh, kvh = K.get_min_heads_per_blk(h, kk, q.dtype, pages.dtype)
  key = T.simplify_key((q.dtype, pages.dtype, qh, kvh // 2, dh, ps, n_tokens, pages_per_seq))
  name = " ".join(device_kind.split()[:2])
  bkv, bq = (32, 32) if name == "TPU v4" else T.TUNED_BLOCK_SIZES.get(name, {}).get(key, (128, 32))
  # the kernel double-buffers a block of bkv pages of kvh heads in VMEM: keep it within
  # KV_BLOCK_VMEM_BYTES (the default 128 pages of 16 tokens x 16 combined heads x 128 in
  # bf16 is 2 x 8 MiB: for v5e that failed with CompileTimeScopedVmemOom, qwen3_0_6b's plan)
  per_page = 2 * ps * kvh * pages.shape[-1] * pages.dtype.itemsize
  bkv = max(1, min(bkv, KV_BLOCK_VMEM_BYTES // per_page))
  return min(pages_per_seq, bkv), min(n_tokens, bq)


def attend_pallas(q, pages, page_table, q_pos, *, layer=None, dtype=None,
                  device_kind: Optional[str] = None,
                  num_kv_pages_per_block: Optional[int] = None,
                  num_queries_per_block: Optional[int] = None, interpret: bool = False):
  """The ragged paged attention kernel (``fbos_kernels.ragged_paged_attention``)
  on the same arguments as :func:`attend_xla` (``layer`` must be None: the
  kernel reads a whole pool array in place, so the engine keeps one pool array
  per layer on TPU). Query i of row b must sit at ``q_pos[b, 0] + i`` and be
  among the row's last T positions (``kv_len = q_pos[:, -1] + 1``).
  ``device_kind``: the target chip, for the kernel's block sizes
  (:func:`kernel_block_sizes`; default: the kernel's own lookup on
  ``jax.devices()``, or :data:`INTERPRET_DEVICE_KIND`'s when interpreted).
  ``interpret``: run it in the Pallas TPU interpreter (any platform)."""
  import jax.experimental.pallas.tpu as pltpu
  from fbos_kernels import ragged_paged_attention as rpa
  if layer is not None:
    raise ValueError("the Pallas paged kernel needs one pool array per layer "
                     "(sampling.layer_loop='unroll'), not a stacked pool.")
  del dtype
  b, t, h, dh = q.shape
  if interpret and device_kind is None:
    device_kind = INTERPRET_DEVICE_KIND
  if device_kind is not None and num_kv_pages_per_block is None:
    num_kv_pages_per_block, num_queries_per_block = kernel_block_sizes(
        device_kind, q.reshape(b * t, h, dh), pages, page_table.shape[1])
  kv_lens = (q_pos[:, -1] + 1).astype(jnp.int32)
  cu_q_lens = (jnp.arange(b + 1, dtype=jnp.int32) * t)
  with (pltpu.force_tpu_interpret_mode() if interpret else contextlib.nullcontext()):
    out = rpa.ragged_paged_attention(
        q.reshape(b * t, h, dh), pages, kv_lens, page_table.astype(jnp.int32), cu_q_lens,
        jnp.full((1,), b, jnp.int32), sm_scale=1.0 / math.sqrt(dh),
        num_kv_pages_per_block=num_kv_pages_per_block,
        num_queries_per_block=num_queries_per_block)
  return out.reshape(b, t, h, dh)


def attend_pallas_gpu(q, pages, page_table, q_pos, *, layer=None, dtype=None,
                      interpret: bool = False):
  """The GPU decode kernel (``fbos_kernels.paged_decode_gpu``) for decode steps
  (T = 1: it reads the row's pages in place), :func:`attend_xla` for prefill chunks
  (T > 1: a gather of the chunk's rows' pages, once per chunk). ``layer`` must be
  None (one pool array per layer). ``interpret``: the kernel in Pallas's interpreter."""
  if layer is not None:
    raise ValueError("the Pallas GPU paged kernel needs one pool array per layer "
                     "(sampling.layer_loop='unroll'), not a stacked pool.")
  b, t, h, dh = q.shape
  if t > 1:
    return attend_xla(q, pages, page_table, q_pos, dtype=dtype)
  from fbos_kernels import paged_decode_gpu as G
  # the pool stays in its dtype (cache_dtype): the kernel casts the keys it loads to q's
  # dtype and the values to float32
  out = G.paged_decode_attention(q[:, 0].astype(dtype or q.dtype), pages, page_table,
                                 q_pos[:, 0] + 1, interpret=interpret)
  return out[:, None]


def attend(impl: str, q, pages, page_table, q_pos, *, layer=None, dtype=None,
           device_kind: Optional[str] = None):
  """:func:`attend_xla`, :func:`attend_pallas` or :func:`attend_pallas_gpu`
  (``impl`` already resolved by :func:`choose`)."""
  if impl in GPU_KERNEL_IMPLS:
    return attend_pallas_gpu(q, pages, page_table, q_pos, layer=layer, dtype=dtype,
                             interpret=impl == "pallas_gpu_interpret")
  if impl in TPU_KERNEL_IMPLS:
    return attend_pallas(q, pages, page_table, q_pos, layer=layer, dtype=dtype,
                         device_kind=device_kind, interpret=impl == "pallas_interpret")
  if impl == "xla":
    return attend_xla(q, pages, page_table, q_pos, layer=layer, dtype=dtype)
  raise ValueError(f"paged attention impl {impl!r}; expected one of ('xla',) + {KERNEL_IMPLS} "
                   "(resolve 'auto' with choose()).")


def write_targets(page_table, positions, valid, page_size: int):
  """Where each new token goes: (page, slot) [B, T] int32; invalid tokens -> the null page."""
  logical = jnp.clip(positions // page_size, 0, page_table.shape[1] - 1)
  page = jnp.take_along_axis(page_table, logical, axis=1)
  return jnp.where(valid, page, NULL_PAGE).astype(jnp.int32), (positions % page_size).astype(jnp.int32)
