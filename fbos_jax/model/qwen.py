"""Qwen2 / Qwen3 decoder, written functionally.

Params are a plain nested dict (a pytree) whose per-layer weights are stacked
along a leading ``layers`` axis, so the layer stack runs under ``lax.scan`` and
compile time does not grow with depth. Every leaf has logical axis names
(:func:`param_logical_axes`) that :mod:`fbos_jax.sharding` maps to mesh axes.

Shapes (B batch, T time, S cache slots, D hidden, H query heads, K kv heads,
Dh head dim, F mlp width, V vocab, L layers)::

    embed            [V, D]          (vocab, embed)
    layers/attn_norm [L, D]
    layers/q         [L, D, H, Dh]   (layers, embed, heads, head_dim)
    layers/k, v      [L, D, K, Dh]   (layers, embed, kv_heads, head_dim)
    layers/o         [L, H, Dh, D]
    layers/q_bias    [L, H, Dh]      Qwen2 only
    layers/k_bias    [L, K, Dh]      Qwen2 only (v_bias too)
    layers/q_norm    [L, Dh]         Qwen3 only (k_norm too)
    layers/mlp_norm  [L, D]
    layers/gate, up  [L, D, F]
    layers/down      [L, F, D]
    final_norm       [D]
    unembed          [D, V]          untied embeddings only

KV cache layout (:class:`KVCache`)::

    k  [L, B, K, Dh, S]   keys stored transposed (head_dim before slots)
    v  [L, B, K, S, Dh]

so that both decode attention products are plain batched matmuls
(``q [B,K,G,Dh] @ k [B,K,Dh,S]`` and ``p [B,K,G,S] @ v [B,K,S,Dh]``) with no
per-step transpose of the cache. Logical axes: :func:`cache_logical_axes`.
Prompts are left-padded, so every row writes slot ``cache_index`` at the same
time and a single scalar index serves the whole batch; ``kv_mask [B, S]`` says
which slots hold real (non-pad) tokens. Positions come from the attention mask,
not from slot numbers, so left padding does not shift RoPE.

Attention (:mod:`fbos_jax.model.attention`, chosen by ``ModelConfig.attention``):
``dense`` materialises float32 scores ``[B, K, G, T, S]`` (the reference);
``blocked`` is flash attention in plain XLA (a few ``[.., block_q, block_kv]``
score tiles in the forward and the backward); ``pallas`` is the TPU splash
kernel, under ``jax.shard_map`` when a mesh is in context (``jax.set_mesh``);
``auto`` (default) keeps dense while the scores are one tile or for a decode
step (T = 1), else pallas on TPU and blocked elsewhere. The training forward
and the cached prefill both go through it.

Layer loop with a cache: ``params["layers"]`` stacked (as stored) runs a
``lax.fori_loop`` over layers that carries the whole stacked cache and updates
slot ``[l, ..., cache_index]`` in place (compile time independent of depth).
``params["layers"]`` given as a list of per-layer dicts (:func:`split_layers`)
together with a layer-split cache (``k``/``v`` tuples of ``L`` per-layer
arrays, :func:`init_cache` with ``split=True``) runs a Python loop over layers
instead: no per-layer dynamic slices of weights or cache, which is much faster
for small-batch decode on CPU, at a compile time that grows with depth.

Paged cache (:func:`paged_forward`, the continuous engine): the same layers,
with the cache write and the attention handed to a callback that works on a
pool of pages (:mod:`fbos_jax.model.paged_attention`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp

from fbos_jax.model import attention as attn_lib

Params = dict[str, Any]

SUPPORTED_MODEL_TYPES = ("qwen2", "qwen3")
REMAT_POLICIES = ("none", "full", "dots", "dots_no_batch")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Architecture of a Qwen2/Qwen3 decoder (field names follow our config, not HF)."""

  model_type: str = "qwen3"
  vocab_size: int = 128
  hidden_size: int = 64
  intermediate_size: int = 192
  num_layers: int = 2
  num_heads: int = 4
  num_kv_heads: int = 2
  head_dim: int = 16
  rope_theta: float = 1_000_000.0
  rms_norm_eps: float = 1e-6
  tie_embeddings: bool = True
  param_dtype: str = "float32"  # storage dtype of the weights
  compute_dtype: str = "float32"  # dtype of matmul inputs/activations
  remat: str = "none"  # one of REMAT_POLICIES, applied per layer
  # attention implementation (fbos_jax/model/attention.py): auto | dense | blocked | pallas
  attention: str = "auto"
  attention_block_q: int = 512  # query / key tile of blocked and pallas (multiples of 128)
  attention_block_kv: int = 512

  def __post_init__(self):
    if self.model_type not in SUPPORTED_MODEL_TYPES:
      raise ValueError(
          f"model.model_type={self.model_type!r} is not supported; expected one of "
          f"{SUPPORTED_MODEL_TYPES}.")
    if self.num_heads % self.num_kv_heads:
      raise ValueError(
          f"model.num_heads={self.num_heads} must be a multiple of "
          f"model.num_kv_heads={self.num_kv_heads} (grouped-query attention).")
    if self.remat not in REMAT_POLICIES:
      raise ValueError(f"model.remat={self.remat!r}; expected one of {REMAT_POLICIES}.")
    if self.attention not in attn_lib.IMPLEMENTATIONS:
      raise ValueError(f"model.attention={self.attention!r}; expected one of "
                       f"{attn_lib.IMPLEMENTATIONS}.")
    for name in ("attention_block_q", "attention_block_kv"):
      size = getattr(self, name)
      if not isinstance(size, int) or size <= 0 or size % attn_lib.LANES:
        raise ValueError(f"model.{name}={size!r} must be a positive multiple of "
                         f"{attn_lib.LANES} (the TPU lane width; model.attention tiles).")

  @property
  def qk_norm(self) -> bool:  # Qwen3: per-head RMSNorm on q and k before RoPE
    return self.model_type == "qwen3"

  @property
  def qkv_bias(self) -> bool:  # Qwen2: biases on the q/k/v projections
    return self.model_type == "qwen2"

  @property
  def dtype(self):
    return jnp.dtype(self.compute_dtype)

  @classmethod
  def from_dict(cls, d) -> "ModelConfig":
    names = {f.name for f in dataclasses.fields(cls)}
    return cls(**{k: v for k, v in dict(d).items() if k in names})


