"""Mesh construction and logical-axis sharding rules (Levanter / MaxText style).

Every array has *logical* axis names (``("layers", "embed", "heads", "head_dim")``);
the config's ``mesh.rules`` map each logical name to zero, one or several mesh
axes. The mesh always has the axes ``MESH_AXES``:

- ``dcn``: across slices / nodes (data parallel over the slow network);
- ``data``: plain data parallel inside a slice / node;
- ``fsdp``: data parallel whose parameters and optimizer state are sharded;
- ``tensor``: tensor (model) parallel: heads, MLP width and vocabulary.
"""

from __future__ import annotations

import math
from typing import Any, Iterable, Optional, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

MESH_AXES = ("dcn", "data", "fsdp", "tensor")

# The default logical -> mesh rules (the config's ``mesh.rules`` starts as these,
# ``configs/base.py``). Order matters only for readability. The batch axes are
# the "batch" entry: every batch-sharded array, the batch shard count and the
# process-local row blocks read them from the rules (:func:`batch_axes`).
DEFAULT_RULES = (
    ("batch", ("dcn", "data", "fsdp")),
    ("vocab", "tensor"),
    ("embed", "fsdp"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("mlp", "tensor"),
    ("layers", None),
    ("head_dim", None),
    ("norm", None),
    ("seq", None),
    ("cache_seq", None),
)



class ShardingError(ValueError):
  pass


def mesh_shape_from_config(mesh_cfg, num_devices: int) -> dict[str, int]:
  """Resolve the config's axis sizes (one of them may be -1 = 'the rest')."""
  sizes = {a: int(mesh_cfg.get(a, 1)) for a in MESH_AXES}
  free = [a for a, s in sizes.items() if s == -1]
  if len(free) > 1:
    raise ShardingError(f"At most one mesh axis may be -1; got mesh.{free[0]} and mesh.{free[1]}.")
  known = math.prod(s for s in sizes.values() if s != -1)
  if free:
    if num_devices % known:
      raise ShardingError(
          f"mesh: the fixed axes multiply to {known}, which does not divide the "
          f"{num_devices} devices; change mesh.{'/'.join(a for a in MESH_AXES if a not in free)}.")
    sizes[free[0]] = num_devices // known
  total = math.prod(sizes.values())
  if total != num_devices:
    raise ShardingError(
        "mesh: axes " + " x ".join(f"{a}={sizes[a]}" for a in MESH_AXES) +
        f" multiply to {total}, but there are {num_devices} devices. Set one axis "
        "to -1 (e.g. --config.mesh.data=-1) or fix the sizes.")
  return sizes


def make_mesh(mesh_cfg, devices: Optional[Sequence[Any]] = None) -> Mesh:
  """Build a concrete mesh over ``devices`` (default: all devices, all processes)."""
  devices = list(devices if devices is not None else jax.devices())
  sizes = mesh_shape_from_config(mesh_cfg, len(devices))
  shape = tuple(sizes[a] for a in MESH_AXES)
  if sizes["dcn"] > 1 and len(devices) == len(jax.devices()) and jax.process_count() > 1:
    from jax.experimental import mesh_utils
    ici = (1,) + shape[1:]
    dcn = (sizes["dcn"], 1, 1, 1)
    arr = mesh_utils.create_hybrid_device_mesh(ici, dcn, devices=devices)
  else:
    try:
      from jax.experimental import mesh_utils
      arr = mesh_utils.create_device_mesh(shape, devices=devices)
    except Exception:  # fake CPU devices / odd topologies: plain order
      arr = np.asarray(devices).reshape(shape)
  return Mesh(arr, MESH_AXES)


def make_abstract_mesh(mesh_cfg, num_devices: int) -> jax.sharding.AbstractMesh:
  """A mesh of ``num_devices`` that does not exist here (dry runs, memory plans)."""
  sizes = mesh_shape_from_config(mesh_cfg, num_devices)
  return jax.sharding.AbstractMesh(tuple(sizes[a] for a in MESH_AXES), MESH_AXES)


def rules_dict(rules: Iterable) -> dict[str, Any]:
  """Rules (pairs, or a dict) as {logical name: mesh axis, tuple of axes, or None}."""
  out = {}
  for name, target in (rules.items() if isinstance(rules, dict) else rules):
    if isinstance(target, list):
      target = tuple(target)
    out[str(name)] = target
  return out


def logical_to_spec(logical_axes: Sequence[Optional[str]], rules) -> P:
  """Map a tuple of logical axis names to a PartitionSpec."""
  r = rules if isinstance(rules, dict) else rules_dict(rules)
  used: set[str] = set()
  spec = []
  for name in logical_axes:
    target = None if name is None else r.get(name)
    if target is None:
      spec.append(None)
      continue
    targets = (target,) if isinstance(target, str) else tuple(target)
    targets = tuple(t for t in targets if t not in used)  # a mesh axis is used once
    used.update(targets)
    spec.append(targets[0] if len(targets) == 1 else (targets or None))
  return P(*spec)


def _axis_size(mesh, entry) -> int:
  if entry is None:
    return 1
  names = (entry,) if isinstance(entry, str) else entry
  return math.prod(mesh.shape[n] for n in names)


def fit_spec(spec: P, shape: Sequence[int], mesh) -> P:
  """Drop mesh axes that do not divide a dimension (e.g. a batch of 1), keeping
  the rest; size-1 mesh axes are dropped too so specs print cleanly."""
  out = []
  for dim, entry in zip(shape, tuple(spec) + (None,) * (len(shape) - len(spec))):
    if entry is None:
      out.append(None)
      continue
    names = (entry,) if isinstance(entry, str) else tuple(entry)
    kept = tuple(n for n in names if mesh.shape[n] > 1)
    while kept and dim % math.prod(mesh.shape[n] for n in kept):
      kept = kept[:-1]
    out.append(kept[0] if len(kept) == 1 else (kept or None))
  return P(*out)


def check_divisible(name: str, shape, spec: P, mesh, field_hint: str = ""):
  """Raise a clear error if a sharded dimension is not divisible by its mesh axes."""
  for dim, entry in zip(shape, spec):
    n = _axis_size(mesh, entry)
    if dim % n:
      raise ShardingError(
          f"{name}: dimension of size {dim} is sharded over mesh axes {entry} of total size "
          f"{n}, which does not divide it. {field_hint}".strip())


def tree_specs(logical_tree, rules, abstract_tree=None, mesh=None, strict=False):
  """Logical-axes pytree -> PartitionSpec pytree (optionally fitted to shapes)."""
  is_leaf = lambda x: isinstance(x, tuple) and all(isinstance(a, (str, type(None))) for a in x)
  specs = jax.tree.map(lambda ax: logical_to_spec(ax, rules), logical_tree, is_leaf=is_leaf)
  if abstract_tree is None or mesh is None:
    return specs
  if strict:
    def chk(path, s, a):
      check_divisible(jax.tree_util.keystr(path), a.shape, s, mesh)
      return s
    return jax.tree.map_with_path(chk, specs, abstract_tree, is_leaf=lambda x: isinstance(x, P))
  return jax.tree.map(lambda s, a: fit_spec(s, a.shape, mesh), specs, abstract_tree,
                      is_leaf=lambda x: isinstance(x, P))


def tree_shardings(mesh, specs):
  return jax.tree.map(lambda s: NamedSharding(mesh, s), specs,
                      is_leaf=lambda x: isinstance(x, P))


def shard_shape(shape: Sequence[int], spec: P, mesh) -> tuple[int, ...]:
  out = []
  for i, dim in enumerate(shape):
    entry = spec[i] if i < len(spec) else None
    out.append(-(-dim // _axis_size(mesh, entry)))
  return tuple(out)


def per_device_bytes(abstract_tree, specs, mesh) -> int:
  """Bytes one device holds for a pytree of ShapeDtypeStructs sharded by ``specs``."""
  total = 0
  for a, s in zip(jax.tree.leaves(abstract_tree),
                  jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, P))):
    total += math.prod(shard_shape(a.shape, s, mesh)) * np.dtype(a.dtype).itemsize
  return total


def batch_axes(rules=None) -> tuple:
  """The mesh axes of the logical "batch" axis in ``rules`` (default
  :data:`DEFAULT_RULES`: dcn, data, fsdp)."""
  target = rules_dict(DEFAULT_RULES if rules is None else rules).get("batch")
  if target is None:
    return ()
  return (target,) if isinstance(target, str) else tuple(target)


def batch_spec(rank: int, mesh=None, batch_size: Optional[int] = None, rules=None) -> P:
  """PartitionSpec for a [batch, ...] array: batch over the rules' batch axes."""
  axes = batch_axes(rules)
  spec = P(axes or None, *([None] * (rank - 1)))
  if mesh is not None and batch_size is not None:
    spec = fit_spec(spec, (batch_size,) + (1,) * (rank - 1), mesh)
  return spec


def batch_shard_count(mesh, rules=None) -> int:
  """How many shards the batch axis has on ``mesh`` (1 without a mesh)."""
  if mesh is None:
    return 1
  return math.prod(mesh.shape[a] for a in batch_axes(rules) if a in mesh.shape)


def local_batch_shard_count(mesh, rules=None) -> int:
  """The batch shards of this process's devices: each host builds its rows
  (a multiple of this) and contributes them to the global batch."""
  return max(batch_shard_count(mesh, rules) // jax.process_count(), 1)


def constrain(x, mesh, logical_axes, rules):
  """with_sharding_constraint by logical names; a no-op without a mesh."""
  if mesh is None:
    return x
  spec = fit_spec(logical_to_spec(logical_axes, rules), x.shape, mesh)
  return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))


