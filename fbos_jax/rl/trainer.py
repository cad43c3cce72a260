"""The RL loop: data -> rollout -> update -> log / eval / checkpoint.

Every algorithm (GRPO, Dr.GRPO, GFPO, GOLF, FBOS-RL, FCP, decoupled PPO) is this
loop with different config fields; nothing here branches on an algorithm.
A step reads its prompts, runs the rollout phases (:mod:`fbos_jax.rl.rollout`:
round 1, verify, round 2, the batches of the objective's terms), runs the one
jitted update (:mod:`fbos_jax.rl.update`) and logs. Everything that changes
lives in the :class:`~fbos_jax.rl.state.TrainState`, checkpointed as one.
"""

from __future__ import annotations

import os
import time
from typing import Callable, Optional

import jax
import numpy as np
from absl import logging

from fbos_jax import checkpoint as ckpt_lib
from fbos_jax import distributed
from fbos_jax import metrics as metrics_lib
from fbos_jax import optim as optim_lib
from fbos_jax import sharding as sh
from fbos_jax.model import qwen
from fbos_jax.rl import config as config_lib
from fbos_jax.rl import evaluation
from fbos_jax.rl import rollout as rollout_lib
from fbos_jax.rl import state as state_lib
from fbos_jax.rl import update as update_lib
from fbos_jax.rl.env import Environment

# metrics summed (not averaged) over hosts: counts and throughput
SUM_METRICS = ("tokens/generated", "rollouts/generated", "round2/rollouts", "epa/injected",
               "tokens/per_s", "verifier/errors", "eval/verifier_errors")


class NonFiniteStepError(FloatingPointError):
  pass


