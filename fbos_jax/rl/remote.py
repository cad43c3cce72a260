"""The rollout in processes of its own: the two sides of a whole-process split.

``fbos_jax/rl/split.py:process_sides`` gives the first T processes the trainer
and the last T the rollout; trainer process t is paired with rollout process
T + t (rollout process r of the side serves trainer process r). Every process
runs the same command (``launch/train.py``); :func:`fbos_jax.rl.run.run_training`
sends the rollout processes to :func:`run_rollout` and the trainer ones to the
one training loop with a :class:`ProcessSource`.

What crosses, and how (JAX's own means only):

* small control messages (the start, each batch's metadata, the versions
  offered, the batches taken, a failure): jax.distributed's key-value store,
  keys under ``fbos/run/``; each side's own agreements (shape buckets, metrics)
  go over its own processes only (``fbos_jax.distributed.Side``);
* arrays: JAX's transfer server (``jax.experimental.transfer``), one per
  process. **Weights** (version v, after each update): trainer process t
  reshards the params it will send (``RLTrainer.rollout_params``) onto an
  intermediate sharding of its own devices laid out as its pair's rollout
  devices (one jitted copy; the update donates the params), and offers them;
  its pair pulls them straight onto the rollout mesh, shard for shard. **Batches**
  (step batch k): the rollout process offers its padded batches, their token
  versions and its GFPO state from one local device; its pair pulls them.

Staleness: the rollout samples batch k once the newest version offered is >= k
- eta (:func:`fbos_jax.rl.sources.admitted`) and the trainer has taken batch
k - capacity (``rl.buffer_groups``). Its samplers read :class:`RemotePolicy`
between engine windows (or once per static call): a newer version is pulled
then (with several rollout processes, the version they all have). Nothing is
ever left waiting: every offered version is pulled, in order.

Failures: every wait checks the peers (a process gone names itself,
``fbos_jax.distributed.PeerLostError``; the watchdog ends a process stuck
elsewhere) and the other side's error key (a failed or timed-out weight sync
names its side and version). The checkpoint (trainer side) holds each rollout
process's data iterator state after the batches trained; a restart sends it
back in the start message, so no prompt is lost or trained twice.
"""

from __future__ import annotations

import datetime
import json
import socket
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging
from jax.sharding import Mesh, NamedSharding, SingleDeviceSharding

from fbos_jax import distributed
from fbos_jax import sharding as sh
from fbos_jax.rl import config as config_lib
from fbos_jax.rl import rollout as rollout_lib
from fbos_jax.rl import sources
from fbos_jax.rl import split as split_lib
from fbos_jax.rl import state as state_lib
from fbos_jax.rl.batch import PolicyBatch
from fbos_jax.rl.context import RolloutContext

KEY = "fbos/run/"


class SyncError(RuntimeError):
  """A weight or batch transfer between the sides failed or timed out."""


# ----------------------------------------------------------------------------- channel


def _local_address() -> str:
  """The address of this host that the coordinator's host reaches (loopback on one machine)."""
  import os
  host = os.environ.get("JAX_COORDINATOR_ADDRESS", "").rpartition(":")[0].strip("[]")
  try:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
      s.connect((host or "127.0.0.1", 9))
      return s.getsockname()[0]
  except OSError:
    return socket.gethostbyname(socket.gethostname())


class Channel:
  """This process's transfer server, and connections to its peers' (their
  addresses through the key-value store)."""

  def __init__(self):
    from jax.experimental import transfer
    devs = jax.local_devices()
    host = _local_address()
    self.server = transfer.start_transfer_server(devs[0].client, f"{host}:0",
                                                 [f"{host}:0"] * len(devs))
    distributed.put_key(f"{KEY}xfer/{jax.process_index()}", self.server.address().encode())
    self._conns = {}

  def offer(self, uuid: int, arrays: list):
    self.server.await_pull(int(uuid), arrays)

  def pull(self, peer: int, uuid: int, specs: list, timeout_s: float, what: str) -> list:
    if peer not in self._conns:
      addr = distributed.wait_key(f"{KEY}xfer/{peer}", f"the transfer address of process {peer}")
      self._conns[peer] = self.server.connect(addr.decode())
    deadline = datetime.datetime.now() + datetime.timedelta(seconds=timeout_s)
    try:
      return jax.block_until_ready(self._conns[peer].pull(int(uuid), specs, timeout=deadline))
    except Exception as e:  # noqa: BLE001 - named, with the side and what
      raise SyncError(f"{what} from {distributed.describe_process(peer)} failed or timed out "
                      f"(rl.sync_timeout_s={timeout_s:g}): {type(e).__name__}: {e}") from e


def _json(key: str, what: str) -> dict:
  return json.loads(distributed.wait_key(KEY + key, what).decode())


