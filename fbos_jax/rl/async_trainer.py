"""The asynchronous loop: the trainer takes finished batches, updates, publishes weights.

:class:`AsyncRLTrainer` is :class:`~fbos_jax.rl.trainer.RLTrainer` with its
rollout moved to a :class:`~fbos_jax.rl.async_rl.RolloutWorker` thread (see
``fbos_jax/rl/async_rl.py`` for the split, the admission rule and the versions).
A loop step:

1. take batch k from the buffer (waiting if the worker is behind);
2. check and log its staleness per token (``staleness/*``);
3. the same update program as the synchronous loop (``RLTrainer.update_step``);
4. publish the new params as version k + 1: a chunked device-to-device sync onto
   the rollout mesh (``fbos_jax/rl/weight_sync.py``), a copy when colocated with
   eta > 0, nothing when the loop is synchronous.

With ``rl.rollout_devices = 0`` and ``rl.max_staleness = 0`` it gives the
synchronous loop's params and metrics bit for bit (``tests/test_async.py``).

Checkpoint and resume: a checkpoint holds the TrainState and the data iterator's
state after the prompts of the last batch trained (not the worker's, which may
be up to eta batches ahead). Batches in the buffer or in flight are not saved;
after a restart they are deterministically regenerated: the worker starts at the
checkpoint's step, pulls the same prompts again (the iterator's saved state),
with the same sampling keys (the ``sample`` stream at each step) and the
restored params and GFPO state. No prompt is lost or trained twice; at eta = 0
the resume is exact, at eta > 0 the regenerated batches are sampled by the
restored (newer) params instead of the versions that first sampled them.
"""

from __future__ import annotations

import json
import os
import time
from typing import Optional

import jax
from absl import logging

from fbos_jax import sharding as sh
from fbos_jax.rl import async_rl
from fbos_jax.rl import config as config_lib
from fbos_jax.rl import state as state_lib
from fbos_jax.rl import weight_sync
from fbos_jax.rl.trainer import RLTrainer


def build_meshes(config, devices=None) -> tuple:
  """(trainer mesh, rollout mesh, colocated) of ``config``: the device split of
  ``rl.rollout_devices`` (:func:`fbos_jax.rl.async_rl.split_devices`), or one mesh."""
  acfg = config_lib.async_config(config)
  devices = list(devices if devices is not None else jax.devices())
  if not acfg.rollout_devices:
    mesh = sh.make_mesh(config.mesh, devices)
    return mesh, mesh, True
  rollout_cfg = async_rl.rollout_mesh_config(config.mesh, acfg.rollout_mesh)
  trainer, rollout = async_rl.split_devices(devices, acfg.rollout_devices, config.mesh,
                                            rollout_cfg)
  return sh.make_mesh(config.mesh, trainer), sh.make_mesh(rollout_cfg, rollout), False


def _hbm_bytes(mesh) -> int:
  """The memory one device may use, when the runtime says (0 on CPU)."""
  stats = getattr(mesh.devices.flat[0], "memory_stats", lambda: None)()
  return int((stats or {}).get("bytes_limit", 0))


