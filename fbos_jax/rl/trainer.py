"""The RL loop: a batch from the rollout source -> update -> publish -> log / eval / checkpoint.

Every algorithm (GRPO, Dr.GRPO, GFPO, GOLF, FBOS-RL, FCP, decoupled PPO) is this
loop with different config fields; nothing here branches on an algorithm, nor
on where the rollout runs. A step takes batch k from its rollout source
(:mod:`fbos_jax.rl.sources`: sampled inline, synchronous; on a thread; or in
other processes, :mod:`fbos_jax.rl.remote`), checks the policy version of every
token it trains on (``rl.max_staleness``), runs the one jitted update
(:mod:`fbos_jax.rl.update`), hands the source the new params and logs.
Everything that changes lives in the :class:`~fbos_jax.rl.state.TrainState`,
checkpointed as one; the run's typed parts live in the
:class:`~fbos_jax.rl.context.RolloutContext`.
"""

from __future__ import annotations

import os
import time
from typing import Callable, Optional

import jax
from absl import logging

from fbos_jax import checkpoint as ckpt_lib
from fbos_jax import data as data_lib
from fbos_jax import distributed
from fbos_jax import metrics as metrics_lib
from fbos_jax import program_cache
from fbos_jax import sharding as sh
from fbos_jax.rl import config as config_lib
from fbos_jax.rl import evaluation
from fbos_jax.rl import guards
from fbos_jax.rl import objectives
from fbos_jax.rl import packing
from fbos_jax.rl import probe as probe_lib
from fbos_jax.rl import sources
from fbos_jax.rl import split as split_lib
from fbos_jax.rl import state as state_lib
from fbos_jax.rl import update as update_lib
from fbos_jax.rl.context import RolloutContext

# metrics summed (not averaged) over hosts: counts and throughput
SUM_METRICS = ("tokens/generated", "rollouts/generated", "round2/rollouts", "epa/injected",
               "tokens/per_s", "verifier/calls", "verifier/errors", "eval/verifier_errors")


