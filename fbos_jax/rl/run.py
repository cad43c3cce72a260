"""End-to-end run: tokenizer -> (warm start) -> RL -> checkpoints -> plot."""

from __future__ import annotations

import json
import os
import time

import jax
import numpy as np
from absl import logging

from fbos_jax import data as data_lib
from fbos_jax import distributed
from fbos_jax import metrics as metrics_lib
from fbos_jax.model import hf
from fbos_jax.rl import config as config_lib
from fbos_jax.rl import evaluation
from fbos_jax.rl import sft as sft_lib
from fbos_jax.rl import split as split_lib
from fbos_jax.rl.trainer import RLTrainer


def run_training(config, workdir: str, **kw):
  """The run (:func:`train_and_summarise`); in a multi-process run a failure here
  is told to the other processes, which stop naming this one."""
  try:
    return train_and_summarise(config, workdir, **kw)
  except BaseException as e:  # noqa: BLE001
    if jax.process_count() > 1:
      distributed.fail_run(e)
    raise


def train_and_summarise(config, workdir: str, *, init_from_hf: str = "", plot: bool = True,
                        allow_config_change: bool = False):
  t_start = time.perf_counter()
  os.makedirs(workdir, exist_ok=True)
  config = config_lib.with_checkpoint_model(config, init_from_hf)
  sides = split_lib.process_sides(config)
  if sides and jax.process_index() in sides[1].processes:  # a rollout process of a split
    from fbos_jax.rl import remote
    remote.run_rollout(config, workdir, sides)
    distributed.finish()
    return None, {}
  trainer = RLTrainer(config, workdir, allow_config_change=allow_config_change)
  trainer.started = t_start
  try:
    state, summary = _train(config, trainer, workdir, plot)
    trainer.close()
  except BaseException:
    close_quietly(trainer)  # the error is what the user needs: a close that fails
    raise                   # too (a full disk) must not hide it
  distributed.finish()
  _print(json.dumps(summary))
  return state, summary


def close_quietly(trainer):
  """Close ``trainer`` after an error, logging (not raising) what fails in the close."""
  try:
    trainer.close()
  except Exception as e:  # pylint: disable=broad-except
    logging.warning("closing the run after the error failed too: %s: %s", type(e).__name__, e)


def _train(config, trainer, workdir: str, plot: bool):
  """The run's parts after the trainer is built: warm start, RL, summary.json, plot."""
  params = None
  if config.model.hf_path:  # straight into the mesh's shardings, in model.param_dtype
    params, _ = hf.load_hf_params(config.model.hf_path, trainer.parts.model, mesh=trainer.mesh,
                                  rules=trainer.rules)
  state = trainer.init_state(params)
  state, resumed = trainer.maybe_restore(state)
  if not resumed and config.train.warm_start == "sft":
    t0 = time.perf_counter()
    params, cached = sft_lib.warm_start(config, trainer.ctx, state,
                                        cache_dir=os.path.join(workdir, "sft"))
    _print(f"warm start (SFT, {sft_lib.describe_steps(config)}): "
           f"{'cached' if cached else f'{time.perf_counter() - t0:.0f}s'}")
    state = trainer.init_state(params)
  compiled = None
  if config.train.compile_at_start:  # every program of the run, before step 1
    compiled = trainer.compile_at_start(state, say=_print)
  evals = trainer.eval_examples
  start_acc = None
  if evals and int(state.step) == 0:
    start_acc = trainer.evaluate(state, evals, k=config.train.eval_k, step=0)
    _print(f"held-out accuracy at RL start: {_acc_line(start_acc)} ({len(evals)} prompts; "
           f"{data_lib.describe_eval_source(config.data)})")
  elif evals:  # resumed: the step-0 eval is the first row of metrics.jsonl
    start_acc = _logged_start_eval(trainer.metrics.path)
  t0 = time.perf_counter()
  state, history = trainer.train(state, eval_examples=evals, initial_eval=start_acc)
  rl_s = trainer.rl_seconds_before + time.perf_counter() - t0
  summary = _summary(config, trainer, state, history, evals, start_acc)
  summary.update(rl_seconds=rl_s, total_seconds=trainer.total_seconds(),
                 resumed=bool(resumed))
  if compiled is not None:  # compile time apart from RL time (the set compiled before it)
    after = [r for r in history if "compile/after_start" in r]
    summary.update(compile_seconds=compiled["seconds"], compile_programs=compiled["programs"],
                   compile_after_start=int(sum(r["compile/after_start"] for r in after)),
                   compile_after_start_seconds=float(sum(r["time/compile_after_start_s"]
                                                         for r in after)))
  if jax.process_index() == 0:
    with open(os.path.join(workdir, "summary.json"), "w") as f:
      json.dump(summary, f, indent=2)
    if plot:
      png = metrics_lib.plot_metrics(metrics_lib.read_jsonl(trainer.metrics.path),
                                     os.path.join(workdir, "metrics.png"),
                                     title=f"{config.algo} ({config.variant})")
      _print(f"curves: {png}")
  return state, summary


