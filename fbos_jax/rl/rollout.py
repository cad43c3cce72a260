"""One step's rollout as named phases: round 1 -> verify -> (GFPO) -> round 2 -> the batches.

Every phase is a small function over :class:`Rollouts`, which keep an explicit
group axis: a round has ``[P, n]`` rows, row ``[p, i]`` being sample ``i`` of
prompt ``p``. Nothing here branches on an algorithm's name; the rollout spec
(:class:`fbos_jax.rl.config.RolloutSpec`) says which phases run and which
batches the terms of the objective need::

    round1      [P, n] rollouts of the prompts q (or FCP's <EF>c+</EF>q)
    verify      rewards, feedback and error flags from the verifier pool
    gfpo_select GFPO: which round-1 rollouts of each group the update keeps
    round2      "single":     m rollouts per prompt from its FAP(q, o_i, F_i)s
                "aggregated": m rollouts per prompt from GOLF's one prompt
                (row [p, j] draws from stream (p, j): the same rows whether the
                round waits for every verdict or streams, fbos_jax/rl/stream.py)
    BATCHES     "epa":  round-1 rows on q + selected round-2 rows re-scored on q
                "ecc":  round-2 rows on their FAPs
                "fcp":  round-1 rows on <EF>c</EF>q, c their own feedback

Each batch builder takes ``(ctx, examples, r1, r2)`` and returns a
:class:`RowSet` and its metrics. The host does text (prompts, decoding,
verification) and numpy; the device runs the samplers. Row sets become padded
:class:`PolicyBatch`es in :func:`pad_batches`, the one place where hosts agree
on shapes, once per step, at the sizes of the shape model
(:mod:`fbos_jax.rl.shapes`).

Randomness: round 1 and round 2 sample with ``key``'s two halves (the
sampler's key contract: sample j of context i draws step t from
``fold_in(fold_in(key, t), i * n + j)``); EPA's random injection slots
(``rl.epa_mode=replace``) use a host generator seeded from round 1's key.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Any, Callable, Optional

import jax
import numpy as np

import fbos_kernels as K
from fbos_jax import buckets
from fbos_jax import distributed
from fbos_jax import sharding as sh
from fbos_jax import templates
from fbos_jax.rl import assemble
from fbos_jax.rl import shapes
from fbos_jax.rl.batch import make_policy_batch
from fbos_jax.rl.context import RolloutContext, Samples


@dataclasses.dataclass
class Rollouts:
  """One sampling round on the host, grouped by prompt.

  contexts: [P][n] token-id lists each row was sampled under
  tokens:   [P, n, R] int32 response ids (pad after the stop token)
  mask:     [P, n, R] int32 1 on generated tokens (stop token included)
  logp:     [P, n, R] float32 sampler log-probs (temperature-scaled policy)
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


@dataclasses.dataclass
class RowSet:
  """Rows of one batch before padding (k rows, response length R); its name in
  the shape model (``shapes.batch_rows`` / ``shapes.batch_prompt_buckets``)."""
  name: str  # epa | ecc | fcp
  prompts: list  # k token-id lists
  tokens: np.ndarray  # [k, R]
  mask: np.ndarray  # [k, R]
  logp: np.ndarray  # [k, R]
  advantages: np.ndarray  # [k]
  offpolicy: np.ndarray  # [k] bool
  loss_mask: np.ndarray  # [k, R] float32


# ----------------------------------------------------------------------------- phases


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


@functools.partial(jax.jit, static_argnames=("group_size", "k_map"))
def _adaptive_k(state, means, group_size, k_map):
  return K.adaptive_k(state, means, group_size=group_size, k_map=k_map)


def gfpo_select(ctx: RolloutContext, r1: Rollouts, gfpo_state) -> tuple:
  """GFPO: keep the top k of each round-1 group by the metric (shortest, or
  reward per token), k fixed or from the adaptive difficulty history in the
  state. Sets ``r1.keep`` [P, n]; returns (new GFPO state, metrics)."""
  spec = ctx.spec
  k = spec.gfpo_k
  if spec.gfpo_adaptive:
    means = np.where(r1.ok, r1.rewards, 0).sum(1) / np.maximum(r1.ok.sum(1), 1)
    k_arr, gfpo_state = _adaptive_k(gfpo_state, means.astype(np.float32), spec.group_size,
                                    spec.gfpo_k_map)
    k = np.asarray(k_arr)
  lengths = np.where(r1.ok, r1.lengths, 0)
  r1.keep = assemble.gfpo_keep(np.where(r1.ok, r1.rewards, 0.0), lengths, r1.ok, k,
                               spec.gfpo_metric)
  m = {"gfpo/kept_frac": float(r1.keep[r1.ok].mean()) if r1.ok.any() else 0.0,
       "response/length_kept": float(lengths[r1.keep].mean()) if r1.keep.any() else 0.0}
  return gfpo_state, m