class AsyncRLTrainer(RLTrainer):
  """The RL loop with the rollout on its own thread (and devices); see the module doc.

  ``mesh``: the one mesh of a colocated run (default the config's); with
  ``rl.rollout_devices`` > 0 the meshes come from the split of ``devices``
  (default all)."""

  def __init__(self, config, workdir: str, *, mesh=None, devices=None, **kw):
    acfg = config_lib.async_config(config)
    if jax.process_count() > 1:
      raise async_rl.AsyncConfigError(
          f"rl.rollout_devices={acfg.rollout_devices}, rl.max_staleness={acfg.max_staleness}: "
          f"the asynchronous loop runs in one process for now ({jax.process_count()} here): "
          "its worker thread and the trainer both call host collectives over every device "
          "(fbos_jax.distributed.allgather_ints, orbax's barriers), which two threads per "
          "process could pair in different orders; each side needs its own (see docs/async.md)")
    if acfg.rollout_devices:
      trainer_mesh, rollout_mesh, colocated = build_meshes(config, devices)
    else:
      trainer_mesh = mesh if mesh is not None else sh.make_mesh(config.mesh, devices)
      rollout_mesh, colocated = trainer_mesh, True
    super().__init__(config, workdir, mesh=trainer_mesh, **kw)
    self.acfg = self.parts.asynchronous
    self.rollout_mesh, self.colocated = rollout_mesh, colocated
    async_rl.check_rows(self.parts, self.mesh, rollout_mesh, self.rules)
    hbm = _hbm_bytes(self.mesh)
    if hbm and not colocated:
      async_rl.check_split_fits(self.parts, self.mesh, rollout_mesh, self.rules, hbm)
    self.wctx = async_rl.VersionedContext.build(config, workdir, mesh=rollout_mesh,
                                                tokenizer=self.ctx.tokenizer,
                                                check_budget=False)
    self.store = async_rl.PolicyStore(self.acfg.inflight_update)
    b = self.parts.rollout.prompts_per_step
    self.buffer = async_rl.StepBuffer(self.acfg.buffer_batches(b), b)
    self.sync = None
    self.worker: Optional[async_rl.RolloutWorker] = None
    self._stop_at = int(config.train.steps)
    self._consumed_data = None
    self._mark = None  # (time, worker busy seconds) at the end of the last step

  # ------------------------------------------------------------------ weights
  def _make_sync(self, params):
    """The sync of the compute copy ``params`` (what the rollout mesh samples with)."""
    specs = state_lib.param_specs(self.parts, self.rollout_mesh, self.rules)
    abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding),
                            params)
    # colocated, a compute copy is already apart from the master the update donates:
    # no second copy is needed for the rollout to sample beside the update
    eta = 0 if state_lib.needs_compute_copy(self.parts.model) else self.acfg.max_staleness
    return weight_sync.make_sync(abstract, specs, self.rollout_mesh, colocated=self.colocated,
                                 max_staleness=eta,
                                 chunk_bytes=self.acfg.sync_chunk_bytes)

  def _publish(self, state) -> weight_sync.SyncStats:
    """The compute copy of ``state``'s params (``model.compute_dtype``, made once
    per version; never the float32 master) onto the rollout mesh, published as
    version ``state.step``."""
    policy = self.policy(state.params)
    if self.sync is None:
      self.sync = self._make_sync(policy)
      logging.info(weight_sync.describe(self.sync))
    params, stats = self.sync(policy)
    self.store.publish(params, int(state.step))
    return stats

  # ------------------------------------------------------------------ the worker
  def _start_worker(self, state, step: int):
    if self.worker is not None:
      return
    self._consumed_data = self._data_state()
    self._publish(state)
    self.worker = async_rl.RolloutWorker(
        self.wctx, self.store, self.buffer, self.train_iter, rng=state.rng, gfpo=state.gfpo,
        start=step, stop=self._stop_at, max_staleness=self.acfg.max_staleness)
    self.worker.start()
    self._mark = (time.perf_counter(), 0.0)

  def _stop_worker(self):
    """Stop the worker; the iterator goes back to the last batch trained (prompts
    the worker pulled ahead are pulled again by the next worker)."""
    w, self.worker = self.worker, None
    if w is None:
      return
    w.stopping.set()
    w.join()
    self.buffer = async_rl.StepBuffer(self.buffer.capacity, self.buffer.groups)
    if self._consumed_data and hasattr(self.train_iter, "set_state"):
      self.train_iter.set_state(self._consumed_data)

  def _data_state(self):
    if self.worker is not None and self._consumed_data is not None:
      return self._consumed_data
    return super()._data_state()

  # ------------------------------------------------------------------ one step
  def train_step(self, state, step: int):
    """Batch ``step`` from the buffer, the shared update, the new weights published."""
    self._start_worker(state, step)
    t0 = time.perf_counter()
    depth = self.buffer.depth_groups()
    item = self.buffer.take(step)
    waited = time.perf_counter() - t0
    state = state.replace(gfpo=item.gfpo)
    m = dict(item.metrics)
    m.update(async_rl.staleness_metrics(item.versions, item.batches, int(state.step),
                                        self.acfg.max_staleness))
    t1 = time.perf_counter()
    state, m = self.update_step(state, item.examples, item.batches, m, t0, step)
    sync = self._publish(state)
    t2 = time.perf_counter()
    self._consumed_data = item.data_state
    self._audit(step + 1, item)
    m.update(sync.metrics())
    m.update(self._busy_metrics(t2, t2 - t1, waited, depth, item))
    m["tokens/per_s"] = m["tokens/generated"] / max(m.get("time/rollout_s", 0.0), 1e-9)
    return state, m

  def _audit(self, logged_step: int, item):
    """One line per step trained in ``async_steps.jsonl``: the batch, the prompt ids
    it trained on and the version it was admitted under (a resume appends the steps
    it redoes again; the last line of a step is the one that counts)."""
    if jax.process_index() != 0:
      return
    with open(os.path.join(self.workdir, "async_steps.jsonl"), "a") as f:
      f.write(json.dumps({"step": logged_step, "batch": item.k,
                          "ids": [str(ex.get("id", "")) for ex in item.examples],
                          "admit_version": item.admit_version}) + "\n")

  def _busy_metrics(self, now: float, trainer_s: float, waited: float, depth: int,
                    item) -> dict:
    """Busy fractions of both sides over the interval since the last step ended."""
    t_prev, busy_prev = self._mark
    busy = self.worker.busy_s() if self.worker is not None else busy_prev
    span = max(now - t_prev, 1e-9)
    self._mark = (now, busy)
    return {"async/trainer_busy": min(trainer_s / span, 1.0),
            "async/rollout_busy": min((busy - busy_prev) / span, 1.0),
            "async/wait_s": waited, "async/buffer_depth": depth,
            "async/admit_version": item.admit_version,
            "async/version_collisions": item.collisions}

  # ------------------------------------------------------------------ the loop
  def compile_at_start(self, state, say=None):
    """Not built for the asynchronous loop (its rollout worker samples on its own
    mesh, with in-flight weight updates): its programs compile on first call."""
    (say or logging.info)("compile set: not enumerated for the asynchronous loop "
                          "(rl.rollout_devices / rl.max_staleness); programs compile on "
                          "first call")
    return None

  def train(self, state=None, *, steps: Optional[int] = None, **kw):
    self._stop_at = int(self.config.train.steps if steps is None else steps)
    try:
      return super().train(state, steps=steps, **kw)
    finally:
      self._stop_worker()

  def close(self):
    self._stop_worker()
    super().close()
    self.wctx.close()