def _put_json(key: str, obj):
  distributed.put_key(KEY + key, json.dumps(obj, default=_jsonable).encode())


def _jsonable(x):
  if isinstance(x, (np.integer, np.floating, np.bool_)):
    return x.item()
  if isinstance(x, np.ndarray):
    return x.tolist()
  return str(x)


def _paired_mesh(rollout_mesh, trainer_procs, rollout_procs) -> Mesh:
  """The trainer devices laid out as the rollout mesh: the rollout device at each
  position replaced by the device of the same local index on its paired trainer
  process (a leaf on it with its rollout spec holds, on trainer process t,
  exactly the shards rollout process T + t needs, in the same order)."""
  local = {}
  for d in jax.devices():
    local.setdefault(d.process_index, []).append(d)
  local = {p: sorted(v, key=lambda d: d.id) for p, v in local.items()}
  pair = dict(zip(rollout_procs, trainer_procs))
  grid = np.empty(rollout_mesh.devices.shape, dtype=object)
  for pos, d in np.ndenumerate(rollout_mesh.devices):
    grid[pos] = local[pair[d.process_index]][local[d.process_index].index(d)]
  return Mesh(grid, rollout_mesh.axis_names)


# ----------------------------------------------------------------------------- trainer side


class ProcessSource:
  """The trainer side's rollout source: batches from its paired rollout process,
  weights offered to it (see the module doc)."""

  def __init__(self, config, parts, sides, rollout_mesh, rules):
    self.trainer, self.rollout = sides
    self.pair = self.rollout.processes[self.trainer.index]
    self.acfg, self.timeout_s = parts.asynchronous, parts.asynchronous.sync_timeout_s
    self.parts, self.rules, self.rollout_mesh = parts, rules, rollout_mesh
    self.chan = Channel()
    self._copy, self._data, self._busy = None, None, 0.0
    self._gfpo_tree = None

  def busy_s(self) -> float:
    return self._busy

  def start(self, state, step: int, stop: int, policy):
    self._gfpo_tree = jax.tree.structure(state.gfpo)
    _put_json(f"start/{self.trainer.index}", {
        "step": int(step), "stop": int(stop), "data": self._data,
        "rng": np.asarray(jax.device_get(state.rng)).tolist(),
        "gfpo": [np.asarray(x).tolist() for x in jax.tree.leaves(jax.device_get(state.gfpo))]})
    self.publish(policy, int(state.step))

  def publish(self, policy, version: int) -> dict:
    """``policy()`` (the trainer's compute copy) resharded as the pair's rollout
    shards and offered as ``version``."""
    t0 = time.perf_counter()
    leaves = jax.tree.leaves(policy())
    if self._copy is None:
      mesh = _paired_mesh(self.rollout_mesh, self.trainer.processes, self.rollout.processes)
      specs = jax.tree.leaves(state_lib.param_specs(self.parts, self.rollout_mesh, self.rules),
                              is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))
      out = tuple(NamedSharding(mesh, s) for s in specs)
      self._copy = jax.jit(lambda *xs: tuple(jnp.copy(x) for x in xs), out_shardings=out)
      _put_json(f"wmeta/{self.trainer.index}", [[list(x.shape), str(x.dtype)] for x in leaves])
    try:
      sent = jax.block_until_ready(self._copy(*leaves))
      self.chan.offer(version, list(sent))
    except Exception as e:  # noqa: BLE001 - named: the side and the version
      raise SyncError(f"the weight sync of version {version} failed on the trainer side "
                      f"({distributed.describe_process(jax.process_index())}): "
                      f"{type(e).__name__}: {e}") from e
    _put_json(f"w/{self.trainer.index}", version)
    nbytes = sum(s.data.nbytes for x in sent for s in x.addressable_shards)
    return {"async/sync_s": time.perf_counter() - t0,
            "async/sync_bytes": float(nbytes * self.trainer.count)}

  def take(self, state, k: int, policy) -> sources.StepItem:
    meta = _json(f"b/{self.pair}/{k}", f"batch {k} from rollout process {self.pair}")
    dev = jax.local_devices()[0]
    specs = [jax.ShapeDtypeStruct(tuple(s), np.dtype(d), sharding=SingleDeviceSharding(dev))
             for _, s, d in meta["arrays"]]
    arrays = self.chan.pull(self.pair, k, specs, self.timeout_s, f"batch {k}")
    named = {n: np.asarray(a) for (n, _, _), a in zip(meta["arrays"], arrays)}
    batches = {b: PolicyBatch(**{f: named[f"{b}/{f}"] for f in PolicyBatch.__dataclass_fields__})
               for b in meta["batches"]}
    versions = {b: named[f"versions/{b}"].astype(np.int64) for b in meta["batches"]}
    gfpo = [named[f"gfpo/{i}"] for i in range(meta["gfpo"])]
    traj = rollout_lib.Trajectory(batches, versions, meta["metrics"],
                                  jax.tree.unflatten(self._gfpo_tree, gfpo), meta["examples"])
    if self.trainer.index == 0:
      _put_json("taken", k + 1)
    self._data, self._busy = meta["data_state"], meta["busy_s"]
    return sources.StepItem(k, traj, meta["data_state"], meta["admit_version"],
                            {"async/pull_s": meta["pull_s"], "async/pull_bytes": meta["pull_bytes"],
                             "rollout/compile_after_start": meta["compiles"]})

  def data_state(self):
    return self._data

  def restore_data(self, data_state):
    self._data = data_state

  def stop(self):
    pass

  def close(self):
    pass