def put_process_local(local: np.ndarray, mesh, rules=None) -> jax.Array:
  """Place this process's rows of a [batch, ...] array as a global array sharded
  over the batch axes (``jax.make_array_from_process_local_data``): every host
  contributes its own shard, nothing is gathered to one host."""
  return put_process_local_many([local], mesh, rules)[0]


def put_process_local_many(locals_: Sequence[np.ndarray], mesh, rules=None) -> list:
  """:func:`put_process_local` of each array, in one transfer call on one process
  (a decode window's dozen small inputs: one ``device_put`` instead of twelve)."""
  locals_ = [np.asarray(x) for x in locals_]
  procs = len({d.process_index for d in mesh.devices.flat})
  shardings = [NamedSharding(mesh, fit_spec(batch_spec(x.ndim, rules=rules),
                                            (x.shape[0] * procs,) + x.shape[1:], mesh))
               for x in locals_]
  if procs == 1:
    return list(jax.device_put(locals_, shardings))
  return [jax.make_array_from_process_local_data(s, x) for s, x in zip(shardings, locals_)]


def local_row_start(x) -> int:
  """First global row of this process's block of a batch-sharded array."""
  if getattr(x, "is_fully_addressable", True):
    return 0
  return min(s.index[0].start or 0 for s in x.addressable_shards)


