"""Jitted sampling engine: prefill + KV-cache decode in one compiled program.

Both sampling rounds of an RL step call :func:`sample`::

    out = sampling.sample(params, model_cfg, prompts, key=key, n_per_prompt=8,
                          max_new_tokens=512, temperature=1.0, stop_token_ids=(eos,),
                          prompt_buckets=(256, 512, 1024, 2048), mesh=mesh, rules=rules)
    out.tokens, out.lengths, out.response_mask, out.logprobs   # [N, R] / [N] numpy

Rows are grouped prompt-major: row ``i * n + j`` is sample ``j`` of prompt ``i``.

How a call runs
---------------
* Host: prompts (lists of ids, or a padded array + mask) are validated, too-long
  prompts are truncated (``truncate='left'``: keep the last tokens) or rejected
  (``'error'``, the default), then left-padded into the smallest prompt bucket
  ``P``; the batch is padded with dummy rows (dropped on output) to the smallest
  batch bucket ``B`` (more prompts than the largest bucket run in chunks).
* Device, one jitted program per (model config, B, P, n, sampling options,
  mesh): prefill of the ``B`` prompts into a preallocated cache, then the cache
  and the last logits are repeated ``n`` times on the batch axis (the prompt is
  prefilled once per group, not n times), then while loops decode one
  token per iteration with no host round trip and stop as soon as every row has
  emitted a stop token. The decode runs in up to ``decode_phases`` consecutive
  loops (:func:`decode_phase_lengths`): each runs over a cache just long enough
  for the slots filled by its end, growing (one pad copy) between phases up to
  ``S = P + max_new_tokens - 1`` slots, so attention reads about the filled part
  of the cache rather than all S slots at every step.
  The KV cache, the per-row outputs and the loop state live in the loop carry and
  are updated in place (``dynamic_update_slice``); the per-call input buffers
  (prompt tokens and mask) are donated. Temperature and top-p are runtime
  scalars and the stop ids a runtime array (changing them does not recompile);
  greedy, top-k, whether top-p is on, ``max_new_tokens`` and the number of stop
  ids (rounded up to a multiple of 8) are compile-time.
* Only token ids, log-probs, masks and lengths come back to the host.

Log-probs (what the trainer must reproduce for pi_old)
------------------------------------------------------
``logprobs[r, t] = log_softmax(logits / T)[token]`` in float32, where ``logits``
are the model's float32 logits for that position and ``T`` the sampling
temperature: the **temperature-scaled, full-vocabulary** distribution. Top-k /
top-p only restrict which tokens can be drawn; they do not renormalise the
reported log-prob. Greedy decoding (``temperature=0`` or ``greedy=True``)
reports temperature-1 log-probs ``log_softmax(logits)[token]``. This is exactly
:func:`teacher_forced_logprobs` (and ``fbos_kernels.token_logprobs_and_entropy``
with ``temperature = T or 1``) on ``prompt + response``; tests hold the two
within 1e-4 in float32. Positions after the stop token carry ``pad_id``,
log-prob 0 and mask 0.

Sharding
--------
With a ``mesh`` the rows are split over the batch axes (``dcn, data, fsdp``),
the KV cache's kv-heads and the params follow the logical ``rules`` (heads /
kv_heads / mlp / vocab over ``tensor``). Without a mesh everything runs on the
default device. Sample ``j`` of prompt ``i`` (``i`` in the global prompt order)
draws its token at step ``t`` from ``fold_in(fold_in(key, t), i * n + j)``, so
sampled tokens depend neither on the sharding nor on padding, batch buckets,
chunking or how the prompts are split over processes.

Multi-process (a mesh over the devices of several hosts): every process calls
:func:`sample` together with **its own** prompts (possibly none); the processes
agree on the prompt bucket and the chunking (:func:`fbos_jax.distributed.allgather_ints`),
each process's bucket is a multiple of its batch shards, the global prompt array
is assembled with ``jax.make_array_from_process_local_data`` (process 0's
prompts first) and each process gets back only its own rows, read from its
addressable shards.

Layer loop
----------
``layer_loop='unroll'`` slices the stacked layer weights once per call (a copy
of the layer weights for the duration of the call) and runs the decode layers
as a Python loop over a layer-split cache; ``'scan'`` runs a ``fori_loop`` over
the stacked weights and cache (constant compile time in depth, but on CPU each
step dynamic-slices, i.e. copies, every layer's weights). ``'auto'`` picks
``unroll`` on CPU and ``scan`` elsewhere.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import warnings
from typing import Any, NamedTuple, Optional, Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np

from fbos_jax import buckets
from fbos_jax import program_cache
from fbos_jax import sharding as sh
from fbos_jax.model import qwen
from fbos_jax.sampling import shared
from fbos_jax.sampling.shared import SampleOutput, SamplingConfig, SamplingError


# ----------------------------------------------------------------------------- the program


def decode_phase_lengths(prompt_len: int, max_new_tokens: int, phases: int,
                         align: int = 16) -> tuple:
  """Cache lengths (slots) of the consecutive decode loops, increasing, the last
  ``S = prompt_len + max_new_tokens - 1``.

  Decode step ``i`` (1 <= i < R) feeds token ``i-1`` into slot ``P + i - 1``; the
  R - 1 steps are split into at most ``phases`` runs of ``c`` steps (``c`` a
  multiple of ``align``), and the loop of phase k runs over a cache of
  ``min(S, P + (k + 1) * c)`` slots: attention then costs about the filled length
  (+ up to ``c`` slots) per step instead of S. ``phases=1``: one loop, ``(S,)``.
  """
  p, r = int(prompt_len), int(max_new_tokens)
  s = p + r - 1
  steps = r - 1
  if phases <= 1 or steps <= align:
    return (s,)
  c = -(-steps // int(phases))
  c = -(-c // align) * align
  return tuple(min(s, p + k * c) for k in range(1, -(-steps // c) + 1))


def grow_cache(cache: qwen.KVCache, length: int) -> qwen.KVCache:
  """Pad every cache array with empty slots up to ``length`` slots (k: last axis,
  v: second-to-last; stacked or layer-split). A no-op at the current length."""
  extra = int(length) - qwen.cache_len(cache)
  if extra < 0:
    raise ValueError(f"cannot shrink a {qwen.cache_len(cache)}-slot cache to {length}")
  if extra == 0:
    return cache

  def pad(x, axis):
    widths = [(0, 0)] * x.ndim
    widths[axis % x.ndim] = (0, extra)
    return jnp.pad(x, widths)

  return qwen.KVCache(jax.tree.map(lambda x: pad(x, -1), cache.k),
                      jax.tree.map(lambda x: pad(x, -2), cache.v))


@dataclasses.dataclass(frozen=True)
class _Static:
  """Everything the compiled program depends on besides the array shapes."""
  max_new_tokens: int
  greedy: bool
  top_k: int
  use_top_p: bool
  num_stop_slots: int  # stop ids are a runtime int32[num_stop_slots] (padded with -1)
  pad_id: int
  unroll: bool
  cache_dtype: Optional[str]
  decode_phases: int
  vocab_limit: int = 0


class _Ops(NamedTuple):
  """The per-call pieces of the compiled sampler (closures over its params,
  key and options): sharding constraints, logits, token choice, stop test."""
  run_params: Any
  con: Any  # (x, logical axes) -> x constrained on the mesh
  con_cache: Any  # KVCache -> KVCache constrained
  logits_of: Any  # hidden [N, D] -> logits [N, V] float32 (ids >= vocab_limit at -inf)
  choose: Any  # (logits [N, V], step) -> (token [N], log-prob [N])
  is_stop: Any  # token [N] -> [N] bool


def _ops(params, key, temperature, top_p, stop_ids, row_ids, logit_bias=None, *,
         cfg: qwen.ModelConfig, st: "_Static", n: int, mesh, rules) -> _Ops:
  rules = sh.DEFAULT_RULES if rules is None else rules

  def con(x, axes):
    return sh.constrain(x, mesh, axes, rules)

  if mesh is not None:
    params = jax.tree.map(con, params, qwen.param_logical_axes(cfg),
                          is_leaf=lambda x: isinstance(x, jax.Array))
  logits_of = shared.step_logits_fn(params, cfg, st.vocab_limit)

  def con_cache(c):
    axes = qwen.cache_logical_axes(split=st.unroll, num_layers=cfg.num_layers)
    return jax.tree.map(con, c, axes, is_leaf=lambda x: isinstance(x, jax.Array))

  sample_ids = None
  if row_ids is not None and not st.greedy:
    ids = row_ids.astype(jnp.uint32)
    sample_ids = con((ids[:, None] * jnp.uint32(n)
                      + jnp.arange(n, dtype=jnp.uint32)[None, :]).reshape(-1), ("batch",))

  bias = None
  if logit_bias is not None:
    bias = con(jnp.repeat(logit_bias.astype(jnp.float32), n, axis=0), ("batch", None))

  def choose(logits, step):
    logits = shared.add_logit_bias(logits, bias)
    k = jax.random.fold_in(key, step)
    u = None
    if sample_ids is not None:
      u = jax.vmap(lambda i: shared.key_uniform(key, step, i))(sample_ids)
    return shared.choose(logits, k, temperature, top_p,
                         greedy=st.greedy, top_k=st.top_k, use_top_p=st.use_top_p, u=u)

  def is_stop(tok):
    if not st.num_stop_slots:
      return jnp.zeros(tok.shape, bool)
    return jnp.any(tok[:, None] == stop_ids[None, :], axis=-1)

  run_params = qwen.split_layers(params) if st.unroll else params
  return _Ops(run_params, con, con_cache, logits_of, choose, is_stop)


def _prefill(ops: _Ops, prompt_tokens, prompt_mask, cache_len: int, *, cfg, st, n: int):
  """Prefill the B prompts once, into a cache of ``cache_len`` slots, and share it
  across the group (repeated n times on the batch axis): (cache, kv_mask [B*n, S],
  first logits [B*n, V], next positions [B*n])."""
  b, p = prompt_tokens.shape
  cache_dt = jnp.dtype(st.cache_dtype) if st.cache_dtype else cfg.dtype
  cache = ops.con_cache(qwen.init_cache(cfg, b, cache_len, cache_dt, split=st.unroll))
  kv_mask = jnp.concatenate([prompt_mask, jnp.zeros((b, cache_len - p), jnp.int32)], axis=1)
  positions = qwen.positions_from_mask(prompt_mask)
  hidden, cache = qwen.forward(ops.run_params, prompt_tokens, prompt_mask, cfg,
                               positions=positions, cache=cache, cache_index=0, kv_mask=kv_mask)
  logits0 = ops.logits_of(hidden[:, -1])
  next_pos = jnp.sum(prompt_mask, axis=-1)
  if n > 1:
    bax = 0 if st.unroll else 1
    cache = jax.tree.map(lambda x: jnp.repeat(x, n, axis=bax), cache)
    logits0, kv_mask, next_pos = (jnp.repeat(x, n, axis=0) for x in (logits0, kv_mask, next_pos))
  row_axes = ("batch", None)
  return ops.con_cache(cache), ops.con(kv_mask, row_axes), ops.con(logits0, row_axes), next_pos


def _decode(ops: _Ops, carry, next_pos, phase_lens: tuple, *, cfg, st, p: int):
  """The decode loops, one ``while_loop`` per phase: phase k's cache holds
  ``phase_lens[k]`` slots, enough for every token fed up to its end, so attention
  never reads the slots of later phases. Between phases the cache (and kv_mask)
  grow by padding: one copy of the filled part. ``carry`` = (step, last token,
  cache, done, kv_mask, tokens, logprobs, lengths); returns the final carry."""
  r = st.max_new_tokens
  rows = carry[1].shape[0]
  pad = jnp.int32(st.pad_id)
  row_axes = ("batch", None)
  con = ops.con

  def body(c):
    i, last, cache, done, kv_mask, tokens, logprobs, lengths = c
    slot = p + i - 1  # slot of token i-1, the one fed now
    kv_mask = jax.lax.dynamic_update_slice(kv_mask, jnp.ones((rows, 1), jnp.int32), (0, slot))
    pos = (next_pos + i - 1)[:, None]
    hidden, cache = qwen.forward(ops.run_params, last[:, None], jnp.ones_like(last[:, None]),
                                 cfg, positions=pos, cache=cache, cache_index=slot,
                                 kv_mask=kv_mask)
    tok, lp = ops.choose(ops.logits_of(hidden[:, 0]), i)
    tok = jnp.where(done, pad, tok)
    lp = jnp.where(done, 0.0, lp)
    tokens = jax.lax.dynamic_update_slice(tokens, tok[:, None], (0, i))
    logprobs = jax.lax.dynamic_update_slice(logprobs, lp[:, None], (0, i))
    lengths = lengths + jnp.logical_not(done).astype(jnp.int32)
    done = done | ops.is_stop(tok)
    return (i + 1, tok, ops.con_cache(cache), con(done, ("batch",)), con(kv_mask, row_axes),
            con(tokens, row_axes), con(logprobs, row_axes), con(lengths, ("batch",)))

  for phase_len in phase_lens:
    i, last, cache, done, kv_mask, tokens, logprobs, lengths = carry
    cache = ops.con_cache(grow_cache(cache, phase_len))
    kv_mask = con(jnp.pad(kv_mask, ((0, 0), (0, phase_len - kv_mask.shape[1]))), row_axes)
    end = min(r, phase_len - p + 1)  # steps i < end feed slots p + i - 1 < phase_len

    def cond(c, end=end):
      return (c[0] < end) & jnp.logical_not(jnp.all(c[3]))

    carry = jax.lax.while_loop(
        cond, body, (i, last, cache, done, kv_mask, tokens, logprobs, lengths))
  return carry


def _generate(params, prompt_tokens, prompt_mask, key, temperature, top_p, stop_ids,
              row_ids=None, logit_bias=None, *, cfg: qwen.ModelConfig, st: _Static, n: int,
              mesh, rules):
  """The compiled core. prompt_tokens/mask [B, P] (left-padded) -> dict of [B*n, ...].

  row_ids [B] int32 (optional): each prompt's index in the global prompt order;
  sample j of prompt i then draws from its own stream ``fold_in(key_t, i*n + j)``,
  so the samples do not depend on padding, bucketing, chunking or on how the
  prompts are split over processes. Without it, row r draws element r of one
  uniform vector (position-dependent). logit_bias [B, V] (optional): added to
  every step's logits of the prompt's samples (:func:`add_logit_bias`)."""
  b, p = prompt_tokens.shape
  r = st.max_new_tokens
  rows = b * n
  ops = _ops(params, key, temperature, top_p, stop_ids, row_ids, logit_bias, cfg=cfg, st=st,
             n=n, mesh=mesh, rules=rules)
  phase_lens = decode_phase_lengths(p, r, st.decode_phases)
  prompt_mask = prompt_mask.astype(jnp.int32)
  cache, kv_mask, logits0, next_pos = _prefill(ops, prompt_tokens, prompt_mask, phase_lens[0],
                                               cfg=cfg, st=st, n=n)
  row_axes = ("batch", None)
  tok0, lp0 = ops.choose(logits0, 0)
  pad = jnp.int32(st.pad_id)
  tokens = jnp.full((rows, r), pad, jnp.int32).at[:, 0].set(tok0)
  logprobs = jnp.zeros((rows, r), jnp.float32).at[:, 0].set(lp0)
  carry = (jnp.int32(1), tok0, cache, ops.is_stop(tok0), kv_mask, ops.con(tokens, row_axes),
           ops.con(logprobs, row_axes), jnp.ones((rows,), jnp.int32))
  _, _, _, done, _, tokens, logprobs, lengths = _decode(ops, carry, next_pos, phase_lens,
                                                        cfg=cfg, st=st, p=p)
  steps = jnp.arange(r, dtype=jnp.int32)[None, :]
  mask = (steps < lengths[:, None]).astype(jnp.int32)
  if n > 1:
    prompt_tokens = jnp.repeat(prompt_tokens, n, axis=0)
    prompt_mask = jnp.repeat(prompt_mask, n, axis=0)
  return dict(tokens=tokens, logprobs=logprobs, response_mask=mask, lengths=lengths,
              stopped=done, prompt_tokens=prompt_tokens, prompt_mask=prompt_mask)


_PROGRAMS = program_cache.ProgramCache()


def _platform(mesh) -> str:
  if mesh is not None:
    return mesh.devices.flat[0].platform
  return jax.default_backend()


def get_generate_fn(cfg: qwen.ModelConfig, scfg: SamplingConfig, *, batch: int, prompt_len: int,
                    n_per_prompt: int = 1, mesh=None, rules=None):
  """The jitted core for one bucket (built once, cached)::

    fn(params, prompt_tokens[B, P], prompt_mask[B, P], key, temperature, top_p,
       stop_ids, row_ids=None, logit_bias=None) -> dict of device arrays with B * n_per_prompt rows

  (prompt_tokens/mask left-padded and donated; ``stop_ids = shared.stop_id_array(...)``)."""
  platform = _platform(mesh)
  unroll = {"unroll": True, "scan": False}.get(scfg.layer_loop, platform == "cpu")
  st = _Static(max_new_tokens=int(scfg.max_new_tokens), greedy=scfg.is_greedy,
               top_k=int(scfg.top_k), use_top_p=float(scfg.top_p) < 1.0,
               num_stop_slots=shared.stop_slots(len(scfg.stop_token_ids)),
               pad_id=int(scfg.pad_id), unroll=unroll, cache_dtype=scfg.cache_dtype,
               decode_phases=int(scfg.decode_phases), vocab_limit=int(scfg.vocab_limit))
  key = (cfg, st, int(batch), int(prompt_len), int(n_per_prompt), mesh, shared.rules_key(rules))
  return _PROGRAMS.get(key, lambda: jax.jit(
      functools.partial(_generate, cfg=cfg, st=st, n=int(n_per_prompt), mesh=mesh, rules=rules),
      donate_argnums=(1, 2)), name="static sampler")


def compiled_programs() -> int:
  """How many generate programs have been compiled in this process (all buckets)."""
  return _PROGRAMS.compiled_programs()


def call_buckets(num_prompts: int, batch_buckets, shards: int = 1) -> list:
  """The batch bucket of each program call that samples ``num_prompts`` prompts:
  chunks of the largest bucket, each padded to the smallest bucket that holds it,
  rounded up to a multiple of ``shards`` (this process's batch shards). The
  shape model (``fbos_jax/rl/shapes.py``) reads the same function."""
  max_b = max(int(b) for b in batch_buckets)
  out = []
  for ci in range(-(-int(num_prompts) // max_b)):
    bb = buckets.pick_bucket(min(max_b, int(num_prompts) - ci * max_b), batch_buckets)
    out.append(buckets.round_up(bb, max(int(shards), 1)))
  return out


def sample(params, cfg: qwen.ModelConfig, prompts: Union[Sequence[Sequence[int]], np.ndarray], *,
           key: jax.Array, n_per_prompt: int = 1, config: Optional[SamplingConfig] = None,
           mesh=None, rules=None, prompt_mask=None, allow_empty: bool = False,
           logit_bias=None, stream_ids=None, **options) -> SampleOutput:
  """Sample ``n_per_prompt`` responses for each prompt.

  prompts: a list of token-id lists, or a padded [B, T] array with ``prompt_mask``
    (1 = real token; any padding side).
  key: a PRNG key; the same key (and inputs) gives the same output.
  config / options: a :class:`SamplingConfig` and/or its fields as keywords
    (``max_new_tokens=``, ``temperature=``, ``top_k=``, ``top_p=``,
    ``stop_token_ids=``, ``prompt_buckets=``, ``batch_buckets=``, ``truncate=``,
    ``pad_id=``, ...); keywords override ``config``, None means "default".
  mesh, rules: shard over this mesh with these logical rules (default rules when
    None); without a mesh, run on the default device.
  allow_empty: when no process has a prompt, return an empty output (0 rows)
    instead of raising (a round that may have nothing to sample, e.g. round 2).
  logit_bias: optional [num_prompts, V] float added to the logits of every step
    of each prompt's samples (:func:`add_logit_bias`; a benchmark's length mix).
  stream_ids: optional [num_prompts] ints, each prompt's index i in the key
    contract (sample j draws from stream ``i * n + j``), unique over all
    processes; default the prompt's position in the global order. A caller that
    samples the same prompt in other calls or orders (FBOS's round 2, by grid
    position) gets the same rows.
  Raises :class:`SamplingError` on bad input before compiling anything.
  """
  scfg = shared.make_config(config, **options).validate(cfg.vocab_size)
  n = int(n_per_prompt)
  if n < 1:
    raise SamplingError(f"n_per_prompt={n_per_prompt} must be >= 1.")
  agreed = shared.agree_prompts(shared.as_rows(prompts, prompt_mask), scfg, cfg.vocab_size, mesh,
                          allow_empty)
  if agreed is None:
    return SampleOutput.empty(scfg.max_new_tokens)
  rows, truncated, plen, offset, max_count, nproc = agreed
  shared.check_stream_ids(stream_ids, len(rows))
  if logit_bias is not None:
    logit_bias = np.asarray(logit_bias, np.float32)
    if logit_bias.shape != (len(rows), cfg.vocab_size):
      raise SamplingError(f"logit_bias has shape {logit_bias.shape}; expected "
                          f"[num_prompts, vocab] = {(len(rows), cfg.vocab_size)}.")
  key = sample_key(key)
  max_b = max(int(x) for x in scfg.batch_buckets)
  # multi-process: each process's bucket is a multiple of its batch shards
  local_shards = sh.batch_shard_count(mesh, rules) // nproc if nproc > 1 else 1
  ids = (offset + np.arange(len(rows)) if stream_ids is None
         else np.asarray(stream_ids, np.int64))  # each prompt's index in the key contract
  outs = []
  # the same chunks and buckets on every process
  for ci, bb in enumerate(call_buckets(max_count, scfg.batch_buckets, local_shards)):
    part = slice(ci * max_b, (ci + 1) * max_b)
    fn = get_generate_fn(cfg, scfg, batch=bb, prompt_len=plen, n_per_prompt=n, mesh=mesh,
                         rules=rules)
    outs.append(_call(fn, params, scfg, rows[part], ids[part], bb, plen, n, key, mesh, rules,
                      None if logit_bias is None else logit_bias[part]))
  cat = {k: np.concatenate([o[k] for o in outs], axis=0) for k in outs[0]}
  return SampleOutput(
      tokens=cat["tokens"].astype(np.int32), lengths=cat["lengths"].astype(np.int32),
      response_mask=cat["response_mask"].astype(np.int32),
      logprobs=cat["logprobs"].astype(np.float32),
      prompt_tokens=cat["prompt_tokens"].astype(np.int32),
      prompt_mask=cat["prompt_mask"].astype(np.int32), stopped=cat["stopped"].astype(bool),
      prompt_truncated=np.repeat(truncated, n))


def _call(fn, params, scfg: SamplingConfig, chunk: list, ids, bb: int, plen: int, n: int, key,
          mesh, rules, logit_bias=None) -> dict:
  """One program call on ``chunk`` (this process's prompts, padded to ``bb``
  with dummy rows); this process's output rows as numpy."""
  args = call_args(params, scfg, chunk, ids, bb, plen, key, mesh, rules, logit_bias)
  start = sh.local_row_start(args[1]) * n  # this process's first output row
  # under the mesh, attention picks its kernel from the mesh's devices (Pallas on TPU)
  mesh_ctx = jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext()
  with warnings.catch_warnings(), mesh_ctx:  # donated prompts alias outputs only when n == 1
    warnings.filterwarnings("ignore", message="Some donated buffers were not usable")
    res = fn(*args)
  keep = len(chunk) * n  # dummy prompts are the last rows
  return {k: sh.host_rows(v, (start, start + keep)) for k, v in res.items()}


