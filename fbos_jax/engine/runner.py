"""The host side of the engine: admission, pages, windows, finished rows.

One :class:`Engine` per (model, sampling options, engine options, mesh); its
:meth:`Engine.run` is the streaming loop, :meth:`Engine.sample` the drop-in
for ``sampling.sample``. The loop, per iteration:

1. take new requests from the feed (``feed.poll()``, never blocking);
2. admission: fill free places with waiting samples (a shard has
   ``slots / shards`` slots and ``staged / shards`` places in its staging
   queue), a prompt's samples together on one batch shard where they fit;
   allocate the prompt's pages (its full pages shared by the samples, its
   partial last page written once per sample) and prefill the prompt (all but
   its last token) in chunks of at most ``engine.prefill_chunk`` tokens;
3. allocate, per row, the pages the next window can write into
   (``min(window, tokens left)`` positions);
4. run one decode window over each shard's first rows (its slots) with the rest
   staged: a slot whose row stops takes the next staged row inside the window;
   hand every row that stopped to the callback and free its pages.

Every page is back in the free list when ``run`` returns or raises
(``try/finally``); the allocator checks it.

Several processes (a mesh over the devices of several hosts): each process
owns the slots on its own batch shards and schedules its own requests, but the
programs are collective, so every process runs the same sequence of prefill
and window calls with the same shapes. Once per iteration the processes
exchange a few ints (``fbos_jax.distributed.allgather_ints``): rows and pages
each needs, whether requests are waiting, whether its feed is finished and how
many prefill rounds it has (then once per prefill round: its shapes). They
take the maxima as the call's buckets; a process with nothing to do passes
idle rows (page table all null pages). The window's early-exit test runs on
the global rows inside the program, so every process leaves it at the same
step. The loop ends when every process's feed is finished and no process has a
row; while some feed is open and nothing is runnable anywhere, all wait
(``verify_wait_s``).

In-flight weight updates (``fbos_jax/rl/sources.py``): ``params`` may be a
:class:`~fbos_jax.engine.types.ParamsSource` instead of a param pytree. Its
``current()`` -> (params, version) is read once per loop iteration, after the
feed's poll and before admission (read once, used for the window and for its
labels; AReaL's PR #1569 read it twice): a feed that admits work by the version
it reads (the staleness rule) never sees a newer version than its rows are
labelled with; with several processes every process reads it at the same
iteration, and the source makes them agree on the version. When the version
changes, rows in flight go on from where they are with the new params: their
KV cache is kept (``source.kv_mode == "keep_kv"``, PipelineRL) or recomputed
under the new params before the next window (``"recompute"``, AReaL: a prefill
of each row's prompt and tokens so far into its own pages). Every token is
labelled with the oldest version whose weights wrote the KV it attended to:
under ``recompute`` the window's version; under ``keep_kv`` the version that
prefilled the row (its KV stays), so the staleness check reads the true lag.
Finished rows carry their ``versions`` [L] (:meth:`Engine.sample`: in
``SampleOutput.versions``).
"""

from __future__ import annotations

import collections
import contextlib
import functools
import math
import time
from typing import Optional, Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np

from fbos_jax import buckets
from fbos_jax import sampling
from fbos_jax import sharding as sh
from fbos_jax.engine import programs
from fbos_jax.engine.pages import PageAllocator
from fbos_jax.engine.types import (EngineConfig, EngineError, EngineStats, FinishedRow, ListFeed,
                                   Request, RowCallback, Timer, is_params_source)
from fbos_jax.model import paged_attention as PA
from fbos_jax.model import qwen

_NULL = PA.NULL_PAGE


def bucket_ladder(cap: int, start: int = 1, growth: int = 2) -> tuple:
  """start, g*start, g^2*start, ... below cap, and cap itself (g = ``growth``,
  ``engine.bucket_growth``: 2 = powers of two; 0 = cap alone)."""
  if int(growth) == 0:
    return (int(cap),)
  out, b = [], max(1, int(start))
  while b < cap:
    out.append(b)
    b *= max(int(growth), 2)
  return tuple(out) + (int(cap),)


def cut_row_buckets(row_buckets: Sequence[int], slots_per_shard: int) -> tuple:
  """The row buckets a shard of ``slots_per_shard`` slots can use: those below it
  and the slots per shard themselves. A window or prefill call never has more
  rows per shard than its slots, so a larger bucket only pads (the tiny config's
  (16, 64, 128) on 4 shards of 32 slots ran every full window at 64 rows per
  shard, half of them idle)."""
  sps = int(slots_per_shard)
  return tuple(sorted({min(int(b), sps) for b in row_buckets}))


def _bucket(n: int, bks: Sequence[int], what: str, field: str) -> int:
  return buckets.pick_bucket(max(int(n), 1), bks, what=what, field=field)


def _raw_key(key) -> np.ndarray:
  """A threefry key as raw uint32[2] (the static sampler's form inside its program)."""
  if key is None:
    return np.zeros((2,), np.uint32)
  if isinstance(key, jax.Array) and jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
    if str(jax.random.key_impl(key)) != "threefry2x32":
      raise EngineError(f"the engine takes threefry keys; got a {jax.random.key_impl(key)} key.")
    key = jax.random.key_data(key)
  k = np.asarray(key)
  if k.shape != (2,) or k.dtype != np.uint32:
    raise EngineError(f"a request key must be a threefry key (uint32[2] or typed); got "
                      f"{k.dtype}{list(k.shape)}.")
  return k