class KVCache(NamedTuple):
  """Preallocated attention cache: k [L, B, K, Dh, S] (transposed), v [L, B, K, S, Dh].

  In the layer-split form (``init_cache(..., split=True)``) k and v are tuples of
  L per-layer arrays [B, K, Dh, S] / [B, K, S, Dh].
  """
  k: Any
  v: Any


def init_cache(cfg: ModelConfig, batch: int, max_len: int, dtype=None, *,
               split: bool = False) -> KVCache:
  dtype = dtype or cfg.dtype
  kshape = (batch, cfg.num_kv_heads, cfg.head_dim, max_len)
  vshape = (batch, cfg.num_kv_heads, max_len, cfg.head_dim)
  if split:
    return KVCache(tuple(jnp.zeros(kshape, dtype) for _ in range(cfg.num_layers)),
                   tuple(jnp.zeros(vshape, dtype) for _ in range(cfg.num_layers)))
  L = cfg.num_layers
  return KVCache(jnp.zeros((L,) + kshape, dtype), jnp.zeros((L,) + vshape, dtype))


def cache_logical_axes(split: bool = False, num_layers: Optional[int] = None) -> KVCache:
  """Logical axis names of the cache arrays (per layer array when ``split``)."""
  k = ("layers", "batch", "kv_heads", "head_dim", "cache_seq")
  v = ("layers", "batch", "kv_heads", "cache_seq", "head_dim")
  if not split:
    return KVCache(k, v)
  if num_layers is None:
    raise ValueError("cache_logical_axes(split=True) needs num_layers")
  return KVCache((k[1:],) * num_layers, (v[1:],) * num_layers)


def cache_is_split(cache: KVCache) -> bool:
  return isinstance(cache.k, (tuple, list))


def cache_len(cache: KVCache) -> int:
  """Number of slots S."""
  return (cache.k[0] if cache_is_split(cache) else cache.k).shape[-1]


