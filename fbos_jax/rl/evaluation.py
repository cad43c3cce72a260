"""Held-out evaluation: greedy pass@1, and unbiased pass@k at temperature 1."""

from __future__ import annotations

import jax
import numpy as np

from fbos_jax import distributed
from fbos_jax.rl import assemble
from fbos_jax.rl.rollout import RolloutContext, prompt_ids


def evaluate(ctx: RolloutContext, params, examples: list, *, k: int = 1, step: int = 0) -> dict:
  """Accuracy on ``examples`` (this host's share of the held-out set).

  * ``eval/accuracy``: one sample per prompt at ``sampling.eval_temperature``
    (greedy by default), and per difficulty level of procedural tasks
    (``eval/accuracy_d{level}``);
  * with ``k > 1``: ``eval/pass@k`` and ``eval/pass@1_sampled`` (the mean of
    k samples) at temperature 1, unbiased estimators.

  A row whose verification failed (an error verdict) is left out of the
  accuracies and counted in ``eval/verifier_errors``; it is never scored as wrong.
  """
  thr = ctx.threshold
  ids = [prompt_ids(ctx, ex) for ex in examples]
  key = jax.random.key(10_000 + step)
  tokens, mask, logp, lengths, texts = ctx.sample(
      params, ids, 1, key, temperature=ctx.config.sampling.eval_temperature)
  rewards, _, errors, _ = ctx.env.verify(examples, texts)
  ok = ~errors
  solved = rewards >= thr
  out = {"eval/accuracy": float(solved[ok].mean()) if ok.any() else float("nan"),
         "eval/length": float(lengths.mean()), "eval/verifier_errors": float(errors.sum())}
  levels = np.asarray([ex.get("difficulty", -1) for ex in examples])
  known = sorted(set(levels.tolist()) - {-1})
  for d in known if len(known) > 1 else ():
    sel = (levels == d) & ok
    out[f"eval/accuracy_d{d}"] = float(solved[sel].mean()) if sel.any() else float("nan")
  if k > 1:
    _, _, _, _, texts_k = ctx.sample(params, ids, k, key, temperature=1.0)
    rewards_k, _, errors_k, _ = ctx.env.verify([ex for ex in examples for _ in range(k)],
                                               texts_k)
    correct = ((rewards_k >= thr) & ~errors_k).reshape(len(examples), k)
    usable = (~errors_k).reshape(len(examples), k).sum(1)
    rows = [(int(u), int(c)) for u, c in zip(usable, correct.sum(1)) if u >= k]
    out[f"eval/pass@{k}"] = float(np.mean([assemble.pass_at_k(u, c, k) for u, c in rows]))
    out["eval/pass@1_sampled"] = float(np.mean([assemble.pass_at_k(u, c, 1) for u, c in rows]))
  return distributed.mean_over_processes(out)  # every host holds an equal share