def _logged_start_eval(path: str):
  """The step-0 eval row of a run's ``metrics.jsonl`` (None when absent)."""
  if not os.path.exists(path):
    return None
  for row in metrics_lib.read_jsonl(path):
    if row.get("step") == 0 and "eval/accuracy" in row:
      return {k: v for k, v in row.items() if k.startswith("eval/")}
  return None


def _summary(config, trainer, state, history: list, evals: list, start_acc) -> dict:
  """summary.json: held-out accuracies at RL start and end, median step times."""
  summary = {"algo": config.algo, "rl_steps": int(state.step)}
  if evals:
    last = history[-1] if history else {}
    # the loop already evaluated its last step (eval_every > 0); reuse that
    end = ({k: v for k, v in last.items() if k.startswith("eval/")}
           if last.get("step") == int(state.step) and "eval/accuracy" in last else
           trainer.evaluate(state, evals, k=config.train.eval_k, step=int(state.step)))
    summary["eval_start"] = start_acc["eval/accuracy"] if start_acc else None
    summary["eval_end"] = end["eval/accuracy"]
    for k in ("eval/pass@1_sampled", f"eval/pass@{config.train.eval_k}",
              *sorted(k for k in end if k.startswith("eval/accuracy_d"))):
      if k in end:
        summary[f"{k.split('/')[1]}_start"] = start_acc.get(k) if start_acc else None
        summary[f"{k.split('/')[1]}_end"] = end[k]
    _print(f"held-out accuracy at RL end:   {_acc_line(end)}")
    # the lowest eval against the start (greedy, T=1): a run that first undoes its warm
    # start shows it here even when it ends above the start
    logged = [r for r in history if "eval/accuracy" in r]
    summary["held_out/drop_from_start"] = evaluation.drop_from_start(
        ([{**start_acc, "step": 0}] if start_acc else []) + logged + [end])
  rows = [r for r in history if "time/step_s" in r]
  for k in ("time/sample1_s", "time/round2_s", "time/rounds_s", "time/verify_s",
            "time/update_s", "time/step_s"):
    vals = [r[k] for r in rows if k in r]
    if vals:
      summary[f"median_{k.split('/')[1]}"] = float(np.median(vals))
  if rows:  # the steps alone (no eval, checkpoint or log time)
    summary["sum_step_s"] = float(sum(r["time/step_s"] for r in rows))
  return summary


def _acc_line(e: dict) -> str:
  """'greedy 0.305, sampled 0.293, pass@4 0.52' from an evaluate() dict."""
  parts = [f"greedy {e['eval/accuracy']:.3f}"]
  if "eval/pass@1_sampled" in e:
    parts.append(f"sampled (T=1) {e['eval/pass@1_sampled']:.3f}")
  parts += [f"{k.split('/')[1]} {v:.3f}" for k, v in e.items()
            if k.startswith("eval/pass@") and not k.endswith("_sampled")]
  levels = [f"d{k.rsplit('_d', 1)[1]} {v:.3f}" for k, v in e.items()
            if k.startswith("eval/accuracy_d")]
  line = ", ".join(parts)
  return f"{line} (greedy by difficulty: {', '.join(levels)})" if levels else line


def _print(msg: str):
  if jax.process_index() == 0:
    print(msg, flush=True)