# ----------------------------------------------------------------------------- rollout side


class RemotePolicy:
  """The rollout side's :class:`~fbos_jax.engine.ParamsSource`: the newest version
  its pair offered (with several rollout processes, the newest they all have),
  pulled onto the rollout mesh when read."""

  def __init__(self, chan: Channel, pair_index: int, trainer, specs: list, kv_mode: str,
               timeout_s: float):
    self.chan, self.index, self.trainer = chan, pair_index, trainer
    self.pair = trainer.processes[pair_index]
    self.specs, self.kv_mode, self.timeout_s = specs, kv_mode, timeout_s
    self.params, self.version, self.treedef = None, -1, None
    self.pull_s, self.pull_bytes = 0.0, 0

  def offered(self) -> int:
    return int(distributed.get_key(f"{KEY}w/{self.index}") or -1)

  def current(self) -> tuple:
    v = self.offered()
    if distributed.process_count() > 1:
      v = int(distributed.allgather_ints(v)[:, 0].min())
    self._pull_to(v)
    return self.params, self.version

  def _pull_to(self, v: int):
    for u in range(self.version + 1, v + 1):  # every offered version is taken, in order
      t0 = time.perf_counter()
      leaves = self.chan.pull(self.pair, u, self.specs, self.timeout_s,
                              f"the weight sync of version {u} (rollout side)")
      self.params = jax.tree.unflatten(self.treedef, leaves)
      self.version = u
      self.pull_s += time.perf_counter() - t0
      self.pull_bytes += sum(s.data.nbytes for x in leaves for s in x.addressable_shards)


def _wait_until(cond, what: str):
  """Poll ``cond()`` (every 20 ms) until true, watching the peers."""
  last = time.time()
  while not cond():
    time.sleep(0.02)
    if time.time() - last > 1.0:
      distributed.check_peers(what=what)
      last = time.time()


def run_rollout(config, workdir: str, sides):
  """A rollout process's whole run: sample step batches for its paired trainer
  process until the trainer's last step (see the module doc)."""
  trainer, rollout = sides
  distributed.set_sides(rollout, trainer)
  _rollout_loop(config, workdir, trainer, rollout)


