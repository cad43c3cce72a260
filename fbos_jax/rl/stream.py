"""Streamed rounds: round 2 decodes beside the tail of round 1 (``rl.stream_rounds``).

With the barrier (:func:`fbos_jax.rl.rounds.round1`, ``verify``, ``round2``)
round 2 starts only once every round-1 row of the step has stopped and been
verified. Here both rounds run in one continuous-engine run
(``fbos_jax.engine.run``):

* each round-1 row goes to the verifier pool as soon as its prompt's n rows
  have stopped (the verdicts of a group decide its round 2: which rollouts get a
  FAP, GOLF's one prompt over its failed attempts), in a background thread;
* between decode windows the engine polls the feed: a prompt whose verdicts are
  in gets its round-2 contexts (:func:`~fbos_jax.rl.rounds.round2_calls`), which
  join the queue at once and decode beside the rest of round 1;
* each prompt's m round-2 rows are verified as soon as they have all stopped.

The only barrier is before the update. Every row keeps its key contract (round
1: stream (p, j) of the round-1 key; round 2: stream (p, j) of the round-2 key,
its [P, m] grid position), so with the same key the step's rollouts, and so its
batches, equal the barrier's.

:class:`StepStream` runs several steps through one engine run: the rollout of the
asynchronous loop (``fbos_jax/rl/sources.py:stream_steps``) admits step k + 1's
prompts into the slots step k frees, as the staleness rule allows, so
generation never drains between steps; each step leaves when all its rows are
verified.
"""

from __future__ import annotations

import concurrent.futures
import time

import jax
import numpy as np

from fbos_jax import distributed
from fbos_jax.rl import rounds as R
from fbos_jax.rl import state as state_lib
from fbos_jax.rl.context import RolloutContext


class _Round:
  """One round's rows as they stop, held in a [P, width] grid that a
  :class:`~fbos_jax.rl.rounds.Rollouts` views (no copy)."""

  def __init__(self, p: int, width: int, r: int, seed):
    self.width = width
    self.done = np.zeros((p,), np.int32)  # rows of each prompt that stopped
    self.ro = R.Rollouts(
        contexts=[[[] for _ in range(width)] for _ in range(p)],
        tokens=np.zeros((p, width, r), np.int32), mask=np.zeros((p, width, r), np.int32),
        logp=np.zeros((p, width, r), np.float32), versions=np.full((p, width, r), -1, np.int64),
        lengths=np.zeros((p, width), np.int32),
        valid=np.zeros((p, width), bool), source=np.full((p, width), -1, np.int64),
        texts=[[""] * width for _ in range(p)], seed=seed,
        rewards=np.zeros((p, width), np.float32), is_error=np.zeros((p, width), bool),
        feedback=[[""] * width for _ in range(p)], truncated=np.zeros((p, width), bool))

  def add(self, p: int, j: int, row, text: str):
    ro, m = self.ro, row.tokens.size
    ro.tokens[p, j, :m], ro.logp[p, j, :m], ro.lengths[p, j] = row.tokens, row.logprobs, m
    if row.versions is not None:
      ro.versions[p, j, :m] = row.versions
    ro.mask[p, j, :m] = 1
    ro.texts[p][j] = text
    self.done[p] += 1

  def complete(self, p: int) -> bool:
    return self.done[p] == int(self.ro.valid[p].sum())

  def verdicts(self, p: int, rewards, feedback, errors):
    """Prompt p's verdicts (its valid rows, in order), as ``verify`` fills them."""
    ro = self.ro
    for k, j in enumerate(np.flatnonzero(ro.valid[p])):
      ro.rewards[p, j] = 0.0 if errors[k] else rewards[k]
      ro.is_error[p, j] = errors[k]
      ro.feedback[p][j] = "" if errors[k] else feedback[k]


