"""AReaL's system: a rollout worker and the trainer overlap, with bounded staleness.

One controller (one Python process per host, as every JAX run); the pieces:

* **the device split** (:func:`split_devices`, ``rl.rollout_devices = N``): the
  devices split into a rollout mesh of N and a trainer mesh of the rest, each
  built from the config's mesh (``mesh.*``, one axis -1) and its logical rules
  (``mesh.rules``); 0 = colocated, one mesh for both. In a multi-process run
  every process gives the rollout mesh its first N / P local devices (by id)
  and the trainer mesh the rest, so **every process holds a part of both
  meshes**: it runs the rollout worker thread on its rollout devices (its own
  prompts, ``rl.prompts_per_step / P`` of them, as today) and the trainer on
  its trainer devices, and the weight sync copies each shard within its process
  (``fbos_jax/rl/weight_sync.py``); the loop itself is single-process for now
  (``AsyncRLTrainer`` says why). A layout with whole hosts on each side
  (AReaL's) would need the processes of one side to run programs the others
  skip and a cross-host ``device_put``, which JAX supports only on the TFRT TPU
  runtime; it is not built. On 2 processes x 4 devices split 4 / 4, process p
  holds rollout devices {4p, 4p + 1} and trainer devices {4p + 2, 4p + 3}.
* **the rollout worker** (:class:`RolloutWorker`, a thread): pulls the prompts
  of batch k, runs both rounds and verification (``rollout.rollout_step``, on
  the rollout mesh with the rollout params) and pushes the finished step batch
  (B = ``rl.prompts_per_step`` groups) into a bounded buffer (:class:`StepBuffer`,
  ``rl.buffer_groups``) with its policy versions per token.
* **staleness control** (:func:`admitted`, AReaL's rule): batch k is admitted
  only while floor((N_r - 1) / B) <= i + eta, N_r = (k + 1) B the groups
  requested with it, i the trainer's version (updates published), eta =
  ``rl.max_staleness``. eta = 0 is the synchronous loop: batch k waits for
  version k.
* **versions per token** (:class:`PolicyStore`, :class:`VersionLedger`): the
  store holds the newest published params and their version; the samplers read
  it per call (static sampler) or between decode windows (continuous engine:
  rows in flight go on with the new weights, their KV cache kept or recomputed,
  ``rl.inflight_update``), and every sampled token records the version that
  drew it. pi_behav is the sampler's log-prob per token (``old_logp``); the
  decoupled loss weighs each token by pi_prox / pi_behav with that per-token
  value. A token with no version, one from the future, or one older than eta
  raises.
* **the trainer** (``fbos_jax/rl/async_trainer.py``) takes batch k, updates,
  and publishes the new weights (``weight_sync``).
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import time
from typing import Any, Optional

import jax
import numpy as np

from fbos_jax import sharding as sh
from fbos_jax.rl import rollout as rollout_lib
from fbos_jax.rl import state as state_lib
from fbos_jax.rl.context import RolloutContext, Samples


class AsyncConfigError(ValueError):
  """A device split or buffer that cannot work; names the field and the numbers."""


# ----------------------------------------------------------------------------- the split


def rollout_mesh_config(mesh_cfg, rollout_mesh: tuple):
  """The rollout side's mesh config of a split: ``mesh_cfg`` (``mesh.*``) with the
  axes of ``rollout_mesh`` (``AsyncConfig.rollout_mesh``: ((axis, size), ...)) over
  it; its logical rules are ``mesh.rules``."""
  import copy
  out = copy.deepcopy(mesh_cfg)
  for axis, size in rollout_mesh:
    out[axis] = size
  return out


def split_devices(devices, rollout_devices: int, mesh_cfg,
                  rollout_mesh_cfg=None) -> tuple[list, list]:
  """(trainer devices, rollout devices): every process gives the rollout mesh its
  first ``rollout_devices / P`` local devices (by id), the trainer the rest. Raises
  :class:`AsyncConfigError` naming ``rl.rollout_devices`` when the split does not
  divide the devices or the processes, or a side cannot take the mesh config."""
  devices = sorted(devices, key=lambda d: (d.process_index, d.id))
  n, total = int(rollout_devices), len(devices)
  if not 0 < n < total:
    raise AsyncConfigError(f"rl.rollout_devices={n}: must leave the trainer devices: "
                           f"0 < N < {total} devices (0 = colocated)")
  local: dict = {}
  for d in devices:
    local.setdefault(d.process_index, []).append(d)
  procs = len(local)
  counts = {len(v) for v in local.values()}
  if n % procs or len(counts) != 1:
    raise AsyncConfigError(
        f"rl.rollout_devices={n} does not divide over the {procs} processes "
        f"({sorted(len(v) for v in local.values())} local devices): each process gives "
        "the rollout mesh the same number of devices")
  per = n // procs
  rollout = [d for v in local.values() for d in v[:per]]
  trainer = [d for v in local.values() for d in v[per:]]
  for side, devs, cfg in (("rollout", rollout, rollout_mesh_cfg or mesh_cfg),
                          ("trainer", trainer, mesh_cfg)):
    try:
      sh.mesh_shape_from_config(cfg, len(devs))
    except sh.ShardingError as e:
      raise AsyncConfigError(f"rl.rollout_devices={n} leaves the {side} mesh {len(devs)} of "
                             f"{total} devices, which the mesh config does not fit: {e}") from None
  if max(n, total - n) % min(n, total - n):
    raise AsyncConfigError(
        f"rl.rollout_devices={n}: the weight sync copies shard by shard, which needs one "
        f"side's device count to be a multiple of the other's (rollout {n}, trainer "
        f"{total - n})")
  return trainer, rollout


def check_rows(parts, trainer_mesh, rollout_mesh, rules):
  """The rollout pads the update's rows to its own batch shards x micro- x
  mini-batches; the trainer mesh's batch shards (per process) must divide that."""
  pc = jax.process_count()
  r = max(sh.batch_shard_count(rollout_mesh, rules) // pc, 1) * parts.update.row_multiple
  t = max(sh.batch_shard_count(trainer_mesh, rules) // pc, 1)
  if r % t:
    raise AsyncConfigError(
        f"rl.rollout_devices: the rollout mesh pads the update's rows to multiples of {r} "
        f"(its batch shards per process x rl.micro_batches x rl.mini_batches), which the "
        f"trainer mesh's {t} batch shards per process do not divide; change the split or "
        "mesh.*")


def split_bytes(parts, trainer_mesh, rollout_mesh, rules) -> dict:
  """Per-device bytes each side must hold besides its programs' temporaries:
  trainer params + optimizer state + float32 gradients (+ the KL reference);
  rollout two compute copies of the params (``model.compute_dtype``: the one
  sampling and the one arriving with an in-flight update). Meshes may be abstract
  (shapes only)."""
  from jax.sharding import PartitionSpec as P
  from fbos_jax import optim as optim_lib
  from fbos_jax.model import qwen
  abstract = qwen.abstract_params(parts.model)
  specs = state_lib.param_specs(parts, trainer_mesh, rules)
  opt = jax.eval_shape(lambda p: optim_lib.init_opt_state(
      optim_lib.make_optimizer(parts.optim), p, parts.optim), abstract)
  opt_specs = state_lib.like_params(opt, abstract, specs, P())
  grads = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, np.float32), abstract)
  params_t = sh.per_device_bytes(abstract, specs, trainer_mesh)
  trainer = (params_t * (2 if parts.update.loss.kl_beta > 0 else 1)
             + sh.per_device_bytes(opt, opt_specs, trainer_mesh)
             + sh.per_device_bytes(grads, specs, trainer_mesh))
  rollout = 2 * sh.per_device_bytes(state_lib.compute_abstract(abstract, parts.model),
                                    state_lib.param_specs(parts, rollout_mesh, rules),
                                    rollout_mesh)
  return {"trainer": trainer, "rollout": rollout}


