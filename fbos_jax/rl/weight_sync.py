"""Weight sync from the trainer mesh to the rollout mesh, device to device, in chunks.

The trainer's params live on the trainer mesh (its shardings from the config's
logical rules); the rollout worker samples with a copy on the rollout mesh
(:mod:`fbos_jax.rl.sources`). A plain ``jax.device_put(x, rollout_sharding)``
copies shard by shard only when the two shardings split the array the same way
(``batched_copy_array_to_devices_with_sharding``); otherwise, when a target
shard is not exactly a source shard, JAX assembles the whole array on the host
(``shard_sharded_device_array_slow_path`` -> ``x._value``): the host round trip
and the full-array gather that tunix avoids with an intermediate sharding
(``tunix/rl/reshard.py``, through pathwaysutils). The same fact here:

1. **intermediate**: on the trainer's own devices, reshard each leaf (one jitted
   identity per chunk, a collective inside the trainer mesh) to
   :func:`intermediate_mesh` with the rollout spec: every rollout shard is then
   exactly a buffer on a trainer device of the same process;
2. **copy**: each rollout device takes that buffer (``jax.device_put`` of a
   single-device array: a device-to-device copy), and the rollout array is
   assembled from its shards (``jax.make_array_from_single_device_arrays``, which
   also holds in a multi-process run: every process copies only its own shards).

Nothing goes through the host, and a target shard that no trainer device of its
process holds raises (never a silent host fallback). Leaves go in chunks of at
most ``rl.sync_chunk_mib`` (a larger leaf is a chunk of its own), each finished
before the next starts, so the sync's extra memory on the trainer side is one
chunk's intermediate shards. Colocated (one mesh), the sync is a chunked copy
(the update donates the params the rollout may still be sampling with), or
nothing at all when the loop is synchronous (eta = 0).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from fbos_jax import sharding as sh

REP_AXIS = "sync_rep"  # the intermediate mesh's extra axis (trainer devices > rollout devices)


class SyncPlanError(ValueError):
  """The two meshes cannot be synced shard by shard; names the field and the numbers."""


@dataclasses.dataclass
class SyncStats:
  """One sync: seconds, bytes the rollout devices received (all of them), chunks,
  and the largest chunk in bytes (of the whole arrays)."""
  seconds: float = 0.0
  bytes: int = 0
  chunks: int = 0
  largest_chunk: int = 0

  def metrics(self) -> dict:
    return {"async/sync_s": self.seconds, "async/sync_bytes": float(self.bytes),
            "async/sync_chunks": float(self.chunks)}


def _spec_axes(spec: P) -> set:
  out = set()
  for e in spec:
    if e is None:
      continue
    out.update((e,) if isinstance(e, str) else e)
  return out


def _fold(dst_mesh, n_src: int, specs: list) -> tuple:
  """(fold axis, fold factor, replication): how ``n_src`` trainer devices hold every
  rollout shard. More trainer devices: each rollout shard on ``n_src / n_dst`` of
  them. Fewer: a rollout axis no param is split over (it only replicates) shrinks
  by ``n_dst / n_src``."""
  n_dst = dst_mesh.size
  if n_src % n_dst == 0:
    return None, 1, n_src // n_dst
  if n_dst % n_src:
    raise SyncPlanError(
        f"rl.rollout_devices: the weight sync copies shard by shard, which needs one side's "
        f"device count to be a multiple of the other's; the trainer has {n_src} devices and "
        f"the rollout {n_dst}")
  k = n_dst // n_src
  used = set().union(*[_spec_axes(s) for s in specs]) if specs else set()
  for axis in sh.MESH_AXES:
    if axis not in used and dst_mesh.shape[axis] % k == 0:
      return axis, k, 1
  raise SyncPlanError(
      f"rl.rollout_devices: the rollout mesh {dict(dst_mesh.shape)} has {n_dst} devices, "
      f"{k}x the trainer's {n_src}, and the params are split over every axis that could "
      f"hold the factor {k} ({sorted(used)}), so {n_src} trainer devices cannot hold each "
      "rollout shard; give the rollout mesh a replicated (data) axis of a multiple of "
      f"{k}, or move devices to the trainer")


def intermediate_mesh(src_devices, dst_mesh, specs: list) -> Mesh:
  """A mesh over the trainer's devices with the rollout mesh's axes (one folded, or
  an extra replication axis): a leaf sharded on it with its rollout spec has every
  rollout shard as the buffer of a trainer device of the same process."""
  src = sorted(src_devices, key=lambda d: (d.process_index, d.id))
  axis, k, rep = _fold(dst_mesh, len(src), specs)
  shape = [dst_mesh.shape[a] // (k if a == axis else 1) for a in sh.MESH_AXES] + [rep]
  free: dict = {}
  for d in src:
    free.setdefault(d.process_index, []).append(d)
  grid = np.empty(shape, dtype=object)
  names = list(sh.MESH_AXES)
  for pos in np.ndindex(*shape):
    anchor = tuple(p * (k if names[i] == axis else 1) for i, p in enumerate(pos[:-1]))
    proc = dst_mesh.devices[anchor].process_index
    if not free.get(proc):
      raise SyncPlanError(
          f"rl.rollout_devices: process {proc} holds more rollout shards than trainer "
          "devices; every process must give both meshes devices in the same ratio")
    grid[pos] = free[proc].pop(0)
  return Mesh(grid, tuple(names) + (REP_AXIS,))


def _index_key(index, shape) -> tuple:
  return tuple((sl.start or 0, dim if sl.stop is None else sl.stop)
               for sl, dim in zip(index, shape))


def _check_cover(shape, inter: NamedSharding, dst: NamedSharding, what: str):
  """Every rollout shard must be a shard of the intermediate on its own process."""
  held = {(d.process_index, _index_key(i, shape))
          for d, i in inter.devices_indices_map(shape).items()}
  for d, i in dst.devices_indices_map(shape).items():
    if (d.process_index, _index_key(i, shape)) not in held:
      raise SyncPlanError(
          f"rl.rollout_devices: the rollout shard {i} of {what} {shape} on device {d.id} "
          f"(process {d.process_index}) is on no trainer device of that process")


def _chunks(nbytes: list, limit: int) -> list:
  """Consecutive leaf indices in groups of at most ``limit`` bytes (a larger leaf alone)."""
  out, cur, size = [], [], 0
  for i, b in enumerate(nbytes):
    if cur and size + b > limit:
      out.append(cur)
      cur, size = [], 0
    cur.append(i)
    size += b
  if cur:
    out.append(cur)
  return out


@functools.lru_cache(maxsize=None)
def _reshard_fn(shardings: tuple):
  return jax.jit(lambda *xs: xs, out_shardings=shardings)


@functools.lru_cache(maxsize=None)
def _copy_fn(shardings: tuple):
  return jax.jit(lambda *xs: tuple(jnp.copy(x) for x in xs), out_shardings=shardings)


class WeightSync:
  """Copies params onto ``dst_shardings`` (a pytree of NamedShardings on the rollout
  mesh), device to device, in chunks of at most ``chunk_bytes``.

  mode: ``split`` (two meshes: intermediate on the trainer, then shard copies),
  ``copy`` (one mesh: a copy the update cannot donate) or ``none`` (one mesh,
  synchronous loop: the same arrays)."""

  def __init__(self, abstract_params, dst_shardings, chunk_bytes: int, mode: str):
    if mode not in ("split", "copy", "none"):
      raise ValueError(f"mode={mode!r}: expected split | copy | none")
    self.mode, self.chunk_bytes = mode, int(chunk_bytes)
    leaves, self.treedef = jax.tree.flatten(abstract_params)
    self.shapes = [tuple(a.shape) for a in leaves]
    self.dst = jax.tree.leaves(dst_shardings, is_leaf=lambda x: isinstance(x, NamedSharding))
    nbytes = [math.prod(a.shape) * np.dtype(a.dtype).itemsize for a in leaves]
    self.groups = _chunks(nbytes, max(self.chunk_bytes, 1))
    self.group_bytes = [sum(nbytes[i] for i in g) for g in self.groups]
    self.inter = None
    if mode == "split":
      src_devices = leaves[0].sharding.device_set
      dst_mesh = self.dst[0].mesh
      mesh = intermediate_mesh(src_devices, dst_mesh, [s.spec for s in self.dst])
      self.inter = [NamedSharding(mesh, s.spec) for s in self.dst]
      for k, (shape, a, b) in enumerate(zip(self.shapes, self.inter, self.dst)):
        _check_cover(shape, a, b, f"param leaf {k}")

  def __call__(self, params) -> tuple[Any, SyncStats]:
    """(the params on the rollout mesh, :class:`SyncStats`)."""
    stats = SyncStats()
    if self.mode == "none":
      return params, stats
    t0 = time.perf_counter()
    leaves = jax.tree.leaves(params)
    out: list = [None] * len(leaves)
    for g, gb in zip(self.groups, self.group_bytes):
      xs = tuple(leaves[i] for i in g)
      if self.mode == "copy":
        ys = _copy_fn(tuple(self.dst[i] for i in g))(*xs)
      else:
        inter = _reshard_fn(tuple(self.inter[i] for i in g))(*xs)
        ys = tuple(self._copy_shards(x, self.dst[i]) for x, i in zip(inter, g))
        del inter
      jax.block_until_ready(ys)  # one chunk at a time: the peak stays one chunk
      for i, y in zip(g, ys):
        out[i] = y
        stats.bytes += sum(s.data.nbytes for s in y.addressable_shards)
      stats.chunks += 1
      stats.largest_chunk = max(stats.largest_chunk, gb)
    stats.seconds = time.perf_counter() - t0
    return jax.tree.unflatten(self.treedef, out), stats

  @staticmethod
  def _copy_shards(x, dst: NamedSharding):
    """``x`` (on the intermediate sharding) onto ``dst``: each target device copies
    the buffer of a source device of its process that holds its shard."""
    shape = x.shape
    held: dict = {}
    for s in x.addressable_shards:
      held.setdefault((s.device.process_index, _index_key(s.index, shape)), []).append(s.data)
    bufs, devices = [], []
    for n, (d, idx) in enumerate(dst.addressable_devices_indices_map(shape).items()):
      cands = held.get((d.process_index, _index_key(idx, shape)))
      if not cands:
        raise SyncPlanError(f"weight sync: shard {idx} of {shape} for device {d.id} is on no "
                            "source device of its process (the plan's check should have said)")
      bufs.append(cands[n % len(cands)])
      devices.append(d)
    copied = jax.device_put(bufs, devices)
    return jax.make_array_from_single_device_arrays(shape, dst, copied)


def sync_mode(colocated: bool, max_staleness: int) -> str:
  """``split`` for two meshes; one mesh: ``copy`` when the rollout may still sample
  while the update runs (eta > 0), else ``none``."""
  if not colocated:
    return "split"
  return "copy" if max_staleness > 0 else "none"


def received_bytes(abstract_params, dst_shardings) -> tuple:
  """(bytes all rollout devices receive, the most one device receives) for one sync
  of ``abstract_params`` onto ``dst_shardings``: what the plan prints."""
  per_dev: dict = {}
  leaves = jax.tree.leaves(abstract_params)
  dst = jax.tree.leaves(dst_shardings, is_leaf=lambda x: isinstance(x, NamedSharding))
  for a, s in zip(leaves, dst):
    item = np.dtype(a.dtype).itemsize
    for d, idx in s.devices_indices_map(tuple(a.shape)).items():
      n = math.prod(b - a0 for a0, b in _index_key(idx, a.shape)) * item
      per_dev[d] = per_dev.get(d, 0) + n
  return sum(per_dev.values()), max(per_dev.values(), default=0)


def rollout_shardings(abstract_params, specs, mesh) -> Any:
  """NamedShardings of the params on ``mesh`` from their PartitionSpecs."""
  del abstract_params
  return jax.tree.map(lambda s: NamedSharding(mesh, s), specs,
                      is_leaf=lambda x: isinstance(x, P))


def make_sync(params_abstract, rollout_specs, rollout_mesh, *, colocated: bool,
              max_staleness: int, chunk_bytes: int) -> WeightSync:
  """The run's :class:`WeightSync`: trainer params (``params_abstract``, with their
  shardings) onto ``rollout_mesh`` by ``rollout_specs``."""
  dst = rollout_shardings(params_abstract, rollout_specs, rollout_mesh)
  return WeightSync(params_abstract, dst, chunk_bytes, sync_mode(colocated, max_staleness))


def describe(ws: WeightSync) -> str:
  """One line: mode, chunks and their sizes."""
  return (f"weight sync ({ws.mode}): {len(ws.groups)} chunk(s) of at most "
          f"{ws.chunk_bytes / 2 ** 20:.0f} MiB (largest {max(ws.group_bytes) / 2 ** 20:.1f} MiB)")
