"""Where the rollout and the trainer run: one mesh, two meshes in one process, or two sides of processes.

``rl.rollout_devices = N`` splits the devices into a rollout mesh of N and a
trainer mesh of the rest, each built from the config's mesh (``mesh.*``, the
rollout's axes overridden by ``rl.rollout_mesh``) and logical rules; 0 = one
mesh for both (colocated).

* **one process**: :func:`split_devices` gives the rollout the first N devices;
  both sides run in this process (the rollout on a thread,
  :class:`fbos_jax.rl.sources.ThreadSource`); the weights cross by
  device-to-device resharding (``fbos_jax/rl/weight_sync.py``).
* **several processes**: whole processes per side (:func:`process_sides`): the
  first processes train, the last N / D (D devices each) roll out, the same
  number on each side, trainer process t paired with rollout process T + t.
  Each side agrees only within itself (``fbos_jax.distributed.Side``: the
  key-value store, its own namespace), runs only its own programs, and the
  weights and batches cross between paired processes by JAX's transfer server
  (``fbos_jax/rl/remote.py``). Every process runs the same command.

A split that cannot divide the devices, the processes, the mesh or the batch
shards is refused here, naming ``rl.rollout_devices`` and the counts.
"""

from __future__ import annotations

import copy
from typing import Optional

import jax
import numpy as np

from fbos_jax import distributed
from fbos_jax import sharding as sh
from fbos_jax.rl import config as config_lib
from fbos_jax.rl import state as state_lib


class AsyncConfigError(ValueError):
  """A device split or buffer that cannot work; names the field and the numbers."""


def rollout_mesh_config(mesh_cfg, rollout_mesh: tuple):
  """The rollout side's mesh config of a split: ``mesh_cfg`` (``mesh.*``) with the
  axes of ``rollout_mesh`` (``AsyncConfig.rollout_mesh``: ((axis, size), ...)) over
  it; its logical rules are ``mesh.rules``."""
  out = copy.deepcopy(mesh_cfg)
  for axis, size in rollout_mesh:
    out[axis] = size
  return out


def split_devices(devices, rollout_devices: int, mesh_cfg,
                  rollout_mesh_cfg=None) -> tuple[list, list]:
  """(trainer devices, rollout devices) of one process: the rollout mesh takes the
  first ``rollout_devices`` (by id), the trainer the rest. Raises
  :class:`AsyncConfigError` naming ``rl.rollout_devices`` when the split leaves a
  side no device, a side cannot take the mesh config, or the weight sync cannot
  copy shard by shard."""
  devices = sorted(devices, key=lambda d: (d.process_index, d.id))
  n, total = int(rollout_devices), len(devices)
  if not 0 < n < total:
    raise AsyncConfigError(f"rl.rollout_devices={n}: must leave the trainer devices: "
                           f"0 < N < {total} devices (0 = colocated)")
  trainer, rollout = devices[n:], devices[:n]
  _check_fit(n, total, rollout, trainer, mesh_cfg, rollout_mesh_cfg or mesh_cfg)
  if max(n, total - n) % min(n, total - n):
    raise AsyncConfigError(
        f"rl.rollout_devices={n}: the weight sync copies shard by shard, which needs one "
        f"side's device count to be a multiple of the other's (rollout {n}, trainer "
        f"{total - n})")
  return trainer, rollout


def _check_fit(n: int, total: int, rollout: list, trainer: list, mesh_cfg, rollout_cfg):
  for side, devs, cfg in (("rollout", rollout, rollout_cfg), ("trainer", trainer, mesh_cfg)):
    try:
      sh.mesh_shape_from_config(cfg, len(devs))
    except sh.ShardingError as e:
      raise AsyncConfigError(f"rl.rollout_devices={n} leaves the {side} mesh {len(devs)} of "
                             f"{total} devices, which the mesh config does not fit: {e}") from None


