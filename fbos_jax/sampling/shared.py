"""What the two samplers share: the sampling contract, the host-side prompt rows and
their agreement across processes, the token draw, stop ids and the program keys.

The static sampler (:mod:`fbos_jax.sampling.static`) and the continuous engine
(:mod:`fbos_jax.engine`) take the same :class:`SamplingConfig`, return the same
:class:`SampleOutput` and draw every token with :func:`choose` from the uniform
:func:`key_uniform` gives a row at its own step, out of the logits of
:func:`step_logits_fn` (the model's ``qwen.logits_fn`` with the ids past
``vocab_limit`` removed): under the key contract the two produce the same rows.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from fbos_jax import buckets
from fbos_jax import sharding as sh
from fbos_jax.model import qwen

DEFAULT_PROMPT_BUCKETS = (64, 128, 256, 512, 1024, 2048, 4096)
DEFAULT_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
TRUNCATE_POLICIES = ("error", "left")
LAYER_LOOPS = ("auto", "unroll", "scan")


class SamplingError(ValueError):
  """Bad sampling input; raised on the host before anything is compiled."""


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
  """Sampling options. ``temperature == 0`` or ``greedy`` -> greedy decoding.

  max_new_tokens: response length R (rows that stop earlier are padded).
  top_k: 0 = off. top_p: 1.0 = off; keeps the smallest set of most likely tokens
    whose probability reaches top_p (applied after top-k, as transformers does).
  stop_token_ids: a row ends after emitting any of these (the stop token is part
    of the response: counted in ``lengths``, mask 1).
  prompt_buckets / batch_buckets: allowed padded prompt lengths / prompt counts.
  truncate: 'error' raises on a prompt longer than the largest prompt bucket;
    'left' drops its first tokens (keeps the end, next to the response).
  pad_id: id written to padding (prompt left padding, response after a stop).
  layer_loop: 'auto' | 'unroll' | 'scan' (see the module docstring).
  cache_dtype: KV-cache dtype; default the model's compute dtype.
  vocab_limit: > 0: only ids below it can be drawn (the tokenizer's size; a
    checkpoint's embedding often has more rows than its tokenizer has tokens,
    e.g. Qwen3's 151,936 for ~151,670), and the reported log-probs are of that
    restricted distribution (the trainer's ``LossConfig.vocab_limit``
    restricts its log-probs the same way). 0 = the whole vocabulary.
  decode_phases: the decode loop runs as up to this many consecutive loops, each
    over a KV cache just long enough for the slots filled by its end (see
    :func:`decode_phase_lengths`), so attention reads only (about) the filled
    part of the cache; 1 = a single loop over the whole preallocated cache.
    Each phase is one more compiled loop body (compile time grows with it).
  """
  max_new_tokens: int = 256
  temperature: float = 1.0
  greedy: bool = False
  top_k: int = 0
  top_p: float = 1.0
  stop_token_ids: tuple = ()
  prompt_buckets: tuple = DEFAULT_PROMPT_BUCKETS
  batch_buckets: tuple = DEFAULT_BATCH_BUCKETS
  truncate: str = "error"
  pad_id: int = 0
  layer_loop: str = "auto"
  cache_dtype: Optional[str] = None
  decode_phases: int = 4
  vocab_limit: int = 0

  @property
  def is_greedy(self) -> bool:
    return bool(self.greedy) or float(self.temperature) == 0.0

  def validate(self, vocab_size: Optional[int] = None) -> "SamplingConfig":
    def bad(msg):
      raise SamplingError(msg)
    if int(self.max_new_tokens) <= 0:
      bad(f"max_new_tokens={self.max_new_tokens} must be >= 1.")
    t = float(self.temperature)
    if not math.isfinite(t) or t < 0:
      bad(f"temperature={self.temperature} must be >= 0 (0 = greedy).")
    p = float(self.top_p)
    if not (0.0 < p <= 1.0):
      bad(f"top_p={self.top_p} must be in (0, 1] (1.0 = off).")
    if int(self.top_k) < 0:
      bad(f"top_k={self.top_k} must be >= 0 (0 = off).")
    if self.truncate not in TRUNCATE_POLICIES:
      bad(f"truncate={self.truncate!r}; expected one of {TRUNCATE_POLICIES}.")
    if int(self.decode_phases) < 1:
      bad(f"decode_phases={self.decode_phases} must be >= 1.")
    if self.layer_loop not in LAYER_LOOPS:
      bad(f"layer_loop={self.layer_loop!r}; expected one of {LAYER_LOOPS}.")
    for name in ("prompt_buckets", "batch_buckets"):
      b = getattr(self, name)
      if not b or any(int(x) <= 0 for x in b):
        bad(f"{name}={b!r} must be a non-empty tuple of positive sizes.")
    if int(self.vocab_limit) < 0 or (vocab_size is not None
                                     and int(self.vocab_limit) > vocab_size):
      bad(f"vocab_limit={self.vocab_limit} must be in [0, {vocab_size}] (0 = the whole "
          "vocabulary).")
    if vocab_size is not None:
      limit = int(self.vocab_limit) or vocab_size
      for s in self.stop_token_ids:
        if not 0 <= int(s) < limit:
          bad(f"stop_token_ids contains {s}, outside the drawable ids [0, {limit}) "
              "(vocab_limit: the tokenizer's size).")
      for s in self.stop_token_ids:
        if not 0 <= int(s) < vocab_size:
          bad(f"stop_token_ids contains {s}, outside the vocabulary [0, {vocab_size}).")
      if not 0 <= int(self.pad_id) < vocab_size:
        bad(f"pad_id={self.pad_id} is outside the vocabulary [0, {vocab_size}).")
    return self


@dataclasses.dataclass
class SampleOutput:
  """Host (numpy) results, one row per sample (prompt-major: row = i * n + j).

  tokens [N, R] int32: generated ids, ``pad_id`` after the stop token.
  lengths [N] int32: generated tokens including the stop token.
  response_mask [N, R] int32: 1 on generated tokens (stop token included).
  logprobs [N, R] float32: log-prob of each generated token under the
    temperature-scaled policy (0 where the mask is 0); see the module docstring.
  prompt_tokens [N, P] int32 / prompt_mask [N, P] int32: the left-padded prompt
    each row was sampled under (P = the prompt bucket).
  stopped [N] bool: the row ended with a stop token (False: hit max_new_tokens).
  prompt_truncated [N] bool: the prompt was cut by ``truncate='left'``.
  versions [N, R] int64 or None: the policy version of each token, when the
    engine sampled from a ``ParamsSource`` (-1 off the mask).
  """
  tokens: np.ndarray
  lengths: np.ndarray
  response_mask: np.ndarray
  logprobs: np.ndarray
  prompt_tokens: np.ndarray
  prompt_mask: np.ndarray
  stopped: np.ndarray
  prompt_truncated: np.ndarray
  versions: Optional[np.ndarray] = None

  @property
  def num_rows(self) -> int:
    return int(self.tokens.shape[0])

  @classmethod
  def empty(cls, max_new_tokens: int) -> "SampleOutput":
    """No rows (a round with nothing to sample on any process)."""
    r = int(max_new_tokens)
    z = lambda *shape, dt=np.int32: np.zeros(shape, dt)
    return cls(tokens=z(0, r), lengths=z(0), response_mask=z(0, r),
               logprobs=z(0, r, dt=np.float32), prompt_tokens=z(0, 0), prompt_mask=z(0, 0),
               stopped=z(0, dt=bool), prompt_truncated=z(0, dt=bool))


# ----------------------------------------------------------------------------- host-side input


def as_rows(prompts, prompt_mask) -> list[np.ndarray]:
  """Prompts as a list of 1-D int64 arrays of real tokens."""
  if isinstance(prompts, (np.ndarray, jax.Array)):
    arr = np.asarray(prompts)
    if arr.ndim != 2:
      raise SamplingError(f"prompts as an array must be [B, T]; got shape {arr.shape}.")
    if prompt_mask is None:
      return [arr[i].astype(np.int64) for i in range(arr.shape[0])]
    m = np.asarray(prompt_mask)
    if m.shape != arr.shape:
      raise SamplingError(f"prompt_mask shape {m.shape} != prompts shape {arr.shape}.")
    return [arr[i][m[i].astype(bool)].astype(np.int64) for i in range(arr.shape[0])]
  if prompt_mask is not None:
    raise SamplingError("prompt_mask is only accepted with prompts given as a [B, T] array.")
  rows = []
  for i, p in enumerate(prompts):
    try:
      rows.append(np.asarray(list(p), np.int64).reshape(-1))
    except (TypeError, ValueError) as e:
      raise SamplingError(f"prompt {i} is not a sequence of token ids: {e}") from None
  return rows


def prepare_prompts(rows, scfg: SamplingConfig, vocab_size: int):
  """Validate / truncate. Returns (rows, truncated flags, prompt bucket P)."""
  if len(rows) == 0:
    raise SamplingError("empty batch: no prompts to sample from.")
  max_bucket = max(int(b) for b in scfg.prompt_buckets)
  out, trunc = [], []
  for i, r in enumerate(rows):
    if r.size == 0:
      raise SamplingError(f"prompt {i} is empty (the model needs at least one token).")
    if r.min() < 0 or r.max() >= vocab_size:
      raise SamplingError(f"prompt {i} has token ids outside [0, {vocab_size}): "
                          f"min {r.min()}, max {r.max()}.")
    if r.size > max_bucket:
      if scfg.truncate == "error":
        raise SamplingError(
            f"prompt {i} has {r.size} tokens, more than the largest prompt bucket "
            f"{max_bucket}; add a bucket, shorten the prompt, or pass truncate='left'.")
      r = r[-max_bucket:]
      trunc.append(True)
    else:
      trunc.append(False)
    out.append(r)
  p = buckets.pick_bucket(max(r.size for r in out), scfg.prompt_buckets, what="prompt")
  return out, np.asarray(trunc, bool), p


def mesh_processes(mesh) -> int:
  """How many processes the mesh's devices belong to (1 without a mesh)."""
  if mesh is None:
    return 1
  return len({d.process_index for d in mesh.devices.flat})


def agree_prompts(rows, scfg: SamplingConfig, vocab_size: int, mesh, allow_empty=False):
  """Validate / truncate this process's prompts and, when ``mesh`` spans several
  processes, agree with the others on the shapes (every process must call
  ``sample`` together; a process may bring no prompts). Returns (rows,
  truncated flags, prompt bucket P, index of this process's first prompt in the
  global order (process 0's prompts, then 1's, ...), the largest per-process
  prompt count, number of processes)."""
  nproc = mesh_processes(mesh)
  if nproc == 1:
    if allow_empty and not len(rows):
      return None
    rows, truncated, plen = prepare_prompts(rows, scfg, vocab_size)
    return rows, truncated, plen, 0, len(rows), 1
  from fbos_jax import distributed
  if nproc != distributed.process_count():
    raise SamplingError(f"the mesh spans {nproc} of the {distributed.process_count()} processes "
                        f"of the {distributed.side().name} side; a multi-process mesh must span "
                        "them all.")
  err, truncated = None, np.zeros((0,), bool)
  try:
    if len(rows):
      rows, truncated, _ = prepare_prompts(rows, scfg, vocab_size)
  except SamplingError as e:
    err = e
  longest = max((r.size for r in rows), default=0) if err is None else 0
  table = distributed.allgather_ints(len(rows), longest, int(err is not None))
  if err is not None:
    raise err
  if table[:, 2].any():
    raise SamplingError(f"process(es) {np.flatnonzero(table[:, 2]).tolist()} rejected their "
                        "prompts (see their logs); no process samples.")
  counts = table[:, 0]
  if counts.sum() == 0 and allow_empty:
    return None
  if counts.sum() == 0:
    raise SamplingError("empty batch: no prompts to sample from on any process.")
  shards = sh.batch_shard_count(mesh)
  if shards % nproc:
    raise SamplingError(f"the mesh's {shards} batch shards (dcn*data*fsdp) do not divide over "
                        f"{nproc} processes; each process samples its own prompts.")
  plen = buckets.pick_bucket(int(table[:, 1].max()), scfg.prompt_buckets, what="prompt")
  offset = int(counts[:distributed.process_index()].sum())
  return rows, truncated, plen, offset, int(counts.max()), nproc


def check_stream_ids(stream_ids, num_prompts: int):
  """``stream_ids`` (None, or one non-negative int per prompt, distinct) or raise."""
  if stream_ids is None:
    return
  ids = np.asarray(stream_ids)
  if ids.shape != (num_prompts,) or (ids < 0).any() or len(set(ids.tolist())) != num_prompts:
    raise SamplingError(f"stream_ids must be {num_prompts} distinct non-negative ints (one per "
                        f"prompt); got {ids.tolist()[:8]}{'...' if ids.size > 8 else ''}")


def make_config(config: Optional[SamplingConfig] = None, **overrides) -> SamplingConfig:
  """``config`` (default SamplingConfig()) with keyword overrides; None values are ignored."""
  base = config or SamplingConfig()
  kw = {k: v for k, v in overrides.items() if v is not None}
  names = {f.name for f in dataclasses.fields(SamplingConfig)}
  unknown = sorted(set(kw) - names)
  if unknown:
    raise TypeError(f"unknown sampling option(s) {unknown}; expected some of {sorted(names)}")
  for k in ("stop_token_ids", "prompt_buckets", "batch_buckets"):
    if k in kw:
      kw[k] = tuple(int(x) for x in kw[k])
  return dataclasses.replace(base, **kw)


# ----------------------------------------------------------------------------- token choice


def _argmax(x):
  """First index of the maximum along the last axis. Same result as jnp.argmax
  (for finite x), but two plain reductions instead of XLA:CPU's slow
  variadic (value, index) reduce: 27 vs 167 us per [16, 2048] step here."""
  m = jnp.max(x, axis=-1, keepdims=True)
  iota = jax.lax.broadcasted_iota(jnp.int32, x.shape, x.ndim - 1)
  return jnp.min(jnp.where(x >= m, iota, x.shape[-1]), axis=-1).astype(jnp.int32)


def _block_size(v: int) -> int:
  b = 64
  while b * b < v:
    b *= 2
  return b


def draw(probs, u):
  """Inverse-CDF draw of one index per row from unnormalised probabilities.

  probs [N, V] >= 0 with a positive sum; u [N] uniform in [0, 1). Two-level
  (blocks of ~sqrt(V)) cumulative sums; only indices with probs > 0 can come
  out. Costs one uniform per row instead of N*V Gumbel variates (57 vs ~900 us
  per [16, 2048] step on CPU), with the same distribution up to float32
  rounding of the cumulative sums.
  """
  n, v = probs.shape
  blk = _block_size(v)
  nb = -(-v // blk)
  if nb * blk != v:
    probs = jnp.pad(probs, ((0, 0), (0, nb * blk - v)))
  pb = probs.reshape(n, nb, blk)
  bsum = jnp.sum(pb, axis=-1)  # [N, nb]
  bcum = jnp.cumsum(bsum, axis=-1)
  total = bcum[:, -1:]
  x = jnp.minimum(u[:, None] * total, jnp.nextafter(total, jnp.zeros_like(total)))  # < total
  bi = jnp.minimum(jnp.sum((bcum <= x).astype(jnp.int32), axis=-1), nb - 1)  # block holding x
  block = jnp.take_along_axis(pb, bi[:, None, None], axis=1)[:, 0]  # [N, blk]
  before = (jnp.take_along_axis(bcum, bi[:, None], axis=-1)
            - jnp.take_along_axis(bsum, bi[:, None], axis=-1))
  wcum = jnp.cumsum(block, axis=-1) + before
  wi = jnp.sum((wcum <= x).astype(jnp.int32), axis=-1)
  # rounding guard: stay on a token of positive probability inside the block
  iota = jax.lax.broadcasted_iota(jnp.int32, block.shape, 1)
  pos = block > 0
  first = jnp.min(jnp.where(pos, iota, blk), axis=-1)
  last = jnp.max(jnp.where(pos, iota, -1), axis=-1)
  return bi * blk + jnp.clip(wi, first, last)


def key_uniform(key, step, stream):
  """The uniform a sampled row draws its token from at ``step`` (its own response
  position) on stream ``stream`` (sample j of global prompt i: ``i * n + j``):
  ``uniform(fold_in(fold_in(key, step), stream))``, float32 scalar. Both samplers
  draw with it (vmapped over rows); tests recompute a row's draw with it."""
  return jax.random.uniform(jax.random.fold_in(jax.random.fold_in(key, step), stream), (),
                            jnp.float32)


def draw_weights(logits, temperature, top_p, *, top_k: int, use_top_p: bool):
  """What a sampled draw walks over: logits [N, V] float32 -> (z [N, V] = logits / T,
  lse [N] = logsumexp(z), w [N, V] = exp(z - max z) with the tokens outside top-k /
  top-p at 0). The token is the first whose cumulative ``w`` exceeds ``u * sum(w)``
  (:func:`draw`); its log-prob is ``z[token] - lse`` (full distribution)."""
  z = logits / temperature
  v = z.shape[-1]
  m = jnp.max(z, axis=-1, keepdims=True)
  e = jnp.exp(z - m)
  lse = m[:, 0] + jnp.log(jnp.sum(e, axis=-1))
  keep = None
  if 0 < top_k < v:
    top_vals = jax.lax.top_k(z, top_k)[0]  # [N, k] descending
    keep = z >= top_vals[:, -1:]
  else:
    top_vals = None
  if use_top_p:
    srt = top_vals if top_vals is not None else -jnp.sort(-z, axis=-1)  # descending
    sp = jax.nn.softmax(srt, axis=-1)
    before = jnp.cumsum(sp, axis=-1) - sp  # mass of strictly more likely tokens
    thresh = jnp.min(jnp.where(before < top_p, srt, jnp.inf), axis=-1, keepdims=True)
    keep = (z >= thresh) if keep is None else keep & (z >= thresh)  # first token always kept
  return z, lse, e if keep is None else jnp.where(keep, e, 0.0)


def choose(logits, key, temperature, top_p, *, greedy: bool, top_k: int, use_top_p: bool,
            u=None):
  """logits [N, V] float32 -> (token [N] int32, logprob [N] float32).

  logprob = log_softmax(logits / T)[token] of the full (untruncated) distribution;
  greedy uses T = 1. ``u`` [N]: the rows' uniforms (default: drawn from ``key``).
  """
  if greedy:
    tok = _argmax(logits)
    lse = jax.nn.logsumexp(logits, axis=-1)
    picked = jnp.take_along_axis(logits, tok[:, None], axis=-1)[:, 0]
    return tok, picked - lse
  z, lse, probs = draw_weights(logits, temperature, top_p, top_k=top_k, use_top_p=use_top_p)
  if u is None:
    u = jax.random.uniform(key, (z.shape[0],), jnp.float32)
  tok = draw(probs, u).astype(jnp.int32)
  picked = jnp.take_along_axis(z, tok[:, None], axis=-1)[:, 0]
  return tok, picked - lse


def add_logit_bias(logits, bias):
  """logits [N, V] float32 + an optional per-row bias [N, V] (both samplers add it
  here, before the token choice; the reported log-probs are then those of the
  biased distribution, which teacher forcing without the bias does not reproduce)."""
  return logits if bias is None else logits + bias


def restrict_vocab(logits, vocab_limit: int):
  """[..., V] logits with the ids >= ``vocab_limit`` at -inf (never drawn, and out
  of the normaliser); unchanged when ``vocab_limit`` is 0 or V."""
  v = logits.shape[-1]
  if not vocab_limit or vocab_limit >= v:
    return logits
  ids = jax.lax.broadcasted_iota(jnp.int32, logits.shape, logits.ndim - 1)
  return jnp.where(ids < vocab_limit, logits, -jnp.inf)


def step_logits_fn(params, cfg: qwen.ModelConfig, vocab_limit: int = 0):
  """hidden [N, D] -> logits [N, V] float32, the distribution both samplers draw
  from: the model's logits (:func:`fbos_jax.model.qwen.logits_fn`, its output
  projection cast once, here, not at every decode step) with the ids >=
  ``vocab_limit`` at -inf (:func:`restrict_vocab`)."""
  logits = qwen.logits_fn(params, cfg)
  return lambda h: restrict_vocab(logits(h), vocab_limit)


def rules_key(rules):
  """Logical sharding rules (None, a dict or (name, axes) pairs) as a hashable
  tuple: part of a compiled program's cache key."""
  if rules is None:
    return None
  items = rules.items() if isinstance(rules, dict) else rules
  return tuple((str(k), tuple(v) if isinstance(v, list) else v) for k, v in items)


def stop_slots(n: int) -> int:
  """The length of the runtime stop-id array for ``n`` stop ids (a multiple of 8,
  so that a few more ids do not recompile; 0 without stop ids)."""
  return 0 if n == 0 else -(-n // 8) * 8


def stop_id_array(stop_token_ids) -> np.ndarray:
  """Runtime stop ids: int32[a multiple of 8], padded with -1 (never a token)."""
  ids = [int(t) for t in stop_token_ids]
  out = np.full((stop_slots(len(ids)),), -1, np.int32)
  out[:len(ids)] = ids
  return out
