"""The feedback-reading probe (issue 24): does the policy read the FAP?

On one batch of prompts, without any update:

1. **Round 1**: n rollouts per prompt q, verified (the rollout's own phases).
2. For every **failed** round-1 rollout i (reward below the success threshold,
   a real verdict) it builds five contexts, all from **that same rollout**:

   ========== =============================================================
   kind        context
   ========== =============================================================
   fap         FAP(q, o_i, F_i): the real feedback-augmented prompt
   swapped     FAP(q, o_i, F_j): the feedback of a failed rollout j of
               **another** prompt (drawn at random; so it talks about another
               problem)
   no_feedback FAP(q, o_i, ""): the attempt without its feedback
   no_attempt  FAP(q, "", F_i): the feedback without the attempt
   q           q itself: a fresh sample, i.e. resampling
   ========== =============================================================

3. For each kind: one sample per context, verified (``solve_<kind>``: the share
   of the failed rollouts that the context solves; ``solve_fap`` is the fix
   rate, ``solve_q`` the **fresh resample rate**), and the teacher-forced
   log-probability of the gold response (the reference solution + EOS) given
   the context (``logp_gold_<kind>``, in nats, summed over the response tokens,
   of the temperature-scaled policy as sampled).

Every figure is also given on the rows of **all-fail groups** (no round-1
success: where GRPO has no signal), with the suffix ``_allfail``. Besides the
fresh resample rate, ``resample_r1`` is the resample rate as
``fbos_jax.rl.rounds.round2_metrics`` defines it (the round-1 success rate of
the rows' prompts); on all-fail groups it is 0 by construction, which is why
the fresh sample from q is the baseline of the ratio ``fix_over_resample``
(``solve_fap / solve_q``). ``fap_raises_logp`` is the share of failed rollouts
whose FAP gives the gold response a higher log-probability than q does.

:func:`probe_batch` returns the per-batch sums (``n_*``, ``sum_*``) that
:func:`pool` adds up over batches (so a batch with few failures weighs little);
:func:`summarize` turns the pooled sums into the rates above. The RL loop can
call :func:`probe_metrics` on a step's prompts every few steps and log its
``probe/*`` dict. ``launch/compare.py --probe_only`` runs it on the warm starts.

It uses the rollout's own pieces: ``rounds.round1`` + ``rounds.verify`` for
the round-1 rows, ``RolloutContext.sample`` / ``verify`` for the control samples
and ``RolloutContext.prompts`` for the FAPs.
"""

from __future__ import annotations

import dataclasses
import functools
import random
from typing import Optional

import jax
import numpy as np

from fbos_jax import buckets
from fbos_jax import sharding as sh
from fbos_jax import tasks as tasks_lib
from fbos_jax import templates
from fbos_jax.rl import batch as batch_lib
from fbos_jax.rl import objectives
from fbos_jax.rl import rounds

KINDS = ("fap", "swapped", "no_feedback", "no_attempt", "q")
SUBSETS = ("", "_allfail")  # all failed rollouts; those of all-fail groups


@dataclasses.dataclass
class ProbeRows:
  """The failed round-1 rollouts of one batch and what each kind made of them.

  rows:      [N, 2] (prompt, sample) of each failed round-1 rollout
  partner:   [N] the row (index into ``rows``) whose feedback the ``swapped``
             context carries (-1: no other prompt failed; no swapped context)
  allfail:   [N] bool, the row's group has no round-1 success
  contexts:  {kind: N token-id lists} (``swapped`` rows without a partner: [])
  solved:    {kind: [N] bool}, the kind's one sample is correct
  logp_gold: {kind: [N] float}, log p(gold response | context), nats
  valid:     {kind: [N] bool}, the kind has a context for the row
  """
  rows: np.ndarray
  partner: np.ndarray
  allfail: np.ndarray
  contexts: dict
  solved: dict
  logp_gold: dict
  valid: dict


def _round1(ctx, params, examples, key):
  """Round 1 and its verdicts: the probe's one use of the rollout phases."""
  r1 = rounds.round1(ctx, params, examples, key)
  rounds.verify(ctx, r1, examples)
  return r1


def failed_rows(r1, threshold: float) -> np.ndarray:
  """[N, 2] (prompt, sample) of the round-1 rows that failed with a real verdict."""
  failed = r1.ok & (r1.rewards < threshold)
  return np.argwhere(failed)


