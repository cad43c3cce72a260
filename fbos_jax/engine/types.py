"""The engine's host-side types: its config, a request, a finished row, the feed
protocol of the streaming entry, and the per-call statistics."""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable, Optional, Protocol, Sequence

import numpy as np

from fbos_jax.model.paged_attention import IMPLEMENTATIONS as ATTENTION


class EngineError(ValueError):
  """Bad engine configuration or input; the message names the field and the numbers."""


@dataclasses.dataclass(frozen=True)
class EngineConfig:
  """The continuous engine's knobs (the sampling options stay in SamplingConfig).

  slots: S, rows decoding at once over the whole mesh (a multiple of the mesh's
    batch shards dcn*data*fsdp; each shard owns S / shards slots and its pages).
  page_size: tokens per KV page.
  num_pages: pages per batch shard, the null page included; 0 = the smallest pool
    with which no row ever waits for a page: slots_per_shard * ceil((P + R - 1) /
    page_size) + staged_per_shard * ceil((P + min(window, R) - 1) / page_size) + 1
    (P the longest prompt, R max_new_tokens). A smaller pool is refused at start
    (the engine neither preempts nor re-queues).
  window: K, the most decode steps one jitted window runs without the host.
  staged: rows admitted (and prefilled) ahead of a free slot, over the mesh (a
    multiple of the batch shards); inside a window a slot whose row stops takes
    the next staged row of its shard at once, so windows need not end to refill.
    -1 = as many as slots; 0 = off.
  swaps_per_step: the most staged rows a shard's idle slots take per decode step
    (on the XLA path each costs a copy of one row's cache inside the window).
  refill_fraction: a window returns early once this share of its rows has stopped
    with no staged row left to take while requests are waiting or the feed is
    still open (its finished rows may start new ones: the refill pays); 1.0 =
    never early.
  shrink: a window also returns early once its rows fit the next smaller row
    bucket (no request waiting: the tail runs on a smaller batch).
  min_fill: 0 = every window holds all its shards' rows (the row bucket above the
    fullest shard: on an accelerator a decode step costs about the same at fewer
    rows); > 0 = a window runs at the largest row bucket up to that one whose
    slots the rows fill to at least this share, and the rows beyond it wait for a
    later window (on a CPU a step costs in proportion to its rows, so an idle
    slot costs what a row does). Not with staged rows waiting.
  prefill_chunk: the most prompt tokens of one prompt per prefill call; longer
    prompts are prefilled in chunks (each attends to the pages of the earlier ones).
  max_prompt_len: the longest prompt (sizes the pool); 0 = the largest of
    SamplingConfig.prompt_buckets.
  row_buckets: rows per batch shard a window may have; () = powers of two up to
    slots / shards. Sizes above slots / shards become slots / shards (a shard
    never runs more rows than its slots; a larger bucket would only pad).
  page_buckets: page-table widths of a window / prefill; () = powers of two up to
    the pages of the longest row.
  prefill_buckets: chunk lengths of a prefill call; () = powers of two from 16 up
    to prefill_chunk.
  bucket_growth: the ratio of one default bucket to the next (row, page, prefill
    and page-copy buckets left at ()): 2 = powers of two; 4 or 8 = fewer programs
    (the run compiles every one before its first step; ``--dry_run`` prints how
    many) at the cost of more padding; 0 = one bucket each, the largest (page
    copies stay powers of two): the fewest programs, for chips where a decode
    step costs about the same at any row count and the Pallas kernel reads only
    the pages in use.
  attention: paged attention: auto (Pallas ragged kernel on TPU, the Pallas GPU
    decode kernel on GPU, XLA elsewhere), xla, pallas (TPU only), pallas_gpu (GPU
    only), or pallas_interpret / pallas_gpu_interpret (the same kernel in Pallas's
    interpreter, on any platform: the TPU or GPU decode path run on CPU, for tests;
    model/paged_attention.py).
  """
  slots: int = 64
  page_size: int = 16
  num_pages: int = 0
  window: int = 32
  staged: int = -1
  swaps_per_step: int = 4
  refill_fraction: float = 0.125
  shrink: bool = True
  min_fill: float = 0.0
  prefill_chunk: int = 512
  max_prompt_len: int = 0
  row_buckets: tuple = ()
  page_buckets: tuple = ()
  prefill_buckets: tuple = ()
  bucket_growth: int = 2
  attention: str = "auto"

  def validate(self) -> "EngineConfig":
    def bad(msg):
      raise EngineError(msg)
    for name in ("slots", "page_size", "window", "prefill_chunk"):
      if int(getattr(self, name)) < 1:
        bad(f"engine.{name}={getattr(self, name)} must be >= 1.")
    if int(self.staged) < -1 or int(self.swaps_per_step) < 1:
      bad(f"engine.staged={self.staged} must be >= -1 (-1 = engine.slots, 0 = off) and "
          f"engine.swaps_per_step={self.swaps_per_step} >= 1.")
    if int(self.num_pages) < 0 or int(self.max_prompt_len) < 0:
      bad(f"engine.num_pages={self.num_pages} and engine.max_prompt_len="
          f"{self.max_prompt_len} must be >= 0 (0 = derived).")
    if not 0.0 <= float(self.min_fill) <= 1.0:
      bad(f"engine.min_fill={self.min_fill} must be in [0, 1] (0 = every row in every window).")
    if not 0.0 < float(self.refill_fraction) <= 1.0:
      bad(f"engine.refill_fraction={self.refill_fraction} must be in (0, 1].")
    if int(self.bucket_growth) < 2 and int(self.bucket_growth) != 0:
      bad(f"engine.bucket_growth={self.bucket_growth} must be 0 (one bucket, the largest) or "
          ">= 2 (2 = powers of two).")
    if self.attention not in ATTENTION:
      bad(f"engine.attention={self.attention!r}; expected one of {ATTENTION}.")
    for name in ("row_buckets", "page_buckets", "prefill_buckets"):
      b = getattr(self, name)
      if any(int(x) <= 0 for x in b):
        bad(f"engine.{name}={b!r} must hold positive sizes (or be () for the default).")
    return self