class _Row:
  """One sample being decoded (host state)."""
  __slots__ = ("req", "j", "shard", "pages", "pos", "step", "last", "limit", "key", "sid",
               "bias", "tokens", "logprobs", "versions", "first_window", "kv_version")

  def __init__(self, req, j, shard, pages, pos, last, limit, key, sid, bias, kv_version):
    self.req, self.j, self.shard, self.pages = req, j, shard, pages
    self.pos, self.step, self.last, self.limit = pos, 0, last, limit
    self.key, self.sid, self.bias = key, sid, bias
    self.tokens, self.logprobs, self.versions = [], [], []
    self.first_window = -1
    self.kv_version = kv_version  # the oldest version whose weights wrote this row's KV


class _Piece:
  """The prefill of one prompt for the samples admitted together on one shard."""
  __slots__ = ("shard", "tokens", "pages", "copies", "done")

  def __init__(self, shard, tokens, pages, copies):
    self.shard, self.tokens, self.pages, self.copies = shard, tokens, pages, copies
    self.done = 0  # tokens prefilled so far


class _Waiting:
  __slots__ = ("req", "prompt", "js", "key", "bias", "limit")

  def __init__(self, req, prompt, js, key, bias, limit):
    self.req, self.prompt, self.js, self.key, self.bias, self.limit = req, prompt, js, key, bias, limit


class PoolLayout(collections.namedtuple("PoolLayout", (
    "slots_per_shard", "staged_per_shard", "max_prompt", "row_pages", "stage_pages",
    "pages_needed", "pages_per_shard", "row_buckets", "page_buckets"))):
  """The engine's page pool per batch shard (:func:`pool_layout`)."""