def swap_partners(rows: np.ndarray, rng: random.Random) -> np.ndarray:
  """For each failed row, another failed row of a **different** prompt, drawn at
  random (-1 when no other prompt has a failed row)."""
  out = np.full(len(rows), -1, np.int64)
  for j, (p, _) in enumerate(rows):
    others = np.flatnonzero(rows[:, 0] != p)
    if len(others):
      out[j] = int(others[rng.randrange(len(others))])
  return out


def build_contexts(ctx, examples, r1, rows: np.ndarray, partner: np.ndarray) -> dict:
  """{kind: N token-id lists}, every kind built from the same failed rollouts."""
  out = {k: [] for k in KINDS}
  fap = lambda ex, text, fb: ctx.prompts.fap(ex["prompt"], text, fb).token_ids
  for j, (p, i) in enumerate(rows):
    ex, text, fb = examples[p], r1.texts[p][i], r1.feedback[p][i]
    out["fap"].append(fap(ex, text, fb))
    if partner[j] >= 0:
      pp, pi = rows[partner[j]]
      out["swapped"].append(fap(ex, text, r1.feedback[pp][pi]))
    else:
      out["swapped"].append([])
    out["no_feedback"].append(fap(ex, text, ""))
    out["no_attempt"].append(fap(ex, "", fb))
    out["q"].append(ctx.prompt_ids(ex))
  return out


def gold_ids(ctx, example, solution_field: str = "") -> list:
  """The gold response's ids (the reference solution, as the SFT warm start
  writes it, + EOS)."""
  field = solution_field
  text = str(example[field]) if field and example.get(field) else tasks_lib.solve(example)
  return templates.encode_plain(ctx.tokenizer, text) + [int(ctx.tokenizer.eos_token_id)]


@functools.lru_cache(maxsize=8)
def _logprob_fn(model_cfg, temperature: float, vocab_limit: int):
  def fn(params, batch):
    logp, _ = objectives.sequence_logprobs(params, model_cfg, batch, temperature=temperature,
                                           compute_entropy=False, vocab_limit=vocab_limit)
    return (logp * batch.loss_mask).sum(-1)
  return jax.jit(fn)