def call_args(params, scfg: SamplingConfig, chunk: list, ids, bb: int, plen: int, key, mesh,
              rules, logit_bias=None) -> tuple:
  """The arguments of one generate call (:func:`get_generate_fn`) on ``chunk``
  (this process's prompts, left-padded to ``plen`` and padded to ``bb`` with
  dummy rows; ``ids`` their indices in the key contract), placed on ``mesh`` as
  the call places them (a compile set lowers the programs with them)."""
  temperature = np.float32(scfg.temperature if not scfg.is_greedy else 1.0)
  toks, mask = buckets.left_pad(chunk, plen, scfg.pad_id, rows=bb)
  row_ids = np.full((bb,), -1, np.int32)  # global prompt index (-1: dummy row)
  row_ids[:len(chunk)] = ids
  put = (lambda x: sh.put_process_local(x, mesh, rules)) if mesh is not None else jnp.asarray
  extra = ()
  if logit_bias is not None:
    bias = np.zeros((bb, logit_bias.shape[1]), np.float32)
    bias[:len(chunk)] = logit_bias
    extra = (put(bias),)
  return (params, put(toks), put(mask), key, temperature, np.float32(scfg.top_p),
          shared.stop_id_array(scfg.stop_token_ids), put(row_ids)) + extra


def sample_key(key):
  """The key as a generate program takes it (raw threefry bits)."""
  if (jnp.issubdtype(key.dtype, jax.dtypes.prng_key)
      and str(jax.random.key_impl(key)) == "threefry2x32"):
    return jax.random.key_data(key)  # one program serves typed and raw threefry keys
  return key