def split_layers(params: "Params") -> "Params":
  """Same params with ``layers`` as a list of per-layer dicts (for the unrolled
  layer loop). Slicing copies the layer weights once: do it outside any loop."""
  layers = params["layers"]
  if isinstance(layers, (list, tuple)):
    return params
  n = jax.tree.leaves(layers)[0].shape[0]
  out = dict(params)
  out["layers"] = [jax.tree.map(lambda w, l=l: w[l], layers) for l in range(n)]
  return out


# ----------------------------------------------------------------------------- params


def param_shapes(cfg: ModelConfig) -> dict[str, Any]:
  """Nested dict of (shape, logical_axes) for every parameter."""
  L, D, H, K, Dh, F, V = (cfg.num_layers, cfg.hidden_size, cfg.num_heads,
                          cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size,
                          cfg.vocab_size)
  layers = {
      "attn_norm": ((L, D), ("layers", "norm")),
      "q": ((L, D, H, Dh), ("layers", "embed", "heads", "head_dim")),
      "k": ((L, D, K, Dh), ("layers", "embed", "kv_heads", "head_dim")),
      "v": ((L, D, K, Dh), ("layers", "embed", "kv_heads", "head_dim")),
      "o": ((L, H, Dh, D), ("layers", "heads", "head_dim", "embed")),
      "mlp_norm": ((L, D), ("layers", "norm")),
      "gate": ((L, D, F), ("layers", "embed", "mlp")),
      "up": ((L, D, F), ("layers", "embed", "mlp")),
      "down": ((L, F, D), ("layers", "mlp", "embed")),
  }
  if cfg.qkv_bias:
    layers["q_bias"] = ((L, H, Dh), ("layers", "heads", "head_dim"))
    layers["k_bias"] = ((L, K, Dh), ("layers", "kv_heads", "head_dim"))
    layers["v_bias"] = ((L, K, Dh), ("layers", "kv_heads", "head_dim"))
  if cfg.qk_norm:
    layers["q_norm"] = ((L, Dh), ("layers", "norm"))
    layers["k_norm"] = ((L, Dh), ("layers", "norm"))
  tree = {
      "embed": ((V, D), ("vocab", "embed")),
      "layers": layers,
      "final_norm": ((D,), ("norm",)),
  }
  if not cfg.tie_embeddings:
    tree["unembed"] = ((D, V), ("embed", "vocab"))
  return tree


def _is_leaf(x):
  return isinstance(x, tuple) and len(x) == 2 and isinstance(x[0], tuple)


def param_logical_axes(cfg: ModelConfig) -> Params:
  """Same structure as the params, with a tuple of logical axis names per leaf."""
  return jax.tree.map(lambda s: s[1], param_shapes(cfg), is_leaf=_is_leaf)


def abstract_params(cfg: ModelConfig) -> Params:
  """ShapeDtypeStructs of the params: no allocation (for dry runs / eval_shape)."""
  dt = jnp.dtype(cfg.param_dtype)
  return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s[0], dt), param_shapes(cfg),
                      is_leaf=_is_leaf)


def init_params(cfg: ModelConfig, key: jax.Array) -> Params:
  """Random init (normal, std 0.02 for matrices; ones for norms; zeros for biases)."""
  shapes = param_shapes(cfg)
  flat, treedef = jax.tree.flatten_with_path(shapes, is_leaf=_is_leaf)
  keys = jax.random.split(key, len(flat))
  dt = jnp.dtype(cfg.param_dtype)
  leaves = []
  for (path, (shape, _)), k in zip(flat, keys):
    name = path[-1].key
    if name.endswith("norm"):
      leaves.append(jnp.ones(shape, dt))
    elif name.endswith("bias"):
      leaves.append(jnp.zeros(shape, dt))
    else:
      leaves.append((0.02 * jax.random.normal(k, shape, jnp.float32)).astype(dt))
  return jax.tree.unflatten(treedef, leaves)


def count_params(params_or_abstract) -> int:
  return int(sum(math.prod(x.shape) for x in jax.tree.leaves(params_or_abstract)))


