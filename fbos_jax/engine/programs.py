"""The engine's jitted programs: pool init, prefill into pages, the decode window.

Device state is only the page pool; everything else (which row sits where, its
position, step, key and pages) lives on the host and comes in as small arrays
with every call, so the programs are pure functions of their inputs:

    pool = init_pool()                                   one array per layer
    pool = prefill(params, pool, tokens[B, C], start[B], n_valid[B],
                   page_table[B, pb], tail[B], copies[B, c])
    pool, tokens[B, W], logprobs[B, W], sources[B, W], source[B], taken[Sh], steps = window(
        params, pool, last[B], pos[B], step[B], limit[B], keys[B, 2], sids[B], live[B],
        page_table[B, pb], <the same 7 fields of the staged rows [Q]>, staged_count[Sh],
        temperature, top_p, stop_ids, min_idle, shrink_to[, logit_bias[B, V], [Q, V]])

Pool (per layer; ``[Sh, L, N, ...]`` stacked when the layers run in a loop)::

    [Sh, N, page_size, 2K, Dh]   Sh = batch shards (dcn*data*fsdp), N pages per shard

sharded over the batch axes on Sh and over the kv-head rule (``kv_heads``,
i.e. ``tensor``) on 2K when it divides both H and K. Slots ``[B] = [Sh * r]``
and staged rows ``[Q] = [Sh * q]`` are laid out shard-major: rows
``[s*r, (s+1)*r)`` live on shard s and their page tables hold page ids of
shard s's pool. Page writes, gathers and the Pallas attention run per shard
inside ``jax.shard_map`` (a row never reads another shard's pages; GSPMD
cannot partition the Pallas kernel anyway).

Window (``W = EngineConfig.window`` steps at most, no host round trip): every
step feeds each live slot's last token at its position, draws the next token
with ``sampling.choose`` from ``u = sampling.key_uniform(key_row, t_row,
sid_row)`` (t_row the row's own step: the static sampler's key contract) and
stops a row on a stop token or at its ``limit``. A slot whose row stopped takes
the next staged row of its shard (already prefilled; at most
``EngineConfig.swaps_per_step`` per shard and step). ``sources`` says which row
made each slot-step's token (b: the row in slot b at the start; B + k: staged
row k; -1: idle). The loop ends after W steps, when no slot is live, once
``min_idle`` slots are idle with no staged row left for them (a refill pays:
the host passes B + 1 when no request waits and the feed is finished), or once
the staged rows are all taken and every shard's live slots fit ``shrink_to``
rows (the next smaller row bucket; -1 = off).

Attention: with a Pallas kernel (TPU: the ragged paged kernel; GPU: the decode
kernel ``fbos_kernels.paged_decode_gpu``, prefill chunks by XLA over their own
pages; ``*_interpret``: the same kernel in Pallas's interpreter on CPU, for tests)
every step writes the new key/value into its page and the kernel reads the pages
in place. On the XLA path (CPU) a per-step gather of every row's pages cost ~8x
a static-sampler step on CPU, so the window gathers the slots' (and staged
rows') pages once into a dense per-row cache (the static sampler's layout,
[B, K, Dh, pb * page_size]), decodes against it, and writes the live rows' new
tokens back into their pages at the end (rows that stopped inside the window
need nothing back).

Prefill writes the keys / values of prompt tokens ``[start, start + n_valid)``
of each row into its pages (queries attend to earlier chunks through the pages).
The tokens of a group's partially filled last prompt page are also written into
that page's private copies, one per extra sample (a scatter of the new values:
copying a page inside the pool, ``pool.at[dst].set(pool[src])``, makes XLA copy
the whole pool). The prompt's last token is not prefilled: the window feeds it
as the row's first step, which gives step 0's logits.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Optional

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

from fbos_jax import program_cache
from fbos_jax import sampling
from fbos_jax import sharding as sh
from fbos_jax.model import attention as attn_lib
from fbos_jax.model import paged_attention as PA
from fbos_jax.model import qwen


@dataclasses.dataclass(frozen=True)
class Static:
  """Everything a compiled engine program depends on besides the array shapes."""
  page_size: int
  window: int
  greedy: bool
  top_k: int
  use_top_p: bool
  num_stop_slots: int
  pad_id: int
  unroll: bool
  cache_dtype: Optional[str]
  impl: str  # paged_attention.IMPLEMENTATIONS but auto (*_interpret: the kernel interpreted)
  shards: int
  bias: bool
  device_kind: Optional[str]  # target chip (Pallas block sizes)
  swaps: int  # staged rows a shard's idle slots may take per step
  stage_len: int  # positions a staged row holds at most (prompt + one window)
  vocab_limit: int = 0  # ids >= this are never drawn (sampling.restrict_vocab)


def _rules(rules):
  return sh.DEFAULT_RULES if rules is None else rules


def _axes_of(mesh, entry):
  if entry is None:
    return ()
  return (entry,) if isinstance(entry, str) else tuple(entry)


def batch_entry(mesh, rules=None):
  """The mesh axes of the pool's shard axis (and of the rows): the rules' batch
  axes of size > 1."""
  if mesh is None:
    return None
  kept = tuple(a for a in sh.batch_axes(_rules(rules)) if mesh.shape[a] > 1)
  return kept[0] if len(kept) == 1 else (kept or None)


def head_entry(mesh, rules, cfg: qwen.ModelConfig):
  """The mesh axes of the kv heads (the ``kv_heads`` rule) when they divide H and K."""
  if mesh is None:
    return None
  rules = _rules(rules)
  target = (rules if isinstance(rules, dict) else sh.rules_dict(rules)).get("kv_heads")
  axes = tuple(a for a in _axes_of(mesh, target) if mesh.shape[a] > 1)
  size = math.prod(mesh.shape[a] for a in axes) if axes else 1
  if not axes or cfg.num_kv_heads % size or cfg.num_heads % size:
    return None
  return axes[0] if len(axes) == 1 else axes


def pool_specs(cfg: qwen.ModelConfig, st: Static, mesh, rules):
  """PartitionSpec of each pool array."""
  bat, hd = batch_entry(mesh, rules), head_entry(mesh, rules, cfg)
  if st.unroll:
    return tuple(P(bat, None, None, hd, None) for _ in range(cfg.num_layers))
  return P(bat, None, None, None, hd, None)


def pool_shapes(cfg: qwen.ModelConfig, st: Static, pages_per_shard: int):
  dt = jnp.dtype(st.cache_dtype) if st.cache_dtype else cfg.dtype
  per = (st.shards, pages_per_shard, st.page_size, 2 * cfg.num_kv_heads, cfg.head_dim)
  if st.unroll:
    return tuple(jax.ShapeDtypeStruct(per, dt) for _ in range(cfg.num_layers))
  return jax.ShapeDtypeStruct((st.shards, cfg.num_layers) + per[1:], dt)


def pool_bytes(cfg: qwen.ModelConfig, st: Static, pages_per_shard: int) -> int:
  return sum(math.prod(a.shape) * a.dtype.itemsize
             for a in jax.tree.leaves(pool_shapes(cfg, st, pages_per_shard)))


# ----------------------------------------------------------------------------- per-shard work


def _shard_mapped(fn, mesh, in_specs, out_specs):
  """fn over every batch shard (and kv-head shard): shard_map on a mesh, else as is
  (one shard: the leading axis has size 1 either way)."""
  if mesh is None or mesh.size == 1:
    return fn
  return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)


def _make_attend(cfg, st: Static, mesh, rules, page_table, wpage, wslot, q_pos, extra=None):
  """The ``attend`` callback of qwen.paged_forward. Rows are flat [B]; page_table
  [B, pb]; wpage, wslot, q_pos [B, T]. Per shard: write k/v, attend. ``extra``:
  (page, slot) [B, T, c], more places each token is written to (the private
  copies of a prompt's partial last page; unused entries: the null page)."""
  b, t = q_pos.shape
  r = b // st.shards
  bat, hd = batch_entry(mesh, rules), head_entry(mesh, rules, cfg)
  rows = lambda x: x.reshape((st.shards, r) + x.shape[1:])
  if extra is None:
    extra = (jnp.zeros((b, t, 0), jnp.int32),) * 2
  meta = (rows(page_table), rows(wpage), rows(wslot), rows(q_pos), rows(extra[0]),
          rows(extra[1]))
  meta_specs = (P(bat, None, None),) * 4 + (P(bat, None, None, None),) * 2
  qkv_spec = P(bat, None, None, hd, None)
  dt = cfg.dtype

  def local(q, k, v, pages, table, wp, ws, qp, ep, es, layer):
    # leading axis: this shard (size 1)
    stacked = pages.ndim == 6
    pg = pages[0]
    li = layer if stacked else None
    pg = PA.write(pg, k[0], v[0], wp[0], ws[0], layer=li)
    c = ep.shape[-1]
    if c:  # the same values again, at the extra places (updates from k/v, not the pool)
      rep = lambda x: jnp.repeat(x[0], c, axis=1)  # [r, T * c, K, Dh]
      pg = PA.write(pg, rep(k), rep(v), ep[0].reshape(ep.shape[1], -1),
                    es[0].reshape(es.shape[1], -1), layer=li)
    out = PA.attend(st.impl, q[0], pg, table[0], qp[0], layer=li, dtype=dt,
                    device_kind=st.device_kind)
    return out[None], pg[None]

  def attend(layer, q, k, v, pool):
    stacked = not st.unroll
    pages = pool if stacked else pool[layer]
    pspec = (P(bat, None, None, None, hd, None) if stacked else P(bat, None, None, hd, None))
    fn = _shard_mapped(local, mesh,
                       (qkv_spec, qkv_spec, qkv_spec, pspec) + meta_specs + (P(),),
                       (qkv_spec, pspec))
    lidx = jnp.asarray(layer, jnp.int32)
    out, pages = fn(rows(q), rows(k), rows(v), pages, *meta, lidx)
    out = out.reshape((b,) + out.shape[2:])
    if stacked:
      return out, pages
    pool = tuple(pages if i == layer else x for i, x in enumerate(pool))
    return out, pool

  return attend


def _dense_specs(mesh, rules, cfg):
  bat, hd = batch_entry(mesh, rules), head_entry(mesh, rules, cfg)
  return P(bat, None, hd, None, None), P(bat, None, hd, None, None)


def _gather_dense(cfg, st: Static, mesh, rules, pool, page_table):
  """The rows' pages as a dense per-row cache for one window (the XLA path):
  per layer (k [B, K, Dh, S], v [B, K, S, Dh]) with S = pb * page_size, the
  layout of the static sampler's cache (qwen.KVCache)."""
  b, pb = page_table.shape
  r = b // st.shards
  bat = batch_entry(mesh, rules)
  kspec, vspec = _dense_specs(mesh, rules, cfg)

  def local(pages, table, layer):
    li = layer if pages.ndim == 6 else None
    k, v = PA.gather(pages[0], table[0], li)  # [r, S, K, Dh]
    return k.transpose(0, 2, 3, 1)[None], v.transpose(0, 2, 1, 3)[None]

  def one(pages, spec, layer):
    fn = _shard_mapped(local, mesh, (spec, P(bat, None, None), P()), (kspec, vspec))
    k, v = fn(pages, page_table.reshape(st.shards, r, pb), jnp.int32(layer))
    return k.reshape((b,) + k.shape[2:]), v.reshape((b,) + v.shape[2:])

  specs = pool_specs(cfg, st, mesh, rules)
  if st.unroll:
    kv = [one(x, sp, 0) for x, sp in zip(pool, specs)]
  else:
    kv = [one(pool, specs, l) for l in range(cfg.num_layers)]
  return tuple(k for k, _ in kv), tuple(v for _, v in kv)


def _write_back(cfg, st: Static, mesh, rules, pool, dense, page_table, pos0, count):
  """After a window: the ``count[b]`` new tokens of each row (positions
  ``pos0[b] + i``) from the dense cache into their pages."""
  b, pb = page_table.shape
  r = b // st.shards
  w = st.window
  bat = batch_entry(mesh, rules)
  kspec, vspec = _dense_specs(mesh, rules, cfg)
  s_len = pb * st.page_size
  i = jnp.arange(w, dtype=jnp.int32)[None, :]
  positions = pos0[:, None] + i  # [B, W]
  page, slot = PA.write_targets(page_table, positions, i < count[:, None], st.page_size)
  idx = jnp.clip(positions, 0, s_len - 1)
  rows = lambda x: x.reshape((st.shards, r) + x.shape[1:])

  def local(pages, k, v, ix, pg, sl, layer):
    kn = jnp.take_along_axis(k[0], ix[0][:, None, None, :], axis=3).transpose(0, 3, 1, 2)
    vn = jnp.take_along_axis(v[0], ix[0][:, None, :, None], axis=2).transpose(0, 2, 1, 3)
    li = layer if pages.ndim == 6 else None
    return PA.write(pages[0], kn, vn, pg[0], sl[0], layer=li)[None]

  def one(pages, spec, k, v, layer):
    fn = _shard_mapped(local, mesh, (spec, kspec, vspec) + (P(bat, None, None),) * 3 + (P(),),
                       spec)
    return fn(pages, rows(k), rows(v), rows(idx), rows(page), rows(slot), jnp.int32(layer))

  specs = pool_specs(cfg, st, mesh, rules)
  ks, vs = dense
  if st.unroll:
    return tuple(one(x, sp, k, v, 0) for x, sp, k, v in zip(pool, specs, ks, vs))
  for l in range(cfg.num_layers):
    pool = one(pool, specs, ks[l], vs[l], l)
  return pool


def _swap_dense(cfg, st: Static, mesh, rules, cache, staged, slot_m, q_m, length: int):
  """cache rows ``slot_m`` <- staged rows ``q_m`` per shard (slot_m [Sh, m], r = none),
  their first ``length`` positions (a staged row holds no more)."""
  bat, hd = batch_entry(mesh, rules), head_entry(mesh, rules, cfg)
  kspec = vspec = P(bat, hd, None, None)  # flat rows [B, K, Dh, S] / [B, K, S, Dh]
  ks, vs = cache
  sk, sv = staged
  nl = len(ks)

  def local(sm, qm, *arrays):
    out = []
    for i, (x, y) in enumerate(zip(arrays[:2 * nl], arrays[2 * nl:])):
      if i < nl:  # k [r, K, Dh, S]
        out.append(x.at[sm[0], :, :, :length].set(y[qm[0], :, :, :length], mode="drop"))
      else:  # v [r, K, S, Dh]
        out.append(x.at[sm[0], :, :length].set(y[qm[0], :, :length], mode="drop"))
    return tuple(out)

  specs = (kspec,) * nl + (vspec,) * nl
  fn = _shard_mapped(local, mesh, (P(bat, None), P(bat, None)) + specs + specs, specs)
  out = fn(slot_m, q_m, *ks, *vs, *sk, *sv)
  return tuple(out[:nl]), tuple(out[nl:])


def _write_dense(cfg, mesh, rules, kt, vt, k, v, at):
  """kt [B, K, Dh, S], vt [B, K, S, Dh] <- k, v [B, K, Dh] at positions ``at`` [B]
  (out of range: dropped), each batch shard writing its own rows: a scatter over
  the sharded row axis would otherwise be partitioned as an all-gather of every
  shard's indices and values, per layer and decode step."""
  bat, hd = batch_entry(mesh, rules), head_entry(mesh, rules, cfg)

  def local(kt, vt, k, v, at):
    i = jnp.arange(kt.shape[0], dtype=jnp.int32)
    return (kt.at[i, :, :, at].set(k.astype(kt.dtype), mode="drop"),
            vt.at[i, :, at, :].set(v.astype(vt.dtype), mode="drop"))

  cs, ts = P(bat, hd, None, None), P(bat, hd, None)
  return _shard_mapped(local, mesh, (cs, cs, ts, ts, P(bat)), (cs, cs))(kt, vt, k, v, at)


def _make_attend_dense(cfg, mesh, rules, pos, alive):
  """``attend`` over the window's dense cache (a tuple of per-layer (k, v)): write the
  new token of each live row at its position, then the static sampler's dense
  attention with row ``b`` seeing positions ``<= pos[b]``."""

  def attend(layer, q, k, v, cache):
    ks, vs = cache
    kt, vt = ks[layer], vs[layer]
    s_len = kt.shape[-1]
    at = jnp.where(alive, pos, s_len)  # dead rows: dropped (out-of-bounds scatter)
    kt, vt = _write_dense(cfg, mesh, rules, kt, vt, k[:, 0], v[:, 0], at)
    valid = jnp.arange(s_len, dtype=jnp.int32)[None, :] <= pos[:, None]
    out = attn_lib.dense(q, kt.astype(cfg.dtype), vt.astype(cfg.dtype), valid,
                         q_offset=s_len - 1, cache_layout=True, dtype=cfg.dtype)
    ks = ks[:layer] + (kt,) + ks[layer + 1:]
    vs = vs[:layer] + (vt,) + vs[layer + 1:]
    return out, (ks, vs)

  return attend


# ----------------------------------------------------------------------------- programs


def _constrainer(mesh, rules):
  rules = _rules(rules)
  return lambda x, axes: sh.constrain(x, mesh, axes, rules)


def _prep_params(params, cfg, st, mesh, rules):
  con = _constrainer(mesh, rules)
  if mesh is not None:
    params = jax.tree.map(con, params, qwen.param_logical_axes(cfg),
                          is_leaf=lambda x: isinstance(x, jax.Array))
  return qwen.split_layers(params) if st.unroll else params


def _con_pool(pool, cfg, st, mesh, rules):
  if mesh is None:
    return pool
  specs = pool_specs(cfg, st, mesh, rules)
  return jax.tree.map(lambda x, s: jax.lax.with_sharding_constraint(x, NamedSharding(mesh, s)),
                      pool, specs, is_leaf=lambda x: isinstance(x, P))


def _init_pool(*, cfg, st, pages_per_shard, mesh, rules):
  pool = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), pool_shapes(cfg, st, pages_per_shard))
  return _con_pool(pool, cfg, st, mesh, rules)