class _Step:
  """One step batch in flight: its prompts' rounds as their rows stop, and which
  prompts' verdicts are in."""

  def __init__(self, ctx: RolloutContext, k: int, examples: list, key, data_state=None):
    from fbos_jax import engine as engine_lib
    spec, sp = ctx.spec, ctx.parts.sampling
    self.k, self.examples, self.data_state, self.t0 = k, examples, data_state, time.perf_counter()
    k1, k2 = jax.random.split(key)
    p_count, n, r = len(examples), spec.group_size, sp.round1.max_new_tokens
    self.base = distributed.process_index() * p_count
    self.raw2 = np.asarray(jax.random.key_data(k2), np.uint32)
    raw1 = np.asarray(jax.random.key_data(k1), np.uint32)
    self.rounds = {1: _Round(p_count, n, r, R.host_seed(k1)),
                   2: _Round(p_count, spec.round2_size, r, R.host_seed(k2))}
    q = [ctx.prompt_ids(ex) for ex in examples]
    self.rounds[1].ro.valid[:] = True
    for p in range(p_count):
      self.rounds[1].ro.contexts[p] = [q[p]] * n
    self.stats: dict = {1: [], 2: []}
    self.windows: dict = {1: [], 2: []}  # (first, last) decode window of each row
    self.verified: dict = {1: set(), 2: set()}
    self.round2 = bool(spec.round2)
    self.requests = [engine_lib.Request(prompt=q[p], n=n, key=raw1, sid_base=(self.base + p) * n,
                                        tag=(k, 1, p, 0)) for p in range(p_count)]

  def done(self) -> bool:
    p = len(self.examples)
    return len(self.verified[1]) == p and (not self.round2 or len(self.verified[2]) == p)

  def result(self) -> tuple:
    """(r1, r2 or None, round-1 pool stats, round-2 pool stats or None), as the
    barrier's ``round1`` / ``verify`` / ``round2`` / ``verify`` would give."""
    if not self.round2:
      return self.rounds[1].ro, None, _merge(self.stats[1]), None
    r1_end = max((w[1] for w in self.windows[1]), default=-1)
    overlap = sum(w[0] <= r1_end for w in self.windows[2])  # round-2 rows beside round 1
    self.stats[2].append({"rollout/round2_rows_beside_round1": float(overlap)})
    return self.rounds[1].ro, self.rounds[2].ro, _merge(self.stats[1]), _merge(self.stats[2])