def check_rows(parts, trainer_mesh, rollout_mesh, rules):
  """The rollout pads the update's rows to its own batch shards x micro- x
  mini-batches; the trainer mesh's batch shards (per process) must divide that."""
  procs = lambda m: len({d.process_index for d in m.devices.flat})
  r = max(sh.batch_shard_count(rollout_mesh, rules) // procs(rollout_mesh), 1)
  r *= parts.update.row_multiple
  t = max(sh.batch_shard_count(trainer_mesh, rules) // procs(trainer_mesh), 1)
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


def hbm_bytes(mesh) -> int:
  """The memory one device may use, when the runtime says (0 on CPU)."""
  stats = getattr(mesh.devices.flat[0], "memory_stats", lambda: None)()
  return int((stats or {}).get("bytes_limit", 0))


def _by_process(devices) -> dict:
  local: dict = {}
  for d in sorted(devices, key=lambda d: (d.process_index, d.id)):
    local.setdefault(d.process_index, []).append(d)
  return local


def side_processes(devices, rollout_devices: int, what: str = "") -> tuple:
  """(trainer processes, rollout processes) of a whole-process split of
  ``devices`` (several processes): the first half trains, the second rolls out.
  Raises :class:`AsyncConfigError` naming ``rl.rollout_devices`` and the counts
  unless each side gets whole processes, as many on each (pairs)."""
  local = _by_process(devices)
  procs, n, per = len(local), int(rollout_devices), len(next(iter(local.values())))
  if n % per or 2 * (n // per) != procs:
    raise AsyncConfigError(
        f"rl.rollout_devices={n} with {procs} processes of {per} devices{what}: a split over "
        f"several processes gives each side whole processes, as many on each (pairs of a "
        f"trainer and a rollout process), so rl.rollout_devices must be {procs * per // 2}")
  order = sorted(local)
  return tuple(order[:procs // 2]), tuple(order[procs // 2:])


def process_sides(config, devices=None) -> Optional[tuple]:
  """(trainer Side, rollout Side) of a whole-process split, or None (one process,
  or no split). Several processes with ``rl.max_staleness > 0`` need one: a
  rollout thread beside the trainer in every process would interleave the two
  sides' collective programs."""
  acfg = config_lib.async_config(config)
  devices = list(devices if devices is not None else jax.devices())
  procs = len(_by_process(devices))
  if procs == 1 or not acfg.enabled:
    return None
  if not acfg.rollout_devices:
    raise AsyncConfigError(
        f"rl.max_staleness={acfg.max_staleness} with {procs} processes needs "
        "rl.rollout_devices: the rollout then runs in processes of its own (a rollout thread "
        "beside the trainer in every process would interleave both sides' programs)")
  trainer, rollout = side_processes(devices, acfg.rollout_devices)
  return distributed.Side("trainer", trainer), distributed.Side("rollout", rollout)


def split_of(devices, rollout_devices: int, mesh_cfg, rollout_cfg) -> tuple[list, list]:
  """(trainer devices, rollout devices) as a run splits ``devices``: in one
  process :func:`split_devices`; over several, whole processes per side."""
  local = _by_process(devices)
  if len(local) == 1:
    return split_devices(devices, rollout_devices, mesh_cfg, rollout_cfg)
  trainer_p, rollout_p = side_processes(devices, rollout_devices)
  trainer = [d for p in trainer_p for d in local[p]]
  rollout = [d for p in rollout_p for d in local[p]]
  _check_fit(rollout_devices, len(devices), rollout, trainer, mesh_cfg, rollout_cfg)
  return trainer, rollout


def build_meshes(config, devices=None) -> tuple:
  """(trainer mesh, rollout mesh, colocated) of ``config``: one mesh, or the two
  meshes of ``rl.rollout_devices`` (:func:`split_of`)."""
  acfg = config_lib.async_config(config)
  devices = list(devices if devices is not None else jax.devices())
  if not acfg.rollout_devices:
    mesh = sh.make_mesh(config.mesh, devices)
    return mesh, mesh, True
  rollout_cfg = rollout_mesh_config(config.mesh, acfg.rollout_mesh)
  trainer, rollout = split_of(devices, acfg.rollout_devices, config.mesh, rollout_cfg)
  return sh.make_mesh(config.mesh, trainer), sh.make_mesh(rollout_cfg, rollout), False