def host_rows(x, rows: Optional[tuple] = None) -> np.ndarray:
  """Device array -> numpy; ``rows=(start, stop)`` keeps only those global rows,
  read from this process's addressable shards (in a multi-process mesh each
  process reads back its own rows; nothing is gathered across hosts)."""
  if getattr(x, "is_fully_addressable", True):
    out = np.asarray(jax.device_get(x))
    return out if rows is None else out[rows[0]:rows[1]]
  if rows is None:
    from jax.experimental import multihost_utils
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))
  start, stop = rows
  out = np.empty((stop - start,) + tuple(x.shape[1:]), x.dtype)
  seen = np.zeros((stop - start,), bool)
  for s in x.addressable_shards:
    if any((sl.start or 0) != 0 or sl.stop not in (None, dim)
           for sl, dim in zip(s.index[1:], x.shape[1:])):
      continue  # a shard of a non-row axis: not a whole row
    r0 = s.index[0].start or 0
    r1 = x.shape[0] if s.index[0].stop is None else s.index[0].stop
    lo, hi = max(r0, start), min(r1, stop)
    if lo < hi and not seen[lo - start:hi - start].all():
      out[lo - start:hi - start] = np.asarray(s.data)[lo - r0:hi - r0]
      seen[lo - start:hi - start] = True
  if not seen.all():
    raise ShardingError(f"rows [{start}, {stop}) of a {x.shape} output are not all on this "
                        f"process's devices (sharding {x.sharding}).")
  return out