def _rollout_loop(config, workdir: str, trainer, rollout):
  acfg = config_lib.async_config(config)
  _, mesh, _ = split_lib.build_meshes(config)
  rules = sh.rules_dict(config.mesh.rules)
  distributed.check_mesh(mesh, sh.batch_axes(rules))
  config_lib.validate(config, sh.batch_shard_count(mesh, rules),
                      process_count=distributed.process_count())
  ctx = RolloutContext.build(config, workdir, mesh=mesh)
  streamed = sources.streams_steps(ctx.parts, distributed.process_count())
  # the compile set first (on a pod, while the trainer compiles its own): the params
  # as the weight sync places them on this mesh, a key as the run's rng gives it
  watch = _compile_at_start(
      config, ctx, state_lib.compute_abstract(
          state_lib.abstract_state(ctx.parts, mesh, rules).params, ctx.parts.model),
      state_lib.root_rng(ctx.parts.seed), streamed or None,
      acfg.inflight_update == "recompute")
  it = sources.train_iterator(config, ctx)
  chan = Channel()
  me = rollout.index
  start = _json(f"start/{me}", "the trainer's start")
  if start["data"]:
    it.set_state(start["data"])
  shapes = _json(f"wmeta/{me}", "the trainer's weights")
  specs = jax.tree.leaves(state_lib.param_specs(ctx.parts, mesh, rules),
                          is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))
  abstract = [jax.ShapeDtypeStruct(tuple(s), np.dtype(d), sharding=NamedSharding(mesh, p))
              for (s, d), p in zip(shapes, specs)]
  policy = RemotePolicy(chan, me, trainer, abstract, acfg.inflight_update, acfg.sync_timeout_s)
  policy.treedef = jax.tree.structure(state_lib.abstract_state(ctx.parts, mesh, rules).params)
  rng = np.asarray(start["rng"], np.uint32)
  gfpo = _gfpo_tree([np.asarray(x) for x in start["gfpo"]], ctx, mesh, rules)
  b, busy = ctx.spec.prompts_per_step, sources.Busy()
  capacity = acfg.buffer_batches(b)
  first, stop = start["step"], start["stop"]
  # the trainer offers its start version (its state's step: past 0 on a resume) first
  policy.version = first - 1
  pulled = [0.0, 0]

  def ready(k: int, in_flight: int = 0) -> bool:
    """Batch k admitted, and room for it: batches taken..k-1 are in flight, sent or
    buffered on the trainer's side, at most ``capacity`` of them."""
    v = policy.offered()
    return v >= 0 and sources.admitted(k, v, b, acfg.max_staleness) and k < _taken(first) + capacity

  def send(item: sources.StepItem):
    leaves = [np.asarray(jax.device_get(x)) for x in jax.tree.leaves(item.traj.gfpo)]
    compiled = _compiles_after_start(watch, item.k, first)
    _send(chan, item, leaves, {"busy_s": busy(), "pull_s": policy.pull_s - pulled[0],
                               "pull_bytes": float(policy.pull_bytes - pulled[1]),
                               "compiles": compiled})
    pulled[:] = [policy.pull_s, policy.pull_bytes]

  logging.info("rollout process %d: batches %d..%d for trainer process %d", jax.process_index(),
               first, stop - 1, policy.pair)
  _wait_until(lambda: ready(first), f"waiting to sample batch {first}")
  if streamed:
    sources.stream_steps(ctx, policy, it, rng=rng, gfpo=gfpo, start=first, stop=stop,
                         admit=ready, put=send, busy=busy)  # never drains between steps
  else:  # (several rollout processes agree on shapes at each step's end: step by step)
    for k in range(first, stop):
      _wait_until(lambda: ready(k), f"waiting to sample batch {k}")
      busy.mark(True)
      examples = next(it)
      data_state = it.get_state() if hasattr(it, "get_state") else {}
      admit = policy.current()[1]
      traj = rollout_lib.rollout_step(ctx, policy, examples,
                                      state_lib.stream_key(rng, "sample", k), gfpo_state=gfpo)
      gfpo = traj.gfpo
      busy.mark(False)
      send(sources.StepItem(k, traj, data_state, admit))
  ctx.close()
  if watch is not None:
    watch.close()


def _compile_at_start(config, ctx, params, rng, streamed, recompute: bool):
  """The rollout process's compile set (``train.compile_at_start``;
  ``fbos_jax.compile_set.rollout_programs``), compiled before its first batch;
  returns the watch that counts the compiles after it (None when off)."""
  from fbos_jax import compile_set
  from fbos_jax import program_cache
  if not config.train.compile_at_start:
    return None
  groups = compile_set.rollout_programs(ctx, params, rng, streamed=streamed, recompute=recompute)
  say = lambda line: print(f"rollout process {jax.process_index()}: {line}", flush=True)
  compile_set.compile_all(groups, progress=config.train.progress, say=say)
  return program_cache.CompileWatch()


def _compiles_after_start(watch, k: int, first: int) -> int:
  """The compiles since the last batch sent (0 without a compile set), each warned
  about as the trainer's are (``fbos_jax.compile_set.after_start``)."""
  from fbos_jax import compile_set
  if watch is None:
    return 0
  return compile_set.after_start(watch.take(), k + 1, first=k == first)["compile/after_start"]


def _taken(first: int) -> int:
  """Batches the trainer has taken (``first``: the start step, before any)."""
  return int(distributed.get_key(f"{KEY}taken") or first)


def _gfpo_tree(leaves: list, ctx, mesh, rules):
  if not leaves:
    return None
  tree = state_lib.abstract_state(ctx.parts, mesh, rules).gfpo
  return jax.tree.unflatten(jax.tree.structure(tree), leaves)


def _send(chan: Channel, item: sources.StepItem, gfpo: list, info: dict):
  """Offer step batch ``item.k``'s arrays (one local device) and write its metadata."""
  traj, arrays = item.traj, []
  for name, batch in traj.batches.items():
    arrays += [(f"{name}/{f}", np.asarray(getattr(batch, f)))
               for f in PolicyBatch.__dataclass_fields__]
    arrays.append((f"versions/{name}", np.asarray(traj.versions[name], np.int32)))
  arrays += [(f"gfpo/{i}", x) for i, x in enumerate(gfpo)]
  dev = jax.local_devices()[0]
  chan.offer(item.k, [jax.device_put(a, dev) for _, a in arrays])
  _put_json(f"b/{jax.process_index()}/{item.k}", dict(
      info, arrays=[(n, a.shape, str(a.dtype)) for n, a in arrays],
      batches=sorted(traj.batches), gfpo=len(gfpo), metrics=traj.metrics,
      examples=traj.examples, data_state=item.data_state, admit_version=item.admit_version))