def check_split_fits(parts, trainer_mesh, rollout_mesh, rules, hbm_bytes: int,
                     fraction: float = 0.9, programs: Optional[dict] = None):
  """Raise :class:`AsyncConfigError` with the numbers when a side cannot hold its
  params (and, given ``programs`` = {side: peak bytes of its largest compiled
  program}, its programs) within ``fraction`` of ``hbm_bytes`` per device."""
  need = split_bytes(parts, trainer_mesh, rollout_mesh, rules)
  n_r, n_t = rollout_mesh.size, trainer_mesh.size
  for side, b in need.items():
    prog = (programs or {}).get(side, 0)
    total = max(b, prog) if prog else b
    if total > fraction * hbm_bytes:
      what = ("params + optimizer state + gradients" if side == "trainer" else
              "two copies of the params (sampling + arriving)")
      raise AsyncConfigError(
          f"rl.rollout_devices={n_r} leaves the {side} mesh "
          f"{n_t if side == 'trainer' else n_r} devices, each of which would need "
          f"{total / 2 ** 30:.2f} GiB ({what}: {b / 2 ** 30:.2f} GiB"
          + (f"; its largest program's peak {prog / 2 ** 30:.2f} GiB" if prog else "")
          + f"), more than {fraction:.0%} of its {hbm_bytes / 2 ** 30:.2f} GiB; move devices "
          f"to the {side} side or shard more")
  return need