class RLTrainer:
  """Owns the rollout context (typed parts, mesh, tokenizer, verifiers), the
  rollout source, the shared update program and the checkpoint / metrics
  plumbing; the state itself is a pure pytree.

  ``mesh``: the one mesh when nothing is split (default the config's); with
  ``rl.rollout_devices`` > 0 the meshes come from the split of ``devices``
  (default all; ``fbos_jax/rl/split.py``)."""

  def __init__(self, config, workdir: str, *, ctx: Optional[RolloutContext] = None,
               mesh=None, devices=None, init_params=None, log_metrics: bool = True,
               allow_config_change: bool = False):
    self.config, self.workdir = config, workdir
    os.makedirs(workdir, exist_ok=True)
    self.rules = sh.rules_dict(config.mesh.rules)
    self.acfg = config_lib.async_config(config)
    self.sides = split_lib.process_sides(config, devices)
    if self.sides:  # this process trains (fbos_jax.rl.run sends the rollout ones elsewhere)
      distributed.set_sides(*self.sides)
    if self.acfg.rollout_devices:
      self.mesh, rollout_mesh, colocated = split_lib.build_meshes(config, devices)
    else:
      self.mesh = mesh if mesh is not None else sh.make_mesh(config.mesh, devices)
      rollout_mesh, colocated = self.mesh, True
    distributed.check_mesh(self.mesh, sh.batch_axes(self.rules))  # multi-process: rows per host
    config_lib.validate(config, sh.batch_shard_count(self.mesh, self.rules),
                        process_count=distributed.process_count())
    self.ctx = ctx if ctx is not None else RolloutContext.build(config, workdir, mesh=self.mesh)
    self.ctx.mesh, self.ctx.rules = self.mesh, self.rules
    self.parts = self.ctx.parts
    self.layout = state_lib.StateLayout.of(self.parts)  # what the TrainState holds
    pi, pc = distributed.process_index(), distributed.process_count()
    self.train_iter = None if self.sides else sources.train_iterator(config, self.ctx)
    self.eval_examples = data_lib.held_out_examples(
        config.data, config.train.eval_prompts, process_index=pi, process_count=pc,
        tokenizer=self.ctx.tokenizer, templates_config=config.templates)
    self._init_params = init_params
    self.allow_config_change = allow_config_change
    self.metrics = metrics_lib.MetricsWriter(workdir, enabled=log_metrics and pi == 0)
    self.steps_log = metrics_lib.MetricsWriter(workdir, enabled=log_metrics and pi == 0,
                                               filename="steps.jsonl", tensorboard=False)
    self.ckpt = ckpt_lib.Checkpointer(os.path.join(workdir, "checkpoints"),
                                      save_every=config.train.checkpoint_every,
                                      keep=config.train.keep_checkpoints,
                                      processes=distributed.side().processes)
    self.rl_seconds_before = 0.0  # RL time of the run before the restored checkpoint
    # the whole run's wall time before the restored checkpoint (warm start, RL, evals)
    # and when this part started (run_training sets it to its own start)
    self.total_seconds_before, self.started = 0.0, time.perf_counter()
    self.guard = guards.StepGuard(self.parts.update.skip_nonfinite,
                                  int(config.verifier.max_failed_steps))
    self.param_watch = guards.ParamChangeWatch(self.parts.model.param_dtype,
                                               self.parts.optim.learning_rate)
    # the policy the samplers read: the master in model.compute_dtype, once per version
    self.policy = state_lib.ComputeCopy(self.parts.model)
    self.compile_watch = None  # compiles after the compile set (compile_at_start)
    self.source = self._make_source(rollout_mesh, colocated)
    self._mark = (0.0, 0.0)  # (time, rollout busy seconds) at the end of the last step

  def _make_source(self, rollout_mesh, colocated: bool):
    """The rollout source of the config (see :mod:`fbos_jax.rl.sources`)."""
    if not self.acfg.enabled:
      return sources.InlineSource(self.ctx, self.train_iter)
    split_lib.check_rows(self.parts, self.mesh, rollout_mesh, self.rules)
    hbm = split_lib.hbm_bytes(self.mesh)
    if hbm and not colocated:
      split_lib.check_split_fits(self.parts, self.mesh, rollout_mesh, self.rules, hbm)
    if self.sides:  # the rollout in processes of its own
      from fbos_jax.rl import remote
      return remote.ProcessSource(self.config, self.parts, self.sides, rollout_mesh,
                                  self.rules)
    wctx = RolloutContext.build(self.config, self.workdir, mesh=rollout_mesh,
                                tokenizer=self.ctx.tokenizer, check_budget=False)
    return sources.ThreadSource(wctx, self.train_iter, self.acfg, rollout_mesh=rollout_mesh,
                                colocated=colocated, rules=self.rules)

  def rollout_params(self, state):
    """The params the rollout samples with, as the trainer produces them for every
    weight sync (and the inline source): the compute copy of the master
    (``model.compute_dtype``, made once per version; never the float32 master),
    the one place that makes it. The sources get it as a callable, called only
    when they sample with or send the params."""
    return self.policy(state.params)

  # ------------------------------------------------------------------ state
  def init_state(self, params=None) -> state_lib.TrainState:
    """A fresh state: ``params`` (copied), else the trainer's init params, else random."""
    return state_lib.init_state(self.parts, self.mesh, self.rules,
                                params if params is not None else self._init_params)

  def save(self, state, force: bool = False, rl_seconds: float = 0.0):
    meta = {"model": self.config.model.to_dict(), "algo": self.config.algo,
            "config": self.config.to_dict(), "layout": self.layout.record(),
            "rl_seconds": float(rl_seconds), "total_seconds": self.total_seconds()}
    # the data iterator after the prompts of the last step trained (a worker may be ahead)
    data_state = distributed.per_process_state(self.source.data_state())
    self.ckpt.save(int(state.step), state, data_state, meta, force=force)

  def maybe_restore(self, state):
    """Resume from the newest readable checkpoint, if any: (state, resumed)."""
    if self.ckpt.latest_step() is None:
      return state, False
    restored, data_state, meta = self.ckpt.restore(
        None, state_lib.abstract_state(self.layout, self.mesh, self.rules),
        {"model": self.config.model.to_dict(), "layout": self.layout})
    ckpt_lib.check_resume_config(meta.get("config"), self.config.to_dict(),
                                 allow=self.allow_config_change)
    self.source.restore_data(distributed.select_process_state(data_state))
    self.rl_seconds_before = float(meta.get("rl_seconds", 0.0))
    # a checkpoint written before total_seconds was recorded: at least its RL time
    self.total_seconds_before = float(meta.get("total_seconds", self.rl_seconds_before))
    logging.info("Resumed from %s at step %d", self.ckpt.directory, self.ckpt.restored_step)
    return restored, True

  def total_seconds(self) -> float:
    """The run's wall time so far: the parts before the restored checkpoint and
    this one since ``started`` (so it is never less than the RL time)."""
    return self.total_seconds_before + time.perf_counter() - self.started

  # ------------------------------------------------------------------ compile set
  def compile_at_start(self, state, say=None) -> dict:
    """Compile every program the run can call (``fbos_jax/compile_set.py``: the
    samplers or the engine, the update, the eval's samplers) before step 1, with
    a progress bar, then count each compile after it in ``compile/after_start``
    (warned, naming the program and its shapes). With a rollout on a thread (its
    own mesh) its programs are in the set too; rollout processes compile theirs
    at their start (``fbos_jax/rl/remote.py``). Returns {"programs": count,
    "seconds": wall time, "groups": ...}."""
    from fbos_jax import compile_set
    cfg = self.config
    evals = len(self.eval_examples) * distributed.process_count()  # this side's
    inline = isinstance(self.source, sources.InlineSource)
    groups = compile_set.run_programs(self.ctx, state, eval_prompts=evals,
                                      eval_k=cfg.train.eval_k, rounds=inline)
    if isinstance(self.source, sources.ThreadSource):
      groups = self.source.programs(state) + groups
    report = compile_set.compile_all(
        groups, progress=cfg.train.progress and jax.process_index() == 0, say=say)
    self.compile_watch = program_cache.CompileWatch()
    return report

  # ------------------------------------------------------------------ one step
  def evaluate(self, state_or_params, examples: list, *, k: int = 1, step: int = 0,
               rng=None) -> dict:
    """Held-out accuracy of ``state_or_params`` (a TrainState, or params with
    ``rng``, the run's ``TrainState.rng``); the pass@k draws come from its
    ``eval`` stream at ``step``."""
    params = self.policy(getattr(state_or_params, "params", state_or_params))
    rng = getattr(state_or_params, "rng", rng)
    if rng is None:
      rng = state_lib.root_rng(self.parts.seed)
    return evaluation.evaluate(self.ctx, params, examples, k=k,
                               key=state_lib.stream_key(rng, "eval", step))

  def train_step(self, state: state_lib.TrainState, step: int):
    """Batch ``step`` from the source, its staleness checked, the update, the new
    params published; one line in ``steps.jsonl`` (the batch, its prompt ids and
    the version it was admitted under)."""
    t0 = time.perf_counter()
    item = self.source.take(state, step, lambda: self.rollout_params(state))
    waited = time.perf_counter() - t0
    traj = self.last_traj = item.traj
    state = state.replace(gfpo=traj.gfpo)
    m = dict(traj.metrics, **item.info)
    m.update(sources.staleness_metrics(traj.versions, traj.batches, int(state.step),
                                       self.acfg.max_staleness))
    t1 = time.perf_counter()
    state, m = self.update_step(state, traj.ids, traj.batches, m, t0, step)
    late = self.source.publish(lambda: self.rollout_params(state), int(state.step))
    now = time.perf_counter()
    self.steps_log.write(step + 1, {"batch": item.k, "ids": traj.ids,
                                    "admit_version": item.admit_version})
    t_prev, busy_prev = self._mark
    busy, span = self.source.busy_s(), max(now - t_prev, 1e-9)
    self._mark = (now, busy)
    late.update({"async/trainer_busy": min((now - t1) / span, 1.0),
                 "async/rollout_busy": min((busy - busy_prev) / span, 1.0),
                 "async/wait_s": waited, "async/admit_version": item.admit_version})
    m.update(distributed.mean_over_processes(late))  # the update's were reduced in it
    return state, m

  def update_step(self, state, ids: list, batches: dict, m: dict, t0: float, step: int):
    """The update of one step on ``batches`` (host numpy) of the prompts ``ids``,
    its metrics added to the rollout's ``m``; ``t0``: when the step started."""
    t1 = time.perf_counter()
    self.policy.release()  # the sampled version's copy is not needed beside the update
    batches, bm = packing.device_batches(batches, self.parts.update, self.mesh, self.rules)
    m.update(bm)
    with jax.set_mesh(self.mesh):  # attention picks its kernel from the mesh's devices
      state, um = update_lib.compiled_update(self.parts, self.mesh, self.rules)(state, batches)
    m.update(objectives.log_metrics(um, self.parts.update.batch_names))
    t2 = time.perf_counter()
    m.update({"time/update_s": t2 - t1, "time/step_s": t2 - t0,
              "tokens/per_s": m["tokens/generated"] / max(m["time/rollout_s"], 1e-9),
              "nonfinite_steps": int(state.nonfinite_steps)})
    m = distributed.mean_over_processes(
        m, sum_keys=SUM_METRICS + tuple(k for k in m if k.startswith("staleness/hist_")),
        max_keys=("staleness/max",))
    self.guard.annotate(m, ids, step + 1)
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
    eval_examples = self.eval_examples if eval_examples is None else eval_examples
    every, k = cfg.train.eval_every, cfg.train.eval_k
    history = []
    if start == 0 and eval_examples and (every > 0 or initial_eval):  # the start, logged
      em = initial_eval or self.evaluate(state, eval_examples, k=k, step=0)
      self.metrics.write(0, em)
      history.append(dict(em, step=0))
      logging.info("step 0 eval: %s", metrics_lib.summary_line(em))
    bar = metrics_lib.progress(range(start, steps), cfg.train.progress and jax.process_index() == 0,
                               desc=f"{cfg.algo} RL")
    last_acc = history[0].get("eval/accuracy", float("nan")) if history else float("nan")
    t_loop = time.perf_counter()
    self.source.start(state, start, steps, lambda: self.rollout_params(state))
    self._mark = (time.perf_counter(), self.source.busy_s())
    try:
      for step in bar:
        self.ckpt.check_errors()  # an asynchronous save that failed stops the run here
        state, m = self.train_step(state, step)
        s = int(state.step)
        if every > 0 and eval_examples and (s % every == 0 or s == steps):
          m.update(self.evaluate(state, eval_examples, k=k, step=s))
        if cfg.train.probe_every > 0 and s % cfg.train.probe_every == 0:
          m.update(probe_lib.probe_metrics(self.ctx, self.policy(state.params),
                                           self.last_traj.examples,
                                           state_lib.stream_key(state.rng, "eval", s, 1)))
        if self.compile_watch is not None:
          from fbos_jax import compile_set
          m.update(compile_set.after_start(self.compile_watch.take(), s, first=step == start))
        self.metrics.write(s, m)
        history.append(dict(m, step=s))
        self.guard.check(m, s)
        self.param_watch.check(m, s)
        last_acc = m.get("eval/accuracy", last_acc)
        if hasattr(bar, "set_postfix"):
          bar.set_postfix(r1=f"{m['reward/round1']:.2f}", acc=f"{last_acc:.2f}", refresh=False)
        if s % cfg.train.log_every == 0:
          logging.info("step %d: %s", s, metrics_lib.summary_line(m))
        if cfg.train.checkpoint_every > 0 and (s % cfg.train.checkpoint_every == 0 or s == steps):
          self.save(state, force=(s == steps),
                    rl_seconds=self.rl_seconds_before + time.perf_counter() - t_loop)
        if on_step is not None:
          on_step(s, state, m)
    except OSError:  # a full disk: a save that failed on it is the error to report, as it
      self.ckpt.wait()  # names the last complete checkpoint (metrics.jsonl's error chained)
      raise
    finally:
      self.source.stop()
    self.ckpt.wait()
    return state, history

  def close(self):
    self.source.close()
    if self.compile_watch is not None:
      self.compile_watch.close()
    self.ckpt.close()
    self.metrics.close()
    self.steps_log.close()
    self.ctx.close()
