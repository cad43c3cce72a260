"""Rollout sources: where the one training loop (``fbos_jax/rl/trainer.py``) gets its batches.

The trainer asks its source for step batch k (``take``), checks its staleness,
updates, and hands the source the new params (``publish``). The params come as
``policy``, a callable that returns the trainer's compute copy
(``RLTrainer.rollout_params``: ``model.compute_dtype``, made once per version on
its first call): a source calls it only when it samples with or sends them. One loop, three
sources (tunix's shape: one learner fed by a queue, whatever the meshes):

* :class:`InlineSource` (the synchronous loop): batch k is sampled when the
  trainer asks, by the trainer's params (version k), on its mesh.
* :class:`ThreadSource` (one process; ``rl.rollout_devices > 0`` or
  ``rl.max_staleness > 0``): AReaL's rollout worker on a thread, on the rollout
  mesh of the device split (or colocated), filling a bounded buffer
  (``rl.buffer_groups``); the weights cross by device-to-device resharding
  (``fbos_jax/rl/weight_sync.py``).
* :class:`fbos_jax.rl.remote.ProcessSource` (several processes): the rollout
  runs in processes of its own (``fbos_jax/rl/split.py``).

Every source hands out a :class:`StepItem`: the step's
:class:`~fbos_jax.rl.rollout.Trajectory`, whose batches carry the policy version
of every token beside its tokens and log-probs (the samplers label them:
:meth:`fbos_jax.rl.context.RolloutContext.sample`), with the data iterator's
state after its prompts.

Staleness control (:func:`admitted`, AReaL's rule): batch k (B =
``rl.prompts_per_step`` groups) is admitted only while floor((N_r - 1) / B) <=
i + eta, N_r = (k + 1) B the groups requested with it, i the trainer's version
(updates published), eta = ``rl.max_staleness``; eta = 0 is the synchronous
loop (batch k waits for version k). The trainer checks every trained token
(:func:`staleness_metrics`): one without a version, from the future, or older
than eta raises :class:`StalenessError`.

Checkpoint and resume: a checkpoint holds the TrainState and the data iterator's
state after the prompts of the last batch trained (a worker may have pulled up
to eta batches more). Batches in a buffer or in flight are not saved; after a
restart they are regenerated from the checkpoint's step (the same prompts, the
same ``sample`` stream keys, the restored params and GFPO state): no prompt is
lost or trained twice (``steps.jsonl``: one line per trained step); at eta = 0
the resume is exact.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import time
from typing import Any, Optional

import jax
import numpy as np

from fbos_jax import data as data_lib
from fbos_jax import distributed
from fbos_jax.rl import rollout as rollout_lib
from fbos_jax.rl import state as state_lib
from fbos_jax.rl import weight_sync


class StalenessError(RuntimeError):
  """A token's version is missing, from the future, or older than eta allows."""


def admitted(k: int, version: int, batch: int, max_staleness: int) -> bool:
  """AReaL's admission rule for step batch ``k`` (0-based) of ``batch`` groups:
  with N_r = (k + 1) * batch groups requested, admitted while
  floor((N_r - 1) / batch) <= version + max_staleness."""
  n_r = (k + 1) * batch
  return (n_r - 1) // batch <= version + max_staleness


def staleness_metrics(versions: dict, batches: dict, version: int, max_staleness: int) -> dict:
  """``staleness/mean``, ``staleness/max`` and ``staleness/hist_<d>`` (tokens whose
  version is d updates older than ``version``) over the tokens the update trains
  on (loss mask > 0) of ``batches``; ``versions``: {name: [N, R] int}. Raises
  :class:`StalenessError` for a token without a version (-1), from a newer
  version, or staler than ``max_staleness``."""
  ages = []
  for name, b in batches.items():
    v = np.asarray(versions[name])
    m = np.asarray(b.loss_mask) > 0
    if (v[m] < 0).any():
      raise StalenessError(f"batch {name!r}: {int((v[m] < 0).sum())} trained tokens have no "
                           "policy version (their sampler was given no ParamsSource)")
    ages.append(version - v[m])
  a = np.concatenate(ages) if ages else np.zeros((0,), np.int64)
  if a.size and a.min() < 0:
    raise StalenessError(f"tokens labelled with version {version - int(a.min())}, newer than "
                         f"the trainer's {version}: a wrong version label")
  if a.size and a.max() > max_staleness:
    raise StalenessError(f"tokens {int(a.max())} updates old, more than rl.max_staleness="
                         f"{max_staleness} allows (the admission rule was broken)")
  out = {"staleness/mean": float(a.mean()) if a.size else 0.0,
         "staleness/max": int(a.max()) if a.size else 0}
  for d in range(max_staleness + 1):
    out[f"staleness/hist_{d}"] = int((a == d).sum())
  return out


