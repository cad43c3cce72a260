"""Held-out evaluation: greedy pass@1, and unbiased pass@k at temperature 1."""

from __future__ import annotations

import jax
import numpy as np

from fbos_jax import distributed
from fbos_jax.rl import assemble
from fbos_jax.rl.context import RolloutContext


def evaluate(ctx: RolloutContext, params, examples: list, *, key, k: int = 1) -> dict:
  """Accuracy on ``examples`` (this host's share of the held-out set); ``key``:
  the run's ``eval`` stream at this step (``fbos_jax.rl.state.stream_key``).

  * ``eval/accuracy``: one sample per prompt at ``sampling.eval_temperature``
    (greedy by default), and per difficulty level of procedural tasks
    (``eval/accuracy_d{level}``);
  * with ``k > 1``: ``eval/pass@k`` and ``eval/pass@1_sampled`` (the mean of
    k samples) at temperature 1, unbiased estimators.

  A row whose verification failed (an error verdict) is left out of the
  accuracies and counted in ``eval/verifier_errors``; it is never scored as wrong.
  """
  thr = ctx.threshold
  ids = [ctx.prompt_ids(ex) for ex in examples]
  k_greedy, k_sampled = jax.random.split(key)
  greedy = ctx.sample(params, ids, 1, k_greedy, ctx.parts.sampling.eval)
  lengths, texts = greedy.lengths, greedy.texts
  rewards, _, errors, _ = ctx.verify(examples, texts)
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
    texts_k = ctx.sample(params, ids, k, k_sampled, ctx.parts.sampling.eval_sampled).texts
    rewards_k, _, errors_k, _ = ctx.verify([ex for ex in examples for _ in range(k)],
                                               texts_k)
    correct = ((rewards_k >= thr) & ~errors_k).reshape(len(examples), k)
    usable = (~errors_k).reshape(len(examples), k).sum(1)
    rows = [(int(u), int(c)) for u, c in zip(usable, correct.sum(1)) if u >= k]
    out[f"eval/pass@{k}"] = float(np.mean([assemble.pass_at_k(u, c, k) for u, c in rows]))
    out["eval/pass@1_sampled"] = float(np.mean([assemble.pass_at_k(u, c, 1) for u, c in rows]))
  return distributed.mean_over_processes(out)  # every host holds an equal share


def evaluate_checkpoint(config, workdir: str, *, k: int = 1, step: int = -1,
                        init_from_hf: str = "") -> dict:
  """Held-out accuracy of checkpoint ``step`` (-1 = latest) of ``workdir``: only
  its params are restored (``fbos_jax.rl.state.restore_params``), on the config's
  mesh, with the run's generation stop ids (``init_from_hf`` or
  ``model.hf_path``: the checkpoint's architecture, tokenizer and stop ids, as
  in training). The pass@k draws come from the run's ``eval`` stream at that
  step, so they are the ones the training loop's eval made."""
  from fbos_jax import data as data_lib
  from fbos_jax import sharding as sh
  from fbos_jax.rl import config as config_lib
  from fbos_jax.rl import state as state_lib
  from fbos_jax.rl.state import restore_params
  config = config_lib.with_checkpoint_model(config, init_from_hf)
  mesh = sh.make_mesh(config.mesh)
  ctx = RolloutContext.build(config, workdir, mesh=mesh, check_budget=False)
  try:
    params, restored = restore_params(config, workdir, step=step, mesh=mesh)
    examples = data_lib.held_out_examples(config.data, config.train.eval_prompts,
                                          process_index=jax.process_index(),
                                          process_count=jax.process_count(),
                                          tokenizer=ctx.tokenizer,
                                          templates_config=config.templates)
    key = state_lib.stream_key(state_lib.root_rng(ctx.parts.seed), "eval", restored)
    with jax.set_mesh(mesh):
      out = evaluate(ctx, state_lib.compute_params(params, ctx.model_cfg), examples, key=key,
                     k=k)
    out["step"] = restored
    return out
  finally:
    ctx.close()


def drop_from_start(rows: list, *, within_rollouts: int = 0) -> dict:
  """How far held-out accuracy fell below the start: the lowest eval minus the
  step-0 eval, greedy (``eval/accuracy``) and T=1 (``eval/pass@1_sampled``) apart;
  0 when no eval went below the start; None for a key the run did not log.

  ``rows``: a run's logged rows in step order (metrics.jsonl, or compare.json's
  runs, which carry cumulative ``rollouts``); the first row with the key is the
  start. ``within_rollouts`` > 0: only evals at or before that many generated
  rollouts (needs ``rollouts`` in the rows)."""
  out = {}
  for name, key in (("greedy", "eval/accuracy"), ("sampled", "eval/pass@1_sampled")):
    ev = [r for r in rows if key in r]
    if within_rollouts > 0:
      if any("rollouts" not in r for r in ev):
        raise ValueError(f"drop_from_start(within_rollouts={within_rollouts}): rows without "
                         "'rollouts' (cumulative generated rollouts)")
      ev = [r for r in ev if r["rollouts"] <= within_rollouts]
    if not ev:
      out[name] = None
      continue
    start = float(ev[0][key])
    out[name] = min(0.0, min(float(r[key]) for r in ev) - start)
  return out

