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
"""

from __future__ import annotations

import concurrent.futures

import jax
import numpy as np

from fbos_jax import distributed
from fbos_jax.rl import rounds as R
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


class _Feed:
  """The engine's feed: round-1 requests at once; a prompt's round-2 requests
  once its round-1 verdicts are in; finished when every prompt's round 2 is
  decided and requested."""

  def __init__(self, requests: list, num_prompts: int):
    self.pending, self.open = list(requests), num_prompts
    self.on_poll = None

  def poll(self) -> list:
    if self.on_poll is not None:
      self.on_poll()
    out, self.pending = self.pending, []
    return out

  def finished(self) -> bool:
    return self.open == 0 and not self.pending


def streamed_rounds(ctx: RolloutContext, params, examples: list, k1, k2):
  """Round 1, its verdicts and round 2 in one engine run, round 2 streamed in.
  Returns (r1, r2, round-1 pool stats, round-2 pool stats), as the barrier's
  ``round1`` / ``verify`` / ``round2`` / ``verify`` would."""
  from fbos_jax import engine as engine_lib
  spec, sp = ctx.spec, ctx.parts.sampling
  p_count, n, r = len(examples), spec.group_size, sp.round1.max_new_tokens
  base = distributed.process_index() * p_count
  raw1, raw2 = (np.asarray(jax.random.key_data(k), np.uint32) for k in (k1, k2))
  rounds = {1: _Round(p_count, n, r, R.host_seed(k1)),
            2: _Round(p_count, spec.round2_size, r, R.host_seed(k2))}
  q = [ctx.prompt_ids(ex) for ex in examples]
  rounds[1].ro.valid[:] = True
  for p in range(p_count):
    rounds[1].ro.contexts[p] = [q[p]] * n
  stats = {1: [], 2: []}
  jobs: list = []  # (round, prompt, future of ctx.verify)
  pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="verify")
  feed = _Feed([engine_lib.Request(prompt=q[p], n=n, key=raw1, sid_base=(base + p) * n,
                                   tag=(1, p, 0)) for p in range(p_count)], p_count)

  windows = {1: [], 2: []}  # (first, last) decode window of each row

  def on_row(row):
    rnd, p, j0 = row.tag
    grid = rounds[rnd]
    windows[rnd].append((row.first_window, row.last_window))
    grid.add(p, j0 + row.j, row, ctx.decode(row.tokens[None], [row.tokens.size])[0])
    if grid.complete(p):
      texts = [grid.ro.texts[p][j] for j in np.flatnonzero(grid.ro.valid[p])]
      jobs.append((rnd, p, pool.submit(ctx.verify, [examples[p]] * len(texts), texts)))

  def take_verdicts():
    for job in [jb for jb in jobs if jb[2].done()]:
      jobs.remove(job)
      rnd, p, fut = job
      rewards, feedback, errors, st = fut.result()
      stats[rnd].append(st)
      rounds[rnd].verdicts(p, rewards, feedback, errors)
      if rnd == 1:  # its round 2 joins the queue now
        feed.pending += _round2_requests(ctx, examples[p], rounds[1].ro, p, rounds[2].ro,
                                         raw2, base)
        feed.open -= 1

  feed.on_poll = take_verdicts
  try:
    engine_lib.run(params, ctx.model_cfg, feed, on_row, config=sp.round2,
                   engine_config=sp.engine_config, mesh=ctx.mesh, rules=ctx.rules,
                   stats=ctx.engine_stats)
    while jobs:  # the barrier before the update: the last verdicts
      concurrent.futures.wait([jb[2] for jb in jobs])
      take_verdicts()
  finally:
    pool.shutdown(wait=True)
  r1_end = max((w[1] for w in windows[1]), default=-1)
  overlap = sum(w[0] <= r1_end for w in windows[2])  # round-2 rows beside round 1's tail
  stats[2].append({"rollout/round2_rows_beside_round1": float(overlap)})
  return rounds[1].ro, rounds[2].ro, _merge(stats[1]), _merge(stats[2])


def _round2_requests(ctx, example, r1: R.Rollouts, p: int, r2: R.Rollouts, raw2,
                     base: int) -> list:
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
                                  sid_base=c.stream_id(base, m) * c.n, tag=(2, p, c.j0)))
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