@dataclasses.dataclass
class Round2Call:
  """One round-2 context of prompt ``p``: ``n`` rows from ``prompt`` (a
  ``templates.Prompt``), rows ``j0 .. j0 + n - 1`` of the prompt's m, built from
  the round-1 rollouts ``sources`` (-1: GOLF's aggregated prompt)."""
  p: int
  j0: int
  n: int
  prompt: Any
  sources: list

  def stream_id(self, base: int, m: int) -> int:
    """The context's index in the key contract: its rows draw from streams
    (base + p) * m + j, their [P, m] grid position (whatever else is sampled)."""
    return ((base + self.p) * m + self.j0) // self.n


def round2_calls(ctx: RolloutContext, example, r1: Rollouts, p: int,
                 mode: Optional[str] = None) -> list:
  """Prompt ``p``'s round-2 contexts, from its round-1 verdicts alone: "single"
  (FBOS) m rows spread round-robin over its FAP(q, o_i, F_i)s, one FAP per
  selected rollout; "aggregated" (GOLF) one prompt over its failed attempts,
  sampled m times (``mode``, default ``rl.fap_mode``). None selected: no round 2
  for it."""
  spec, m = ctx.spec, ctx.spec.round2_size
  mode = mode or spec.fap_mode
  sel = assemble.select_fap_sources(r1.rewards[p:p + 1], spec.fap_from, ctx.threshold)
  _, sources = assemble.round2_plan(sel & r1.ok[p:p + 1], m, mode)
  if not sources.size:
    return []
  if mode == "aggregated":
    return [Round2Call(p, 0, m, aggregated_prompt(ctx, example, r1, p), [-1] * m)]
  built = {int(s): ctx.prompts.fap(example["prompt"], r1.texts[p][s], r1.feedback[p][s])
           for s in set(sources.tolist())}
  return [Round2Call(p, j, 1, built[int(s)], [int(s)]) for j, s in enumerate(sources)]


def round2(ctx: RolloutContext, params, examples: list, r1: Rollouts, key,
           mode: Optional[str] = None) -> Rollouts:
  """m rollouts per prompt from its round-2 contexts (:func:`round2_calls`): [P, m]."""
  spec, sc = ctx.spec, ctx.parts.sampling.round2
  m = spec.round2_size
  calls = [c for p, ex in enumerate(examples) for c in round2_calls(ctx, ex, r1, p, mode)]
  n = calls[0].n if calls else 1
  base = jax.process_index() * len(examples)
  rows = ctx.sample(params, [c.prompt.token_ids for c in calls], n, key, sc,
                    stream_ids=[c.stream_id(base, m) for c in calls])
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


# ----------------------------------------------------------------------------- batches