# ----------------------------------------------------------------------------- layers


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
  """RMSNorm computed in float32 (HF convention), cast back to x's dtype."""
  xf = x.astype(jnp.float32)
  xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
  return (weight.astype(jnp.float32) * xf).astype(x.dtype)


def positions_from_mask(attention_mask: jax.Array) -> jax.Array:
  """[B, T] 0/1 mask of a left-padded batch -> [B, T] int32 positions (pads get 0)."""
  m = attention_mask.astype(jnp.int32)
  return jnp.maximum(jnp.cumsum(m, axis=-1) - 1, 0)


def positions_from_segments(segment_ids: jax.Array) -> jax.Array:
  """[B, T] segment ids of packed rows (each sequence one contiguous run) ->
  [B, T] int32 positions that restart at 0 where a segment starts."""
  seg = segment_ids.astype(jnp.int32)
  idx = jnp.broadcast_to(jnp.arange(seg.shape[1], dtype=jnp.int32), seg.shape)
  starts = jnp.concatenate([jnp.ones_like(seg[:, :1], bool), seg[:, 1:] != seg[:, :-1]], axis=1)
  return idx - jax.lax.cummax(jnp.where(starts, idx, 0), axis=1)


def rope_tables(positions: jax.Array, head_dim: int, theta: float):
  """cos, sin [B, T, 1, Dh] (float32) for :func:`rope`."""
  inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
  freqs = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, Dh/2]
  emb = jnp.concatenate([freqs, freqs], axis=-1)[:, :, None, :]  # [B, T, 1, Dh]
  return jnp.cos(emb), jnp.sin(emb)


def rope(x: jax.Array, positions: jax.Array, theta: float, tables=None) -> jax.Array:
  """Rotary embedding, HF rotate-half convention. x: [B, T, N, Dh], positions [B, T].
  ``tables``: precomputed :func:`rope_tables` (shared by all layers)."""
  cos, sin = tables if tables is not None else rope_tables(positions, x.shape[-1], theta)
  xf = x.astype(jnp.float32)
  x1, x2 = jnp.split(xf, 2, axis=-1)
  rotated = jnp.concatenate([-x2, x1], axis=-1)
  return (xf * cos + rotated * sin).astype(x.dtype)


def _attention(cfg: ModelConfig, q, k, v, attention_mask, segment_ids=None):
  """Causal grouped-query self-attention of a training / scoring batch.

  q: [B, T, H, Dh]; k, v: [B, T, K, Dh]; attention_mask: [B, T] (1 = real token);
  segment_ids: [B, T] of packed rows (a token attends only within its segment)
  or None -> [B, T, H, Dh]. Implementation: ``cfg.attention`` (:mod:`.attention`).
  """
  return attn_lib.attention(q, k, v, attention_mask, impl=cfg.attention,
                            block_q=cfg.attention_block_q, block_kv=cfg.attention_block_kv,
                            dtype=cfg.dtype, segment_ids=segment_ids)


def _cached_attention(cfg: ModelConfig, q, k_t, v, kv_mask, cache_index):
  """Grouped-query attention against the cache layout.

  q: [B, T, H, Dh] in slots [cache_index, cache_index + T); k_t: [B, K, Dh, S];
  v: [B, K, S, Dh]; kv_mask: [B, S] -> [B, T, H, Dh]. A query in slot i attends
  to slots j <= i with kv_mask. Decode (T = 1) always runs the dense path (the G
  query heads share one matmul against the cache, no transpose of k); a prefill
  uses ``cfg.attention``.
  """
  return attn_lib.attention(q, k_t, v, kv_mask, q_offset=cache_index, cache_layout=True,
                            impl=cfg.attention, block_q=cfg.attention_block_q,
                            block_kv=cfg.attention_block_kv, dtype=cfg.dtype)


