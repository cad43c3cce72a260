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

KV cache layout (:class:`KVCache`): ``k, v: [L, B, S, K, Dh]``. Prompts are
left-padded, so every row writes slot ``cache_index`` at the same time and a
single scalar index serves the whole batch; ``kv_mask [B, S]`` says which
slots hold real (non-pad) tokens. Positions come from the attention mask, not
from slot numbers, so left padding does not shift RoPE.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp

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
  """Preallocated attention cache. k, v: [L, B, S, K, Dh]."""
  k: jax.Array
  v: jax.Array


def init_cache(cfg: ModelConfig, batch: int, max_len: int, dtype=None) -> KVCache:
  shape = (cfg.num_layers, batch, max_len, cfg.num_kv_heads, cfg.head_dim)
  dtype = dtype or cfg.dtype
  return KVCache(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))


def cache_logical_axes() -> KVCache:
  ax = ("layers", "batch", "cache_seq", "kv_heads", "head_dim")
  return KVCache(ax, ax)


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


def rope(x: jax.Array, positions: jax.Array, theta: float) -> jax.Array:
  """Rotary embedding, HF rotate-half convention. x: [B, T, N, Dh], positions [B, T]."""
  dh = x.shape[-1]
  inv_freq = 1.0 / (theta ** (jnp.arange(0, dh, 2, dtype=jnp.float32) / dh))
  freqs = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, Dh/2]
  emb = jnp.concatenate([freqs, freqs], axis=-1)[:, :, None, :]  # [B, T, 1, Dh]
  cos, sin = jnp.cos(emb), jnp.sin(emb)
  xf = x.astype(jnp.float32)
  x1, x2 = jnp.split(xf, 2, axis=-1)
  rotated = jnp.concatenate([-x2, x1], axis=-1)
  return (xf * cos + rotated * sin).astype(x.dtype)


def _attention(q, k, v, mask, dtype):
  """Grouped-query attention.

  q: [B, T, H, Dh]; k, v: [B, S, K, Dh]; mask: [B, T, S] bool -> [B, T, H, Dh].
  """
  b, t, h, dh = q.shape
  kv = k.shape[2]
  q = q.reshape(b, t, kv, h // kv, dh)
  scores = jnp.einsum("btkgd,bskd->bkgts", q, k,
                      preferred_element_type=jnp.float32) / math.sqrt(dh)
  scores = jnp.where(mask[:, None, None, :, :], scores, jnp.finfo(jnp.float32).min)
  probs = jax.nn.softmax(scores, axis=-1).astype(dtype)
  out = jnp.einsum("bkgts,bskd->btkgd", probs, v)
  return out.reshape(b, t, h, dh)


def _layer(cfg: ModelConfig, h, lp, positions, mask, cache_kv, cache_index):
  """One decoder block. h: [B, T, D]. Returns (h, (k_cache, v_cache) or None)."""
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
  q = rope(q, positions, cfg.rope_theta)
  k = rope(k, positions, cfg.rope_theta)
  if cache_kv is not None:
    ck, cv = cache_kv
    ck = jax.lax.dynamic_update_slice_in_dim(ck, k.astype(ck.dtype), cache_index, axis=1)
    cv = jax.lax.dynamic_update_slice_in_dim(cv, v.astype(cv.dtype), cache_index, axis=1)
    attn = _attention(q, ck.astype(dt), cv.astype(dt), mask, dt)
    new_cache = (ck, cv)
  else:
    attn = _attention(q, k, v, mask, dt)
    new_cache = None
  h = h + jnp.einsum("bthk,hkd->btd", attn, lp["o"].astype(dt))
  x = rms_norm(h, lp["mlp_norm"], cfg.rms_norm_eps)
  gate = jnp.einsum("btd,df->btf", x, lp["gate"].astype(dt))
  up = jnp.einsum("btd,df->btf", x, lp["up"].astype(dt))
  h = h + jnp.einsum("btf,fd->btd", jax.nn.silu(gate) * up, lp["down"].astype(dt))
  return h, new_cache


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
            kv_mask: Optional[jax.Array] = None):
  """Run the decoder and return final hidden states (after the final norm).

  Without a cache (training / scoring): tokens, attention_mask [B, T]; causal
  attention restricted to non-pad keys. Returns (hidden [B, T, D], None).

  With a cache (sampling): the T new tokens are written to slots
  ``[cache_index, cache_index + T)`` of every layer's cache. ``kv_mask [B, S]``
  marks the slots that hold real tokens (including the new ones); a query in
  slot i attends to slots j <= i with kv_mask. Returns (hidden, new KVCache).
  Prefill is the call with cache_index=0 and T=prompt length; decode is T=1.
  """
  b, t = tokens.shape
  if positions is None:
    positions = positions_from_mask(attention_mask)
  h = jnp.take(params["embed"], tokens, axis=0).astype(cfg.dtype)
  qpos = jnp.arange(t)[:, None]
  if cache is None:
    kpos = jnp.arange(t)[None, :]
    mask = (kpos <= qpos)[None] & attention_mask.astype(bool)[:, None, :]
  else:
    s = cache.k.shape[2]
    kpos = jnp.arange(s)[None, :]
    mask = (kpos <= qpos + cache_index)[None] & kv_mask.astype(bool)[:, None, :]

  def body(h, xs):
    if cache is None:
      lp = xs
      h, _ = _layer(cfg, h, lp, positions, mask, None, 0)
      return h, None
    lp, ck, cv = xs
    h, (ck, cv) = _layer(cfg, h, lp, positions, mask, (ck, cv), cache_index)
    return h, (ck, cv)

  body = _remat(body, cfg.remat)
  if cache is None:
    h, _ = jax.lax.scan(body, h, params["layers"])
    new_cache = None
  else:
    h, (ks, vs) = jax.lax.scan(body, h, (params["layers"], cache.k, cache.v))
    new_cache = KVCache(ks, vs)
  h = rms_norm(h, params["final_norm"], cfg.rms_norm_eps)
  return h, new_cache


def unembed_matrix(params: Params, cfg: ModelConfig) -> jax.Array:
  """[D, V] output projection (the transposed embedding when tied)."""
  if cfg.tie_embeddings:
    return params["embed"].T
  return params["unembed"]


def logits_from_hidden(params: Params, hidden: jax.Array, cfg: ModelConfig) -> jax.Array:
  """[B, T, D] -> [B, T, V] float32 logits. Materialises the vocab axis: use
  ``fbos_kernels.token_logprobs_and_entropy`` for training-time log-probs."""
  w = unembed_matrix(params, cfg).astype(cfg.dtype)
  return jnp.einsum("btd,dv->btv", hidden, w, preferred_element_type=jnp.float32)


def apply(params: Params, tokens: jax.Array, attention_mask: jax.Array,
          cfg: ModelConfig) -> jax.Array:
  """Convenience: full logits [B, T, V] for a (left-padded) batch."""
  hidden, _ = forward(params, tokens, attention_mask, cfg)
  return logits_from_hidden(params, hidden, cfg)