def gold_logprobs(ctx, params, contexts: list, golds: list) -> np.ndarray:
  """[N] teacher-forced log p(gold | context), summed over the gold's tokens, of
  the policy as sampled (``sampling.temperature``), in one batch per call."""
  n = len(contexts)
  if not n:
    return np.zeros(0, np.float32)
  r = max(len(g) for g in golds)
  tokens = np.full((n, r), ctx.pad_id, np.int32)
  mask = np.zeros((n, r), np.int32)
  for j, g in enumerate(golds):
    tokens[j, :len(g)] = g
    mask[j, :len(g)] = 1
  sp = ctx.parts.sampling
  plen = buckets.pick_bucket(max(len(c) for c in contexts),
                             sorted(set(sp.round1.prompt_buckets) | set(sp.round2.prompt_buckets)),
                             what="probe context",
                             field="sampling.fap_prompt_buckets / templates.max_prompt_tokens")
  shards = max(sh.batch_shard_count(ctx.mesh, ctx.rules) // jax.process_count(), 1)
  batch = batch_lib.make_policy_batch(
      contexts, tokens, mask, np.zeros(n, np.float32), np.zeros((n, r), np.float32),
      np.zeros(n, bool), prompt_len=plen, num_rows=buckets.bucket_rows(n, shards),
      pad_id=ctx.pad_id, field="sampling.fap_prompt_buckets")
  batch = jax.tree.map(lambda a: sh.put_process_local(a, ctx.mesh, ctx.rules), batch)
  fn = _logprob_fn(ctx.model_cfg, float(sp.round1.temperature) or 1.0,
                   ctx.parts.update.loss.vocab_limit)
  with jax.set_mesh(ctx.mesh):
    out = fn(params, batch)
  return np.asarray(jax.device_get(out), np.float32)[:n]


def _sample_and_verify(ctx, params, examples, rows, contexts, key, *, fap: bool):
  """One sample per context at the sampling temperature -> [N] solved."""
  if not contexts:
    return np.zeros(0, bool)
  sp = ctx.parts.sampling
  texts = ctx.sample(params, contexts, 1, key, sp.round2 if fap else sp.round1).texts
  rewards, _, errors, _ = ctx.verify([examples[p] for p, _ in rows], texts)
  return (rewards >= ctx.threshold) & ~errors


def probe_rows(ctx, params, examples: list, key, *, seed: int = 0,
               solution_field: str = "") -> tuple:
  """Round 1 on ``examples`` and the five kinds on its failed rollouts:
  (round-1 Rollouts, :class:`ProbeRows`)."""
  k1, k2 = jax.random.split(key)
  r1 = _round1(ctx, params, examples, k1)
  rows = failed_rows(r1, ctx.threshold)
  partner = swap_partners(rows, random.Random(seed))
  successes = ((r1.rewards >= ctx.threshold) & r1.ok).sum(axis=1)
  allfail = successes[rows[:, 0]] == 0 if len(rows) else np.zeros(0, bool)
  contexts = build_contexts(ctx, examples, r1, rows, partner)
  golds = [gold_ids(ctx, examples[p], solution_field) for p, _ in rows]
  solved, logp, valid = {}, {}, {}
  for idx, kind in enumerate(KINDS):
    ok = np.asarray([len(c) > 0 for c in contexts[kind]], bool)
    sel = np.flatnonzero(ok)
    ctxs = [contexts[kind][j] for j in sel]
    s = np.zeros(len(rows), bool)
    lp = np.full(len(rows), np.nan, np.float32)
    s[sel] = _sample_and_verify(ctx, params, examples, rows[sel], ctxs,
                                jax.random.fold_in(k2, idx), fap=kind != "q")
    lp[sel] = gold_logprobs(ctx, params, ctxs, [golds[j] for j in sel])
    solved[kind], logp[kind], valid[kind] = s, lp, ok
  return r1, ProbeRows(rows=rows, partner=partner, allfail=allfail, contexts=contexts,
                       solved=solved, logp_gold=logp, valid=valid)


def batch_sums(r1, pr: ProbeRows, threshold: float) -> dict:
  """The per-batch sums and counts that :func:`pool` adds and :func:`summarize`
  divides."""
  solved1 = (r1.rewards >= threshold) & r1.ok
  out = {"n_prompts": int(r1.shape[0]), "n_rollouts": int(r1.ok.sum()),
         "n_solved_r1": int(solved1.sum()), "n_allfail_groups": int((~solved1.any(1)).sum())}
  rate = solved1.sum(1) / np.maximum(r1.ok.sum(1), 1)  # round-1 success rate per prompt
  for sub in SUBSETS:
    m = pr.allfail if sub else np.ones(len(pr.rows), bool)
    out[f"n_failed{sub}"] = int(m.sum())
    out[f"sum_resample_r1{sub}"] = float(rate[pr.rows[m, 0]].sum()) if m.any() else 0.0
    both = m & pr.valid["fap"] & pr.valid["q"]
    out[f"n_raises{sub}"] = int(both.sum())
    out[f"sum_raises{sub}"] = int((pr.logp_gold["fap"][both] > pr.logp_gold["q"][both]).sum())
    for kind in KINDS:
      v = m & pr.valid[kind]
      out[f"n_{kind}{sub}"] = int(v.sum())
      out[f"sum_solve_{kind}{sub}"] = int(pr.solved[kind][v].sum())
      out[f"sum_logp_{kind}{sub}"] = float(pr.logp_gold[kind][v].sum())
  return out


def pool(sums: list) -> dict:
  """Adds the per-batch sums of :func:`batch_sums` over batches."""
  out: dict = {}
  for s in sums:
    for k, v in s.items():
      out[k] = out.get(k, 0) + v
  out["batches"] = len(sums)
  return out


def summarize(p: dict) -> dict:
  """Rates from pooled sums: ``solve_<kind>[_allfail]``, ``logp_gold_<kind>[_allfail]``,
  ``resample_r1[_allfail]``, ``fix_over_resample[_allfail]``, ``fap_raises_logp[_allfail]``,
  round-1 success and all-fail groups (NaN where there are no rows)."""
  div = lambda a, b: float(a) / b if b else float("nan")
  out = {"batches": p.get("batches", 1),
         "round1_solved": div(p["n_solved_r1"], p["n_rollouts"]),
         "all_fail_groups": div(p["n_allfail_groups"], p["n_prompts"])}
  for sub in SUBSETS:
    out[f"failed_rows{sub}"] = int(p[f"n_failed{sub}"])
    out[f"resample_r1{sub}"] = div(p[f"sum_resample_r1{sub}"], p[f"n_failed{sub}"])
    for kind in KINDS:
      out[f"solve_{kind}{sub}"] = div(p[f"sum_solve_{kind}{sub}"], p[f"n_{kind}{sub}"])
      out[f"logp_gold_{kind}{sub}"] = div(p[f"sum_logp_{kind}{sub}"], p[f"n_{kind}{sub}"])
    out[f"fap_raises_logp{sub}"] = div(p[f"sum_raises{sub}"], p[f"n_raises{sub}"])
    out[f"fix_over_resample{sub}"] = div(out[f"solve_fap{sub}"], out[f"solve_q{sub}"]) \
        if out[f"solve_q{sub}"] > 0 else float("inf") if out[f"solve_fap{sub}"] > 0 \
        else float("nan")
  return out


def probe_batch(ctx, params, examples: list, key, *, seed: int = 0) -> dict:
  """The per-batch sums of one batch (:func:`batch_sums`)."""
  r1, pr = probe_rows(ctx, params, examples, key, seed=seed)
  return batch_sums(r1, pr, ctx.threshold)


def probe_metrics(ctx, params, examples: list, key, *, seed: int = 0) -> dict:
  """``{"probe/<rate>": value}`` of one batch, for the RL loop's metrics (e.g.
  on the step's prompts every few steps; it samples about 4x the failed rows
  of round 1 again, so not every step)."""
  return {f"probe/{k}": v for k, v in
          summarize(pool([probe_batch(ctx, params, examples, key, seed=seed)])).items()}


def run_probe(ctx, params, next_batch, batches: int, *, key) -> dict:
  """The probe over ``batches`` batches from ``next_batch()``, pooled:
  :func:`summarize` of the pooled sums, plus ``sums`` (the pooled sums). ``key``:
  the caller's stream (a run's ``stream_key(rng, "eval", ...)``)."""
  sums = [probe_batch(ctx, params, next_batch(), jax.random.fold_in(key, b), seed=b)
          for b in range(batches)]
  pooled = pool(sums)
  return dict(summarize(pooled), sums=pooled)


def markdown(results: dict) -> str:
  """A table of :func:`summarize` outputs, one row per label."""
  if not results:
    return ""
  lines = []
  head = ["warm start", "round-1 solved", "all-fail groups", "failed rollouts (in all-fail)"]
  for sub, name in (("", "failed"), ("_allfail", "all-fail")):
    head += [f"fix (FAP) {name}", f"resample (fresh q) {name}", f"fix/resample {name}"]
  head += ["log p(gold ∣ FAP)", "log p(gold ∣ q)", "FAP raises log p"]
  lines.append("| " + " | ".join(head) + " |")
  lines.append("|" + "---|" * len(head))
  f = lambda x: "inf" if np.isinf(x) else ("n/a" if np.isnan(x) else f"{x:.3f}")
  for label, s in results.items():
    row = [label, f(s["round1_solved"]), f(s["all_fail_groups"]),
           f"{s['failed_rows']} ({s['failed_rows_allfail']})"]
    for sub in SUBSETS:
      row += [f(s[f"solve_fap{sub}"]), f(s[f"solve_q{sub}"]), f(s[f"fix_over_resample{sub}"])]
    row += [f(s["logp_gold_fap"]), f(s["logp_gold_q"]), f(s["fap_raises_logp"])]
    lines.append("| " + " | ".join(row) + " |")
  lines.append("")
  head = ["warm start", "rows"] + [f"solve {k}" for k in KINDS] + [f"log p(gold ∣ {k})" for k in KINDS]
  lines.append("Controls on the same failed rollouts (all failed / all-fail groups):")
  lines.append("")
  lines.append("| " + " | ".join(head) + " |")
  lines.append("|" + "---|" * len(head))
  for label, s in results.items():
    for sub, name in (("", "all failed"), ("_allfail", "all-fail groups")):
      row = [f"{label}, {name}", str(s[f"failed_rows{sub}"])]
      row += [f(s[f"solve_{k}{sub}"]) for k in KINDS]
      row += [f(s[f"logp_gold_{k}{sub}"]) for k in KINDS]
      lines.append("| " + " | ".join(row) + " |")
  return "\n".join(lines)