def _project_qkv(cfg: ModelConfig, h, lp, positions, rope_cs=None):
  """attn_norm, q/k/v projections (+bias), q/k norms, RoPE. h: [B, T, D]."""
  dt = cfg.dtype
  x = rms_norm(h, lp["attn_norm"], cfg.rms_norm_eps)
  q = jnp.einsum("btd,dhk->bthk", x, lp["q"].astype(dt))
  k = jnp.einsum("btd,dhk->bthk", x, lp["k"].astype(dt))
  v = jnp.einsum("btd,dhk->bthk", x, lp["v"].astype(dt))
  if cfg.qkv_bias:
    q = q + lp["q_bias"].astype(dt)
    k = k + lp["k_bias"].astype(dt)
    v = v + lp["v_bias"].astype(dt)
  if cfg.qk_norm:
    q = rms_norm(q, lp["q_norm"], cfg.rms_norm_eps)
    k = rms_norm(k, lp["k_norm"], cfg.rms_norm_eps)
  q = rope(q, positions, cfg.rope_theta, rope_cs)
  k = rope(k, positions, cfg.rope_theta, rope_cs)
  return q, k, v


def _finish_layer(cfg: ModelConfig, h, attn, lp):
  """Output projection + residual, then the MLP block."""
  dt = cfg.dtype
  h = h + jnp.einsum("bthk,hkd->btd", attn, lp["o"].astype(dt))
  x = rms_norm(h, lp["mlp_norm"], cfg.rms_norm_eps)
  gate = jnp.einsum("btd,df->btf", x, lp["gate"].astype(dt))
  up = jnp.einsum("btd,df->btf", x, lp["up"].astype(dt))
  return h + jnp.einsum("btf,fd->btd", jax.nn.silu(gate) * up, lp["down"].astype(dt))


def _layer(cfg: ModelConfig, h, lp, positions, attention_mask, segment_ids=None):
  """One decoder block without a cache. h: [B, T, D] -> [B, T, D]."""
  q, k, v = _project_qkv(cfg, h, lp, positions)
  return _finish_layer(cfg, h, _attention(cfg, q, k, v, attention_mask, segment_ids), lp)


def _new_kv(k, v, dtype):
  """[B, T, K, Dh] new keys/values -> cache layout [B, K, Dh, T] / [B, K, T, Dh]."""
  return k.astype(dtype).transpose(0, 2, 3, 1), v.astype(dtype).transpose(0, 2, 1, 3)


def _cached_layers(cfg: ModelConfig, h, layers, positions, kv_mask, cache: KVCache,
                   cache_index):
  """The layer stack with a KV cache (see the module docstring for the two loops)."""
  dt = cfg.dtype
  idx = jnp.asarray(cache_index, jnp.int32)
  zero = jnp.zeros((), jnp.int32)
  # RoPE tables for every cache slot (positions < S): a function of static shapes
  # only, so XLA builds it once, not per decode step and per layer; the rows are
  # gathered (cheap) where sin/cos would otherwise be recomputed in 2 * L fusions.
  s = cache_len(cache)
  cos_t, sin_t = rope_tables(jnp.arange(s, dtype=jnp.int32)[None, :], cfg.head_dim, cfg.rope_theta)
  pos = jnp.clip(positions, 0, s - 1)
  rope_cs = (cos_t[0, :, 0][pos][:, :, None, :], sin_t[0, :, 0][pos][:, :, None, :])
  if isinstance(layers, (list, tuple)):  # unrolled: one Python iteration per layer
    split = cache_is_split(cache)
    ks, vs = (list(cache.k), list(cache.v)) if split else (cache.k, cache.v)
    for l, lp in enumerate(layers):
      q, k, v = _project_qkv(cfg, h, lp, positions, rope_cs)
      if split:
        nk, nv = _new_kv(k, v, ks[l].dtype)
        ks[l] = jax.lax.dynamic_update_slice(ks[l], nk, (zero, zero, zero, idx))
        vs[l] = jax.lax.dynamic_update_slice(vs[l], nv, (zero, zero, idx, zero))
        kl, vl = ks[l], vs[l]
      else:
        nk, nv = _new_kv(k, v, ks.dtype)
        ks = jax.lax.dynamic_update_slice(ks, nk[None], (l, zero, zero, zero, idx))
        vs = jax.lax.dynamic_update_slice(vs, nv[None], (l, zero, zero, idx, zero))
        kl, vl = ks[l], vs[l]
      attn = _cached_attention(cfg, q, kl.astype(dt), vl.astype(dt), kv_mask, cache_index)
      h = _finish_layer(cfg, h, attn, lp)
    if split:
      return h, KVCache(tuple(ks), tuple(vs))
    return h, KVCache(ks, vs)

  if cache_is_split(cache):
    raise ValueError("A layer-split cache needs params['layers'] as a per-layer list "
                     "(qwen.split_layers(params)).")
  num_layers = cache.k.shape[0]

  def body(l, carry):  # the full stacked cache is carried and updated in place
    h, ck, cv = carry
    lp = jax.tree.map(lambda w: jax.lax.dynamic_index_in_dim(w, l, keepdims=False), layers)
    q, k, v = _project_qkv(cfg, h, lp, positions, rope_cs)
    nk, nv = _new_kv(k, v, ck.dtype)
    ck = jax.lax.dynamic_update_slice(ck, nk[None], (l, zero, zero, zero, idx))
    cv = jax.lax.dynamic_update_slice(cv, nv[None], (l, zero, zero, idx, zero))
    kl = jax.lax.dynamic_index_in_dim(ck, l, keepdims=False)
    vl = jax.lax.dynamic_index_in_dim(cv, l, keepdims=False)
    attn = _cached_attention(cfg, q, kl.astype(dt), vl.astype(dt), kv_mask, cache_index)
    return _finish_layer(cfg, h, attn, lp), ck, cv

  h, ck, cv = jax.lax.fori_loop(0, num_layers, body, (h, cache.k, cache.v))
  return h, KVCache(ck, cv)