class StepStream:
  """The engine's feed over step batches ``start .. stop - 1`` (AReaL's streaming
  rollout): step k's round-1 requests join the queue once ``admit(k, in_flight)``
  allows (``begin(k)`` -> its :class:`_Step`), so the prompts of the next steps
  fill the slots the last ones free; each prompt's rows go to the verifier pool
  as soon as its group has stopped, its round 2 joins the queue once its round-1
  verdicts are in; ``on_step(step)`` gets each step, in order, when all its rows
  are verified. ``stopping()`` true: the run stops at the next poll."""

  def __init__(self, ctx: RolloutContext, start: int, stop: int, *, begin, admit=None,
               on_step=None, stopping=None):
    self.ctx, self.next_k, self.stop = ctx, int(start), int(stop)
    self.begin, self.admit, self.on_step = begin, admit, on_step
    self.stopping = stopping
    self.steps: dict = {}  # k -> _Step, in flight
    self.pending: list = []
    self.jobs: list = []  # (step, round, prompt, future of ctx.verify)
    self.pool = concurrent.futures.ThreadPoolExecutor(max_workers=1,
                                                      thread_name_prefix="verify")

  def poll(self) -> list:
    if self.stopping is not None and self.stopping():
      raise StreamStopped()
    self._take_verdicts()
    while self.next_k < self.stop and (self.admit is None or
                                       self.admit(self.next_k, len(self.steps))):
      step = self.begin(self.next_k)
      step.beside = len(self.steps)  # steps still decoding when this one joins
      self.steps[self.next_k] = step
      self.pending += step.requests
      self.next_k += 1
    while self.steps and self.steps[min(self.steps)].done():
      step = self.steps.pop(min(self.steps))
      if self.on_step is not None:
        self.on_step(step)
    out, self.pending = self.pending, []
    return out

  def finished(self) -> bool:
    return self.next_k >= self.stop and not self.steps and not self.pending

  def on_row(self, row):
    k, rnd, p, j0 = row.tag
    step = self.steps[k]
    grid = step.rounds[rnd]
    step.windows[rnd].append((row.first_window, row.last_window))
    grid.add(p, j0 + row.j, row, self.ctx.decode(row.tokens[None], [row.tokens.size])[0])
    if grid.complete(p):
      texts = [grid.ro.texts[p][j] for j in np.flatnonzero(grid.ro.valid[p])]
      self.jobs.append((step, rnd, p, self.pool.submit(
          self.ctx.verify, [step.examples[p]] * len(texts), texts)))

  def _take_verdicts(self):
    for job in [jb for jb in self.jobs if jb[3].done()]:
      self.jobs.remove(job)
      step, rnd, p, fut = job
      rewards, feedback, errors, st = fut.result()
      step.stats[rnd].append(st)
      step.rounds[rnd].verdicts(p, rewards, feedback, errors)
      step.verified[rnd].add(p)
      if rnd == 1 and step.round2:  # its round 2 joins the queue now
        reqs = _round2_requests(self.ctx, step.examples[p], step.rounds[1].ro, p,
                                step.rounds[2].ro, step.raw2, step.base, step.k)
        self.pending += reqs
        if not reqs:  # no round 2 for this prompt
          step.verified[2].add(p)

  def run(self, params):
    """Decode until every step is done (``params``: a param pytree or a
    ParamsSource); the verifier pool is shut down at the end."""
    from fbos_jax import engine as engine_lib
    if not engine_lib.is_params_source(params):
      state_lib.check_compute_params(params, self.ctx.model_cfg, "the streamed rounds' engine")
    sp = self.ctx.parts.sampling
    try:
      engine_lib.run(params, self.ctx.model_cfg, self, self.on_row, config=sp.round2,
                     engine_config=sp.engine_config, mesh=self.ctx.mesh, rules=self.ctx.rules,
                     stats=self.ctx.engine_stats)
    finally:
      self.pool.shutdown(wait=True)


class StreamStopped(Exception):
  """The stream's owner stopped it (``StepStream.stopping``)."""


def streamed_rounds(ctx: RolloutContext, params, examples: list, key):
  """Round 1, its verdicts and round 2 of one step in one engine run, round 2
  streamed in. Returns (r1, r2, round-1 pool stats, round-2 pool stats), as the
  barrier's ``round1`` / ``verify`` / ``round2`` / ``verify`` would."""
  out = []
  StepStream(ctx, 0, 1, begin=lambda k: _Step(ctx, k, examples, key),
             on_step=lambda step: out.append(step.result())).run(params)
  return out[0]


def _round2_requests(ctx, example, r1: R.Rollouts, p: int, r2: R.Rollouts, raw2,
                     base: int, k: int) -> list:
  """Prompt p's round-2 engine requests; their rows' places in the round-2 grid."""
  from fbos_jax import engine as engine_lib
  m = ctx.spec.round2_size
  out = []
  for c in R.round2_calls(ctx, example, r1, p):
    for j in range(c.j0, c.j0 + c.n):
      r2.valid[p, j] = True
      r2.source[p, j] = c.sources[j - c.j0]
      r2.contexts[p][j] = c.prompt.token_ids
      r2.truncated[p, j] = c.prompt.truncated
    out.append(engine_lib.Request(prompt=c.prompt.token_ids, n=c.n, key=raw2,
                                  sid_base=c.stream_id(base, m) * c.n, tag=(k, 2, p, c.j0)))
  return out


def _merge(stats: list) -> dict:
  """The pool stats of several calls as one: counts summed, the error rate recomputed."""
  from fbos_jax.verifiers.base import ERROR_KINDS
  out: dict = {}
  for st in stats:
    for k, v in st.items():
      if k.split("/")[-1] in ("calls", "errors") + ERROR_KINDS or k.startswith("rollout/"):
        out[k] = out.get(k, 0.0) + float(v)
  calls = out.get("verifier/calls", 0.0)
  out["verifier/error_rate"] = out.get("verifier/errors", 0.0) / calls if calls else 0.0
  return out
