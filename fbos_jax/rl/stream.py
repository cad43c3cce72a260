"""A step's rounds on the continuous engine, rollout by rollout: per-rollout
verification and round 2 streamed beside round 1 (``rl.stream_rounds``).

Both schedules verify each rollout the moment it stops: the engine hands every
row that stops to :meth:`_Step.on_row`, which submits it alone to the verifier
pool (``VerifierPool.submit``: at most ``verifier.workers`` calls in flight, each
in its own thread, round-1 verdicts ahead of round-2 ones; a hung call holding
only its own row, until ``verifier.timeout_s``).

* :func:`barrier_rounds` (``rl.stream_rounds=False``): round 1 in one engine run
  (round 1's sampler settings), then every round-1 verdict, then round 2 in a
  second run (round 2's), then its verdicts: round 2 starts once every round-1
  row of the step has stopped and been verified.
* :func:`streamed_rounds` (``True``): both rounds in one engine run (round 2's
  settings). Between decode windows the engine polls the feed; the verdicts that
  came in start round-2 rows at once, which decode beside the rest of round 1.

Round 2 starts rollout by rollout and keeps FBOS's semantics
(``fbos_jax/rl/assemble.py:round2_plan``: prompt p's m rows round-robin over its
k selected rollouts, so each gets at least floor(m / n), ``rounds.round2_quota``):

* a selected rollout's guaranteed quota floor(m / n) starts the moment its own
  verdict lands;
* the rest of the m rows are allocated when the group's n verdicts are in (the
  round-robin needs k);
* GOLF's aggregated prompt needs every failure: it waits for the group.

Every row keeps its key contract (round 1: stream p * n + j of the round-1 key;
round 2: ``rounds.round2_stream`` (prompt, source, replica) of the round-2 key,
never its place in the grid), so with the same key the step's rollouts, and so
its batches, are the same in both schedules and equal ``rounds.round2``'s.

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
from fbos_jax.rl import assemble
from fbos_jax.rl import rounds as R
from fbos_jax.rl import state as state_lib
from fbos_jax.rl.context import RolloutContext


def _grid(p: int, width: int, r: int, seed) -> R.Rollouts:
  """An empty [p, width] round of ``r`` tokens per row (filled as rows stop)."""
  return R.Rollouts(
      contexts=[[[] for _ in range(width)] for _ in range(p)],
      tokens=np.zeros((p, width, r), np.int32), mask=np.zeros((p, width, r), np.int32),
      logp=np.zeros((p, width, r), np.float32), versions=np.full((p, width, r), -1, np.int64),
      lengths=np.zeros((p, width), np.int32),
      valid=np.zeros((p, width), bool), source=np.full((p, width), -1, np.int64),
      texts=[[""] * width for _ in range(p)], seed=seed,
      rewards=np.zeros((p, width), np.float32), is_error=np.zeros((p, width), bool),
      feedback=[[""] * width for _ in range(p)], truncated=np.zeros((p, width), bool))


def _put_row(ro: R.Rollouts, p: int, j: int, row, text: str):
  m = row.tokens.size
  ro.tokens[p, j, :m], ro.logp[p, j, :m], ro.lengths[p, j] = row.tokens, row.logprobs, m
  if row.versions is not None:
    ro.versions[p, j, :m] = row.versions
  ro.mask[p, j, :m] = 1
  ro.texts[p][j] = text


def _put_verdict(ro: R.Rollouts, p: int, j: int, verdict: tuple):
  reward, feedback, error = verdict
  ro.rewards[p, j] = 0.0 if error else reward
  ro.is_error[p, j] = error
  ro.feedback[p][j] = "" if error else feedback


class _Verifier:
  """Rows to the verifier pool one at a time, as they stop
  (``VerifierPool.submit``: at most ``verifier.workers`` calls at once, each in
  its own thread and no second thread waiting on it; a hung call holds only its
  own row, until ``verifier.timeout_s``). Round-1 verdicts, which start round-2
  rows, go ahead of round-2 verdicts waiting for a free worker. ``ready()``:
  the jobs whose verdict is in, each a future of ``ctx.verify``'s result."""

  def __init__(self, ctx: RolloutContext):
    self.ctx = ctx
    self.jobs: list = []  # (step, key, future of ctx.verify's result for one row)
    self.calls: list = []  # the pool's futures (cancelled by close if not started)

  def submit(self, step, key, example, text: str):
    call = self.ctx.pool.submit(example, text, priority=key[0])
    out: concurrent.futures.Future = concurrent.futures.Future()
    call.add_done_callback(lambda f: _as_verify(f, out))
    self.calls.append(call)
    self.jobs.append((step, key, out))

  def ready(self, wait: bool = False) -> list:
    """The jobs whose verdict is in (``wait``: at least one, if any is pending)."""
    if wait and self.jobs:
      concurrent.futures.wait([j[2] for j in self.jobs],
                              return_when=concurrent.futures.FIRST_COMPLETED)
    out = [jb for jb in self.jobs if jb[2].done()]
    self.jobs = [jb for jb in self.jobs if not jb[2].done()]
    return out

  def close(self):
    """Calls still waiting for a worker are dropped (a run that raised)."""
    for call in self.calls:
      call.cancel()


