"""The shape model of a step: the one home of "how big can it get".

The rollout pads its batches with these functions (:func:`padded_rows`,
:func:`batch_prompt_buckets`), and the compiled plan (``fbos_jax/planning/programs.py``)
compiles the programs at :func:`step_shapes`, the largest shapes a config can
produce; neither keeps a second model of the other's shapes.

Per batch of the objective (a term's ``batch``): its rows per prompt, prompt
buckets and what its prompts hold, read from its kind's row of the table
(:mod:`fbos_jax.rl.batch_kinds`) under the rollout spec.

Packed update batches (``rl.micro_batch_tokens``, :func:`packed_update_shapes`):
each batch's sequences in rows of its padded row length, micro-batches of the
token budget; at the largest (every sequence at its full length, one per row:
what the plan compiles) or modelled under a response-length distribution (what
the roofline times: :func:`sequence_lengths`).

Sampler calls (:func:`sampler_calls`): round 1 (P prompts x n), round 2 (P*m
FAPs x 1, or GOLF's P aggregated prompts x m), eval (greedy, and pass@k at
temperature 1). The static sampler takes each call in chunks of its batch
buckets (:func:`sampler_shapes`, :func:`fbos_jax.sampling.call_buckets`); the
continuous engine (``sampling.engine=continuous``) takes a whole call through
its ``engine.slots`` slots (:func:`engine_shapes`), and its programs' shapes
come from the engine config, not from the call's size.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from fbos_jax import buckets
from fbos_jax.rl import batch_kinds
from fbos_jax.rl.config import RunParts


@dataclasses.dataclass(frozen=True)
class SamplerShape:
  """One sampler program: ``prompts`` left-padded prompts of ``prompt_len``
  tokens, ``n`` samples each, ``max_new_tokens`` new tokens, under ``sampling``
  (the :class:`fbos_jax.sampling.SamplingConfig` of the call)."""
  prompts: int
  prompt_len: int
  n: int
  sampling: object
  chunks: tuple = ()  # prompts of every chunk of the call, in order (the largest: prompts)

  @property
  def rows(self) -> int:
    return self.prompts * self.n

  @property
  def max_new_tokens(self) -> int:
    return int(self.sampling.max_new_tokens)


@dataclasses.dataclass(frozen=True)
class EngineShape:
  """One sampler call on the continuous engine: all ``prompts`` x ``n`` rows of
  the call go through the engine's ``engine.slots`` slots, under ``sampling``
  (the call's :class:`fbos_jax.sampling.SamplingConfig`) and ``engine`` (the
  run's :class:`fbos_jax.engine.EngineConfig`). The engine's programs (decode
  window, prefill into pages) and its page pool are sized by ``engine``,
  ``prompt_len`` and ``max_new_tokens`` (``fbos_jax/planning/engine.py``), not by
  ``prompts``, which only sets how much work the call is."""
  prompts: int
  n: int
  sampling: object
  engine: object

  @property
  def rows(self) -> int:
    return self.prompts * self.n

  @property
  def slots(self) -> int:
    return int(self.engine.slots)

  @property
  def prompt_len(self) -> int:
    """The longest prompt the pool holds (engine.max_prompt_len, default the
    largest prompt bucket of the call)."""
    return int(self.engine.max_prompt_len or max(int(b) for b in self.sampling.prompt_buckets))

  @property
  def max_new_tokens(self) -> int:
    return int(self.sampling.max_new_tokens)


@dataclasses.dataclass(frozen=True)
class UpdateShape:
  """One update batch: ``rows`` sequences of ``prompt_len + response_len`` tokens."""
  rows: int
  prompt_len: int
  response_len: int

  @property
  def seq_len(self) -> int:
    return self.prompt_len + self.response_len

  @property
  def scored_len(self) -> int:
    """Positions per row whose log-probs the update takes (the response's)."""
    return self.response_len


@dataclasses.dataclass(frozen=True)
class PackedShape:
  """One packed update batch: ``rows`` rows of ``seq_len`` tokens (the padded
  row length) holding ``real_tokens`` tokens of sequences, in ``micro_batches``
  micro-batches of the token budget per mini-batch; every position is scored."""
  rows: int
  seq_len: int
  response_len: int
  micro_batches: int
  real_tokens: int

  @property
  def scored_len(self) -> int:
    return self.seq_len


def batch_rows(parts: RunParts, name: str, prompts: int = 0) -> int:
  """The most rows batch ``name`` can have in a step of ``prompts`` prompts
  (default ``rl.prompts_per_step``)."""
  spec = parts.rollout
  return (prompts or spec.prompts_per_step) * batch_kinds.kind(name).rows_per_prompt(spec)


def batch_prompt_buckets(parts: RunParts, name: str) -> tuple:
  """(prompt buckets, their config field) of batch ``name``."""
  kind = batch_kinds.kind(name)
  return kind.prompt_buckets(parts.sampling), kind.prompt_field


def row_multiple(parts: RunParts, batch_shards: int) -> int:
  """Rows of every batch divide by this: batch shards x micro- x mini-batches."""
  return max(int(batch_shards), 1) * parts.update.row_multiple


def padded_rows(parts: RunParts, name: str, rows: int, batch_shards: int, *,
                prompts: int = 0) -> int:
  """The padded row count of ``rows`` rows of batch ``name`` (a power-of-two
  bucket; with ``rl.fixed_row_buckets`` at least the most the batch can have, so
  the run compiles one update program), a multiple of :func:`row_multiple`."""
  if parts.rollout.fixed_row_buckets:
    rows = max(int(rows), batch_rows(parts, name, prompts))
  return buckets.bucket_rows(rows, row_multiple(parts, batch_shards))


def update_shapes(parts: RunParts, batch_shards: int) -> dict:
  """{batch name: UpdateShape} of the update's terms at the largest row counts
  and prompt buckets a step can produce (what the trainer pads to)."""
  out = {}
  for name in parts.update.batch_names:
    pb, _ = batch_prompt_buckets(parts, name)
    rows = padded_rows(parts, name, batch_rows(parts, name), batch_shards)
    out[name] = UpdateShape(rows, max(pb), parts.sampling.round1.max_new_tokens)
  return out


def micro_batch_budget(parts: RunParts, batch_shards: int) -> int:
  """The packed update's token budget per batch shard: ``rl.micro_batch_tokens``,
  or for a padded run the tokens of its largest micro-batch on one batch shard
  (the packed layout at the padded one's activation memory)."""
  if parts.update.packed:
    return parts.update.micro_batch_tokens
  shards, u = max(int(batch_shards), 1), parts.update
  return max(s.rows // (shards * u.mini_batches * u.micro_batches) * s.seq_len
             for s in update_shapes(parts, batch_shards).values())


def sequence_lengths(parts: RunParts, name: str, rows: int, lengths, seed: int = 0):
  """[rows] modelled lengths (prompt + response, int) of batch ``name``'s
  sequences, the responses drawn from ``lengths`` (a
  :class:`fbos_jax.planning.hardware.ResponseLengths`), the prompts by what they hold (the
  kind's ``context``): q at their largest bucket; a FAP holds q, a failed attempt
  and its feedback, so its largest bucket less the room of a whole response plus
  an attempt drawn from ``lengths``; <EF>c</EF>q its largest bucket less a
  response's room."""
  import numpy as np
  r = parts.sampling.round1.max_new_tokens
  top = max(batch_prompt_buckets(parts, name)[0])
  context = batch_kinds.kind(name).context
  if context == "fap":
    prompt = np.clip(top - r + lengths.sample(rows, r, (seed, 1)), 1, top)
  elif context == "feedback":
    prompt = max(top - r, 1)
  else:
    prompt = top
  return prompt + lengths.sample(rows, r, seed)


def packed_update_shapes(parts: RunParts, batch_shards: int, *, lengths=None,
                         budget: int = 0) -> dict:
  """{batch name: PackedShape} of the update's terms packed at ``budget`` tokens
  per micro-batch and batch shard (default :func:`micro_batch_budget`): with
  ``lengths`` None the largest (every sequence at its row length, one per row),
  else the sequences :func:`sequence_lengths` models under ``lengths``."""
  from fbos_jax.rl import packing
  budget = budget or micro_batch_budget(parts, batch_shards)
  out = {}
  for name, s in update_shapes(parts, batch_shards).items():
    n = batch_rows(parts, name)
    seqs = ([s.seq_len] * n if lengths is None else sequence_lengths(parts, name, n, lengths))
    bins = len(packing.first_fit_decreasing(seqs, s.seq_len))
    m, rows = packing.packed_shape(bins, s.seq_len, budget, batch_shards,
                                   parts.update.mini_batches)
    out[name] = PackedShape(rows, s.seq_len, s.response_len, m, int(sum(seqs)))
  return out


def sampler_calls(parts: RunParts, *, eval_prompts: int = 0, eval_k: int = 1,
                  rounds: bool = True) -> dict:
  """{name: (prompts, samples per prompt, SamplingConfig)} of every sampler call
  one step (``rounds``: its rollout rounds; False for a split's trainer, whose
  rollout samples elsewhere) and the eval (with ``eval_prompts`` > 0) make,
  whole (not chunked)."""
  spec, sp = parts.rollout, parts.sampling
  out = {"sample_round1": (spec.prompts_per_step, spec.group_size, sp.round1)} if rounds else {}
  if spec.round2 and rounds:
    if spec.fap_mode == "aggregated":
      out["sample_round2"] = (spec.prompts_per_step, spec.round2_size, sp.round2)
    else:
      out["sample_round2"] = (spec.prompts_per_step * spec.round2_size, 1, sp.round2)
  if eval_prompts > 0:
    out["eval_greedy"] = (eval_prompts, 1, sp.eval)
    if eval_k > 1:
      out["eval_sampled"] = (eval_prompts, eval_k, sp.eval_sampled)
  return out


def sampler_shapes(parts: RunParts, batch_shards: int, *, eval_prompts: int = 0,
                   eval_k: int = 1) -> dict:
  """{name: SamplerShape} of the largest static-sampler programs one step (and
  the eval, with ``eval_prompts`` > 0) runs: the largest chunk of each call,
  with every chunk's size in ``chunks``."""
  from fbos_jax import sampling as sampling_lib
  out = {}
  for name, (prompts, n, sampling) in sampler_calls(
      parts, eval_prompts=eval_prompts, eval_k=eval_k).items():
    calls = tuple(sampling_lib.call_buckets(prompts, sampling.batch_buckets, batch_shards))
    out[name] = SamplerShape(max(calls), max(sampling.prompt_buckets), n, sampling, calls)
  return out


def engine_config(parts: RunParts):
  """The run's :class:`fbos_jax.engine.EngineConfig` (``config.engine``; its
  defaults when the parts were built without that section)."""
  from fbos_jax.engine import EngineConfig
  return parts.sampling.engine_config or EngineConfig()


def engine_shapes(parts: RunParts, *, eval_prompts: int = 0, eval_k: int = 1) -> dict:
  """{name: EngineShape} of the same calls as :func:`sampler_shapes` on the
  continuous engine (whole calls: the engine has no batch buckets)."""
  ecfg = engine_config(parts)
  return {name: EngineShape(prompts, n, sampling, ecfg)
          for name, (prompts, n, sampling) in sampler_calls(
              parts, eval_prompts=eval_prompts, eval_k=eval_k).items()}


# ----------------------------------------------------------------------------- the compile set
#
# Every program a run can call, not only the largest: what the run compiles before
# its first step (fbos_jax/compile_set.py) and what the plan counts. Per process,
# as the samplers and the trainer bucket their calls.


def _per_process(n: int, processes: int) -> int:
  return -(-int(n) // max(int(processes), 1))


def sampler_programs(parts: RunParts, batch_shards: int, processes: int = 1, *,
                     eval_prompts: int = 0, eval_k: int = 1, rounds: bool = True) -> dict:
  """{call name: (SamplingConfig, n, [(batch bucket, prompt bucket), ...])}: every
  static-sampler program the calls of :func:`sampler_calls` can take. A call of k
  prompts is cut into :func:`fbos_jax.sampling.call_buckets` chunks; k is fixed
  for round 1 and the eval, and anything from 1 to its most for round 2 (the
  prompts with a FAP); any of the call's prompt buckets."""
  from fbos_jax import sampling as sampling_lib
  local = max(int(batch_shards) // processes, 1) if processes > 1 else 1
  out = {}
  for name, (prompts, n, sampling) in sampler_calls(
      parts, eval_prompts=eval_prompts, eval_k=eval_k, rounds=rounds).items():
    most = _per_process(prompts, processes)
    counts = range(1, most + 1) if name == "sample_round2" else (most,)
    bbs = sorted({b for k in counts
                  for b in sampling_lib.call_buckets(k, sampling.batch_buckets, local)})
    out[name] = (sampling, n, [(b, int(p)) for b in bbs
                               for p in sorted(set(sampling.prompt_buckets))])
  return out


def engine_runs(parts: RunParts, *, eval_prompts: int = 0, eval_k: int = 1,
                rounds: bool = True, streamed: Optional[bool] = None) -> list:
  """[(call names, SamplingConfig, most samples per request)]: one entry per
  engine the calls of :func:`sampler_calls` run on (calls with the same sampler
  settings share one engine and its programs). ``streamed`` (default
  ``rl.stream_rounds``; the asynchronous rollout's stream of steps): round 1 and
  round 2 in one engine, under round 2's settings
  (:class:`fbos_jax.rl.stream.StepStream`)."""
  calls = sampler_calls(parts, eval_prompts=eval_prompts, eval_k=eval_k, rounds=rounds)
  streamed = parts.rollout.stream_rounds if streamed is None else streamed
  if streamed and "sample_round1" in calls:
    p1, n1, _ = calls.pop("sample_round1")
    p2, n2, _ = calls.pop("sample_round2", (p1, n1, None))
    calls = {"rounds (streamed)": (max(p1, p2), max(n1, n2), parts.sampling.round2), **calls}
  runs: dict = {}
  for name, (_, n, sampling) in calls.items():
    names, most = runs.get(sampling, ((), 0))
    runs[sampling] = (names + (name,), max(most, int(n)))
  return [(names, sampling, most) for sampling, (names, most) in runs.items()]


def update_programs(parts: RunParts, batch_shards: int, processes: int = 1) -> list:
  """Every {batch name: UpdateShape} (packed, ``rl.micro_batch_tokens``: every
  {batch name: PackedShape}) the trainer's update can be called with, this
  process's rows: each batch at any of its prompt buckets and row buckets (one
  row bucket with ``rl.fixed_row_buckets``; packed, every (micro-batches, rows)
  bucket of :func:`fbos_jax.rl.packing.packed_shape` that 0 to all of its
  sequences, one per row at the worst, can take, or with ``rl.fixed_row_buckets``
  the one of all of them), all combinations (one program per combination)."""
  import itertools
  local = max(int(batch_shards) // processes, 1)
  prompts = _per_process(parts.rollout.prompts_per_step, processes)
  r = parts.sampling.round1.max_new_tokens
  per_batch = []
  for name in parts.update.batch_names:
    pb, _ = batch_prompt_buckets(parts, name)
    most = batch_rows(parts, name, prompts)
    if parts.update.packed:
      if parts.update.fixed_micro_batches:  # what the padded rows can fill, every step
        most = padded_rows(parts, name, most, local, prompts=prompts)
        shapes = [(p, packing_shape(parts, int(p) + r, most, local)) for p in sorted(set(pb))]
      else:
        shapes = [(p, mn) for p in sorted(set(pb))
                  for mn in packed_buckets(parts, int(p) + r, most, local)]
      per_batch.append([PackedShape(n, int(p) + r, r, m, 0) for p, (m, n) in shapes])
      continue
    rows = sorted({padded_rows(parts, name, k, local, prompts=prompts)
                   for k in range(0, most + 1)})
    per_batch.append([UpdateShape(n, int(p), r) for n in rows for p in sorted(set(pb))])
  return [dict(zip(parts.update.batch_names, combo)) for combo in itertools.product(*per_batch)]


def packing_shape(parts: RunParts, row_len: int, packed_rows: int, shards: int) -> tuple:
  """(micro-batches, rows) of a packed batch of ``packed_rows`` rows of ``row_len``
  tokens over ``shards`` batch shards (:func:`fbos_jax.rl.packing.packed_shape`
  at ``rl.micro_batch_tokens``)."""
  from fbos_jax.rl import packing
  u = parts.update
  return packing.packed_shape(packed_rows, row_len, u.micro_batch_tokens, shards, u.mini_batches)


def packed_buckets(parts: RunParts, row_len: int, most: int, shards: int) -> list:
  """Sorted (micro-batches, rows) of a packed batch of rows of ``row_len`` tokens
  holding 0 to ``most`` packed rows over ``shards`` batch shards
  (:func:`fbos_jax.rl.packing.packed_shape` at ``rl.micro_batch_tokens``)."""
  return sorted({packing_shape(parts, row_len, k, shards) for k in range(0, int(most) + 1)})