class RLTrainer:
  """Owns the compiled update, the rollout context (environment, mesh) and the
  checkpoint / metrics plumbing; the state itself is a pure pytree."""

  def __init__(self, config, workdir: str, *, env: Optional[Environment] = None,
               mesh=None, init_params=None, log_metrics: bool = True,
               allow_config_change: bool = False):
    self.config, self.workdir = config, workdir
    os.makedirs(workdir, exist_ok=True)
    self.mesh = mesh if mesh is not None else sh.make_mesh(config.mesh)
    distributed.check_mesh(self.mesh)  # multi-process: batch axes must split over hosts
    config_lib.validate(config, sh.batch_shard_count(self.mesh))
    self.env = env if env is not None else Environment.from_config(config, workdir)
    self.model_cfg = qwen.ModelConfig.from_dict(config.model)
    if self.env.vocab_size > self.model_cfg.vocab_size:
      raise ValueError(f"model.vocab_size={self.model_cfg.vocab_size} is smaller than the "
                       f"tokenizer's {self.env.vocab_size} tokens")
    self.ucfg = config_lib.update_config(config)
    self.optimizer = optim_lib.make_optimizer(
        config.optim, config.train.steps * self.ucfg.epochs * self.ucfg.mini_batches)
    self.abstract = state_lib.abstract_state(config, self.mesh, self.model_cfg, self.optimizer)
    self.ctx = rollout_lib.RolloutContext(config, self.env, self.mesh, self.model_cfg)
    self._init_params = init_params
    self.allow_config_change = allow_config_change
    self.metrics = metrics_lib.MetricsWriter(workdir, enabled=log_metrics and jax.process_index() == 0)
    self.ckpt = ckpt_lib.Checkpointer(os.path.join(workdir, "checkpoints"),
                                      save_every=config.train.checkpoint_every,
                                      keep=config.train.keep_checkpoints)
    self._update = None

  # ------------------------------------------------------------------ state
  def init_state(self, params=None) -> state_lib.TrainState:
    """A fresh state: ``params`` (copied), else the trainer's init params, else random."""
    return state_lib.init_state(self.config, self.abstract, self.optimizer,
                                params if params is not None else self._init_params)

  def save(self, state, force: bool = False):
    meta = {"model": self.config.model.to_dict(), "algo": self.config.algo,
            "config": self.config.to_dict()}
    self.ckpt.save(int(state.step), state, distributed.per_process_state(self.env.data_state()),
                   meta, force=force)

  def restore_train_state(self, step=None) -> state_lib.TrainState:
    """The TrainState of checkpoint ``step`` (newest readable if None), resharded
    onto this trainer's mesh (for eval / export; the data iterator is not touched)."""
    if self.ckpt.latest_step() is None:
      raise FileNotFoundError(f"no checkpoint in {self.ckpt.directory}")
    state, _, _ = self.ckpt.restore(step, self.abstract, {"model": self.config.model.to_dict()})
    return state

  def maybe_restore(self, state):
    """Resume from the newest readable checkpoint, if any: (state, resumed)."""
    if self.ckpt.latest_step() is None:
      return state, False
    restored, data_state, meta = self.ckpt.restore(None, self.abstract,
                                                   {"model": self.config.model.to_dict()})
    ckpt_lib.check_resume_config(meta.get("config"), self.config.to_dict(),
                                 allow=self.allow_config_change)
    self.env.set_data_state(distributed.select_process_state(data_state))
    logging.info("Resumed from %s at step %d", self.ckpt.directory, self.ckpt.restored_step)
    return restored, True

  def update_fn(self):
    """The jitted update; its output state keeps the input's shardings (one compile)."""
    if self._update is None:
      fn = update_lib.make_update_fn(self.model_cfg, self.optimizer, self.ucfg)
      rep = jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec())
      self._update = jax.jit(fn, donate_argnums=(0,),
                             out_shardings=(state_lib.state_shardings(self.abstract), rep))
    return self._update

  # ------------------------------------------------------------------ one step
  def evaluate(self, params, examples: list, *, k: int = 1, step: int = 0) -> dict:
    return evaluation.evaluate(self.ctx, params, examples, k=k, step=step)

  def train_step(self, state: state_lib.TrainState, step: int):
    """One loop step: rollout with the sampling params, then the update."""
    examples = self.env.next_train_batch()
    key = jax.random.fold_in(jax.random.wrap_key_data(state.rng), step)
    t0 = time.perf_counter()
    sampled_with = state.sampling_params()
    batches, m, gfpo = rollout_lib.rollout_step(
        self.ctx, sampled_with, examples, key, step=step, batch_names=self.ucfg.batch_names,
        gfpo_state=state.gfpo)
    state = state.after_sampling().replace(gfpo=gfpo)
    t1 = time.perf_counter()
    batches = {k: jax.tree.map(lambda a: sh.put_process_local(a, self.mesh), b)
               for k, b in batches.items()}
    with jax.set_mesh(self.mesh):  # attention picks its kernel from the mesh's devices
      state, um = self.update_fn()(state, batches)
    um = jax.device_get(um)
    t2 = time.perf_counter()
    m.update(_update_metrics(um, self.ucfg))
    m.update({"time/update_s": t2 - t1, "time/step_s": t2 - t0,
              "tokens/per_s": m["tokens/generated"] / max(t1 - t0, 1e-9),
              "nonfinite_steps": int(state.nonfinite_steps)})
    m = distributed.mean_over_processes(m, sum_keys=SUM_METRICS)
    if um["finite"] < 1:
      ids = [str(ex.get("id", "")) for ex in examples]
      logging.warning("step %d: an optimizer step was skipped (non-finite loss or gradient); "
                      "batch ids: %s", step, ids)
      m["skipped_batch_ids"] = ids
      if not self.config.rl.skip_nonfinite:
        raise NonFiniteStepError(
            f"non-finite loss or gradient at step {step} (rl.skip_nonfinite=False)")
    return state, m

  # ------------------------------------------------------------------ the loop
  def train(self, state=None, *, steps: Optional[int] = None, eval_examples=None,
            on_step: Optional[Callable] = None, initial_eval: Optional[dict] = None):
    """Train to ``steps`` (default ``train.steps``). ``initial_eval``: the step-0
    evaluate() result if the caller already has it (logged, not recomputed)."""
    cfg = self.config
    if state is None:
      state, _ = self.maybe_restore(self.init_state())
    steps = cfg.train.steps if steps is None else steps
    start = int(state.step)
    eval_examples = self.env.eval_examples() if eval_examples is None else eval_examples
    every, k = cfg.train.eval_every, cfg.train.eval_k
    history = []
    if start == 0 and every > 0 and eval_examples:
      em = initial_eval or self.evaluate(state.params, eval_examples, k=k, step=0)
      self.metrics.write(0, em)
      history.append(dict(em, step=0))
      logging.info("step 0 eval: %s", _fmt(em))
    bar = _progress(range(start, steps), cfg.train.progress, desc=f"{cfg.algo} RL")
    last_acc = history[0].get("eval/accuracy", float("nan")) if history else float("nan")
    for step in bar:
      state, m = self.train_step(state, step)
      s = int(state.step)
      if every > 0 and eval_examples and (s % every == 0 or s == steps):
        m.update(self.evaluate(state.params, eval_examples, k=k, step=s))
      self.metrics.write(s, m)
      history.append(dict(m, step=s))
      last_acc = m.get("eval/accuracy", last_acc)
      if hasattr(bar, "set_postfix"):
        bar.set_postfix(r1=f"{m['reward/round1']:.2f}", acc=f"{last_acc:.2f}", refresh=False)
      if s % cfg.train.log_every == 0:
        logging.info("step %d: %s", s, _fmt(m))
      if cfg.train.checkpoint_every > 0 and (s % cfg.train.checkpoint_every == 0 or s == steps):
        self.save(state, force=(s == steps))
      if on_step is not None:
        on_step(s, state, m)
    self.ckpt.wait()
    return state, history

  def close(self):
    self.ckpt.close()
    self.metrics.close()
    self.env.close()


def _update_metrics(um: dict, ucfg: config_lib.UpdateConfig) -> dict:
  """The update's metrics under their logged names (loss/<term>, policy/...)."""
  out = {}
  for k, v in um.items():
    if k.endswith("_loss"):
      out[f"loss/{k[:-5]}"] = float(v)
    elif k.startswith("grad_norm_"):  # one term's weighted contribution (issue 16)
      out[f"grad_norm/{k[len('grad_norm_'):]}"] = float(v)
    else:
      out[f"policy/{k}"] = float(v)
  first = ucfg.terms[0].batch if ucfg.terms else "epa"
  for name in ("entropy", "kl", "clipfrac"):
    out[f"policy/{name}"] = float(um.get(f"{first}_{name}", np.nan))
  out["policy/grad_norm"] = float(um["grad_norm"])
  return out


def _fmt(m: dict) -> str:
  keys = ("reward/round1", "reward/round2", "feedback/fix_rate", "epa/injected", "loss/epa",
          "loss/ecc", "policy/entropy", "policy/grad_norm", "eval/accuracy", "time/step_s")
  return " ".join(f"{k.split('/')[-1]}={m[k]:.4g}" for k in keys if k in m
                  and isinstance(m[k], (int, float)))


def _progress(it, enabled: bool, desc: str):
  if not enabled or jax.process_index() != 0:
    return it
  from tqdm.auto import tqdm
  return tqdm(it, desc=desc, dynamic_ncols=True)
