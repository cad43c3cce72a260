"""One step's rollout: the rounds (:mod:`fbos_jax.rl.rounds`), GFPO, and the batches.

The rollout spec (:class:`fbos_jax.rl.config.RolloutSpec`) says which phases run
and which batches the terms of the objective need::

    rounds      round 1 -> verify -> round 2 -> verify, behind a barrier
                (fbos_jax/rl/rounds.py; on the continuous engine each rollout
                verified as it stops, fbos_jax/rl/stream.py) or streamed into
                one engine run (``rl.stream_rounds``)
    gfpo_select GFPO: which round-1 rollouts of each group the update keeps
    batches     one per term, by its kind's builder (fbos_jax/rl/batch_kinds.py:
                EPA's rows on q, ECC's on their FAPs, FCP's on <EF>c</EF>q)

Each batch builder takes ``(ctx, examples, r1, r2)`` and returns a
:class:`RowSet` and its metrics. The host does text (prompts, decoding,
verification) and numpy; the device runs the samplers. Row sets become padded
:class:`PolicyBatch`es in :func:`pad_batches`, the one place where hosts agree
on shapes, once per step, at the sizes of the shape model
(:mod:`fbos_jax.rl.shapes`). A step's result is a :class:`Trajectory`: the
batches with the policy version of every token beside them.

EPA's random injection slots (``rl.epa_mode=replace``) use a host generator
seeded from round 1's key.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Any, Optional

import jax
import numpy as np

import fbos_kernels as K
from fbos_jax import buckets
from fbos_jax import distributed
from fbos_jax import sharding as sh
from fbos_jax.rl import assemble
from fbos_jax.rl import batch_kinds
from fbos_jax.rl import shapes
from fbos_jax.rl import stream
from fbos_jax.rl.batch import make_policy_batch
from fbos_jax.rl.context import RolloutContext
from fbos_jax.rl.rounds import Rollouts, round1, round2, round2_metrics, round1_metrics, \
    verifier_metrics, verify


@dataclasses.dataclass
class RowSet:
  """Rows of one batch before padding (k rows, response length R); its name in
  the shape model (``shapes.batch_rows`` / ``shapes.batch_prompt_buckets``)."""
  name: str  # a batch kind's name (fbos_jax/rl/batch_kinds.py)
  prompts: list  # k token-id lists
  tokens: np.ndarray  # [k, R]
  mask: np.ndarray  # [k, R]
  logp: np.ndarray  # [k, R]
  versions: np.ndarray  # [k, R] int64 the policy version of each token
  advantages: np.ndarray  # [k]
  offpolicy: np.ndarray  # [k] bool
  loss_mask: np.ndarray  # [k, R] float32


@dataclasses.dataclass
class Trajectory:
  """One step's rollout, ready to train on: ``batches`` {name: PolicyBatch} (host
  numpy) and beside them ``versions`` {name: [N, R] int64}, the policy version
  that drew each response token (-1 on padding); the rollout's ``metrics``, the
  GFPO state after it and its prompts (the examples)."""
  batches: dict
  versions: dict
  metrics: dict
  gfpo: Any
  examples: list

  @property
  def ids(self) -> list:
    return [str(ex.get("id", "")) for ex in self.examples]


# ----------------------------------------------------------------------------- GFPO


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
  """Rows ``flat`` (indices into the [P*n] grid) as (tokens, mask, logp, versions)."""
  r = ro.tokens.shape[-1]
  return tuple(x.reshape(-1, r)[flat] for x in (ro.tokens, ro.mask, ro.logp, ro.versions))


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
  tokens, mask, logp, versions = (np.concatenate([a, b]) for a, b in zip(on, off))
  loss_mask = np.concatenate([on_loss, off[1]]).astype(np.float32)
  rows = RowSet(batch_kinds.EPA.name, [q[p] for p in vp[order]], tokens, mask, logp, versions,
                adv[vp, vg][order], ~onp[order], loss_mask)
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
  tokens, mask, logp, versions = _rows(r2 if r2 is not None else r1, r2_flat)
  contexts = [r2.contexts[j // m][j % m] for j in r2_flat]
  rows = RowSet(batch_kinds.ECC.name, contexts, tokens, mask, logp, versions, a2,
                np.zeros(len(a2), bool), mask.astype(np.float32))
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
  tokens, mask, logp, versions = _rows(r1, flat)
  rows = RowSet(batch_kinds.FCP.name, contexts, tokens, mask, logp, versions,
                np.ones(len(flat), np.float32), np.zeros(len(flat), bool),
                mask.astype(np.float32))
  return rows, {}


def pad_batches(ctx: RolloutContext, rowsets: dict) -> tuple[dict, dict]:
  """Row sets -> (padded PolicyBatches whose shapes every host agrees on, their
  token versions [N, R] padded with -1): the one cross-host shape agreement of a
  step (one all-gather of the sizes).

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
  procs = distributed.process_count()
  shards = max(sh.batch_shard_count(ctx.mesh, ctx.rules) // procs, 1)
  out, versions = {}, {}
  for i, name in enumerate(names):
    rs = rowsets[name]
    n_rows, longest = agreed[2 * i], agreed[2 * i + 1]
    prompt_buckets, field = shapes.batch_prompt_buckets(ctx.parts, name)
    plen = buckets.pick_bucket(longest, prompt_buckets, what=f"{name} prompt", field=field)
    rows = shapes.padded_rows(ctx.parts, name, n_rows, shards,
                              prompts=ctx.spec.prompts_per_step // procs)
    out[name] = make_policy_batch(rs.prompts, rs.tokens, rs.mask, rs.advantages, rs.logp,
                                  rs.offpolicy, prompt_len=plen, num_rows=rows,
                                  loss_mask=rs.loss_mask, pad_id=ctx.pad_id, field=field)
    versions[name] = np.full((rows, rs.tokens.shape[1]), -1, np.int64)
    versions[name][:len(rs.prompts)] = np.where(rs.mask > 0, rs.versions, -1)
  return out, versions


# ----------------------------------------------------------------------------- the step


def rollout_step(ctx: RolloutContext, params, examples: list, key, *,
                 gfpo_state=None) -> Trajectory:
  """The rounds and the batches of the update's terms, as a :class:`Trajectory`.
  ``params``: a param pytree, or a :class:`~fbos_jax.engine.ParamsSource` (the
  policy and its version, read by the samplers)."""
  t0 = time.perf_counter()
  ctx.engine_stats = new_engine_stats(ctx)
  spec = ctx.spec
  if ctx.parts.sampling.engine == "continuous":  # each rollout verified as it stops
    rounds = stream.streamed_rounds if spec.round2 and spec.stream_rounds else \
        stream.barrier_rounds
    r1, r2, vs1, vs2 = rounds(ctx, params, examples, key)
    m = {"time/rounds_s": time.perf_counter() - t0}
  else:
    k1, k2 = jax.random.split(key)
    r1 = round1(ctx, params, examples, k1)
    t1 = time.perf_counter()
    vs1 = verify(ctx, r1, examples)
    m = {"time/sample1_s": t1 - t0, "time/verify_s": time.perf_counter() - t1}
    r2 = vs2 = None
    if spec.round2:
      t2 = time.perf_counter()
      r2 = round2(ctx, params, examples, r1, k2)
      vs2 = verify(ctx, r2, examples)
      m["time/round2_s"] = time.perf_counter() - t2
  return trajectory(ctx, examples, r1, r2, vs1, vs2, m, gfpo_state, t0)


def trajectory(ctx: RolloutContext, examples: list, r1: Rollouts, r2: Optional[Rollouts],
               vs1: dict, vs2: Optional[dict], m: dict, gfpo_state, t0: float) -> Trajectory:
  """A step's :class:`Trajectory` from its verified rounds (``vs1`` / ``vs2``: the
  pool's stats of each; ``m``: the step's timings so far; ``t0``: when it began):
  GFPO, the batches of the update's terms, the metrics."""
  spec = ctx.spec
  for k in [k for k in (vs2 or {}) if k.startswith("rollout/")]:  # the engine's rounds
    m[k] = vs2.pop(k)
  m.update(round1_metrics(r1, ctx.threshold), **verifier_metrics(vs1, "round1"))
  if r2 is not None:
    m.update(verifier_metrics(vs2, "round2"))
    m.update(round2_metrics(r1, r2, ctx.threshold))
  if spec.gfpo:
    gfpo_state, gm = gfpo_select(ctx, r1, gfpo_state)
    m.update(gm)
  gen_tokens = int(r1.mask.sum()) + (int(r2.mask.sum()) if r2 is not None else 0)
  rowsets = {}
  for name in spec.batch_names:
    rowsets[name], bm = batch_kinds.kind(name).build(ctx, examples, r1, r2)
    m.update(bm)
  batches, versions = pad_batches(ctx, rowsets)
  m.update(_verifier_totals(m))
  m.update(_sampler_metrics(ctx, [r for r in (r1, r2) if r is not None]))
  m["time/rollout_s"] = time.perf_counter() - t0
  m["tokens/generated"] = gen_tokens
  m["rollouts/generated"] = int(r1.valid.sum()) + (int(r2.valid.sum()) if r2 is not None else 0)
  return Trajectory(batches, versions, m, gfpo_state, list(examples))


def new_engine_stats(ctx: RolloutContext):
  if ctx.parts.sampling.engine != "continuous":
    return None
  from fbos_jax.engine import EngineStats
  return EngineStats()


def _sampler_metrics(ctx: RolloutContext, rounds: list) -> dict:
  """``rollout/slot_util``: generated tokens / slot-steps computed (the static
  sampler runs every row of a call to its longest row); the critical path:
  ``rollout/decode_steps`` (sequential decode steps), ``rollout/slot_steps`` and
  ``rollout/kv_reads`` (positions generated tokens attend to; the static sampler's
  finished rows read theirs too); with the continuous engine also
  ``rollout/pages_peak``, ``rollout/windows``, ``rollout/refills`` and
  ``time/verify_wait_s`` (the engine waited on verdicts). The static figures
  count one sampler call per round (rounds larger than the largest
  ``sampling.batch_buckets`` are split into more)."""
  st = ctx.engine_stats
  if st is not None:
    return {"rollout/slot_util": st.slot_util, "rollout/pages_peak": st.pages_peak,
            "rollout/windows": st.windows, "rollout/refills": st.refills,
            "rollout/decode_steps": st.decode_steps, "rollout/slot_steps": st.slot_steps,
            "rollout/kv_reads": st.kv_reads, "time/verify_wait_s": st.verify_wait_s}
  tokens = sum(int(ro.lengths[ro.valid].sum()) for ro in rounds)
  longest = [int(ro.lengths[ro.valid].max(initial=0)) for ro in rounds]
  rows = [int(ro.valid.sum()) for ro in rounds]
  steps = sum(r * t for r, t in zip(rows, longest))
  ctx_len = [max((len(c) for cs in ro.contexts for c in cs), default=0) for ro in rounds]
  kv = sum(r * (t * c + t * (t - 1) // 2) for r, t, c in zip(rows, longest, ctx_len))
  return {"rollout/slot_util": tokens / steps if steps else 0.0,
          "rollout/decode_steps": sum(longest), "rollout/slot_steps": steps,
          "rollout/kv_reads": kv}


def _verifier_totals(m: dict) -> dict:
  """``verifier/calls``, ``verifier/errors`` and ``verifier/<kind>`` over the step's rounds."""
  from fbos_jax.verifiers.base import ERROR_KINDS
  out = {}
  for k in ("calls", "errors") + ERROR_KINDS:
    out[f"verifier/{k}"] = sum(v for key, v in m.items()
                               if key.startswith(f"verifier/{k}_round"))
  return out