def _prefill(params, pool, tokens, start, n_valid, page_table, tail, copies, *, cfg,
             st: Static, mesh, rules):
  """tokens [B, C], start / n_valid [B], page_table [B, pb]; tail [B]: the logical
  index of the row's partially filled last prompt page (-1: none); copies [B, c]:
  that page's private copies (one per extra sample; the null page when unused),
  which get the same keys / values as the page itself."""
  b, c = tokens.shape
  run_params = _prep_params(params, cfg, st, mesh, rules)
  positions = start[:, None] + jnp.arange(c, dtype=jnp.int32)[None, :]
  valid = jnp.arange(c, dtype=jnp.int32)[None, :] < n_valid[:, None]
  wpage, wslot = PA.write_targets(page_table, positions, valid, st.page_size)
  in_tail = valid & (positions // st.page_size == tail[:, None])  # [B, C]
  epage = jnp.where(in_tail[:, :, None], copies[:, None, :], PA.NULL_PAGE).astype(jnp.int32)
  eslot = jnp.broadcast_to(wslot[:, :, None], epage.shape)
  attend = _make_attend(cfg, st, mesh, rules, page_table, wpage, wslot, positions,
                        extra=(epage, eslot))
  _, pool = qwen.paged_forward(run_params, tokens, positions, cfg, pool, attend)
  return _con_pool(pool, cfg, st, mesh, rules)


_LAST, _POS, _STEP, _LIMIT = 0, 1, 2, 3  # columns of a row's packed int state


def _u32(x):
  return jax.lax.bitcast_convert_type(x, jnp.uint32)


def _pack(last, pos, step, limit, keys, sids):
  """A row state's small fields in one int32 array [N, 7] (a swap is one gather)."""
  bits = lambda x: jax.lax.bitcast_convert_type(x.astype(jnp.uint32), jnp.int32)
  return jnp.stack([last, pos, step, limit, bits(keys[:, 0]), bits(keys[:, 1]), bits(sids)],
                   axis=1)


class _Win:
  """The constants of one decode window (closure state of its loop), and the
  loop's pieces: :meth:`swap` (idle slots take staged rows), :meth:`body` (one
  decode step) and :meth:`cond` (run on, or return early for a refill)."""

  def __init__(self, params, pool, page_table, s_table, ss: dict, s_count, temperature, top_p,
               stop_ids, min_idle, shrink_to, b: int, *, cfg, st: Static, mesh, rules):
    self.cfg, self.st, self.b, self.ss, self.s_count = cfg, st, b, ss, s_count
    self.temperature, self.top_p, self.stop_ids = temperature, top_p, stop_ids
    self.min_idle, self.shrink_to = min_idle, shrink_to
    self.shards = st.shards
    self.r, self.q = b // st.shards, s_table.shape[0] // st.shards
    self.m = min(self.r, self.q, st.swaps)  # staged rows a shard can take per step
    self.con = _constrainer(mesh, rules)
    run_params = _prep_params(params, cfg, st, mesh, rules)
    self.logits_of = sampling.step_logits_fn(run_params, cfg, st.vocab_limit)
    self.pad = jnp.int32(st.pad_id)
    self.dense = st.impl == "xla"  # XLA: one gather per window into a dense per-row cache
    self.mesh, self.rules = mesh, rules
    if self.dense:
      self.cache = _gather_dense(cfg, st, mesh, rules, pool, page_table)
      self.stage_w = min(s_table.shape[1], -(-st.stage_len // st.page_size))  # its pages
      self.staged_cache = (_gather_dense(cfg, st, mesh, rules, pool, s_table[:, :self.stage_w])
                           if self.m else None)
      kax = ("batch", "kv_heads", "head_dim", "cache_seq")
      vax = ("batch", "kv_heads", "cache_seq", "head_dim")
      self.con_cache = lambda c: (tuple(self.con(x, kax) for x in c[0]),
                                  tuple(self.con(x, vax) for x in c[1]))
      run_params = qwen.split_layers(run_params)  # the dense cache is a per-layer tuple
    else:
      self.cache = pool
      self.con_cache = lambda c: _con_pool(c, cfg, st, mesh, rules)
    self.run_params = run_params
    self.idle0 = None  # padding slots idle from the start (set by _window)

  def is_stop(self, tok):
    if not self.st.num_stop_slots:
      return jnp.zeros(tok.shape, bool)
    return jnp.any(tok[:, None] == self.stop_ids[None, :], axis=-1)

  def draw(self, logits, rs):
    st = self.st
    logits = sampling.add_logit_bias(logits, rs.get("bias"))
    u = None
    if not st.greedy:
      u = jax.vmap(sampling.key_uniform)(_u32(rs["ints"][:, 4:6]), rs["ints"][:, _STEP],
                                         _u32(rs["ints"][:, 6]))
    return sampling.choose(logits, None, self.temperature, self.top_p, greedy=st.greedy,
                           top_k=st.top_k, use_top_p=st.use_top_p, u=u)

  def swap(self, rs, done, src, wb, nxt, cache):
    """Idle slots take the next staged rows of their shard (at most m per shard)."""
    shards, r, q, m, st = self.shards, self.r, self.q, self.m, self.st
    if not m:
      return rs, done, src, wb, nxt, cache
    idle = done.reshape(shards, r)
    rank = jnp.cumsum(idle.astype(jnp.int32), axis=1) - 1
    take = idle & (rank < m) & (rank < (self.s_count - nxt)[:, None])  # [Sh, r]
    qi = jnp.clip(nxt[:, None] + rank, 0, q - 1)  # the staged row each slot takes

    def pick(cur, stg):
      c = cur.reshape((shards, r) + cur.shape[1:])
      g = stg.reshape((shards, q) + stg.shape[1:])
      idx = jnp.broadcast_to(qi.reshape(qi.shape + (1,) * (c.ndim - 2)), (shards, r) + g.shape[2:])
      t = take.reshape(take.shape + (1,) * (c.ndim - 2))
      return jnp.where(t, jnp.take_along_axis(g, idx, axis=1), c).reshape(cur.shape)

    rs = {k: pick(v, self.ss[k]) for k, v in rs.items()}
    flat = take.reshape(-1)
    gid = (jnp.arange(shards, dtype=jnp.int32)[:, None] * q + qi).reshape(-1)
    src = jnp.where(flat, self.b + gid, src)
    wb = jnp.where(flat, rs["ints"][:, _POS], wb)
    done = done & jnp.logical_not(flat)
    if self.dense:  # the taken rows' caches into their slots: m row copies per shard (under
      # a lax.cond XLA would copy the whole cache in both branches: cheaper to always copy)
      slot_m = jnp.stack([jnp.where(jnp.any(take & (rank == j), axis=1),
                                    jnp.argmax(take & (rank == j), axis=1), r)
                          for j in range(m)], axis=1).astype(jnp.int32)  # [Sh, m]; r = none
      q_m = jnp.clip(nxt[:, None] + jnp.arange(m, dtype=jnp.int32)[None, :], 0, q - 1)
      cache = _swap_dense(self.cfg, st, self.mesh, self.rules, cache, self.staged_cache, slot_m,
                          q_m, self.stage_w * st.page_size)
    nxt = nxt + jnp.sum(take.astype(jnp.int32), axis=1)
    return rs, done, src, wb, nxt, cache

  def body(self, c):
    """One decode step of every live slot, then the swaps."""
    i, rs, done, src, wb, nxt, n_idle, cache, toks, lps, srcs = c
    cfg, st, con, row = self.cfg, self.st, self.con, ("batch",)
    alive = jnp.logical_not(done)
    pos = rs["ints"][:, _POS]
    positions = pos[:, None]
    if self.dense:
      attend = _make_attend_dense(cfg, self.mesh, self.rules, pos, alive)
    else:
      wpage, wslot = PA.write_targets(rs["table"], positions, alive[:, None], st.page_size)
      attend = _make_attend(cfg, st, self.mesh, self.rules, rs["table"], wpage, wslot, positions)
    hidden, cache = qwen.paged_forward(self.run_params, rs["ints"][:, _LAST][:, None], positions,
                                       cfg, cache, attend)
    tok, lp = self.draw(self.logits_of(hidden[:, 0]), rs)
    tok = jnp.where(alive, tok, self.pad)
    lp = jnp.where(alive, lp, 0.0)
    toks = jax.lax.dynamic_update_slice(toks, tok[:, None], (0, i))
    lps = jax.lax.dynamic_update_slice(lps, lp[:, None], (0, i))
    srcs = jax.lax.dynamic_update_slice(srcs, jnp.where(alive, src, -1)[:, None], (0, i))
    inc = alive.astype(jnp.int32)
    new = jnp.stack([jnp.where(alive, tok, rs["ints"][:, _LAST]), pos + inc,
                     rs["ints"][:, _STEP] + inc], axis=1)
    rs = dict(rs, ints=jnp.concatenate([new, rs["ints"][:, 3:]], axis=1))
    done = done | (alive & (self.is_stop(tok) | (rs["ints"][:, _STEP] >= rs["ints"][:, _LIMIT])))
    src = jnp.where(done, -1, src)
    rs, done, src, wb, nxt, cache = self.swap(rs, done, src, wb, nxt, cache)
    rs = {k: con(v, row + (None,) * (v.ndim - 1)) for k, v in rs.items()}
    return (i + 1, rs, con(done, row), con(src, row), con(wb, row), nxt, n_idle,
            self.con_cache(cache), con(toks, ("batch", None)), con(lps, ("batch", None)),
            con(srcs, ("batch", None)))

  def cond(self, c):
    """Run on while a row is alive, up to the window, unless a refill (or a shrink
    to a smaller row bucket) pays; at least one step always runs."""
    i, done, nxt = c[0], c[2], c[5]
    alive = jnp.logical_not(done).astype(jnp.int32).reshape(self.shards, -1)
    left = self.s_count - nxt  # staged rows not taken yet, per shard
    # slots that stopped inside this window (not the idle padding slots) with no staged
    # row left for them
    stopped = (done & jnp.logical_not(self.idle0)).astype(jnp.int32).reshape(self.shards, -1)
    unfillable = jnp.sum(jnp.maximum(jnp.sum(stopped, axis=1) - left, 0))
    # every shard's rows fit the smaller bucket; a sum, not a max, so that the cond's
    # reductions over the shards are one all-reduce per decode step
    shrink = (jnp.sum(left) == 0) & (jnp.sum(jnp.sum(alive, axis=1) > self.shrink_to) == 0)
    early = (unfillable >= self.min_idle) | shrink
    return (i < self.st.window) & (jnp.sum(alive) > 0) & ((i == 0) | jnp.logical_not(early))


def _window(params, pool, last, pos, step, limit, keys, sids, live, page_table, s_last, s_pos,
            s_step, s_limit, s_keys, s_sids, s_table, s_count, temperature, top_p, stop_ids,
            min_idle, shrink_to, logit_bias=None, s_logit_bias=None, *, cfg, st: Static, mesh,
            rules):
  """See the module docstring. Slots [B] = [Sh * r]; staged rows [Q] = [Sh * q] with
  s_count [Sh] valid per shard. Returns (pool, tokens [B, W], logprobs [B, W],
  sources [B, W], final source [B], staged rows consumed [Sh], steps run); a source
  is the row that made a slot's token: b for the row in slot b at the start, B + k
  for staged row k, -1 for an idle slot."""
  b, w = last.shape[0], st.window
  con = _constrainer(mesh, rules)
  rs = dict(ints=_pack(last, pos, step, limit, keys, sids), table=page_table)
  ss = dict(ints=_pack(s_last, s_pos, s_step, s_limit, s_keys, s_sids), table=s_table)
  if logit_bias is not None:
    rs["bias"] = con(logit_bias.astype(jnp.float32), ("batch", None))
    ss["bias"] = con(s_logit_bias.astype(jnp.float32), ("batch", None))
  win = _Win(params, pool, page_table, s_table, ss, s_count, temperature, top_p, stop_ids,
             min_idle, shrink_to, b, cfg=cfg, st=st, mesh=mesh, rules=rules)
  done = jnp.logical_not(live.astype(bool))
  src = jnp.where(done, -1, jnp.arange(b, dtype=jnp.int32))
  nxt = jnp.zeros((st.shards,), jnp.int32)
  # idle slots take staged rows at the start
  rs, done, src, wb, nxt, cache = win.swap(rs, done, src, pos, nxt, win.cache)
  win.idle0 = done  # padding slots idle from the start
  toks = con(jnp.full((b, w), win.pad, jnp.int32), ("batch", None))
  lps = con(jnp.zeros((b, w), jnp.float32), ("batch", None))
  srcs = con(jnp.full((b, w), -1, jnp.int32), ("batch", None))
  carry = (jnp.int32(0), rs, done, src, wb, nxt, jnp.int32(0), win.con_cache(cache), toks, lps,
           srcs)
  i, rs, done, src, wb, nxt, _, cache, toks, lps, srcs = jax.lax.while_loop(win.cond, win.body,
                                                                           carry)
  if win.dense:  # the live rows' new tokens back into their pages
    count = jnp.where(done, 0, rs["ints"][:, _POS] - wb)
    pool = _write_back(cfg, st, mesh, rules, pool, cache, rs["table"], wb, count)
  else:
    pool = cache
  return _con_pool(pool, cfg, st, mesh, rules), toks, lps, srcs, src, nxt, i


_PROGRAMS = program_cache.ProgramCache()


def get_fn(kind: str, cfg: qwen.ModelConfig, st: Static, *, mesh=None, rules=None,
           pages_per_shard: int = 0):
  """The jitted program ``kind`` ('init', 'prefill', 'window'), built once per
  (model config, static options, mesh, rules) and cached; one compile per shape
  bucket."""
  key = (kind, cfg, st, mesh, sampling.rules_key(rules), pages_per_shard if kind == "init" else 0)
  return _PROGRAMS.get(key, lambda: _build(kind, cfg, st, mesh, rules, pages_per_shard),
                       name=f"engine {kind}")


def _build(kind, cfg, st, mesh, rules, pages_per_shard):
  common = dict(cfg=cfg, st=st, mesh=mesh, rules=rules)
  if kind == "init":
    out = None
    if mesh is not None:
      out = jax.tree.map(lambda s: NamedSharding(mesh, s), pool_specs(cfg, st, mesh, rules),
                         is_leaf=lambda x: isinstance(x, P))
    return jax.jit(functools.partial(_init_pool, pages_per_shard=pages_per_shard, **common),
                   out_shardings=out)
  if kind == "prefill":
    return jax.jit(functools.partial(_prefill, **common), donate_argnums=(1,))
  if kind == "window":
    return jax.jit(functools.partial(_window, **common), donate_argnums=(1,))
  raise ValueError(kind)


def compiled_programs() -> int:
  """How many engine programs have been compiled in this process (all kinds and buckets)."""
  return _PROGRAMS.compiled_programs()