def _flat_r2(r2: Optional[Rollouts]):
  """Round 2 as flat rows (row-major over ok): (rewards, prompt, source, flat index)."""
  if r2 is None:
    z = np.zeros((0,), np.int64)
    return np.zeros((0,), np.float32), z, z, z
  idx = np.flatnonzero(r2.ok.reshape(-1))
  m = r2.shape[1]
  return (r2.rewards.reshape(-1)[idx], idx // m, r2.source.reshape(-1)[idx], idx)


def _rows(ro: Rollouts, flat: np.ndarray):
  """Rows ``flat`` (indices into the [P*n] grid) as (tokens, mask, logp)."""
  r = ro.tokens.shape[-1]
  return (ro.tokens.reshape(-1, r)[flat], ro.mask.reshape(-1, r)[flat],
          ro.logp.reshape(-1, r)[flat])


def _epa_groups(ctx: RolloutContext, r1: Rollouts, r2: Optional[Rollouts]):
  """EPA's merged groups on q ([P, n + appended]), error verdicts out."""
  spec = ctx.spec
  r2_rewards, r2_prompt, r2_source, _ = _flat_r2(r2)
  groups = assemble.epa_groups(
      np.where(r1.ok, r1.rewards, 0.0), r2_rewards, r2_prompt, r2_source,
      select=spec.epa_select, mode=spec.epa_mode, trigger=spec.epa_trigger, tau=spec.tau,
      max_per_prompt=spec.epa_max_per_prompt, threshold=ctx.threshold,
      enabled=r2 is not None, rng=np.random.default_rng(r1.seed))
  groups.valid[:, :spec.group_size] &= r1.ok | groups.offpolicy[:, :spec.group_size]
  return groups


def epa_rows(ctx: RolloutContext, examples: list, r1: Rollouts, r2: Optional[Rollouts]):
  """EPA's groups on q: round-1 rows (PPO clip) + selected round-2 rows pulled
  back onto q as off-policy samples (f(u)); advantages over the merged group
  (over GFPO's kept members when ``r1.keep`` is set). Returns (RowSet, metrics)."""
  spec, n = ctx.spec, ctx.spec.group_size
  groups = _epa_groups(ctx, r1, r2)
  keep = None
  r1_mask = r1.mask
  if r1.keep is not None:  # appended feedback-guided rows are always kept
    keep = np.ones(groups.valid.shape, bool)
    keep[:, :n] = r1.keep | groups.offpolicy[:, :n]
    r1_mask = np.asarray(K.gfpo_loss_mask(r1.mask, r1.keep))
  adv = assemble.advantages(groups.rewards, groups.valid, spec.advantage, spec.adv_eps, keep)
  vp, vg = np.nonzero(groups.valid)
  onp = ~groups.offpolicy[vp, vg]
  mem = groups.member[vp, vg]
  order = np.concatenate([np.flatnonzero(onp), np.flatnonzero(~onp)])  # on-policy rows first
  q = [ctx.prompt_ids(ex) for ex in examples]
  on = _rows(r1, mem[onp])  # round-1 members are flat [P*n] row indices
  on_loss = r1_mask.reshape(-1, r1_mask.shape[-1])[mem[onp]]
  off = _rows(r2, _flat_r2(r2)[3][mem[~onp]]) if (~onp).any() else tuple(x[:0] for x in on)
  tokens, mask, logp = (np.concatenate([a, b]) for a, b in zip(on, off))
  loss_mask = np.concatenate([on_loss, off[1]]).astype(np.float32)
  rows = RowSet("epa", [q[p] for p in vp[order]], tokens, mask, logp, adv[vp, vg][order],
                ~onp[order], loss_mask)
  return rows, {"epa/injected": groups.injected}


def ecc_rows(ctx: RolloutContext, examples: list, r1: Rollouts, r2: Optional[Rollouts]):
  """ECC: round-2 rows on their FAPs, on-policy, advantages over q's round-2 group
  (``ecc_advantage=group``) or of the improvement over their source."""
  spec = ctx.spec
  r2_rewards, r2_prompt, r2_source, r2_flat = _flat_r2(r2)
  a2 = assemble.ecc_advantages(np.where(r1.ok, r1.rewards, 0.0), r2_rewards, r2_prompt,
                               r2_source, mode=spec.ecc_advantage, estimator=spec.advantage,
                               eps=spec.adv_eps, width=spec.round2_size)
  m = spec.round2_size
  if r2 is None:
    tokens = np.zeros((0, r1.tokens.shape[-1]), np.int32)
    mask, logp, contexts = tokens, tokens.astype(np.float32), []
  else:
    tokens, mask, logp = _rows(r2, r2_flat)
    contexts = [r2.contexts[j // m][j % m] for j in r2_flat]
  rows = RowSet("ecc", contexts, tokens, mask, logp, a2, np.zeros(len(a2), bool),
                mask.astype(np.float32))
  return rows, {}


def fcp_rows(ctx: RolloutContext, examples: list, r1: Rollouts, r2: Optional[Rollouts]):
  """FCP's online bootstrap: round-1 rows re-conditioned on their fresh feedback
  c (c+ when correct), <EF>c</EF>q -> o, for the MLE term."""
  p, n = r1.shape
  flat = np.flatnonzero(r1.ok.reshape(-1))
  contexts = []
  for j in flat:
    ex, rew, fb = examples[j // n], r1.rewards.reshape(-1)[j], r1.feedback[j // n][j % n]
    c = ctx.spec.fcp_positive_feedback if rew >= ctx.threshold else fb
    contexts.append(ctx.prompts.fcp(ex["prompt"], c).token_ids)
  tokens, mask, logp = _rows(r1, flat)
  rows = RowSet("fcp", contexts, tokens, mask, logp, np.ones(len(flat), np.float32),
                np.zeros(len(flat), bool), mask.astype(np.float32))
  return rows, {}


BATCHES: dict[str, Callable] = {"epa": epa_rows, "ecc": ecc_rows, "fcp": fcp_rows}


def pad_batches(ctx: RolloutContext, rowsets: dict) -> dict:
  """Row sets -> padded PolicyBatches whose shapes every host agrees on: the one
  cross-host shape agreement of a step (one all-gather of the sizes).

  Rows are padded as the shape model says (:func:`fbos_jax.rl.shapes.padded_rows`:
  a power-of-two bucket, or with ``rl.fixed_row_buckets`` the most a batch can
  have, a multiple of this host's batch shards x micro- x mini-batches); prompts
  to the batch's prompt bucket."""
  names = sorted(rowsets)
  local = []
  for name in names:
    rs = rowsets[name]
    local += [len(rs.prompts), max((len(c) for c in rs.prompts), default=1)]
  agreed = distributed.agree_max(*local)
  shards = sh.local_batch_shard_count(ctx.mesh, ctx.rules)
  out = {}
  for i, name in enumerate(names):
    rs = rowsets[name]
    n_rows, longest = agreed[2 * i], agreed[2 * i + 1]
    prompt_buckets, field = shapes.batch_prompt_buckets(ctx.parts, name)
    plen = buckets.pick_bucket(longest, prompt_buckets, what=f"{name} prompt", field=field)
    rows = shapes.padded_rows(ctx.parts, name, n_rows, shards,
                              prompts=ctx.spec.prompts_per_step // jax.process_count())
    out[name] = make_policy_batch(rs.prompts, rs.tokens, rs.mask, rs.advantages, rs.logp,
                                  rs.offpolicy, prompt_len=plen, num_rows=rows,
                                  loss_mask=rs.loss_mask, pad_id=ctx.pad_id, field=field)
  return out


# ----------------------------------------------------------------------------- the step


def rollout_step(ctx: RolloutContext, params, examples: list, key, *,
                 gfpo_state=None) -> tuple[dict, dict, Any]:
  """Phases 1-2 and the batches of the update's terms.

  Returns ({name: PolicyBatch (host numpy)}, metrics, new GFPO state)."""
  spec = ctx.spec
  k1, k2 = jax.random.split(key)
  t0 = time.perf_counter()
  ctx.engine_stats = _new_engine_stats(ctx)
  r1, r2, m = _rounds(ctx, params, examples, k1, k2)
  if spec.gfpo:
    gfpo_state, gm = gfpo_select(ctx, r1, gfpo_state)
    m.update(gm)
  gen_tokens = int(r1.mask.sum()) + (int(r2.mask.sum()) if r2 is not None else 0)
  rowsets = {}
  for name in spec.batch_names:
    rowsets[name], bm = BATCHES[name](ctx, examples, r1, r2)
    m.update(bm)
  batches = pad_batches(ctx, rowsets)
  m.update(_verifier_totals(m))
  m.update(_sampler_metrics(ctx, [r for r in (r1, r2) if r is not None]))
  m["time/rollout_s"] = time.perf_counter() - t0
  m["tokens/generated"] = gen_tokens
  m["rollouts/generated"] = int(r1.valid.sum()) + (int(r2.valid.sum()) if r2 is not None else 0)
  return batches, m, gfpo_state


def _rounds(ctx: RolloutContext, params, examples: list, k1, k2) -> tuple:
  """Round 1, verify, round 2 (when the spec has one), verify: behind a barrier,
  or streamed into one engine run (``rl.stream_rounds``, fbos_jax/rl/stream.py).
  Returns (r1, r2 or None, metrics)."""
  spec, t0 = ctx.spec, time.perf_counter()
  r2 = vs2 = None
  if spec.round2 and spec.stream_rounds:
    from fbos_jax.rl import stream
    r1, r2, vs1, vs2 = stream.streamed_rounds(ctx, params, examples, k1, k2)
    m = {"time/rounds_s": time.perf_counter() - t0,
         "rollout/round2_rows_beside_round1": vs2.pop("rollout/round2_rows_beside_round1")}
  else:
    r1 = round1(ctx, params, examples, k1)
    t1 = time.perf_counter()
    vs1 = verify(ctx, r1, examples)
    m = {"time/sample1_s": t1 - t0, "time/verify_s": time.perf_counter() - t1}
    if spec.round2:
      t2 = time.perf_counter()
      r2 = round2(ctx, params, examples, r1, k2)
      vs2 = verify(ctx, r2, examples)
      m["time/round2_s"] = time.perf_counter() - t2
  m.update(_round1_metrics(r1, ctx.threshold), **_verifier_metrics(vs1, "round1"))
  if r2 is not None:
    m.update(_verifier_metrics(vs2, "round2"))
    m.update(round2_metrics(r1, r2, ctx.threshold))
  return r1, r2, m


def probe_step(ctx: RolloutContext, params, examples: list, key, *,
               fap_mode: Optional[str] = None) -> dict:
  """Round 1, verify and a round 2 (``fap_mode``, default the spec's) without
  building batches or updating: the metrics of a warm start (round-1 success,
  all-fail and all-equal groups, FAP truncation, fix rates), whatever the
  config's own ``rl.round2``."""
  k1, k2 = jax.random.split(key)
  r1 = round1(ctx, params, examples, k1)
  verify(ctx, r1, examples)
  m = _round1_metrics(r1, ctx.threshold)
  r2 = round2(ctx, params, examples, r1, k2, fap_mode)
  verify(ctx, r2, examples)
  m.update(round2_metrics(r1, r2, ctx.threshold))
  return m


def _new_engine_stats(ctx: RolloutContext):
  if ctx.parts.sampling.engine != "continuous":
    return None
  from fbos_jax.engine import EngineStats
  return EngineStats()


def _sampler_metrics(ctx: RolloutContext, rounds: list) -> dict:
  """``rollout/slot_util``: generated tokens / slot-steps computed (the static
  sampler runs every row of a call to its longest row); with the continuous
  engine also ``rollout/pages_peak``, ``rollout/windows``, ``rollout/refills``
  and ``time/verify_wait_s`` (the engine waited on verdicts)."""
  st = ctx.engine_stats
  if st is not None:
    return {"rollout/slot_util": st.slot_util, "rollout/pages_peak": st.pages_peak,
            "rollout/windows": st.windows, "rollout/refills": st.refills,
            "time/verify_wait_s": st.verify_wait_s}
  tokens = sum(int(ro.lengths[ro.valid].sum()) for ro in rounds)
  steps = sum(int(ro.valid.sum()) * int(ro.lengths[ro.valid].max(initial=0)) for ro in rounds)
  return {"rollout/slot_util": tokens / steps if steps else 0.0}


def _round1_metrics(r1: Rollouts, threshold: float) -> dict:
  ok = r1.ok
  r = np.where(ok, r1.rewards, 0.0)
  solved = (r1.rewards >= threshold) & ok
  return {"reward/round1": float(r[ok].mean()) if ok.any() else 0.0,
          "reward/round1_solved": float(solved[ok].mean()) if ok.any() else 0.0,
          "groups/all_equal_frac": assemble.all_zero_group_fraction(r),
          # no correct sample in the group: plain GRPO learns nothing from it
          "groups/all_fail_frac": float(np.mean(~solved.any(axis=1))),
          "response/length": float(r1.lengths.mean())}


def _verifier_metrics(stats: dict, round_name: str) -> dict:
  """The pool's calls, errors, error rate and each error kind
  (``verifier/bad_reward``, ...) of one round, suffixed with the round's name."""
  from fbos_jax.verifiers.base import ERROR_KINDS
  keep = ("calls", "errors", "error_rate") + ERROR_KINDS
  out = {f"verifier/{k}_{round_name}": float(stats.get(f"verifier/{k}", 0.0)) for k in keep}
  return out


def _verifier_totals(m: dict) -> dict:
  """``verifier/calls``, ``verifier/errors`` and ``verifier/<kind>`` over the step's rounds."""
  from fbos_jax.verifiers.base import ERROR_KINDS
  out = {}
  for k in ("calls", "errors") + ERROR_KINDS:
    out[f"verifier/{k}"] = sum(v for key, v in m.items()
                               if key.startswith(f"verifier/{k}_round"))
  return out