def pool_layout(e: EngineConfig, s, shards: int = 1, nproc: int = 1) -> PoolLayout:
  """The page pool of an engine with engine config ``e`` and sampling config ``s``
  (its ``max_new_tokens`` R and ``prompt_buckets``) over ``shards`` batch shards on
  ``nproc`` processes: the arithmetic is known before any program is built, so a
  run checks it at start (``fbos_jax/rl/context.py``). Raises EngineError naming
  the fields when the slots do not divide over the shards, the pool
  (``engine.num_pages``) is smaller than the rows need, or a bucket list does not
  reach its size."""
  e = e.validate()
  if e.slots % shards:
    raise EngineError(f"engine.slots={e.slots} must be a multiple of the mesh's "
                      f"{shards} batch shards (dcn*data*fsdp).")
  if shards % nproc:
    raise EngineError(f"the mesh's {shards} batch shards do not divide over "
                      f"{nproc} processes.")
  sps = e.slots // shards  # slots per shard
  staged = e.slots if e.staged == -1 else int(e.staged)
  if staged % shards:
    raise EngineError(f"engine.staged={e.staged} must be a multiple of the mesh's "
                      f"{shards} batch shards.")
  qs = staged // shards  # staged rows per shard
  r = int(s.max_new_tokens)
  max_prompt = int(e.max_prompt_len or max(int(b) for b in s.prompt_buckets))
  ps = e.page_size
  row_pages = -(-(max_prompt + r - 1) // ps)  # pages of the longest row
  stage_pages = -(-(max_prompt + min(e.window, r) - 1) // ps)
  need = sps * row_pages + qs * stage_pages + 1
  if e.num_pages and e.num_pages < need:
    raise EngineError(
        f"engine.num_pages={e.num_pages} per batch shard is too small: {sps} slots per "
        f"shard (engine.slots={e.slots} over {shards} shard(s)) x {row_pages} pages "
        f"per row (prompt {max_prompt} + max_new_tokens {r} - 1 tokens at "
        f"engine.page_size={ps}) + {qs} staged rows per shard (engine.staged) x "
        f"{stage_pages} pages (prompt + one window) + 1 null page = {need}. Raise "
        "engine.num_pages (or 0 for that size), or lower engine.slots / engine.staged / "
        "sampling.max_new_tokens / the prompt length.")
  grow = int(e.bucket_growth)
  row_buckets = tuple(e.row_buckets) or bucket_ladder(sps, 1, grow)
  page_buckets = tuple(e.page_buckets) or bucket_ladder(row_pages, 1, grow)
  if max(row_buckets) < sps:
    raise EngineError(f"engine.row_buckets={e.row_buckets} must reach the {sps} slots "
                      "per batch shard.")
  row_buckets = cut_row_buckets(row_buckets, sps)
  if max(page_buckets) < row_pages:
    raise EngineError(f"engine.page_buckets={e.page_buckets} must reach {row_pages} "
                      "pages (the longest row).")
  return PoolLayout(sps, qs, max_prompt, row_pages, stage_pages, need,
                    int(e.num_pages or need), row_buckets, page_buckets)


class Engine:
  """The continuous-batching engine for one model / sampling / engine config / mesh.

  ``logit_bias=True`` builds programs that add a per-row logit bias (each request's
  ``logit_bias``; the benchmark's length mix)."""

  def __init__(self, cfg: qwen.ModelConfig, config: Optional[sampling.SamplingConfig] = None,
               engine_config: Optional[EngineConfig] = None, *, mesh=None, rules=None,
               logit_bias: bool = False, **options):
    self.cfg = cfg
    self.scfg = sampling.make_config(config, **options).validate(cfg.vocab_size)
    self.ecfg = (engine_config or EngineConfig()).validate()
    self.mesh, self.rules = mesh, rules
    e, s = self.ecfg, self.scfg
    self.nproc = sampling.mesh_processes(mesh)
    self.shards = sh.batch_shard_count(mesh, self.rules) if mesh is not None else 1
    lay = pool_layout(e, s, self.shards, self.nproc)
    self.sps, self.qs, self.local_shards = lay.slots_per_shard, lay.staged_per_shard, \
        self.shards // self.nproc
    self.R, self.max_prompt = int(s.max_new_tokens), lay.max_prompt
    self.row_pages, self.stage_pages = lay.row_pages, lay.stage_pages
    self.pages_per_shard = lay.pages_per_shard
    ps = e.page_size
    platform = mesh.devices.flat[0].platform if mesh is not None else jax.default_backend()
    device_kind = mesh.devices.flat[0].device_kind if mesh is not None else None
    try:
      impl = PA.choose(e.attention, platform, cfg.head_dim, e.page_size)
    except ValueError as err:
      raise EngineError(str(err)) from None
    unroll = {"unroll": True, "scan": False}.get(s.layer_loop, platform == "cpu")
    if impl in PA.KERNEL_IMPLS:
      unroll = True  # the kernel reads one pool array per layer in place
    self.st = programs.Static(
        page_size=ps, window=int(e.window), greedy=s.is_greedy, top_k=int(s.top_k),
        use_top_p=float(s.top_p) < 1.0,
        num_stop_slots=sampling.stop_slots(len(s.stop_token_ids)), pad_id=int(s.pad_id),
        unroll=unroll, cache_dtype=s.cache_dtype, impl=impl, shards=self.shards,
        bias=bool(logit_bias), device_kind=device_kind if impl == "pallas" else None,
        swaps=int(e.swaps_per_step), stage_len=self.stage_pages * ps,
        vocab_limit=int(s.vocab_limit))
    self.row_buckets, self.page_buckets = lay.row_buckets, lay.page_buckets
    grow = int(e.bucket_growth)
    self.prefill_buckets = tuple(e.prefill_buckets) or bucket_ladder(e.prefill_chunk, 16, grow)
    # a prompt's samples on one shard: up to its slots + staged places, one copy less
    # (never one bucket: each copy is written, so few samples must not pay for many)
    self.copies_buckets = bucket_ladder(self.sps + self.qs, 1, grow or 2)
    self.chunk = min(int(e.prefill_chunk), max(self.prefill_buckets))
    self.pages = PageAllocator(self.local_shards, self.pages_per_shard)
    self.stop_ids = set(int(t) for t in s.stop_token_ids)

  # ------------------------------------------------------------------------- helpers

  def program(self, kind: str):
    """The jitted program ``kind`` (init | window | prefill) of this engine's
    shapes and mesh (cached: one per engine configuration)."""
    return programs.get_fn(kind, self.cfg, self.st, mesh=self.mesh, rules=self.rules,
                           pages_per_shard=self.pages_per_shard)

  def _put(self, *xs) -> list:
    """Host arrays [rows, ...] onto the mesh, sharded by rows (one transfer call)."""
    if self.mesh is None:
      return [jnp.asarray(np.asarray(x)) for x in xs]
    return sh.put_process_local_many(xs, self.mesh, self.rules)

  def _agree(self, *values) -> np.ndarray:
    """[processes, len(values)]: every process's values (collective when several)."""
    if self.nproc == 1:
      return np.asarray([values], np.int64)
    from fbos_jax import distributed
    return distributed.allgather_ints(*values)

  def _read(self, x, rows: int) -> np.ndarray:
    start = sh.local_row_start(x)
    return sh.host_rows(x, (start, start + rows))

  def _check_request(self, req: Request) -> _Waiting:
    prompt = np.asarray(list(req.prompt), np.int64).reshape(-1)
    tag = f"request {req.tag!r}"
    if prompt.size == 0:
      raise EngineError(f"{tag} has an empty prompt (the model needs at least one token).")
    if prompt.min() < 0 or prompt.max() >= self.cfg.vocab_size:
      raise EngineError(f"{tag} has token ids outside [0, {self.cfg.vocab_size}).")
    if prompt.size > self.max_prompt:
      raise EngineError(f"{tag} has {prompt.size} prompt tokens, more than the engine's "
                        f"{self.max_prompt} (engine.max_prompt_len, default the largest "
                        "sampling.prompt_buckets), which sizes the page pool.")
    if int(req.n) < 1:
      raise EngineError(f"{tag}: n={req.n} must be >= 1.")
    limit = self.R if req.max_new_tokens is None else int(req.max_new_tokens)
    if not 1 <= limit <= self.R:
      raise EngineError(f"{tag}: max_new_tokens={req.max_new_tokens} must be in [1, "
                        f"sampling.max_new_tokens={self.R}].")
    if req.key is None and not self.st.greedy:
      raise EngineError(f"{tag} has no key (sampling is not greedy).")
    bias = None
    if self.st.bias:
      bias = (np.zeros((self.cfg.vocab_size,), np.float32) if req.logit_bias is None
              else np.asarray(req.logit_bias, np.float32))
      if bias.shape != (self.cfg.vocab_size,):
        raise EngineError(f"{tag}: logit_bias has shape {bias.shape}; expected "
                          f"({self.cfg.vocab_size},).")
    elif req.logit_bias is not None:
      raise EngineError(f"{tag} has a logit_bias but the engine was built without logit "
                        "biases (Engine(..., logit_bias=True)).")
    return _Waiting(req, prompt, list(range(int(req.n))), _raw_key(req.key), bias, limit)

  # ------------------------------------------------------------------------- admission

  def _admit(self, waiting: collections.deque, rows: list, pieces: list, version: int) -> int:
    """Fill free slots from ``waiting`` (host only), prefilled under ``version``.
    Returns the samples admitted."""
    ps = self.st.page_size
    admitted = 0
    while waiting:
      free = [self.sps + self.qs - len(r) for r in rows]  # slots, then the staging queue
      s = int(np.argmax(free))
      if free[s] == 0:
        break
      w = waiting[0]
      take = min(free[s], len(w.js))
      js, w.js = w.js[:take], w.js[take:]
      if not w.js:
        waiting.popleft()
      f = int(w.prompt.size) - 1  # prefilled tokens (the last one is the first decode step)
      full, partial = divmod(f, ps)
      shared = self.pages.alloc(s, full, refs=take)
      tail = self.pages.alloc(s, 1 + (take - 1)) if partial else []
      prompt_pages = shared + tail[:1]
      copies = tail[1:]  # private copies of the partial last page
      if f:
        pieces.append(_Piece(s, w.prompt[:f], prompt_pages, copies))
      for a, j in enumerate(js):
        own = shared + ([tail[a]] if partial else [])
        rows[s].append(_Row(w.req, j, s, own, f, int(w.prompt[-1]), w.limit, w.key,
                            int(w.req.sid_base) + j, w.bias, version))
      admitted += take
    return admitted

  def _prefill(self, params, pool, pieces: list, stats: EngineStats):
    """Every chunk of the admitted prompts (collective: agreed shapes per round),
    at most the largest row bucket of prompts per shard and call."""
    rounds_local = max((-(-p.tokens.size // self.chunk) for p in pieces), default=0)
    rounds = int(self._agree(rounds_local)[:, 0].max())
    cap = max(self.row_buckets)
    for _ in range(rounds):
      todo = [p for p in pieces if p.done < p.tokens.size]
      per_shard = [[p for p in todo if p.shard == s] for s in range(self.local_shards)]
      calls = int(self._agree(max(-(-len(x) // cap) for x in per_shard))[:, 0].max())
      for ci in range(calls):
        pool = self._prefill_call(params, pool, [x[ci * cap:(ci + 1) * cap] for x in per_shard],
                                  stats)
        stats.prefills += 1
      for p in todo:
        p.done = min(p.tokens.size, p.done + self.chunk)
    pieces.clear()
    return pool

  def _prefill_call(self, params, pool, per_shard: list, stats: EngineStats):
    """One prefill program call: the next chunk of each piece in ``per_shard``."""
    ps = self.st.page_size
    todo = [p for x in per_shard for p in x]
    clen = max((min(self.chunk, p.tokens.size - p.done) for p in todo), default=1)
    pages = max((-(-min(p.tokens.size, p.done + self.chunk) // ps) for p in todo), default=1)
    ncopy = max((len(p.copies) for p in todo), default=0)
    g = self._agree(max(map(len, per_shard)), clen, pages, ncopy).max(0)
    bp = _bucket(g[0], self.row_buckets, "prefill rows", "engine.row_buckets")
    c = _bucket(g[1], self.prefill_buckets, "prefill chunk", "engine.prefill_buckets")
    pb = _bucket(g[2], self.page_buckets, "page-table width", "engine.page_buckets")
    nc = _bucket(g[3], self.copies_buckets, "page copies", "") if g[3] else 0
    a = self._prefill_arrays(bp, c, pb, nc)
    for s, ps_list in enumerate(per_shard):
      for i, p in enumerate(ps_list):
        r = s * bp + i
        k = min(self.chunk, p.tokens.size - p.done)
        a["tokens"][r, :k] = p.tokens[p.done:p.done + k]
        a["start"][r], a["n_valid"][r] = p.done, k
        stats.prefill_tokens += k
        used = p.pages[:pb]
        a["table"][r, :len(used)] = used
        if p.copies:
          a["tail"][r] = len(p.pages) - 1
          a["copies"][r, :len(p.copies)] = p.copies
    with self._mesh_ctx():
      return self.program("prefill")(*self._prefill_args(params, pool, a))

  def _prefill_arrays(self, bp: int, c: int, pb: int, nc: int) -> dict:
    """Host arrays of one prefill call (``bp`` rows per shard, ``c``-token chunk,
    page tables ``pb`` wide, ``nc`` page copies), every row empty."""
    n = self.local_shards * bp
    return dict(tokens=np.full((n, c), self.scfg.pad_id, np.int32),
                start=np.zeros((n,), np.int32), n_valid=np.zeros((n,), np.int32),
                table=np.full((n, pb), _NULL, np.int32), tail=np.full((n,), -1, np.int32),
                copies=np.full((n, nc), _NULL, np.int32))

  def _prefill_args(self, params, pool, a: dict) -> tuple:
    """The prefill program's arguments: the arrays ``a`` on the mesh."""
    return (params, pool) + tuple(self._put(*(a[k] for k in ("tokens", "start", "n_valid",
                                                              "table", "tail", "copies"))))

  def _mesh_ctx(self):
    return jax.set_mesh(self.mesh) if self.mesh is not None else contextlib.nullcontext()

  # ------------------------------------------------------------------------- the loop

  def run(self, params, feed, on_row: RowCallback, *, stats: Optional[EngineStats] = None
          ) -> EngineStats:
    """Decode every request the feed hands out; call ``on_row`` with each row that
    stops (between windows, on this host). Returns (and updates) ``stats``. With
    several processes every process calls ``run`` together with its own feed."""
    stats = stats if stats is not None else EngineStats()
    timer = Timer()
    source = params if is_params_source(params) else None
    version = -1
    if source is not None:
      params, version = source.current()
    ps, w = self.st.page_size, self.st.window
    rows: list = [[] for _ in range(self.local_shards)]
    waiting: collections.deque = collections.deque()
    pieces: list = []
    pool = None
    self._windows = 0
    nap = 0.0005
    try:
      with self._mesh_ctx():
        pool = self.program("init")()
      while True:
        for req in feed.poll():
          waiting.append(self._check_request(req))
        # every row so far is prefilled: swap before admitting, after the poll, so that
        # the rows the feed let in under version v are labelled v or newer (never the
        # version before an update published while the feed admitted them)
        if source is not None:
          params, version, pool = self._swap(source, params, version, pool, rows, stats)
        admitted = self._admit(waiting, rows, pieces, version)
        if admitted:
          stats.refills += 1
        # pages for what the next window can write: positions [pos, pos + min(W, left))
        for shard_rows in rows:
          for r in shard_rows:
            last_pos = r.pos + min(w, r.limit - r.step) - 1
            need = last_pos // ps + 1 - len(r.pages)
            if need > 0:
              r.pages.extend(self.pages.alloc(r.shard, need))
        stats.pages_peak = max(stats.pages_peak, self.pages.in_use())
        live = sum(map(len, rows))
        g = self._agree(max(min(len(rr), self.sps) for rr in rows),
                        max(max(len(rr) - self.sps, 0) for rr in rows),
                        max((len(r.pages) for rr in rows for r in rr), default=0),
                        int(bool(waiting)), int(feed.finished() and not waiting and not live),
                        live, int(not feed.finished()),
                        *(sum(min(len(rr), self.sps, b) for rr in rows) for b in self.row_buckets))
        if pieces or self.nproc > 1:
          pool = self._prefill(params, pool, pieces, stats)
        if g[:, 0].max() == 0:
          if g[:, 4].all():
            break
          t0 = time.perf_counter()  # nothing runnable anywhere: wait for the feed
          time.sleep(nap)
          nap = min(nap * 2, 0.01)
          stats.verify_wait_s += time.perf_counter() - t0
          continue
        nap = 0.0005
        pool = self._run_window(params, pool, rows, g, stats, on_row)
      self.pages.check_all_free()
    finally:
      for shard_rows in rows:
        for r in shard_rows:
          self.pages.release(r.shard, r.pages)
        shard_rows.clear()
      del pool
      stats.wall_s += timer()
    return stats

  def _swap(self, source, params, version, pool, rows, stats):
    """Take the source's newest params between windows; with ``recompute``, redo
    the KV cache of every row in flight under them (each row's prompt and tokens
    so far, into its own pages). Returns (params, version, pool)."""
    new_params, new_version = source.current()
    if new_version == version:
      return params, version, pool
    mode = getattr(source, "kv_mode", "keep_kv")
    if mode not in ("keep_kv", "recompute"):
      raise EngineError(f"source.kv_mode={mode!r}: expected keep_kv | recompute "
                        "(rl.inflight_update).")
    stats.swaps += 1
    if mode == "recompute":
      pieces = []
      for shard_rows in rows:
        for r in shard_rows:
          seq = np.concatenate([np.asarray(list(r.req.prompt), np.int64),
                                np.asarray(r.tokens, np.int64)])[:r.pos]
          r.kv_version = new_version  # its KV is redone under the new weights
          if seq.size:
            pieces.append(_Piece(r.shard, seq, r.pages, []))
            stats.recomputed_tokens += int(seq.size)
      pool = self._prefill(new_params, pool, pieces, stats)
    return new_params, new_version, pool

  def _window_arrays(self, m: int, pb: int) -> dict:
    """Host arrays for ``m`` rows of a window (slots or staged), page tables ``pb`` wide."""
    return dict(last=np.full((m,), self.scfg.pad_id, np.int32), pos=np.zeros((m,), np.int32),
                step=np.zeros((m,), np.int32), limit=np.ones((m,), np.int32),
                keys=np.zeros((m, 2), np.uint32), sids=np.zeros((m,), np.uint32),
                table=np.full((m, pb), _NULL, np.int32),
                bias=np.zeros((m, self.cfg.vocab_size), np.float32) if self.st.bias else None)

  def _window_args(self, params, pool, sa: dict, qa: dict, live, count, min_idle: int,
                   shrink_to: int) -> list:
    """The window program's arguments: slot arrays ``sa`` and staged arrays ``qa``
    (:meth:`_window_arrays`), ``live`` [slots], ``count`` [shards] on the mesh."""
    fields = ("last", "pos", "step", "limit", "keys", "sids")
    host = ([sa[k] for k in fields] + [live, sa["table"]] + [qa[k] for k in fields + ("table",)]
            + [count])
    n = len(host)  # then the logit biases, the program's last arguments
    dev = self._put(*host, *([sa["bias"], qa["bias"]] if self.st.bias else []))  # one transfer
    args = [params, pool] + dev[:n]
    args += [np.float32(1.0 if self.scfg.is_greedy else self.scfg.temperature),
             np.float32(self.scfg.top_p), sampling.stop_id_array(self.scfg.stop_token_ids),
             np.int32(min_idle), np.int32(shrink_to)]
    return args + dev[n:]

  @staticmethod
  def _fill(a: dict, k: int, r: _Row):
    """Row ``r``'s state into slot ``k`` of the arrays ``a``."""
    a["last"][k], a["pos"][k], a["step"][k], a["limit"][k] = r.last, r.pos, r.step, r.limit
    a["keys"][k], a["sids"][k] = r.key, r.sid
    a["table"][k, :len(r.pages)] = r.pages
    if a["bias"] is not None:
      a["bias"][k] = r.bias

  def _window_inputs(self, rows, rb: int, qb: int, pb: int):
    """Each shard's first ``rb`` rows into its slots, the next ``qb`` staged (the
    rest wait): (slot arrays, staged arrays, live [n], staged count [shards],
    slot index -> row, staged index -> row)."""
    sa, qa = self._window_arrays(self.local_shards * rb, pb), self._window_arrays(
        self.local_shards * qb, pb)
    live = np.zeros((self.local_shards * rb,), bool)
    count = np.zeros((self.local_shards,), np.int32)
    slot_rows, staged_rows = {}, {}
    for s, rr in enumerate(rows):
      for i, r in enumerate(rr[:rb]):
        self._fill(sa, s * rb + i, r)
        live[s * rb + i] = True
        slot_rows[s * rb + i] = r
      for i, r in enumerate(rr[rb:rb + qb]):
        self._fill(qa, s * qb + i, r)
        staged_rows[s * qb + i] = r
      count[s] = min(max(len(rr) - rb, 0), qb)
    return sa, qa, live, count, slot_rows, staged_rows

  def _window_rows(self, g) -> int:
    """The window's row bucket (rows per shard) from the agreed counts ``g``: the one
    that holds every shard's slot rows, or with ``engine.min_fill`` > 0 and nothing
    staged the largest bucket below it whose slots the rows fill to that share
    (the best-filled one if none does); the rows beyond it wait for a later window."""
    top = _bucket(g[:, 0].max(), self.row_buckets, "window rows", "engine.row_buckets")
    want = float(self.ecfg.min_fill)
    if want <= 0 or g[:, 1].max() > 0:
      return top
    held = g[:, 7:].sum(0)  # rows each bucket would run, over every shard
    fills = [(held[i] / (self.shards * b), b) for i, b in enumerate(self.row_buckets) if b <= top]
    ok = [b for fill, b in fills if fill >= want]
    return max(ok) if ok else max(fills)[1]

  def _window_knobs(self, g, rb: int):
    """(min idle slots before a refill, row bucket to shrink to or -1) from the agreed
    per-shard counts ``g``. A refill pays while requests wait, and while a feed is
    open (``not feed.finished()``): the rows that stop may start new ones (a
    verdict starts round-2 rows, a finished step lets the next one in), which then
    take the freed slots instead of waiting for the window's slowest row."""
    b_global = self.shards * rb
    waiting_any = bool(g[:, 3].any()) or rb < g[:, 0].max()  # rows deferred by min_fill
    live_global = int(g[:, 5].sum())
    min_idle = (max(1, math.ceil(self.ecfg.refill_fraction * min(live_global, b_global)))
                if waiting_any or g[:, 6].any() else b_global + 1)
    smaller = [x for x in self.row_buckets if x < rb]
    shrink_to = max(smaller) if (self.ecfg.shrink and not waiting_any and smaller) else -1
    return min_idle, shrink_to

  def _run_window(self, params, pool, rows, g, stats, on_row):
    """One window over each shard's first ``sps`` rows (the slots), the rest of its
    rows staged; then the rows' new tokens (each labelled with its row's
    ``kv_version``), finished rows to the callback."""
    rb = self._window_rows(g)
    qb = self.qs if g[:, 1].max() > 0 else 0
    pb = _bucket(g[:, 2].max(), self.page_buckets, "page-table width", "engine.page_buckets")
    n = self.local_shards * rb
    min_idle, shrink_to = self._window_knobs(g, rb)
    sa, qa, live, count, slot_rows, staged_rows = self._window_inputs(rows, rb, qb, pb)
    args = self._window_args(params, pool, sa, qa, live, count, min_idle, shrink_to)
    t0 = time.perf_counter()
    with self._mesh_ctx():
      pool, toks, lps, srcs, final, nxt, steps = self.program("window")(*args)
    row_off = sh.local_row_start(toks)  # this process's first slot (global)
    first_shard = row_off // rb
    toks, lps, srcs, final = (self._read(x, n) for x in (toks, lps, srcs, final))
    nxt = sh.host_rows(nxt, (first_shard, first_shard + self.local_shards))
    steps = int(steps)
    stats.window_s += time.perf_counter() - t0
    stats.windows += 1
    stats.slot_steps += n * steps
    stats.decode_steps += steps
    window = self._windows  # this run's window index
    self._windows += 1
    b_global, q_off = self.shards * rb, first_shard * qb

    def row_of(gid):
      if gid < b_global:
        return slot_rows[gid - row_off]
      return staged_rows[gid - b_global - q_off]

    touched = self._scatter_tokens(toks, lps, srcs, steps, row_of, window, stats)
    finished = [r for r in touched
                if r.step >= r.limit or (r.tokens and r.tokens[-1] in self.stop_ids)]
    gone = set(map(id, finished))
    for s in range(len(rows)):
      in_slots = [row_of(int(x)) for x in final[s * rb:(s + 1) * rb] if x >= 0]
      untaken = [staged_rows[s * qb + i] for i in range(int(nxt[s]), int(count[s]))]
      rest = rows[s][rb + qb:]  # admitted beyond this window's slots and staging (not sent)
      rows[s] = [r for r in in_slots + untaken + rest if id(r) not in gone]
    self._retire(finished, window, stats, on_row)
    return pool

  @staticmethod
  def _scatter_tokens(toks, lps, srcs, steps: int, row_of, window: int,
                      stats: EngineStats) -> list:
    """A window's tokens ``[slots, steps]`` to their rows: ``srcs`` names, per slot
    and step, the row (global id; -1 idle) whose token it is. Returns the rows touched."""
    touched = []
    for k in range(toks.shape[0]):
      ids = srcs[k, :steps]
      i = 0
      while i < steps:
        gid = int(ids[i])
        j = i + 1
        while j < steps and ids[j] == gid:
          j += 1
        if gid >= 0:
          r = row_of(gid)
          if r.first_window < 0:
            r.first_window = window
          r.tokens.extend(toks[k, i:j].tolist())
          r.logprobs.extend(lps[k, i:j].tolist())
          r.versions.extend([r.kv_version] * (j - i))
          # token t at position pos + t attends to its pos + t + 1 keys
          stats.kv_reads += (j - i) * (r.pos + 1) + (j - i) * (j - i - 1) // 2
          r.last = int(toks[k, j - 1])
          r.step += j - i
          r.pos += j - i
          stats.tokens += j - i
          touched.append(r)
        i = j
    return touched

  def _retire(self, finished: list, window: int, stats: EngineStats, on_row: RowCallback):
    """Finished rows: every page back first (a callback may raise), then each to ``on_row``."""
    for r in finished:
      self.pages.release(r.shard, r.pages)
      r.pages = []
      stats.rows += 1
    for r in finished:
      on_row(FinishedRow(request=r.req, j=r.j, tokens=np.asarray(r.tokens, np.int32),
                         logprobs=np.asarray(r.logprobs, np.float32),
                         stopped=bool(r.tokens) and r.tokens[-1] in self.stop_ids,
                         first_window=r.first_window, last_window=window,
                         versions=np.asarray(r.versions, np.int64)))

  # ------------------------------------------------------------------------- compile set

  def program_shapes(self, n_max: int = 1, *, recompute: bool = False) -> list:
    """Every program shape a run of this engine can call, from its buckets:
    ``("init",)``, ``("window", rows, staged, pages)`` and ``("prefill", rows,
    chunk, pages, copies)`` (rows and staged per batch shard, as the runner picks
    them). ``n_max``: the most samples one request asks for (a prompt's samples
    on one shard share its pages, each but one with a copy of its partial last
    page); ``recompute``: in-flight weight updates redo the cache of rows in
    flight (``rl.inflight_update=recompute``: longer prefills, no copies).

    Only combinations a run can reach: staged rows only at the largest row
    bucket (a shard stages rows only once its slots are full), and a prefill
    call's chunk and page-table width both follow from the longest prompt in the
    call and the chunk's index (the calls of one round prefill the same chunk
    index of every prompt)."""
    bk = lambda n, bks: _bucket(n, bks, "", "")
    top = bk(self.sps, self.row_buckets)
    rows = sorted(b for b in set(self.row_buckets) if b <= top)
    page_top = bk(self.row_pages, self.page_buckets)
    pages = sorted(b for b in set(self.page_buckets) if b <= page_top)
    out = [("init",)]
    for rb in rows:
      for qb in ((0, self.qs) if self.qs and rb == top else (0,)):
        out += [("window", rb, qb, pb) for pb in pages]
    ch, ps = self.chunk, self.st.page_size

    def chunks(longest: int) -> list:  # (chunk bucket, page bucket) of prompts up to `longest`
      pairs = {(bk(ch, self.prefill_buckets), bk(-(-(k + 1) * ch // ps), self.page_buckets))
               for k in range(-(-longest // ch) - 1)}  # a chunk before a prompt's last
      for f in range(1, longest + 1):  # the last chunk of an f-token prefill
        k = (f - 1) // ch
        pairs.add((bk(f - k * ch, self.prefill_buckets), bk(-(-f // ps), self.page_buckets)))
      return sorted(pairs)

    prows = [b for b in rows if b <= bk(min(top, self.sps + self.qs), self.row_buckets)]
    most = min(int(n_max), self.sps + self.qs) - 1  # page copies of one prompt's samples
    copies = [0] + sorted({bk(t, self.copies_buckets) for t in range(1, most + 1)})
    seen = set()
    for longest, ncs in ((self.max_prompt - 1, copies),
                         (self.max_prompt + self.R - 1 if recompute else 0, [0])):
      for c, pb in chunks(longest):
        for bp in prows:
          for nc in ncs:
            if ("prefill", bp, c, pb, nc) not in seen:
              seen.add(("prefill", bp, c, pb, nc))
              out.append(("prefill", bp, c, pb, nc))
    return out

  def program_args(self, shape: tuple, params, pool) -> tuple:
    """(jitted program, its arguments as a run passes them, every row idle) of one
    :meth:`program_shapes` entry: what a compile set lowers before the run."""
    kind = shape[0]
    if kind == "init":
      return self.program("init"), ()
    if kind == "window":
      _, rb, qb, pb = shape
      n = self.local_shards * rb
      sa, qa = self._window_arrays(n, pb), self._window_arrays(self.local_shards * qb, pb)
      return self.program("window"), tuple(self._window_args(
          params, pool, sa, qa, np.zeros((n,), bool), np.zeros((self.local_shards,), np.int32),
          1, -1))
    if kind == "prefill":
      _, bp, c, pb, nc = shape
      return self.program("prefill"), self._prefill_args(params, pool,
                                                       self._prefill_arrays(bp, c, pb, nc))
    raise ValueError(f"unknown engine program {shape!r}")

  def compile_jobs(self, params, shapes: Sequence[tuple]) -> list:
    """One thunk per program of ``shapes`` (:meth:`program_shapes`) that lowers
    and compiles it with the arguments the run passes, so the run's calls find it
    compiled (any order, any thread). Allocates the page pool once, to read its
    placement, and compiles the init program."""
    with self._mesh_ctx():
      pool = self.program("init")()
    pool = jax.tree.map(lambda x: jax.ShapeDtypeStruct(  # the placement, not the memory
        x.shape, x.dtype, sharding=x.sharding if x.committed else None), pool)

    def job(shape):
      fn, args = self.program_args(shape, params, pool)
      with self._mesh_ctx():
        fn.lower(*args).compile()

    return [functools.partial(job, s) if s[0] != "init" else (lambda: None) for s in shapes]

  # ------------------------------------------------------------------------- sample

  def sample(self, params, prompts, *, key, n_per_prompt: int = 1, prompt_mask=None,
             allow_empty: bool = False, logit_bias=None, stream_ids=None,
             stats: Optional[EngineStats] = None) -> sampling.SampleOutput:
    """``sampling.sample`` on the engine: same arguments, same output, same key
    contract (sample j of global prompt i draws from its own stream i * n + j)."""
    scfg = self.scfg
    n = int(n_per_prompt)
    if n < 1:
      raise sampling.SamplingError(f"n_per_prompt={n_per_prompt} must be >= 1.")
    agreed = sampling.agree_prompts(sampling.as_rows(prompts, prompt_mask), scfg,
                                    self.cfg.vocab_size, self.mesh, allow_empty)
    r_len = self.R
    if agreed is None:
      return sampling.SampleOutput.empty(r_len)
    rows, truncated, plen, offset, _, _ = agreed
    sampling.check_stream_ids(stream_ids, len(rows))
    if plen > self.max_prompt:
      raise EngineError(f"prompt bucket {plen} is longer than engine.max_prompt_len="
                        f"{self.max_prompt}.")
    if logit_bias is not None:
      logit_bias = np.asarray(logit_bias, np.float32)
      if logit_bias.shape != (len(rows), self.cfg.vocab_size):
        raise sampling.SamplingError(f"logit_bias has shape {logit_bias.shape}; expected "
                                     f"[num_prompts, vocab] = {(len(rows), self.cfg.vocab_size)}.")
    raw = _raw_key(key)
    gid = (lambda i: offset + i) if stream_ids is None else (lambda i: int(stream_ids[i]))
    reqs = [Request(prompt=r, n=n, key=raw, sid_base=gid(i) * n, tag=i,
                    logit_bias=None if logit_bias is None else logit_bias[i])
            for i, r in enumerate(rows)]
    total = len(rows) * n
    tokens = np.full((total, r_len), scfg.pad_id, np.int32)
    logprobs = np.zeros((total, r_len), np.float32)
    lengths = np.zeros((total,), np.int32)
    stopped = np.zeros((total,), bool)
    seen = np.zeros((total,), bool)
    versions = np.full((total, r_len), -1, np.int64) if is_params_source(params) else None

    def on_row(fr: FinishedRow):
      k = fr.tag * n + fr.j
      m = fr.tokens.size
      tokens[k, :m] = fr.tokens
      logprobs[k, :m] = fr.logprobs
      if versions is not None:
        versions[k, :m] = fr.versions
      lengths[k], stopped[k], seen[k] = m, fr.stopped, True

    self.run(params, ListFeed(reqs), on_row, stats=stats)
    if not seen.all():
      raise EngineError(f"{int((~seen).sum())} of {total} rows never finished (an engine bug).")
    ptoks, pmask = buckets.left_pad(rows, plen, scfg.pad_id)
    mask = (np.arange(r_len)[None, :] < lengths[:, None]).astype(np.int32)
    return sampling.SampleOutput(
        tokens=tokens, lengths=lengths, response_mask=mask, logprobs=logprobs,
        prompt_tokens=np.repeat(ptoks, n, axis=0), prompt_mask=np.repeat(pmask, n, axis=0),
        stopped=stopped, prompt_truncated=np.repeat(truncated, n), versions=versions)


# ----------------------------------------------------------------------------- functional API


def sample(params, cfg: qwen.ModelConfig, prompts: Union[Sequence[Sequence[int]], np.ndarray], *,
           key: jax.Array, n_per_prompt: int = 1,
           config: Optional[sampling.SamplingConfig] = None,
           engine_config: Optional[EngineConfig] = None, mesh=None, rules=None,
           prompt_mask=None, allow_empty: bool = False, logit_bias=None, stream_ids=None,
           stats: Optional[EngineStats] = None, **options) -> sampling.SampleOutput:
  """Drop-in for :func:`fbos_jax.sampling.sample` on the continuous engine: the same
  arguments (plus ``engine_config`` and an optional ``stats`` to fill) and the same
  :class:`~fbos_jax.sampling.SampleOutput`."""
  engine = Engine(cfg, config, engine_config, mesh=mesh, rules=rules,
                  logit_bias=logit_bias is not None, **options)
  return engine.sample(params, prompts, key=key, n_per_prompt=n_per_prompt,
                       prompt_mask=prompt_mask, allow_empty=allow_empty, logit_bias=logit_bias,
                       stream_ids=stream_ids, stats=stats)


def run(params, cfg: qwen.ModelConfig, feed, on_row: RowCallback, *,
        config: Optional[sampling.SamplingConfig] = None,
        engine_config: Optional[EngineConfig] = None, mesh=None, rules=None,
        logit_bias: bool = False, stats: Optional[EngineStats] = None,
        **options) -> EngineStats:
  """The streaming entry: decode the requests ``feed`` hands out (``poll()`` between
  windows, until ``finished()``), calling ``on_row`` with each finished row."""
  engine = Engine(cfg, config, engine_config, mesh=mesh, rules=rules, logit_bias=logit_bias,
                  **options)
  return engine.run(params, feed, on_row, stats=stats)