@dataclasses.dataclass
class StepItem:
  """Step batch ``k``: its trajectory, the data iterator's state after its prompts,
  the version it was admitted under, and the source's own metrics."""
  k: int
  traj: rollout_lib.Trajectory
  data_state: Any
  admit_version: int
  info: dict = dataclasses.field(default_factory=dict)


def train_iterator(config, ctx):
  """This process's training prompts (its share of ``rl.prompts_per_step`` on its
  side); ``ctx``: the run's RolloutContext (its typed parts and tokenizer)."""
  pi, pc = distributed.process_index(), distributed.process_count()
  return data_lib.make_prompt_iterator(
      config.data, batch_size=ctx.spec.prompts_per_step // pc, process_index=pi,
      process_count=pc, seed=state_lib.data_seed(config.seed, config.data.shuffle_seed),
      tokenizer=ctx.tokenizer, templates_config=config.templates)


def _iter_state(it) -> Any:
  return it.get_state() if hasattr(it, "get_state") else {}


def _set_iter_state(it, data_state):
  if data_state and hasattr(it, "set_state"):
    it.set_state(data_state)


def _host(tree):
  return None if tree is None else jax.tree.map(lambda a: np.asarray(jax.device_get(a)), tree)


class Busy:
  """Seconds a side spent working, readable from another thread."""

  def __init__(self):
    self._total, self._since, self._lock = 0.0, None, threading.Lock()

  def __call__(self) -> float:
    with self._lock:
      return self._total + (time.perf_counter() - self._since if self._since else 0.0)

  def mark(self, busy: bool):
    with self._lock:
      now = time.perf_counter()
      if busy:
        self._since = self._since or now
      elif self._since is not None:
        self._total, self._since = self._total + now - self._since, None


class FixedPolicy:
  """A :class:`~fbos_jax.engine.ParamsSource` that never changes: ``params`` as
  ``version`` (the synchronous loop's samplers label every token with it)."""
  kv_mode = "keep_kv"

  def __init__(self, params, version: int):
    self.params, self.version = params, int(version)

  def current(self) -> tuple:
    return self.params, self.version


class InlineSource:
  """The synchronous loop: batch k sampled when the trainer asks, by its params."""

  def __init__(self, ctx, iterator):
    self.ctx, self.iterator, self.busy_s = ctx, iterator, Busy()

  def start(self, state, step: int, stop: int, policy):
    pass

  def take(self, state, k: int, policy) -> StepItem:
    params = policy()
    state_lib.check_compute_params(params, self.ctx.model_cfg, "the inline rollout")
    self.busy_s.mark(True)
    try:
      examples = next(self.iterator)
      traj = rollout_lib.rollout_step(self.ctx, FixedPolicy(params, int(state.step)), examples,
                                      state_lib.stream_key(state.rng, "sample", k),
                                      gfpo_state=state.gfpo)
    finally:
      self.busy_s.mark(False)
    return StepItem(k, traj, _iter_state(self.iterator), int(state.step))

  def publish(self, policy, version: int) -> dict:
    return {}

  def data_state(self):
    return _iter_state(self.iterator)

  def restore_data(self, data_state):
    _set_iter_state(self.iterator, data_state)

  def stop(self):
    pass

  def close(self):
    pass


class PolicyStore:
  """The newest published rollout params and their version (thread-safe): the
  worker's :class:`~fbos_jax.engine.ParamsSource` (``kv_mode``:
  ``rl.inflight_update``)."""

  def __init__(self, kv_mode: str = "keep_kv"):
    self.kv_mode = kv_mode
    self._cond = threading.Condition()
    self._params, self._version = None, -1

  def publish(self, params, version: int):
    with self._cond:
      if version <= self._version:
        raise ValueError(f"version {version} published after version {self._version}")
      self._params, self._version = params, int(version)
      self._cond.notify_all()

  def current(self) -> tuple:
    with self._cond:
      return self._params, self._version

  def wait(self, ready, stop: threading.Event, poll_s: float = 0.05) -> bool:
    """Block until ``ready(version)`` or ``stop`` is set; True when ready."""
    with self._cond:
      while not ready(self._version):
        if stop.is_set():
          return False
        self._cond.wait(poll_s)
      return True