def engine_config_defaults() -> dict:
  """The engine section of a config (``config.engine``): the fields of
  :class:`EngineConfig` with their defaults (the one home of those defaults)."""
  return {f.name: f.default for f in dataclasses.fields(EngineConfig)}


@dataclasses.dataclass
class Request:
  """One prompt to sample ``n`` rows from, with its own key contract.

  prompt: token ids (1-D). key: a threefry PRNG key (raw uint32[2] or typed).
  Row j (0 <= j < n) draws its token at step t from
  ``fold_in(fold_in(key, t), sid_base + j)``; the static sampler's sample j of
  global prompt i is ``sid_base = i * n``. tag: anything; handed back with every
  row. logit_bias: optional [V] added to every step's logits (the engine must be
  built with logit biases on). max_new_tokens: optional cap below the engine's.
  """
  prompt: Sequence[int]
  n: int = 1
  key: Any = None
  sid_base: int = 0
  tag: Any = None
  logit_bias: Optional[np.ndarray] = None
  max_new_tokens: Optional[int] = None


@dataclasses.dataclass
class FinishedRow:
  """A row that stopped (stop token or its token budget).

  tokens / logprobs [L] (the stop token included, L >= 1); ``stopped``: ended
  with a stop token. ``request`` is the request it came from, ``j`` its sample
  index in it (its stream id is ``request.sid_base + j``). ``first_window`` /
  ``last_window``: the run's indices of the first and last decode window the
  row ran in (rows whose windows overlap decoded side by side). ``versions`` [L]:
  the policy version that drew each token (-1 without a :class:`ParamsSource`)."""
  request: Request
  j: int
  tokens: np.ndarray
  logprobs: np.ndarray
  stopped: bool
  first_window: int = -1
  last_window: int = -1
  versions: Optional[np.ndarray] = None

  @property
  def tag(self):
    return self.request.tag


class Feed(Protocol):
  """Where the streaming engine gets its requests (called between windows)."""

  def poll(self) -> list:  # new Requests, never blocking
    ...

  def finished(self) -> bool:  # no request will ever come again
    ...


class ParamsSource(Protocol):
  """Params that change while the engine runs (in-flight weight updates).

  ``current()`` -> (params, version): read once per loop iteration, between
  windows (with several processes, at the same iteration on each: the source
  makes them agree); ``kv_mode``: what a version change does to rows in flight
  (``keep_kv`` | ``recompute``)."""
  kv_mode: str

  def current(self) -> tuple:
    ...


def is_params_source(x) -> bool:
  """Whether ``x`` is a :class:`ParamsSource` rather than a param pytree."""
  return callable(getattr(x, "current", None)) and hasattr(x, "kv_mode")


class ListFeed:
  """A feed that hands out a fixed list of requests at once, then is finished;
  ``submit`` adds more while the engine runs (e.g. from a row callback)."""

  def __init__(self, requests: Sequence[Request] = (), *, closed: bool = True):
    self._pending = list(requests)
    self._closed = closed

  def submit(self, *requests: Request):
    self._pending.extend(requests)

  def close(self):
    self._closed = True

  def poll(self) -> list:
    out, self._pending = self._pending, []
    return out

  def finished(self) -> bool:
    return self._closed and not self._pending


@dataclasses.dataclass
class EngineStats:
  """Per-call figures (accumulated over calls when the same object is passed again).

  slot_util: generated tokens / slot-steps computed (rows of every window x its
  steps); pages_peak: the most pages in use at once (this process);
  windows / refills / prefills: decode windows, admission rounds that admitted a
  row, prefill calls; verify_wait_s: time the engine had nothing to run and
  waited on its feed (e.g. for verdicts); window_s: time from each window's
  dispatch until its results are on the host (device work, including the
  prefills queued before it); wall_s: time inside the engine; swaps: weight
  updates taken between windows; recomputed_tokens: KV positions redone after
  them (``recompute``).

  The critical path (what an accelerator pays, where a memory-bound decode step
  costs about the same at 16 rows as at 64): decode_steps, the sequential decode
  steps of every window (each window's steps, whatever its rows); prefill_tokens,
  the prompt tokens prefilled (chunks, recomputes included); kv_reads, the keys
  generated tokens attended to (each token reads its row's positions so far: the
  KV bytes a paged kernel reads are kv_reads x bytes per position)."""
  tokens: int = 0
  slot_steps: int = 0
  decode_steps: int = 0
  prefill_tokens: int = 0
  kv_reads: int = 0
  rows: int = 0
  pages_peak: int = 0
  windows: int = 0
  refills: int = 0
  prefills: int = 0
  verify_wait_s: float = 0.0
  window_s: float = 0.0
  wall_s: float = 0.0
  swaps: int = 0
  recomputed_tokens: int = 0

  @property
  def slot_util(self) -> float:
    return self.tokens / self.slot_steps if self.slot_steps else 0.0

  def as_dict(self) -> dict:
    d = dataclasses.asdict(self)
    d["slot_util"] = self.slot_util
    return d


RowCallback = Callable[[FinishedRow], None]


class Timer:
  def __init__(self):
    self.t0 = time.perf_counter()

  def __call__(self) -> float:
    return time.perf_counter() - self.t0