def _remat(fn, policy: str):
  if policy == "none":
    return fn
  policies = {
      "full": jax.checkpoint_policies.nothing_saveable,
      "dots": jax.checkpoint_policies.checkpoint_dots,
      "dots_no_batch": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
  }
  return jax.checkpoint(fn, policy=policies[policy], prevent_cse=False)


def forward(params: Params, tokens: jax.Array, attention_mask: jax.Array,
            cfg: ModelConfig, *, positions: Optional[jax.Array] = None,
            cache: Optional[KVCache] = None, cache_index: Any = 0,
            kv_mask: Optional[jax.Array] = None, segment_ids: Optional[jax.Array] = None):
  """Run the decoder and return final hidden states (after the final norm).

  Without a cache (training / scoring): tokens, attention_mask [B, T]; causal
  attention restricted to non-pad keys. Returns (hidden [B, T, D], None).
  ``segment_ids`` [B, T] (rows that pack several sequences end to end, 0 on
  padding; :class:`fbos_jax.rl.batch.PackedBatch`): a token attends only to
  its own sequence, and positions (when not given) restart at 0 in each
  (:func:`positions_from_segments`), so every sequence sees what it would alone.

  With a cache (sampling): the T new tokens are written to slots
  ``[cache_index, cache_index + T)`` of every layer's cache. ``kv_mask [B, S]``
  marks the slots that hold real tokens (including the new ones); a query in
  slot i attends to slots j <= i with kv_mask. Returns (hidden, new KVCache).
  Prefill is the call with cache_index=0 and T=prompt length; decode is T=1.
  ``attention_mask`` is only used to derive positions when ``positions`` is None.
  Attention runs with ``cfg.attention`` (see :mod:`fbos_jax.model.attention`).

  ``params["layers"]`` may also be a list of per-layer dicts
  (:func:`split_layers`): the layers then run in a Python loop (see the module
  docstring); results are the same.
  """
  if segment_ids is not None and cache is not None:
    raise ValueError("qwen.forward: segment_ids (packed rows) are for the training forward, "
                     "not a cached one")
  if positions is None:
    positions = (positions_from_mask(attention_mask) if segment_ids is None
                 else positions_from_segments(segment_ids))
  h = jnp.take(params["embed"], tokens, axis=0).astype(cfg.dtype)
  if cache is not None:
    h, new_cache = _cached_layers(cfg, h, params["layers"], positions, kv_mask, cache,
                                  cache_index)
    return rms_norm(h, params["final_norm"], cfg.rms_norm_eps), new_cache

  def body(h, lp):
    return _layer(cfg, h, lp, positions, attention_mask, segment_ids), None

  body = _remat(body, cfg.remat)
  if isinstance(params["layers"], (list, tuple)):
    for lp in params["layers"]:
      h, _ = body(h, lp)
  else:
    h, _ = jax.lax.scan(body, h, params["layers"])
  h = rms_norm(h, params["final_norm"], cfg.rms_norm_eps)
  return h, None


