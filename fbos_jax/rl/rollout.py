"""One step's rollout as named phases: round 1 -> verify -> round 2 -> the batches.

Every phase is a small function over :class:`Rollouts`, which keep an explicit
group axis: a round has ``[P, n]`` rows, row ``[p, i]`` being sample ``i`` of
prompt ``p``. Nothing here branches on an algorithm's name; the config says
which phases run and which batches the terms of the objective need::

    round1      [P, n] rollouts of the prompts q (or FCP's <EF>c+</EF>q)
    verify      rewards, feedback and error flags from the verifier pool
    ROUND2      "single":     m rollouts per prompt from its FAP(q, o_i, F_i)s
                "aggregated": m rollouts per prompt from GOLF's one prompt
    BATCHES     "epa":  round-1 rows on q + selected round-2 rows re-scored on q
                "ecc":  round-2 rows on their FAPs
                "fcp":  round-1 rows on <EF>c</EF>q, c their own feedback

The host does text (prompts, decoding, verification) and numpy; the device runs
the samplers. Row sets become padded :class:`PolicyBatch`es in
:func:`pad_batches`, the one place where hosts agree on shapes, once per step.
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
from fbos_jax.model import qwen
from fbos_jax.rl import assemble
from fbos_jax.rl.batch import PolicyBatch, make_policy_batch


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
  rewards:  [P, n] float32, feedback [P][n] str, is_error [P, n] bool: from verify
  texts:    [P][n] decoded responses
  truncated:[P, n] bool   round 2: the row's prompt (FAP or aggregated prompt) had
                          its response or feedback cut to fit templates.max_prompt_tokens
  """
  contexts: list
  tokens: np.ndarray
  mask: np.ndarray
  logp: np.ndarray
  lengths: np.ndarray
  valid: np.ndarray
  source: np.ndarray
  texts: list
  rewards: Optional[np.ndarray] = None
  feedback: Optional[list] = None
  is_error: Optional[np.ndarray] = None
  truncated: Optional[np.ndarray] = None

  @property
  def shape(self) -> tuple:
    return self.valid.shape

  @property
  def ok(self) -> np.ndarray:
    """[P, n] rows that exist and have a real verdict."""
    return self.valid & ~self.is_error


@dataclasses.dataclass
class RowSet:
  """Rows of one batch before padding (k rows, response length R)."""
  prompts: list  # k token-id lists
  tokens: np.ndarray  # [k, R]
  mask: np.ndarray  # [k, R]
  logp: np.ndarray  # [k, R]
  advantages: np.ndarray  # [k]
  offpolicy: np.ndarray  # [k] bool
  loss_mask: np.ndarray  # [k, R] float32
  prompt_buckets: tuple  # the buckets its prompts are padded to
  field: str  # the config field of those buckets (for errors)
  max_rows: int  # the most rows this batch can have (rl.fixed_row_buckets)


class RolloutContext:
  """What the phases need: the config, the environment (tokenizer, templates,
  verifier pool, data) and the mesh the samplers run on.

  Building it checks the feedback-prompt budget once
  (:func:`fbos_jax.rl.env.check_fap_budget`): a ``templates.max_prompt_tokens``
  below the longest FAP the task can produce warns (``templates.truncation=error``:
  raises), naming the field and the length needed. ``fap_budget`` keeps the bound."""

  def __init__(self, config, env, mesh, model_cfg: qwen.ModelConfig):
    from fbos_jax.rl import env as env_lib
    self.config, self.env, self.mesh, self.model_cfg = config, env, mesh, model_cfg
    self.rules = sh.rules_dict(config.mesh.rules)
    self.rl = config.rl
    self.threshold = float(config.verifier.success_threshold)
    tokenizer = getattr(env, "tokenizer", None)
    self.fap_budget = (env_lib.check_fap_budget(config, tokenizer)
                       if tokenizer is not None else None)

  def sample(self, params, contexts: list, n: int, key, *, temperature=None,
             prompt_buckets=None) -> tuple:
    """n samples per context -> (tokens, mask, logp [N*n, R], lengths [N*n], texts)."""
    sc = self.config.sampling
    out = self.env.sample(params, self.model_cfg, contexts, n=n, key=key, mesh=self.mesh,
                          rules=self.rules,
                          temperature=sc.temperature if temperature is None else temperature,
                          prompt_buckets=tuple(prompt_buckets or sc.prompt_buckets))
    texts = self.env.decode(out.tokens, out.lengths) if out.tokens.shape[0] else []
    return (np.asarray(out.tokens, np.int32), np.asarray(out.response_mask, np.int32),
            np.asarray(out.logprobs, np.float32), np.asarray(out.lengths, np.int32), texts)