def _as_verify(call: concurrent.futures.Future, out: concurrent.futures.Future):
  """A pool call's ([verdict], stats) into ``out`` as ``ctx.verify``'s result
  (rewards [1], feedback [1], is_error [1], stats)."""
  if call.cancelled():
    out.cancel()
    return
  try:
    (v,), st = call.result()
  except BaseException as e:  # pylint: disable=broad-except
    out.set_exception(e)
    return
  out.set_result((np.asarray([v.reward], np.float32), [v.feedback],
                  np.asarray([v.is_error], bool), st))


class _Step:
  """One step batch in flight: its round-1 rows as they stop and their verdicts,
  its round-2 rows (keyed by prompt, source rollout and replica until the
  group's plan gives them their places in the [P, m] grid)."""

  def __init__(self, ctx: RolloutContext, k: int, examples: list, key, data_state=None):
    from fbos_jax import engine as engine_lib
    spec, sp = ctx.spec, ctx.parts.sampling
    self.ctx, self.k, self.examples, self.data_state = ctx, k, examples, data_state
    self.t0 = time.perf_counter()
    k1, k2 = jax.random.split(key)
    p_count, n, m = len(examples), spec.group_size, spec.round2_size
    self.n, self.m = n, m
    self.base = distributed.process_index() * p_count
    self.raw2 = np.asarray(jax.random.key_data(k2), np.uint32)
    raw1 = np.asarray(jax.random.key_data(k1), np.uint32)
    self.r1 = _grid(p_count, n, sp.round1.max_new_tokens, R.host_seed(k1))
    self.r2 = _grid(p_count, m, sp.round2.max_new_tokens, R.host_seed(k2))
    self.seed2 = R.host_seed(k2)
    q = [ctx.prompt_ids(ex) for ex in examples]
    self.r1.valid[:] = True
    for p in range(p_count):
      self.r1.contexts[p] = [q[p]] * n
    self.judged = np.zeros((p_count, n), bool)  # round-1 verdicts in
    self.round2 = bool(spec.round2)
    self.mode = spec.fap_mode
    self.faps: dict = {}  # (p, source) -> templates.Prompt (source -1: aggregated)
    self.issued: dict = {}  # (p, source) -> round-2 rows requested so far
    self.rows2: dict = {}  # (p, source, replica) -> (FinishedRow, text)
    self.verdicts2: dict = {}  # (p, source, replica) -> (reward, feedback, error)
    self.plans: dict = {}  # p -> [(source, replica)] of its m grid places (none: [])
    self.early = 0  # round-2 rows requested before their group's verdicts were all in
    self.streamed = True  # round 2 joins round 1's engine run (barrier_rounds: False)
    self.stats: dict = {1: [], 2: []}
    self.windows: dict = {1: [], 2: []}  # (first, last) decode window of each row
    self.requests = [engine_lib.Request(prompt=q[p], n=n, key=raw1, sid_base=(self.base + p) * n,
                                        tag=(k, 1, p, 0, 0),
                                        max_new_tokens=sp.round1.max_new_tokens)
                     for p in range(p_count)]

  # ------------------------------------------------------------------ rows and verdicts

  def on_row(self, row, verifier: _Verifier):
    """A row stopped: into its round, and to the verifier pool at once."""
    _, rnd, p, source, r0 = row.tag
    self.windows[rnd].append((row.first_window, row.last_window))
    text = self.ctx.decode(row.tokens[None], [row.tokens.size])[0]
    if rnd == 1:
      _put_row(self.r1, p, row.j, row, text)
      verifier.submit(self, (1, p, row.j), self.examples[p], text)
    else:
      self.rows2[(p, source, r0 + row.j)] = (row, text)
      verifier.submit(self, (2, p, source, r0 + row.j), self.examples[p], text)

  def on_verdict(self, key: tuple, result: tuple) -> list:
    """A row's verdict (``ctx.verify``'s result) is in: the round-2 requests it
    starts (its rollout's quota; the group's remainder once the group is in)."""
    rewards, feedback, errors, st = result
    verdict = (float(rewards[0]), feedback[0], bool(errors[0]))
    if key[0] == 2:
      self.stats[2].append(st)
      self.verdicts2[key[1:]] = verdict
      return []
    self.stats[1].append(st)
    _, p, j = key
    _put_verdict(self.r1, p, j, verdict)
    self.judged[p, j] = True
    if not self.round2:
      return []
    out = []
    quota = R.round2_quota(self.n, self.m)
    if self.mode == "single" and quota and self._selected(p)[j]:
      out += self._request(p, j, quota)
      self.early += quota * (not self.judged[p].all())
    if self.judged[p].all():
      out += self._plan(p)
    return out

  def _selected(self, p: int) -> np.ndarray:
    """[n] prompt p's rollouts that get a FAP, of those with a verdict
    (``rl.fap_from``; an error verdict never does)."""
    sel = assemble.select_fap_sources(self.r1.rewards[p:p + 1], self.ctx.spec.fap_from,
                                      self.ctx.threshold)[0]
    return sel & self.r1.ok[p] & self.judged[p]

  def _request(self, p: int, source: int, count: int) -> list:
    """Requests for the next ``count`` replicas of (p, source)'s round-2 prompt."""
    from fbos_jax import engine as engine_lib
    if count <= 0:
      return []
    if (p, source) not in self.faps:
      self.faps[(p, source)] = (
          R.aggregated_prompt(self.ctx, self.examples[p], self.r1, p) if source < 0 else
          R.fap_prompt(self.ctx, self.examples[p], self.r1, p, source))
    r0 = self.issued.get((p, source), 0)
    self.issued[(p, source)] = r0 + count
    # a FAP's replicas one request each (one sample per request, as rounds.round2's
    # calls: the compile set's shapes); GOLF's prompt its m samples in one
    per = count if source < 0 else 1
    return [engine_lib.Request(prompt=self.faps[(p, source)].token_ids, n=per, key=self.raw2,
                               sid_base=R.round2_stream(self.base, p, source, r, self.n, self.m),
                               tag=(self.k, 2, p, source, r))
            for r in range(r0, r0 + count, per)]

  def _plan(self, p: int) -> list:
    """Prompt p's verdicts are all in: its round-2 plan (``assemble.round2_plan``)
    and the requests of the rows not yet asked for."""
    sel = self._selected(p)
    _, sources = assemble.round2_plan(sel[None], self.m, self.mode)
    replicas = R.replica_index(sources)
    self.plans[p] = [(int(s), int(r)) for s, r in zip(sources, replicas)]
    out = []
    for s in sorted(set(sources.tolist())):
      out += self._request(p, s, int((sources == s).sum()) - self.issued.get((p, s), 0))
    return out

  # ------------------------------------------------------------------ the result

  def done(self) -> bool:
    if not self.judged.all():
      return False
    return not self.round2 or (len(self.plans) == len(self.examples) and all(
        (p,) + place in self.verdicts2 for p, plan in self.plans.items() for place in plan))

  def result(self) -> tuple:
    """(r1, r2 or None, round-1 pool stats, round-2 pool stats or None), as the
    static barrier's ``round1`` / ``verify`` / ``round2`` / ``verify`` would give."""
    if not self.round2:
      return self.r1, None, _merge(self.stats[1]), None
    r2 = self.r2
    for p, plan in self.plans.items():
      for j, (s, r) in enumerate(plan):
        row, text = self.rows2[(p, s, r)]
        _put_row(r2, p, j, row, text)
        _put_verdict(r2, p, j, self.verdicts2[(p, s, r)])
        fap = self.faps[(p, s)]
        r2.valid[p, j], r2.source[p, j] = True, s
        r2.contexts[p][j], r2.truncated[p, j] = fap.token_ids, fap.truncated
    st2 = _merge(self.stats[2])
    st2["rollout/round2_chain_steps"] = float(self.chain_steps())
    if self.streamed:
      r1_end = max((w[1] for w in self.windows[1]), default=-1)
      overlap = sum(w[0] <= r1_end for w in self.windows[2])  # round-2 rows beside round 1
      st2["rollout/round2_rows_beside_round1"] = float(overlap)
      st2["rollout/round2_rows_before_group"] = float(self.early)
    return self.r1, r2, _merge(self.stats[1]), st2

  def chain_steps(self) -> int:
    """The fewest sequential decode steps any schedule of this step's rollouts
    can take (every round-1 row from step 0, every verdict at once): the
    longest chain of a round-2 row's own length after the round-1 rows it
    waits for (its source's, for a rollout's quota; the whole group's, for the
    rest and for GOLF's aggregated prompt), or the longest round-1 row."""
    l1 = self.r1.lengths
    quota = R.round2_quota(self.n, self.m) if self.mode == "single" else 0
    out = int(l1.max(initial=0))
    for p, plan in self.plans.items():
      for s, r in plan:
        wait = l1[p, s] if 0 <= s and r < quota else l1[p].max()
        out = max(out, int(wait) + int(self.rows2[(p, s, r)][0].tokens.size))
    return out