def paged_forward(params: Params, tokens: jax.Array, positions: jax.Array, cfg: ModelConfig,
                  pool: Any, attend):
  """The decoder over a paged KV cache (the continuous engine, :mod:`fbos_jax.engine`).

  tokens, positions [B, T] (absolute positions in each row; no padding
  semantics here). ``attend(layer, q, k, v, pool) -> (out, pool)`` writes the
  new keys / values (k, v [B, T, K, Dh], after RoPE) of ``layer`` into
  ``pool`` and attends q [B, T, H, Dh] over the row's pages
  (:mod:`fbos_jax.model.paged_attention`); ``layer`` is a Python int when
  ``params["layers"]`` is a per-layer list (:func:`split_layers`), else a
  traced index of a ``fori_loop`` over the stacked layers. Returns
  (hidden [B, T, D] after the final norm, pool).
  """
  h = jnp.take(params["embed"], tokens, axis=0).astype(cfg.dtype)
  rope_cs = rope_tables(positions, cfg.head_dim, cfg.rope_theta)  # shared by all layers
  layers = params["layers"]
  if isinstance(layers, (list, tuple)):
    for l, lp in enumerate(layers):
      q, k, v = _project_qkv(cfg, h, lp, positions, rope_cs)
      attn, pool = attend(l, q, k, v, pool)
      h = _finish_layer(cfg, h, attn, lp)
  else:
    def body(l, carry):
      h, pool = carry
      lp = jax.tree.map(lambda w: jax.lax.dynamic_index_in_dim(w, l, keepdims=False), layers)
      q, k, v = _project_qkv(cfg, h, lp, positions, rope_cs)
      attn, pool = attend(l, q, k, v, pool)
      return _finish_layer(cfg, h, attn, lp), pool

    num_layers = jax.tree.leaves(layers)[0].shape[0]
    h, pool = jax.lax.fori_loop(0, num_layers, body, (h, pool))
  return rms_norm(h, params["final_norm"], cfg.rms_norm_eps), pool


def unembed_matrix(params: Params, cfg: ModelConfig) -> jax.Array:
  """[D, V] output projection (the transposed embedding when tied), as the chunked
  log-prob kernels (``fbos_kernels.token_logprobs_and_entropy``) take it; logits
  themselves come from :func:`logits`."""
  if cfg.tie_embeddings:
    return params["embed"].T
  return params["unembed"]


def logits_fn(params: Params, cfg: ModelConfig):
  """hidden [..., D] -> logits [..., V] float32: the output projection as stored, cast
  to ``cfg.dtype`` once (here: a decode loop calls the returned function at every
  step), the product accumulated in float32. A tied model multiplies by the
  embedding [V, D] itself, with no transposed [D, V] copy (311 MB for Qwen3-0.6B in
  bf16). Both samplers' logits (``fbos_jax.sampling.step_logits_fn``)."""
  if cfg.tie_embeddings:
    w, spec = params["embed"].astype(cfg.dtype), "...d,vd->...v"
  else:
    w, spec = params["unembed"].astype(cfg.dtype), "...d,dv->...v"
  return lambda h: jnp.einsum(spec, h, w, preferred_element_type=jnp.float32)


def logits(params: Params, hidden: jax.Array, cfg: ModelConfig) -> jax.Array:
  """[..., D] -> [..., V] float32 logits (:func:`logits_fn`). Materialises the vocab
  axis: use ``fbos_kernels.token_logprobs_and_entropy`` for training-time log-probs."""
  return logits_fn(params, cfg)(hidden)


def apply(params: Params, tokens: jax.Array, attention_mask: jax.Array,
          cfg: ModelConfig) -> jax.Array:
  """Convenience: full logits [B, T, V] for a (left-padded) batch."""
  hidden, _ = forward(params, tokens, attention_mask, cfg)
  return logits(params, hidden, cfg)
