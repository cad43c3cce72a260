"""A step's sampling rounds as named phases over ``[P, n]`` groups: round 1, verify, round 2.

Every phase is a small function over :class:`Rollouts`, which keep an explicit
group axis: a round has ``[P, n]`` rows, row ``[p, i]`` being sample ``i`` of
prompt ``p``. Nothing here branches on an algorithm's name::

    round1      [P, n] rollouts of the prompts q (or FCP's <EF>c+</EF>q)
    verify      rewards, feedback and error flags from the verifier pool
    round2      "single":     m rollouts per prompt from its FAP(q, o_i, F_i)s
                "aggregated": m rollouts per prompt from GOLF's one prompt
                (a row draws the stream of (prompt, source, replica): the same
                rows whether the round waits for every verdict or starts rollout
                by rollout, fbos_jax/rl/stream.py)

Every row carries the policy version of each of its tokens (``Rollouts.versions``,
the sampler's labels: :meth:`fbos_jax.rl.context.RolloutContext.sample`), beside
its tokens and log-probs, into the batches (:mod:`fbos_jax.rl.rollout`).

Randomness: round 1 and round 2 sample with the two halves of the step's key
(the sampler's key contract: sample j of context i draws step t from
``fold_in(fold_in(key, t), i * n + j)``).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import jax
import numpy as np

from fbos_jax import distributed
from fbos_jax import templates
from fbos_jax.rl import assemble
from fbos_jax.rl.context import RolloutContext, Samples


@dataclasses.dataclass
class Rollouts:
  """One sampling round on the host, grouped by prompt.

  contexts: [P][n] token-id lists each row was sampled under
  tokens:   [P, n, R] int32 response ids (pad after the stop token)
  mask:     [P, n, R] int32 1 on generated tokens (stop token included)
  logp:     [P, n, R] float32 sampler log-probs (temperature-scaled policy)
  versions: [P, n, R] int64 the policy version that drew each token (-1 off the mask)
  lengths:  [P, n] int32
  valid:    [P, n] bool   the row exists (round 2: prompts without a FAP have none)
  source:   [P, n] int    round 2: the round-1 rollout whose feedback built the
                          FAP (-1: GOLF's aggregated prompt; round 1: -1)
  seed:     host seed of the round (from its PRNG key) for host-side choices
  rewards:  [P, n] float32, feedback [P][n] str, is_error [P, n] bool: from verify
  texts:    [P][n] decoded responses
  truncated:[P, n] bool   round 2: the row's prompt (FAP or aggregated prompt) had
                          its response or feedback cut to fit templates.max_prompt_tokens
  keep:     [P, n] bool   GFPO (round 1): the rollouts the update trains on; None: all
  """
  contexts: list
  tokens: np.ndarray
  mask: np.ndarray
  logp: np.ndarray
  versions: np.ndarray
  lengths: np.ndarray
  valid: np.ndarray
  source: np.ndarray
  texts: list
  seed: tuple = ()
  rewards: Optional[np.ndarray] = None
  feedback: Optional[list] = None
  is_error: Optional[np.ndarray] = None
  truncated: Optional[np.ndarray] = None
  keep: Optional[np.ndarray] = None

  @property
  def shape(self) -> tuple:
    return self.valid.shape

  @property
  def ok(self) -> np.ndarray:
    """[P, n] rows that exist and have a real verdict."""
    return self.valid & ~self.is_error


def host_seed(key) -> tuple:
  """A numpy seed from a PRNG key (its raw bits), for host-side random choices."""
  return tuple(int(x) for x in np.asarray(jax.random.key_data(key)).reshape(-1))


def _grouped(valid: np.ndarray, rows: Samples, contexts: list, source: np.ndarray, r: int,
             seed: tuple, truncated: Optional[list] = None) -> Rollouts:
  """Scatter the sampled rows (row-major over ``valid``) into a [P, n] Rollouts
  (``truncated``: one flag per sampled row, whose prompt was cut)."""
  p, n = valid.shape
  idx = np.flatnonzero(valid.reshape(-1))

  def scatter(x, fill, dtype):
    out = np.full((p * n,) + x.shape[1:], fill, dtype)
    out[idx] = x
    return out.reshape((p, n) + x.shape[1:])

  grid_texts = [[""] * n for _ in range(p)]
  grid_ctx = [[[] for _ in range(n)] for _ in range(p)]
  for k, j in enumerate(idx):
    grid_texts[j // n][j % n] = rows.texts[k]
    grid_ctx[j // n][j % n] = contexts[k]
  cut = np.zeros(len(idx), bool) if truncated is None else np.asarray(truncated, bool)
  return Rollouts(contexts=grid_ctx,
                  tokens=scatter(rows.tokens.reshape(-1, r), 0, np.int32),
                  mask=scatter(rows.mask.reshape(-1, r), 0, np.int32),
                  logp=scatter(rows.logp.reshape(-1, r), 0.0, np.float32),
                  versions=scatter(rows.versions.reshape(-1, r), -1, np.int64),
                  lengths=scatter(rows.lengths.reshape(-1), 0, np.int32), valid=valid.copy(),
                  source=source, texts=grid_texts, seed=seed,
                  truncated=scatter(cut, False, bool))


def round1(ctx: RolloutContext, params, examples: list, key) -> Rollouts:
  """n rollouts per prompt: [P, n]."""
  n, sc = ctx.spec.group_size, ctx.parts.sampling.round1
  q = [ctx.prompt_ids(ex) for ex in examples]
  rows = ctx.sample(params, q, n, key, sc)
  valid = np.ones((len(examples), n), bool)
  return _grouped(valid, rows, [c for c in q for _ in range(n)],
                  np.full(valid.shape, -1, np.int64), sc.max_new_tokens, host_seed(key))


def verify(ctx: RolloutContext, ro: Rollouts, examples: list) -> dict:
  """Score every valid row in the pool; error verdicts are flagged, never feedback."""
  p, n = ro.shape
  idx = np.flatnonzero(ro.valid.reshape(-1))
  texts = [ro.texts[j // n][j % n] for j in idx]
  rewards, feedback, errors, stats = ctx.verify([examples[j // n] for j in idx], texts)
  ro.rewards = np.zeros((p, n), np.float32)
  ro.is_error = np.zeros((p, n), bool)
  ro.feedback = [[""] * n for _ in range(p)]
  ro.rewards.reshape(-1)[idx] = np.where(errors, 0.0, rewards)
  ro.is_error.reshape(-1)[idx] = errors
  for k, j in enumerate(idx):
    ro.feedback[j // n][j % n] = "" if errors[k] else feedback[k]
  return stats


def round2_quota(n: int, m: int) -> int:
  """Round-2 rows every selected rollout of a group of ``n`` gets, whatever the
  other verdicts: the round-robin of :func:`~fbos_jax.rl.assemble.round2_plan`
  spreads m rows over k <= n selected rollouts, so each gets at least
  floor(m / k) >= floor(m / n). A streamed round 2 starts these rows the moment
  the rollout's own verdict lands; the rest wait for the group
  (``fbos_jax/rl/stream.py``)."""
  return int(m) // int(n)


def round2_stream(base: int, p: int, source: int, replica: int, n: int, m: int) -> int:
  """The key-contract stream of a round-2 row: replica ``replica`` of the FAP of
  round-1 rollout ``source`` of prompt ``p`` (this process's prompts start at
  global prompt ``base``; groups of ``n``, ``m`` round-2 rows per prompt), or row
  ``replica`` of GOLF's aggregated prompt (``source`` -1). Keyed by (prompt,
  source, replica), never by the row's place in the [P, m] grid (which depends on
  the group's other verdicts), so a round 2 that starts rollout by rollout draws
  the same tokens as one behind the barrier."""
  if source < 0:
    return (base + p) * m + replica
  return ((base + p) * n + source) * m + replica


@dataclasses.dataclass
class Round2Call:
  """One round-2 context of prompt ``p``: ``n`` rows from ``prompt`` (a
  ``templates.Prompt``), rows ``j0 .. j0 + n - 1`` of the prompt's m, built from
  the round-1 rollouts ``sources`` (-1: GOLF's aggregated prompt); ``replica``:
  its first row's replica of its source (:func:`round2_stream`)."""
  p: int
  j0: int
  n: int
  prompt: Any
  sources: list
  replica: int = 0

  def stream_id(self, base: int, group: int, m: int) -> int:
    """The context's index in the sampler's key contract (its row j draws stream
    ``stream_id * n + j``): its rows draw the streams of :func:`round2_stream`
    (``group``: n of round 1)."""
    first = round2_stream(base, self.p, self.sources[0], self.replica, group, m)
    assert first % self.n == 0, (first, self.n)
    return first // self.n


def fap_prompt(ctx: RolloutContext, example, r1: Rollouts, p: int, s: int):
  """FBOS's FAP(q, o_s, F_s) of round-1 rollout ``s`` of prompt ``p``."""
  return ctx.prompts.fap(example["prompt"], r1.texts[p][s], r1.feedback[p][s])


def round2_calls(ctx: RolloutContext, example, r1: Rollouts, p: int,
                 mode: Optional[str] = None) -> list:
  """Prompt ``p``'s round-2 contexts, from its round-1 verdicts alone: "single"
  (FBOS) m rows spread round-robin over its FAP(q, o_i, F_i)s, one FAP per
  selected rollout (one call per row, its replica counted per source);
  "aggregated" (GOLF) one prompt over its failed attempts, sampled m times
  (``mode``, default ``rl.fap_mode``). None selected: no round 2 for it."""
  spec, m = ctx.spec, ctx.spec.round2_size
  mode = mode or spec.fap_mode
  sel = assemble.select_fap_sources(r1.rewards[p:p + 1], spec.fap_from, ctx.threshold)
  _, sources = assemble.round2_plan(sel & r1.ok[p:p + 1], m, mode)
  if not sources.size:
    return []
  if mode == "aggregated":
    return [Round2Call(p, 0, m, aggregated_prompt(ctx, example, r1, p), [-1] * m)]
  built = {int(s): fap_prompt(ctx, example, r1, p, int(s)) for s in set(sources.tolist())}
  replicas = replica_index(sources)
  return [Round2Call(p, j, 1, built[int(s)], [int(s)], int(replicas[j]))
          for j, s in enumerate(sources)]


def replica_index(sources: np.ndarray) -> np.ndarray:
  """[m] each round-2 row's replica of its source: how many earlier rows share it."""
  out = np.zeros(len(sources), np.int64)
  seen: dict = {}
  for j, s in enumerate(np.asarray(sources).tolist()):
    out[j] = seen.get(s, 0)
    seen[s] = out[j] + 1
  return out


def round2(ctx: RolloutContext, params, examples: list, r1: Rollouts, key,
           mode: Optional[str] = None) -> Rollouts:
  """m rollouts per prompt from its round-2 contexts (:func:`round2_calls`): [P, m]."""
  spec, sc = ctx.spec, ctx.parts.sampling.round2
  m = spec.round2_size
  calls = [c for p, ex in enumerate(examples) for c in round2_calls(ctx, ex, r1, p, mode)]
  n = calls[0].n if calls else 1
  base = distributed.process_index() * len(examples)
  rows = ctx.sample(params, [c.prompt.token_ids for c in calls], n, key, sc,
                    stream_ids=[c.stream_id(base, spec.group_size, m) for c in calls])
  valid = np.zeros((len(examples), m), bool)
  source = np.full(valid.shape, -1, np.int64)
  for c in calls:
    valid[c.p, c.j0:c.j0 + c.n] = True
    source[c.p, c.j0:c.j0 + c.n] = c.sources
  return _grouped(valid, rows, [c.prompt.token_ids for c in calls for _ in range(c.n)], source,
                  sc.max_new_tokens, host_seed(key), [c.prompt.truncated for c in calls
                                                       for _ in range(c.n)])


def aggregated_prompt(ctx: RolloutContext, example, r1: Rollouts, p: int) -> templates.Prompt:
  """GOLF's refinement prompt over prompt ``p``'s failed attempts with a real verdict."""
  attempts = [templates.Attempt(r1.texts[p][i], r1.feedback[p][i], float(r1.rewards[p, i]))
              for i in range(r1.shape[1]) if r1.ok[p, i] and r1.rewards[p, i] < ctx.threshold]
  return ctx.prompts.aggregated(example["prompt"], attempts)



def success_buckets(n: int) -> list:
  """Round-1 success-count buckets of a group of n for the per-bucket fix rate:
  [(name, lo, hi)] with lo <= successes <= hi. ``0``: no correct sample (GRPO
  gets no signal; where both FBOS-RL and GOLF say feedback matters most);
  ``1to{h-1}``: a minority correct; ``{h}plus``: at least half correct
  (h = ceil(n / 2); n = 8: ``0``, ``1to3``, ``4plus``)."""
  h = -(-n // 2)
  out = [("0", 0, 0)]
  if h - 1 >= 1:
    out.append((f"1to{h - 1}", 1, h - 1))
  out.append((f"{h}plus", max(h, 1), n))
  return out


def _fix_metrics(r1: Rollouts, r2: Rollouts, threshold: float) -> dict:
  """The fix rate of round-2 rows from failed round-1 rollouts, overall and per
  round-1 success bucket, and the resample rate beside it."""
  ok, m = r2.ok, {}
  src_r = np.where(r2.source >= 0,
                   np.take_along_axis(r1.rewards, np.maximum(r2.source, 0), axis=1), -np.inf)
  src_failed = ok & (src_r < threshold)
  fixed = r2.rewards >= threshold
  m["feedback/fix_rate"] = float(fixed[src_failed].mean()) if src_failed.any() else 0.0
  m["feedback/fix_rows"] = int(src_failed.sum())
  successes = ((r1.rewards >= threshold) & r1.ok).sum(axis=1)  # [P]
  if src_failed.any():  # what sampling q again would give: its round-1 success rate
    r1_rate = successes / np.maximum(r1.ok.sum(axis=1), 1)
    m["feedback/resample_rate"] = float(
        np.broadcast_to(r1_rate[:, None], ok.shape)[src_failed].mean())
  for name, lo, hi in success_buckets(r1.shape[1]):
    rows = src_failed & ((successes >= lo) & (successes <= hi))[:, None]
    m[f"feedback/fix_rows_r1succ_{name}"] = int(rows.sum())
    if rows.any():
      m[f"feedback/fix_rate_r1succ_{name}"] = float(fixed[rows].mean())
  return m


def round2_metrics(r1: Rollouts, r2: Rollouts, threshold: float) -> dict:
  """Round-2 rewards, the share of round-2 rows whose prompt was cut
  (``fap/truncated_frac``), the FAP lengths in tokens (``fap/length_tokens``,
  mean and max), and the fix rate: the share of round-2 rows from a
  failed round-1 rollout that are correct, overall (``feedback/fix_rate``, over
  ``feedback/fix_rows`` rows) and per round-1 success bucket of their prompt
  (``feedback/fix_rate_r1succ_<bucket>``, with the row count
  ``feedback/fix_rows_r1succ_<bucket>`` so steps can be pooled).
  ``feedback/resample_rate`` is the round-1 success rate of the prompts of the
  same rows: what sampling q again would have given, the fix rate's baseline."""
  ok = r2.ok
  m = {"round2/rollouts": int(r2.valid.sum())}
  cut = r2.truncated if r2.truncated is not None else np.zeros(r2.shape, bool)
  m["fap/truncated_frac"] = float(cut[r2.valid].mean()) if r2.valid.any() else 0.0
  fap_len = [len(r2.contexts[p][j]) for p, j in zip(*np.nonzero(r2.valid))]
  if fap_len:  # in the tokenizer's own tokens (real BPE tokens for a Qwen checkpoint)
    m["fap/length_tokens"] = float(np.mean(fap_len))
    m["fap/length_tokens_max"] = int(max(fap_len))
  if ok.any():
    m["reward/round2"] = float(r2.rewards[ok].mean())
    m["response/length_round2"] = float(r2.lengths[ok].mean())
    m.update(_fix_metrics(r1, r2, threshold))
  return m


def probe_step(ctx: RolloutContext, params, examples: list, key, *,
               fap_mode: Optional[str] = None) -> dict:
  """Round 1, verify and a round 2 (``fap_mode``, default the spec's) without
  building batches or updating: the metrics of a warm start (round-1 success,
  all-fail and all-equal groups, FAP truncation, fix rates), whatever the
  config's own ``rl.round2``."""
  k1, k2 = jax.random.split(key)
  r1 = round1(ctx, params, examples, k1)
  verify(ctx, r1, examples)
  m = round1_metrics(r1, ctx.threshold)
  r2 = round2(ctx, params, examples, r1, k2, fap_mode)
  verify(ctx, r2, examples)
  m.update(round2_metrics(r1, r2, ctx.threshold))
  return m


def round1_metrics(r1: Rollouts, threshold: float) -> dict:
  ok = r1.ok
  r = np.where(ok, r1.rewards, 0.0)
  solved = (r1.rewards >= threshold) & ok
  return {"reward/round1": float(r[ok].mean()) if ok.any() else 0.0,
          "reward/round1_solved": float(solved[ok].mean()) if ok.any() else 0.0,
          "groups/all_equal_frac": assemble.all_zero_group_fraction(r),
          # no correct sample in the group: plain GRPO learns nothing from it
          "groups/all_fail_frac": float(np.mean(~solved.any(axis=1))),
          "response/length": float(r1.lengths.mean())}


def verifier_metrics(stats: dict, round_name: str) -> dict:
  """The pool's calls, errors, error rate and each error kind
  (``verifier/bad_reward``, ...) of one round, suffixed with the round's name."""
  from fbos_jax.verifiers.base import ERROR_KINDS
  keep = ("calls", "errors", "error_rate") + ERROR_KINDS
  out = {f"verifier/{k}_{round_name}": float(stats.get(f"verifier/{k}", 0.0)) for k in keep}
  return out