# ----------------------------------------------------------------------------- staleness


def admitted(k: int, version: int, batch: int, max_staleness: int) -> bool:
  """AReaL's admission rule for step batch ``k`` (0-based) of ``batch`` groups:
  with N_r = (k + 1) * batch groups requested, admitted while
  floor((N_r - 1) / batch) <= version + max_staleness."""
  n_r = (k + 1) * batch
  return (n_r - 1) // batch <= version + max_staleness


class StalenessError(RuntimeError):
  """A token's version is missing, from the future, or older than eta allows."""


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
                           "policy version (the ledger did not see them sampled)")
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


# ----------------------------------------------------------------------------- versions


class VersionLedger:
  """The version of every token sampled for one step batch, found again by row.

  Each sampled row is recorded as (tokens, log-probs, versions); a row of a
  padded batch is looked up by its response tokens and its ``old_logp`` (the
  sampler's log-probs, copied bit for bit by the rollout's row shuffles). Two
  rows with the same tokens and log-probs but different versions (the params
  changed without changing those log-probs) get the older label per token and
  are counted (``collisions``)."""

  def __init__(self):
    self._rows: dict = {}
    self.collisions = 0
    self.rows = 0

  def record(self, tokens, logprobs, versions):
    t = np.asarray(tokens, np.int32)
    key = (t.tobytes(), np.asarray(logprobs, np.float32).tobytes())
    v = np.asarray(versions, np.int64)
    self.rows += 1
    old = self._rows.get(key)
    if old is not None and not np.array_equal(old, v):
      self.collisions += 1
      v = np.minimum(old, v)
    self._rows[key] = v

  def versions_of(self, batch) -> np.ndarray:
    """[N, R] int64: the version of each response token of ``batch`` (a
    PolicyBatch, host numpy); -1 on padding. A real row the ledger never saw raises."""
    n, r = batch.num_rows, batch.response_len
    p = batch.prompt_len
    attn = np.asarray(batch.attn_mask)[:, p:]
    tokens = np.asarray(batch.tokens)[:, p:]
    logp = np.asarray(batch.old_logp)
    out = np.full((n, r), -1, np.int64)
    for i in range(n):
      length = int(attn[i].sum())
      if length == 0:
        continue
      key = (tokens[i, :length].astype(np.int32).tobytes(),
             logp[i, :length].astype(np.float32).tobytes())
      v = self._rows.get(key)
      if v is None:
        raise StalenessError(f"row {i} of a batch ({length} tokens) was never recorded as "
                             "sampled: its version is unknown")
      out[i, :length] = v
    return out


class PolicyStore:
  """The newest published rollout params and their version (thread-safe), and the
  engine's :class:`~fbos_jax.engine.ParamsSource`: ``current()`` -> (params,
  version), ``kv_mode`` (``rl.inflight_update``), ``record(row)`` into the ledger
  of the batch being sampled."""

  def __init__(self, kv_mode: str = "keep_kv"):
    self.kv_mode = kv_mode
    self._cond = threading.Condition()
    self._params, self._version = None, -1
    self.ledger: Optional[VersionLedger] = None

  def publish(self, params, version: int):
    with self._cond:
      if version <= self._version:
        raise ValueError(f"version {version} published after version {self._version}")
      self._params, self._version = params, int(version)
      self._cond.notify_all()

  def current(self) -> tuple:
    with self._cond:
      return self._params, self._version

  @property
  def version(self) -> int:
    with self._cond:
      return self._version

  def wait(self, ready, stop: threading.Event, poll_s: float = 0.05) -> bool:
    """Block until ``ready(version)`` or ``stop`` is set; True when ready."""
    with self._cond:
      while not ready(self._version):
        if stop.is_set():
          return False
        self._cond.wait(poll_s)
      return True

  def record(self, row):
    """A finished engine row (``FinishedRow``) with its per-token versions."""
    if self.ledger is not None:
      self.ledger.record(row.tokens, row.logprobs, row.versions)