class StepStream:
  """The engine's feed over step batches ``start .. stop - 1`` (AReaL's streaming
  rollout): step k's round-1 requests join the queue once ``admit(k, in_flight)``
  allows (``begin(k)`` -> its :class:`_Step`), so the prompts of the next steps
  fill the slots the last ones free; each row goes to the verifier pool as soon
  as it stops, and the round-2 rows its verdict starts join the queue at the
  next poll; ``on_step(step)`` gets each step, in order, when all its rows are
  verified. ``stopping()`` true: the run stops at the next poll. ``in_flight``:
  rows handed to the engine that have not stopped."""

  def __init__(self, ctx: RolloutContext, start: int, stop: int, *, begin, admit=None,
               on_step=None, stopping=None):
    self.ctx, self.next_k, self.stop = ctx, int(start), int(stop)
    self.begin, self.admit, self.on_step = begin, admit, on_step
    self.stopping = stopping
    self.steps: dict = {}  # k -> _Step, in flight
    self.pending: list = []
    self.in_flight = 0
    self.verifier = _Verifier(ctx)

  def poll(self) -> list:
    if self.stopping is not None and self.stopping():
      raise StreamStopped()
    for step, key, fut in self.verifier.ready():
      self.pending += step.on_verdict(key, fut.result())
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
    self.in_flight += sum(int(r.n) for r in out)
    return out

  def finished(self) -> bool:
    return self.next_k >= self.stop and not self.steps and not self.pending

  def on_row(self, row):
    self.in_flight -= 1
    self.steps[row.tag[0]].on_row(row, self.verifier)

  def run(self, params):
    """Decode until every step is done (``params``: a param pytree or a
    ParamsSource); the verifier threads are shut down at the end."""
    from fbos_jax import engine as engine_lib
    _check_params(self.ctx, params)
    sp = self.ctx.parts.sampling
    try:
      engine_lib.run(params, self.ctx.model_cfg, self, self.on_row, config=sp.round2,
                     engine_config=sp.engine_config, mesh=self.ctx.mesh, rules=self.ctx.rules,
                     stats=self.ctx.engine_stats)
    finally:
      self.verifier.close()