class StepBuffer:
  """A bounded FIFO of :class:`StepItem` (``capacity`` step batches); a worker's
  error reaches the trainer at its next ``take``."""

  def __init__(self, capacity: int):
    self.capacity = int(capacity)
    self._items: collections.deque = collections.deque()
    self._cond = threading.Condition()
    self._error: Optional[BaseException] = None

  def __len__(self) -> int:
    with self._cond:
      return len(self._items)

  def wait_room(self, stop: threading.Event) -> bool:
    with self._cond:
      while len(self._items) >= self.capacity:
        if stop.is_set():
          return False
        self._cond.wait(0.05)
      return True

  def put(self, item: StepItem):
    with self._cond:
      self._items.append(item)
      self._cond.notify_all()

  def fail(self, error: BaseException):
    with self._cond:
      self._error = error
      self._cond.notify_all()

  def take(self, k: int) -> StepItem:
    """Batch ``k`` (blocks until it is there); the worker's error, if it failed."""
    with self._cond:
      while not self._items and self._error is None:
        self._cond.wait(0.05)
      if not self._items:
        raise RuntimeError(f"the rollout worker failed before batch {k}") from self._error
      item = self._items.popleft()
      self._cond.notify_all()
    if item.k != k:
      raise RuntimeError(f"the buffer handed out batch {item.k} for step {k}")
    return item


def streams_steps(parts, rollout_processes: int = 1) -> bool:
  """Whether an asynchronous rollout streams its steps through one continuous-engine
  run (:func:`stream_steps`: round 1 and round 2 of every step under round 2's
  settings, never draining between steps): on the continuous engine, in one
  process; several rollout processes sample step by step (they agree on shapes
  at each step's end, ``fbos_jax/rl/remote.py``)."""
  return parts.sampling.engine == "continuous" and int(rollout_processes) == 1


class RolloutWorker(threading.Thread):
  """Samples step batches ``start .. stop - 1`` with the store's params and puts
  them in the buffer, each admitted by :func:`admitted`."""

  def __init__(self, ctx, store: PolicyStore, buffer: StepBuffer, iterator, *, rng, gfpo,
               start: int, stop: int, max_staleness: int):
    super().__init__(name="rollout-worker", daemon=True)
    self.ctx, self.store, self.buffer, self.iterator = ctx, store, buffer, iterator
    # host copies: the trainer's update donates the state's arrays
    self.rng, self.gfpo = np.asarray(jax.device_get(rng)), _host(gfpo)
    self.start_k, self.stop_k, self.eta = int(start), int(stop), int(max_staleness)
    self.stopping, self.busy_s = threading.Event(), Busy()

  def run(self):
    try:
      b = self.ctx.spec.prompts_per_step
      if streams_steps(self.ctx.parts):  # AReaL's streaming: never drains
        admit = lambda k, in_flight: (admitted(k, self.store.current()[1], b, self.eta)
                                      and len(self.buffer) + in_flight < self.buffer.capacity)
        self.gfpo = stream_steps(self.ctx, self.store, self.iterator, rng=self.rng, gfpo=self.gfpo,
                                 start=self.start_k, stop=self.stop_k, admit=admit,
                                 put=self.buffer.put, stopping=self.stopping.is_set,
                                 busy=self.busy_s)
        return
      for k in range(self.start_k, self.stop_k):
        ok = self.store.wait(lambda v, k=k: admitted(k, v, b, self.eta), self.stopping)
        if not ok or not self.buffer.wait_room(self.stopping):
          return
        self.busy_s.mark(True)
        try:
          examples = next(self.iterator)
          data_state, admit = _iter_state(self.iterator), self.store.current()[1]
          traj = rollout_lib.rollout_step(self.ctx, self.store, examples,
                                          state_lib.stream_key(self.rng, "sample", k),
                                          gfpo_state=self.gfpo)
        finally:
          self.busy_s.mark(False)
        self.gfpo = _host(traj.gfpo)  # the trainer's state takes (and donates) its own
        self.buffer.put(StepItem(k, traj, data_state, admit))
    except BaseException as e:  # noqa: BLE001  (reaches the trainer at its next take)
      self.buffer.fail(e)


def stream_steps(ctx, policy, iterator, *, rng, gfpo, start: int, stop: int, admit, put,
                 stopping=None, busy: Optional[Busy] = None):
  """Step batches ``start .. stop - 1`` through one continuous-engine run
  (:class:`fbos_jax.rl.stream.StepStream`): step k's prompts join the queue once
  ``admit(k, steps in flight)`` allows, into the slots the earlier steps free
  (generation never drains between steps); each finished step, in order, goes to
  ``put`` as a :class:`StepItem` (GFPO applied in step order). ``policy``: the
  ParamsSource the engine reads between windows; ``busy`` runs while a step is
  in flight. Returns the GFPO state after the last step. Engine metrics
  (``rollout/slot_util``, ...) are over the run so far."""
  from fbos_jax.rl import stream
  ctx.engine_stats = rollout_lib.new_engine_stats(ctx)
  state = {"gfpo": gfpo}

  def begin(k):
    if busy is not None:
      busy.mark(True)
    examples = next(iterator)
    step = stream._Step(ctx, k, examples, state_lib.stream_key(rng, "sample", k),
                        _iter_state(iterator))
    step.admit_version = policy.current()[1]
    return step

  def finish(step):
    r1, r2, vs1, vs2 = step.result()
    m = {"time/rounds_s": time.perf_counter() - step.t0, "rollout/steps_beside": step.beside}
    traj = rollout_lib.trajectory(ctx, step.examples, r1, r2, vs1, vs2, m, state["gfpo"],
                                  step.t0)
    state["gfpo"] = _host(traj.gfpo)
    put(StepItem(step.k, traj, step.data_state, step.admit_version))

  def admit_and_mark(k, in_flight):
    ok = admit(k, in_flight)
    if busy is not None and not ok and not in_flight:
      busy.mark(False)
    return ok

  feed = stream.StepStream(ctx, start, stop, begin=begin, admit=admit_and_mark, on_step=finish,
                           stopping=stopping)
  try:
    feed.run(policy)
  except stream.StreamStopped:
    pass
  finally:
    if busy is not None:
      busy.mark(False)
  return state["gfpo"]