class VersionedContext(RolloutContext):
  """The rollout worker's context: ``sample`` takes a :class:`PolicyStore` for
  params. The static sampler reads the store once per call (all its tokens get
  that version); the continuous engine reads it between decode windows
  (``fbos_jax/engine/runner.py``: in-flight updates). Every sampled row goes into
  the store's ledger with its versions."""

  def sample(self, params, contexts: list, n: int, key, sampling, stream_ids=None) -> Samples:
    if not isinstance(params, PolicyStore):
      return super().sample(params, contexts, n, key, sampling, stream_ids)
    store = params
    if self.parts.sampling.engine == "continuous":  # the engine records rows
      return super().sample(store, contexts, n, key, sampling, stream_ids)
    p, version = store.current()
    out = super().sample(p, contexts, n, key, sampling, stream_ids)
    if store.ledger is not None:
      for i, length in enumerate(out.lengths):
        length = int(length)
        store.ledger.record(out.tokens[i, :length], out.logp[i, :length],
                            np.full((length,), version, np.int64))
    return out


# ----------------------------------------------------------------------------- the buffer


@dataclasses.dataclass
class StepItem:
  """One finished step batch: ``k`` (its step), the examples, the padded batches
  ({name: PolicyBatch}, host numpy), the rollout's metrics, the GFPO state after
  it, the data iterator's state after its prompts were pulled, the per-token
  versions ({name: [N, R]}), the version it was admitted under and the ledger's
  collision count."""
  k: int
  examples: list
  batches: dict
  metrics: dict
  gfpo: Any
  data_state: Any
  versions: dict
  admit_version: int
  collisions: int = 0


class StepBuffer:
  """A bounded FIFO of :class:`StepItem` (``capacity`` step batches); a worker's
  error reaches the trainer at its next ``take``."""

  def __init__(self, capacity: int, groups_per_item: int):
    self.capacity, self.groups = int(capacity), int(groups_per_item)
    self._items: collections.deque = collections.deque()
    self._cond = threading.Condition()
    self._error: Optional[BaseException] = None

  def depth_groups(self) -> int:
    with self._cond:
      return len(self._items) * self.groups

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


# ----------------------------------------------------------------------------- the worker


class RolloutWorker(threading.Thread):
  """Samples step batches ``start .. stop - 1`` on the rollout mesh and puts them
  in the buffer, each admitted by :func:`admitted`. ``busy_s()``: seconds spent
  sampling so far (the rest it waited for admission or room)."""

  def __init__(self, ctx: VersionedContext, store: PolicyStore, buffer: StepBuffer, iterator,
               *, rng, gfpo, start: int, stop: int, max_staleness: int):
    super().__init__(name="rollout-worker", daemon=True)
    self.ctx, self.store, self.buffer, self.iterator = ctx, store, buffer, iterator
    # host copies: the trainer's update donates the state's arrays
    self.rng, self.gfpo = np.asarray(jax.device_get(rng)), _host(gfpo)
    self.start_k, self.stop_k, self.eta = int(start), int(stop), int(max_staleness)
    self.batch = ctx.spec.prompts_per_step
    self.stopping = threading.Event()
    self._busy, self._since = 0.0, None
    self._lock = threading.Lock()

  def busy_s(self) -> float:
    with self._lock:
      extra = time.perf_counter() - self._since if self._since is not None else 0.0
      return self._busy + extra

  def _mark(self, busy: bool):
    with self._lock:
      now = time.perf_counter()
      if busy:
        self._since = now
      elif self._since is not None:
        self._busy += now - self._since
        self._since = None

  def run(self):
    try:
      for k in range(self.start_k, self.stop_k):
        ok = self.store.wait(lambda v, k=k: admitted(k, v, self.batch, self.eta), self.stopping)
        if not ok or not self.buffer.wait_room(self.stopping):
          return
        self._mark(True)
        try:
          item = self._sample(k)
        finally:
          self._mark(False)
        self.buffer.put(item)
    except BaseException as e:  # noqa: BLE001  (reaches the trainer at its next take)
      self.buffer.fail(e)

  def _sample(self, k: int) -> StepItem:
    examples = next(self.iterator)
    data_state = self.iterator.get_state() if hasattr(self.iterator, "get_state") else {}
    key = state_lib.stream_key(self.rng, "sample", k)
    ledger = VersionLedger()
    self.store.ledger = ledger
    admit = self.store.version
    batches, m, gfpo = rollout_lib.rollout_step(self.ctx, self.store, examples, key,
                                                gfpo_state=self.gfpo)
    self.store.ledger = None
    self.gfpo = _host(gfpo)  # the trainer's state takes (and donates) ``gfpo`` itself
    versions = {name: ledger.versions_of(b) for name, b in batches.items()}
    return StepItem(k, examples, batches, m, gfpo, data_state, versions, admit,
                    ledger.collisions)


def _host(tree):
  return None if tree is None else jax.tree.map(lambda a: np.asarray(jax.device_get(a)), tree)