# ----------------------------------------------------------------------------- reference


def teacher_forced_logprobs(params, cfg: qwen.ModelConfig, prompt_tokens, prompt_mask, tokens,
                            response_mask, *, temperature: float = 1.0,
                            vocab_limit: int = 0) -> jax.Array:
  """What the sampler reports, recomputed by one full forward pass on prompt + response:
  ``log_softmax(logits / temperature)[token]`` (float32, 0 where the mask is 0).

  Use ``temperature = T`` for sampled rows and 1.0 for greedy rows (``T or 1``).
  Materialises [N, P + R, V] logits: a reference for tests and small batches; the
  trainer's chunked ``fbos_kernels.token_logprobs_and_entropy`` computes the same.
  """
  tokens = jnp.asarray(tokens, jnp.int32)
  rmask = jnp.asarray(response_mask, jnp.int32)
  z = teacher_forced_logits(params, cfg, prompt_tokens, prompt_mask, tokens, rmask,
                            vocab_limit=vocab_limit) / temperature
  lp = jnp.take_along_axis(jax.nn.log_softmax(z, axis=-1), tokens[..., None], axis=-1)[..., 0]
  return jnp.where(rmask > 0, lp, 0.0)


def teacher_forced_logits(params, cfg: qwen.ModelConfig, prompt_tokens, prompt_mask, tokens,
                          response_mask, *, vocab_limit: int = 0) -> jax.Array:
  """The logits each response token was drawn from, recomputed by one forward pass on
  prompt [N, P] + response [N, R]: [N, R, V] float32 (ids >= ``vocab_limit`` at -inf);
  position t sees the prompt and tokens[:t] only."""
  prompt_tokens = jnp.asarray(prompt_tokens, jnp.int32)
  tokens = jnp.asarray(tokens, jnp.int32)
  seq = jnp.concatenate([prompt_tokens, tokens], axis=1)
  smask = jnp.concatenate([jnp.asarray(prompt_mask, jnp.int32),
                           jnp.asarray(response_mask, jnp.int32)], axis=1)
  logits = qwen.apply(params, seq, smask, cfg)
  p, r = prompt_tokens.shape[1], tokens.shape[1]
  return shared.restrict_vocab(logits[:, p - 1:p - 1 + r].astype(jnp.float32), vocab_limit)