class ThreadSource:
  """AReaL's rollout worker on a thread of this process (see the module doc):
  ``ctx`` on the rollout mesh, the weights synced onto it after every update."""

  def __init__(self, ctx, iterator, acfg, *, rollout_mesh, colocated: bool, rules):
    self.ctx, self.iterator, self.acfg = ctx, iterator, acfg
    self.rollout_mesh, self.colocated, self.rules = rollout_mesh, colocated, rules
    self.store = PolicyStore(acfg.inflight_update)
    self.capacity = acfg.buffer_batches(ctx.spec.prompts_per_step)
    self.buffer = StepBuffer(self.capacity)
    self.sync, self.worker, self._consumed = None, None, None

  def busy_s(self) -> float:
    return self.worker.busy_s() if self.worker is not None else 0.0

  def programs(self, state) -> list:
    """The worker's programs on the rollout mesh (``fbos_jax.compile_set.rollout_programs``):
    the params as the weight sync places them, the key from the host copy of the
    run's rng the worker holds; streamed on the continuous engine."""
    from fbos_jax import compile_set
    params = state_lib.compute_abstract(
        state_lib.abstract_state(self.ctx.parts, self.rollout_mesh, self.rules).params,
        self.ctx.parts.model)
    return compile_set.rollout_programs(
        self.ctx, params, state.rng, streamed=streams_steps(self.ctx.parts),
        recompute=self.acfg.inflight_update == "recompute")

  def start(self, state, step: int, stop: int, policy):
    self._consumed = _iter_state(self.iterator)
    self.publish(policy, int(state.step))
    self.worker = RolloutWorker(self.ctx, self.store, self.buffer, self.iterator, rng=state.rng,
                                gfpo=state.gfpo, start=step, stop=stop,
                                max_staleness=self.acfg.max_staleness)
    self.worker.start()

  def take(self, state, k: int, policy) -> StepItem:
    depth = len(self.buffer) * self.ctx.spec.prompts_per_step
    item = self.buffer.take(k)
    self._consumed = item.data_state
    item.info["async/buffer_depth"] = depth
    return item

  def publish(self, policy, version: int) -> dict:
    """``policy()`` (the trainer's compute copy, ``model.compute_dtype``; never the
    float32 master) onto the rollout mesh (a chunked device-to-device sync; a copy
    colocated), published as ``version``."""
    params = policy()
    if self.sync is None:
      specs = state_lib.param_specs(self.ctx.parts, self.rollout_mesh, self.rules)
      abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype,
                                                             sharding=a.sharding), params)
      # colocated, a compute copy is already apart from the master the update donates:
      # no second copy is needed for the rollout to sample beside the update
      eta = (0 if state_lib.needs_compute_copy(self.ctx.parts.model)
             else self.acfg.max_staleness)
      self.sync = weight_sync.make_sync(abstract, specs, self.rollout_mesh,
                                        colocated=self.colocated, max_staleness=eta,
                                        chunk_bytes=self.acfg.sync_chunk_bytes)
    params, stats = self.sync(params)
    self.store.publish(params, version)
    return stats.metrics()

  def data_state(self):
    return self._consumed if self._consumed is not None else _iter_state(self.iterator)

  def restore_data(self, data_state):
    _set_iter_state(self.iterator, data_state)

  def stop(self):
    """Stop the worker; the iterator goes back to the last batch trained (prompts
    the worker pulled ahead are pulled again by the next worker)."""
    w, self.worker = self.worker, None
    if w is None:
      return
    w.stopping.set()
    w.join()
    self.buffer = StepBuffer(self.capacity)
    self.store = PolicyStore(self.acfg.inflight_update)
    self.restore_data(self._consumed)

  def close(self):
    self.stop()
    self.ctx.close()