# ----------------------------------------------------------------------------- phases


def _grouped(valid: np.ndarray, flat_rows: tuple, contexts: list, source: np.ndarray,
             r: int, truncated: Optional[list] = None) -> Rollouts:
  """Scatter the sampled rows (row-major over ``valid``) into a [P, n] Rollouts
  (``truncated``: one flag per sampled row, whose prompt was cut)."""
  p, n = valid.shape
  tokens, mask, logp, lengths, texts = flat_rows
  idx = np.flatnonzero(valid.reshape(-1))

  def scatter(x, fill, dtype):
    out = np.full((p * n,) + x.shape[1:], fill, dtype)
    out[idx] = x
    return out.reshape((p, n) + x.shape[1:])

  grid_texts = [[""] * n for _ in range(p)]
  grid_ctx = [[[] for _ in range(n)] for _ in range(p)]
  for k, j in enumerate(idx):
    grid_texts[j // n][j % n] = texts[k]
    grid_ctx[j // n][j % n] = contexts[k]
  cut = np.zeros(len(idx), bool) if truncated is None else np.asarray(truncated, bool)
  return Rollouts(contexts=grid_ctx,
                  tokens=scatter(tokens.reshape(-1, r), 0, np.int32),
                  mask=scatter(mask.reshape(-1, r), 0, np.int32),
                  logp=scatter(logp.reshape(-1, r), 0.0, np.float32),
                  lengths=scatter(lengths.reshape(-1), 0, np.int32), valid=valid.copy(),
                  source=source, texts=grid_texts, truncated=scatter(cut, False, bool))


def prompt_ids(ctx: RolloutContext, example) -> list:
  """The round-1 (and eval) context of an example: q, or <EF>c+</EF>q (rl.prompt=fcp).
  A prompt too long for the template budget or the largest prompt bucket raises,
  naming the record (file:line and id) and the fields that decide it."""
  from fbos_jax import data as data_lib
  from fbos_jax import templates
  longest = max(int(b) for b in ctx.config.sampling.prompt_buckets)
  hint = (f"raise the budget, or drop such records at load with "
          f"--config.data.max_prompt_tokens=N (data.over_long=filter)")
  try:
    if ctx.rl.prompt == "fcp":
      ids = ctx.env.fcp_prompt(example, ctx.rl.fcp_positive_feedback)
    else:
      ids = ctx.env.prompt_ids(example)
  except templates.PromptTooLongError as e:
    raise buckets.BucketError(f"the prompt of {data_lib.locate(example)}: {e} "
                              f"(templates.max_prompt_tokens); {hint}") from None
  if len(ids) > longest:
    raise buckets.BucketError(
        f"the prompt of {data_lib.locate(example)} has {len(ids)} tokens, more than the largest "
        f"sampling.prompt_buckets={longest}; {hint}")
  return ids


def round1(ctx: RolloutContext, params, examples: list, key) -> Rollouts:
  """n rollouts per prompt: [P, n]."""
  n, r = ctx.rl.group_size, ctx.config.sampling.max_new_tokens
  q = [prompt_ids(ctx, ex) for ex in examples]
  rows = ctx.sample(params, q, n, key)
  valid = np.ones((len(examples), n), bool)
  return _grouped(valid, rows, [c for c in q for _ in range(n)],
                  np.full(valid.shape, -1, np.int64), r)


def verify(ctx: RolloutContext, ro: Rollouts, examples: list) -> dict:
  """Score every valid row in the pool; error verdicts are flagged, never feedback."""
  p, n = ro.shape
  idx = np.flatnonzero(ro.valid.reshape(-1))
  texts = [ro.texts[j // n][j % n] for j in idx]
  rewards, feedback, errors, stats = ctx.env.verify([examples[j // n] for j in idx], texts)
  ro.rewards = np.zeros((p, n), np.float32)
  ro.is_error = np.zeros((p, n), bool)
  ro.feedback = [[""] * n for _ in range(p)]
  ro.rewards.reshape(-1)[idx] = np.where(errors, 0.0, rewards)
  ro.is_error.reshape(-1)[idx] = errors
  for k, j in enumerate(idx):
    ro.feedback[j // n][j % n] = "" if errors[k] else feedback[k]
  return stats


def round2_single(ctx: RolloutContext, params, examples: list, r1: Rollouts, key) -> Rollouts:
  """FBOS: m rollouts per prompt, spread round-robin over its FAP(q, o_i, F_i)s: [P, m]."""
  rl, r = ctx.rl, ctx.config.sampling.max_new_tokens
  selected = assemble.select_fap_sources(r1.rewards, rl.fap_from, ctx.threshold) & r1.ok
  r2_prompt, r2_source = assemble.round2_plan(selected, rl.round2_size, "single")
  built = {}  # one FAP per selected round-1 row, shared by its round-robin rows
  for p, s in zip(r2_prompt, r2_source):
    if (p, s) not in built:
      built[(p, s)] = ctx.env.fap(examples[p], r1.texts[p][s], r1.feedback[p][s])
  faps = [built[(p, s)].token_ids for p, s in zip(r2_prompt, r2_source)]
  cut = [built[(p, s)].truncated for p, s in zip(r2_prompt, r2_source)]
  rows = ctx.sample(params, faps, 1, key, prompt_buckets=ctx.config.sampling.fap_prompt_buckets)
  valid = np.zeros((len(examples), rl.round2_size), bool)
  valid[np.unique(r2_prompt).astype(int)] = True
  source = np.full(valid.shape, -1, np.int64)
  source[valid] = r2_source
  return _grouped(valid, rows, faps, source, r, cut)


def round2_aggregated(ctx: RolloutContext, params, examples: list, r1: Rollouts,
                      key) -> Rollouts:
  """GOLF: m rollouts per prompt from one prompt over its failed attempts: [P, m]."""
  rl, r = ctx.rl, ctx.config.sampling.max_new_tokens
  selected = assemble.select_fap_sources(r1.rewards, rl.fap_from, ctx.threshold) & r1.ok
  uniq = np.flatnonzero(selected.any(axis=1))
  built = [ctx.env.aggregated(examples[p], r1.texts[p], r1.feedback[p],
                              np.where(r1.ok[p], r1.rewards[p], np.inf)) for p in uniq]
  agg = [b.token_ids for b in built]
  rows = ctx.sample(params, agg, rl.round2_size, key,
                    prompt_buckets=ctx.config.sampling.fap_prompt_buckets)
  valid = np.zeros((len(examples), rl.round2_size), bool)
  valid[uniq] = True
  return _grouped(valid, rows, [a for a in agg for _ in range(rl.round2_size)],
                  np.full(valid.shape, -1, np.int64), r,
                  [b.truncated for b in built for _ in range(rl.round2_size)])


ROUND2: dict[str, Callable] = {"single": round2_single, "aggregated": round2_aggregated}


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
    src_r = np.where(r2.source >= 0,
                     np.take_along_axis(r1.rewards, np.maximum(r2.source, 0), axis=1), -np.inf)
    src_failed = ok & (src_r < threshold)
    fixed = r2.rewards >= threshold
    m["reward/round2"] = float(r2.rewards[ok].mean())
    m["feedback/fix_rate"] = float(fixed[src_failed].mean()) if src_failed.any() else 0.0
    m["feedback/fix_rows"] = int(src_failed.sum())
    m["response/length_round2"] = float(r2.lengths[ok].mean())
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


# ----------------------------------------------------------------------------- batches


def _flat_r2(r2: Optional[Rollouts]):
  """Round 2 as flat rows (row-major over valid): (rewards, prompt, source, flat index)."""
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


def _gfpo_keep(ctx, groups, r1: Rollouts, r2: Optional[Rollouts], gfpo_state):
  """GFPO's retention mask over the EPA groups, and the new difficulty history."""
  rl = ctx.rl
  n = r1.shape[1]
  r1_len = r1.lengths.reshape(-1)
  r2_len = r2.lengths.reshape(-1)[_flat_r2(r2)[3]] if r2 is not None else np.zeros(0, np.int32)
  member = np.maximum(groups.member, 0)
  lengths = np.where(groups.offpolicy, r2_len[np.minimum(member, max(len(r2_len) - 1, 0))]
                     if len(r2_len) else 0, r1_len[member])
  lengths = np.where(groups.valid, lengths, 0)
  k = rl.gfpo_k
  if rl.gfpo_adaptive:
    means = np.where(r1.ok, r1.rewards, 0).sum(1) / np.maximum(r1.ok.sum(1), 1)
    k_arr, gfpo_state = _adaptive_k(gfpo_state, means.astype(np.float32), n, tuple(rl.gfpo_k_map))
    k = np.asarray(k_arr)
  keep = assemble.gfpo_keep(groups.rewards, lengths, groups.valid, k, rl.gfpo_metric)
  m = {"gfpo/kept_frac": float(keep[groups.valid].mean()),
       "response/length_kept": float(lengths[keep].mean()) if keep.any() else 0.0}
  return keep, gfpo_state, m


@functools.partial(jax.jit, static_argnames=("group_size", "k_map"))
def _adaptive_k(state, means, group_size, k_map):
  return K.adaptive_k(state, means, group_size=group_size, k_map=k_map)


def epa_rows(ctx: RolloutContext, examples: list, r1: Rollouts, r2: Optional[Rollouts],
             gfpo_state, host_rng: np.random.Generator):
  """EPA's groups on q: round-1 rows (PPO clip) + selected round-2 rows pulled
  back onto q as off-policy samples (f(u)); advantages over the merged group.
  Returns (RowSet, metrics, new GFPO state)."""
  rl, n = ctx.rl, ctx.rl.group_size
  r2_rewards, r2_prompt, r2_source, r2_flat = _flat_r2(r2)
  r1_rewards = np.where(r1.ok, r1.rewards, 0.0)
  tau = rl.epa_tau if rl.epa_tau >= 0 else 1.0 / n
  groups = assemble.epa_groups(
      r1_rewards, r2_rewards, r2_prompt, r2_source, select=rl.epa_select, mode=rl.epa_mode,
      trigger=rl.epa_trigger, tau=tau, max_per_prompt=rl.epa_max_per_prompt,
      threshold=ctx.threshold, enabled=r2 is not None, rng=host_rng)
  groups.valid[:, :n] &= r1.ok | groups.offpolicy[:, :n]  # error verdicts leave the group
  m = {"epa/injected": groups.injected}
  keep = None
  if rl.gfpo_k or rl.gfpo_adaptive:
    keep, gfpo_state, gm = _gfpo_keep(ctx, groups, r1, r2, gfpo_state)
    m.update(gm)
  adv = assemble.advantages(groups.rewards, groups.valid, rl.advantage, rl.adv_eps, keep)
  vp, vg = np.nonzero(groups.valid)
  onp = ~groups.offpolicy[vp, vg]
  mem = groups.member[vp, vg]
  order = np.concatenate([np.flatnonzero(onp), np.flatnonzero(~onp)])  # on-policy rows first
  q = [prompt_ids(ctx, ex) for ex in examples]
  on = _rows(r1, mem[onp])  # round-1 members are flat [P*n] row indices
  off = _rows(r2, r2_flat[mem[~onp]]) if (~onp).any() else tuple(x[:0] for x in on)
  tokens, mask, logp = (np.concatenate([a, b]) for a, b in zip(on, off))
  loss_mask = mask.astype(np.float32)
  if keep is not None:
    loss_mask = loss_mask * keep[vp, vg][order][:, None]
  extra = rl.epa_max_per_prompt if (rl.round2 and rl.epa_mode == "append") else 0
  rows = RowSet([q[p] for p in vp[order]], tokens, mask, logp, adv[vp, vg][order],
                ~onp[order], loss_mask, tuple(ctx.config.sampling.prompt_buckets),
                "sampling.prompt_buckets", len(examples) * (n + extra))
  return rows, m, gfpo_state


def ecc_rows(ctx: RolloutContext, examples: list, r1: Rollouts, r2: Optional[Rollouts],
             gfpo_state, host_rng) -> tuple:
  """ECC: round-2 rows on their FAPs, on-policy, advantages over q's round-2 group
  (``ecc_advantage=group``) or of the improvement over their source."""
  rl = ctx.rl
  r2_rewards, r2_prompt, r2_source, r2_flat = _flat_r2(r2)
  r1_rewards = np.where(r1.ok, r1.rewards, 0.0)
  a2 = assemble.ecc_advantages(r1_rewards, r2_rewards, r2_prompt, r2_source,
                               mode=rl.ecc_advantage, estimator=rl.advantage, eps=rl.adv_eps)
  m = rl.round2_size
  if r2 is None:
    tokens = np.zeros((0, ctx.config.sampling.max_new_tokens), np.int32)
    mask, logp, contexts = tokens, tokens.astype(np.float32), []
  else:
    tokens, mask, logp = _rows(r2, r2_flat)
    contexts = [r2.contexts[j // m][j % m] for j in r2_flat]
  rows = RowSet(contexts, tokens, mask, logp, a2, np.zeros(len(a2), bool),
                mask.astype(np.float32), tuple(ctx.config.sampling.fap_prompt_buckets),
                "sampling.fap_prompt_buckets", len(examples) * m)
  return rows, {}, gfpo_state


def fcp_rows(ctx: RolloutContext, examples: list, r1: Rollouts, r2, gfpo_state,
             host_rng) -> tuple:
  """FCP's online bootstrap: round-1 rows re-conditioned on their fresh feedback
  c (c+ when correct), <EF>c</EF>q -> o, for the MLE term."""
  p, n = r1.shape
  flat = np.flatnonzero(r1.ok.reshape(-1))
  contexts = []
  for j in flat:
    ex, rew, fb = examples[j // n], r1.rewards.reshape(-1)[j], r1.feedback[j // n][j % n]
    contexts.append(ctx.env.fcp_prompt(ex, ctx.rl.fcp_positive_feedback
                                       if rew >= ctx.threshold else fb))
  tokens, mask, logp = _rows(r1, flat)
  rows = RowSet(contexts, tokens, mask, logp, np.ones(len(flat), np.float32),
                np.zeros(len(flat), bool), mask.astype(np.float32),
                tuple(ctx.config.sampling.fap_prompt_buckets), "sampling.fap_prompt_buckets",
                p * n)
  return rows, {}, gfpo_state


BATCHES: dict[str, Callable] = {"epa": epa_rows, "ecc": ecc_rows, "fcp": fcp_rows}


def pad_batches(ctx: RolloutContext, rowsets: dict) -> dict:
  """Row sets -> padded PolicyBatches whose shapes every host agrees on: the one
  cross-host shape agreement of a step (one all-gather of the sizes).

  Rows are padded to a power-of-two bucket (or, with ``rl.fixed_row_buckets``,
  to the most a batch can have: one update program per run), a multiple of this
  host's batch shards x micro-batches x mini-batches."""
  names = sorted(rowsets)
  local = []
  for name in names:
    rs = rowsets[name]
    local += [len(rs.prompts), max((len(c) for c in rs.prompts), default=1)]
  agreed = distributed.agree_max(*local)
  rl = ctx.rl
  shards = max(sh.batch_shard_count(ctx.mesh) // jax.process_count(), 1)
  mult = shards * max(rl.micro_batches, 1) * max(rl.mini_batches, 1)
  out = {}
  for i, name in enumerate(names):
    rs = rowsets[name]
    n_rows, longest = agreed[2 * i], agreed[2 * i + 1]
    if rl.fixed_row_buckets:
      n_rows = max(n_rows, rs.max_rows)
    plen = buckets.pick_bucket(longest, rs.prompt_buckets, what=f"{name} prompt",
                               field=rs.field)
    out[name] = make_policy_batch(rs.prompts, rs.tokens, rs.mask, rs.advantages, rs.logp,
                                  rs.offpolicy, prompt_len=plen,
                                  num_rows=buckets.bucket_rows(n_rows, mult),
                                  loss_mask=rs.loss_mask, pad_id=ctx.env.pad_id, field=rs.field)
  return out


# ----------------------------------------------------------------------------- the step


def rollout_step(ctx: RolloutContext, params, examples: list, key, *, step: int,
                 batch_names: tuple, gfpo_state=None) -> tuple[dict, dict, Any]:
  """Phases 1-2 and the batches of the terms ``batch_names``.

  Returns ({name: PolicyBatch (host numpy)}, metrics, new GFPO state)."""
  rl = ctx.rl
  k1, k2 = jax.random.split(key)
  host_rng = np.random.default_rng([ctx.config.seed, step])
  t0 = time.perf_counter()
  r1 = round1(ctx, params, examples, k1)
  t1 = time.perf_counter()
  vstats = verify(ctx, r1, examples)
  m = {"time/sample1_s": t1 - t0, "time/verify_s": time.perf_counter() - t1,
       **_round1_metrics(r1, ctx.threshold), **_verifier_metrics(vstats, "round1")}
  gen_tokens = int(r1.mask.sum())
  r2 = None
  if rl.round2:
    t2 = time.perf_counter()
    r2 = ROUND2[rl.fap_mode](ctx, params, examples, r1, k2)
    m.update(_verifier_metrics(verify(ctx, r2, examples), "round2"))
    m.update(round2_metrics(r1, r2, ctx.threshold))
    gen_tokens += int(r2.mask.sum())
    m["time/round2_s"] = time.perf_counter() - t2
  rowsets = {}
  for name in batch_names:
    rowsets[name], bm, gfpo_state = BATCHES[name](ctx, examples, r1, r2, gfpo_state, host_rng)
    m.update(bm)
  batches = pad_batches(ctx, rowsets)
  m["verifier/errors"] = sum(v for k, v in m.items() if k.startswith("verifier/errors_"))
  m["time/rollout_s"] = time.perf_counter() - t0
  m["tokens/generated"] = gen_tokens
  m["rollouts/generated"] = int(r1.valid.sum()) + (int(r2.valid.sum()) if r2 is not None else 0)
  return batches, m, gfpo_state


def probe_step(ctx: RolloutContext, params, examples: list, key, *,
               fap_mode: Optional[str] = None) -> dict:
  """Round 1, verify and a round 2 (``fap_mode``, default the config's) without
  building batches or updating: the metrics of a warm start (round-1 success,
  all-fail and all-equal groups, FAP truncation, fix rates), whatever the
  config's own ``rl.round2``."""
  k1, k2 = jax.random.split(key)
  r1 = round1(ctx, params, examples, k1)
  verify(ctx, r1, examples)
  m = _round1_metrics(r1, ctx.threshold)
  r2 = ROUND2[fap_mode or ctx.rl.fap_mode](ctx, params, examples, r1, k2)
  verify(ctx, r2, examples)
  m.update(round2_metrics(r1, r2, ctx.threshold))
  return m


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
  out = {f"verifier/{k.split('/', 1)[-1]}_{round_name}": float(v) for k, v in stats.items()
         if k.split("/", 1)[-1] in ("errors", "error_rate")}
  out[f"verifier/errors_{round_name}"] = float(stats.get("verifier/errors", 0))
  return out