class StreamStopped(Exception):
  """The stream's owner stopped it (``StepStream.stopping``)."""


def _check_params(ctx: RolloutContext, params):
  from fbos_jax import engine as engine_lib
  if not engine_lib.is_params_source(params):
    state_lib.check_compute_params(params, ctx.model_cfg, "the continuous engine's rounds")


def streamed_rounds(ctx: RolloutContext, params, examples: list, key):
  """Round 1, its verdicts and round 2 of one step in one engine run, round 2
  started rollout by rollout. Returns (r1, r2, round-1 pool stats, round-2 pool
  stats), as the barrier's ``round1`` / ``verify`` / ``round2`` / ``verify`` would."""
  out = []
  StepStream(ctx, 0, 1, begin=lambda k: _Step(ctx, k, examples, key),
             on_step=lambda step: out.append(step.result())).run(params)
  return out[0]


def barrier_rounds(ctx: RolloutContext, params, examples: list, key):
  """The barrier schedule on the engine, each rollout verified as it stops:
  round 1 (round 1's sampler settings), every round-1 verdict, then round 2
  (round 2's), its verdicts. Returns what :func:`streamed_rounds` does (round 2
  None without ``rl.round2``). With several processes every process runs both
  engine runs (they are collective), with or without rows of its own."""
  from fbos_jax import engine as engine_lib
  _check_params(ctx, params)
  sp = ctx.parts.sampling
  step = _Step(ctx, 0, examples, key)
  step.streamed = False
  verifier = _Verifier(ctx)
  configs = [sp.round1] + ([sp.round2] if step.round2 else [])
  try:
    requests = step.requests
    for config in configs:
      engine_lib.run(params, ctx.model_cfg, engine_lib.ListFeed(requests),
                     lambda row: step.on_row(row, verifier), config=config,
                     engine_config=sp.engine_config, mesh=ctx.mesh, rules=ctx.rules,
                     stats=ctx.engine_stats)
      requests = []
      while verifier.jobs:  # the barrier: every verdict of the round
        for _, vkey, fut in verifier.ready(wait=True):
          requests += step.on_verdict(vkey, fut.result())
    assert not requests and step.done(), "the barrier left rows unsampled"
  finally:
    verifier.close()
  return step.result()


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
