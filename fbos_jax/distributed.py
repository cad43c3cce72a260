"""Multi-process start-up through JAX's own runtime (no home-made cluster layer).

* TPU pods: ``jax.distributed.initialize()`` discovers everything itself.
* GPU / CPU clusters: coordinator, process count and id from flags, else from
  the environment (``JAX_COORDINATOR_ADDRESS``/``JAX_NUM_PROCESSES``/
  ``JAX_PROCESS_ID``, or SLURM's variables, which JAX's cluster detection reads).
* A single process needs nothing.

Also the few cross-host reductions the host-side code of a step needs (all tiny:
a handful of ints or a JSON blob per host, never rollouts or texts):
:func:`agree_max` / :func:`allgather_ints` (shape buckets, row offsets),
:func:`mean_over_processes` (metrics), :func:`allgather_json` and
:func:`per_process_state` / :func:`select_process_state` (each host's data
iterator state in a checkpoint), and :func:`check_mesh` (the mesh's batch axes
must split over the processes).
"""

from __future__ import annotations

import json
import math
import os
import socket
import sys
import threading
import time
from typing import Any, Optional, Sequence

import jax
import numpy as np

# Exit status of a process whose jax.distributed start-up timed out (see initialize).
INIT_TIMEOUT_EXIT_CODE = 75


class DistributedInitError(RuntimeError):
  pass


class ProcessMeshError(ValueError):
  """The mesh does not fit the processes (batch axes must split over hosts)."""


def _on_tpu_pod() -> bool:
  """On a Cloud TPU VM (GCE or GKE), where ``jax.distributed.initialize()`` finds
  the workers itself (a single-host slice is a 1-process "pod")."""
  platforms = os.environ.get("JAX_PLATFORMS", "")
  if platforms and "tpu" not in platforms:
    return False
  if any(os.environ.get(v) for v in ("TPU_WORKER_HOSTNAMES", "TPU_PROCESS_ADDRESSES",
                                     "MEGASCALE_COORDINATOR_ADDRESS")):
    return True
  try:  # TPU chips on the PCI bus (what JAX's own Cloud TPU detection looks at)
    from jax._src import hardware_utils
    return hardware_utils.num_available_tpu_chips_and_device_id()[0] > 0
  except Exception:  # noqa: BLE001 - private API; fall back to the device files
    import glob
    return bool(glob.glob("/dev/accel[0-9]*") or glob.glob("/dev/vfio/[0-9]*"))


def _on_slurm() -> bool:
  return "SLURM_JOB_ID" in os.environ and int(os.environ.get("SLURM_NTASKS", "1")) > 1


def _slurm_tasks_per_node() -> Optional[int]:
  for var in ("SLURM_STEP_TASKS_PER_NODE", "SLURM_NTASKS_PER_NODE", "SLURM_TASKS_PER_NODE"):
    v = os.environ.get(var, "")
    head = v.split(",")[0].split("(")[0]  # e.g. "8(x4)" -> 8
    if head.isdigit():
      return int(head)
  return None


def _slurm_local_device_ids() -> Optional[list]:
  """One process per node under SLURM: every GPU of the node belongs to it.

  (JAX's SLURM detection otherwise pins each process to GPU ``SLURM_LOCALID``,
  which is right for one process per GPU and wrong for one per node.)"""
  if _slurm_tasks_per_node() != 1:
    return None
  vis = os.environ.get("CUDA_VISIBLE_DEVICES", "")
  if vis:
    return list(range(len([v for v in vis.split(",") if v.strip()])))
  n = os.environ.get("SLURM_GPUS_ON_NODE", "")
  return list(range(int(n))) if n.isdigit() and int(n) > 0 else None


def _wait_for_port(host: str, port: int, deadline: float) -> Optional[Exception]:
  """Poll a TCP connect to host:port until it succeeds or the deadline passes."""
  last: Optional[Exception] = None
  while True:
    try:
      with socket.create_connection((host, port), timeout=max(0.2, min(2.0, deadline - time.time()))):
        return None
    except OSError as e:
      last = e
    if time.time() >= deadline:
      return last
    time.sleep(0.25)


def _wait_for_coordinator(address: str, process_id: int, deadline: float, timeout_s: int):
  """A process other than 0: the coordinator's host resolves and its port opens
  before ``deadline``, else ``DistributedInitError`` saying what to check."""
  host, _, port = address.rpartition(":")
  host = host.strip("[]")
  try:  # fail fast with a clear message if the coordinator's host does not resolve
    socket.getaddrinfo(host, int(port))
  except (socket.gaierror, ValueError) as e:
    raise DistributedInitError(
        f"coordinator {address!r} cannot be resolved ({e}); check "
        "--coordinator_address (host:port of process 0)") from None
  err = _wait_for_port(host, int(port), deadline)
  if err is not None:
    raise DistributedInitError(
        f"process {process_id}: the coordinator {address} is unreachable after "
        f"{timeout_s}s ({err}). Start process 0 first (it hosts the coordinator), check "
        "--coordinator_address (host:port of process 0) and that the port is open between "
        "the hosts.")


def initialize(coordinator_address: str = "", num_processes: int = 0, process_id: int = -1,
               *, timeout_s: int = 300, local_device_ids=None) -> bool:
  """Initialise jax.distributed when there is more than one process.

  Returns True if it initialised. Never hangs past ``timeout_s``:

  * a process other than 0 first waits (TCP) for the coordinator's port and
    raises ``DistributedInitError`` if it is not reachable within ``timeout_s``;
  * JAX's own start-up aborts the process (a C++ fatal error) when its
    deadline passes, e.g. on process 0 when some peers never connect; a
    watchdog ends the process a little earlier with a clear message on stderr
    and exit status ``INIT_TIMEOUT_EXIT_CODE`` instead.
  """
  coordinator_address = coordinator_address or os.environ.get("JAX_COORDINATOR_ADDRESS", "")
  num_processes = num_processes or int(os.environ.get("JAX_NUM_PROCESSES", "0") or 0)
  if process_id < 0:
    process_id = int(os.environ.get("JAX_PROCESS_ID", "-1") or -1)
  explicit = bool(coordinator_address) and num_processes > 1
  if not (explicit or _on_tpu_pod() or _on_slurm()):
    return False
  if explicit and not 0 <= process_id < num_processes:
    raise DistributedInitError(
        f"--process_id={process_id} must be in [0, --num_processes={num_processes})")
  t0 = time.time()
  if explicit and process_id != 0:
    _wait_for_coordinator(coordinator_address, process_id, t0 + timeout_s, timeout_s)
  kwargs = {}
  if explicit:
    kwargs = dict(coordinator_address=coordinator_address, num_processes=num_processes,
                  process_id=process_id)
  if local_device_ids is None and _on_slurm() and not _on_tpu_pod():
    # (JAX's SLURM detection fills unset local_device_ids even with explicit flags)
    local_device_ids = _slurm_local_device_ids()
  if local_device_ids is not None:
    kwargs["local_device_ids"] = local_device_ids
  left = max(1.0, timeout_s - (time.time() - t0))
  where = coordinator_address or "(auto-detected)"
  done = threading.Event()

  def watchdog():
    if done.wait(left):
      return
    msg = (f"[fbos_jax.distributed] process {process_id if process_id >= 0 else '(auto)'}: "
           f"jax.distributed start-up with the coordinator {where} did not finish within "
           f"{timeout_s}s ({num_processes or '(auto)'} processes expected). Are all processes "
           "started, with the same --coordinator_address and --num_processes, distinct "
           "--process_id values, and can they reach process 0 on that port? Giving up.")
    print(msg, file=sys.stderr, flush=True)
    try:
      from absl import logging
      logging.error(msg)
    except Exception:  # noqa: BLE001
      pass
    os._exit(INIT_TIMEOUT_EXIT_CODE)

  threading.Thread(target=watchdog, name="jax-distributed-watchdog", daemon=True).start()
  try:
    # JAX's own deadline is set past ours, so that the watchdog speaks first.
    jax.distributed.initialize(initialization_timeout=int(left) + 30, **kwargs)
  except Exception as e:  # noqa: BLE001 - re-raised with the fix
    raise DistributedInitError(
        f"jax.distributed.initialize failed for coordinator {where} "
        f"with {num_processes or '(auto)'} processes: {e}. Is process 0 "
        "running and reachable on that port?") from None
  finally:
    done.set()
  return True


# ----------------------------------------------------------------------------- reductions


def allgather_ints(*values: int) -> np.ndarray:
  """[process_count, len(values)] int64: every host's ``values`` (every host
  must call it, in the same order)."""
  local = np.asarray([int(v) for v in values], np.int64).reshape(1, -1)
  if jax.process_count() == 1:
    return local
  from jax.experimental import multihost_utils
  if np.abs(local).max(initial=0) >= 2**31:
    raise OverflowError(f"allgather_ints: {values} do not fit int32")
  arr = multihost_utils.process_allgather(local.astype(np.int32).reshape(-1))
  return np.asarray(arr, np.int64).reshape(jax.process_count(), -1)


def agree_max(*values: int) -> tuple[int, ...]:
  """The element-wise max of some ints over all processes (every host must call
  it, in the same order). Hosts use it to agree on shape buckets, so that their
  process-local batches assemble into one global array."""
  if jax.process_count() == 1:
    return tuple(int(v) for v in values)
  return tuple(int(v) for v in allgather_ints(*values).max(0))


def allgather_json(obj: Any) -> list:
  """Every host's JSON-serialisable ``obj``, in process order (small objects:
  metric names, data iterator states)."""
  if jax.process_count() == 1:
    return [obj]
  from jax.experimental import multihost_utils
  blob = np.frombuffer(json.dumps(obj, sort_keys=True).encode("utf-8"), np.uint8)
  sizes = allgather_ints(blob.size)[:, 0]
  n = 1 << int(max(sizes.max(), 1) - 1).bit_length()  # power-of-two buffers: few programs
  buf = np.zeros((n,), np.uint8)
  buf[:blob.size] = blob
  allb = np.asarray(multihost_utils.process_allgather(buf)).reshape(jax.process_count(), n)
  return [json.loads(bytes(allb[i, :sizes[i]]).decode("utf-8")) for i in range(len(sizes))]


def _is_number(v) -> bool:
  return isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, (bool, np.bool_))


def mean_over_processes(metrics: dict, sum_keys: Sequence[str] = ()) -> dict:
  """Reduce the numeric metrics of every host: the mean (hosts have equal local
  batches), or the sum for ``sum_keys`` (counts, throughput). A metric some
  hosts lack (e.g. round-2 stats on a host that sampled no round 2) is averaged
  over the hosts that have it."""
  if jax.process_count() == 1:
    return metrics
  from jax.experimental import multihost_utils
  mine = sorted(k for k, v in metrics.items() if _is_number(v))
  keys = sorted(set().union(*[set(ks) for ks in allgather_json(mine)]))
  vals = np.asarray([float(metrics[k]) if k in metrics and _is_number(metrics[k]) else np.nan
                     for k in keys], np.float64)
  # float64 travels as uint32 pairs (exact, with or without jax_enable_x64)
  allv = np.asarray(multihost_utils.process_allgather(vals.view(np.uint32)), np.uint32)
  allv = allv.reshape(jax.process_count(), -1).view(np.float64)
  out = dict(metrics)
  sums = set(sum_keys)
  for i, k in enumerate(keys):
    col = allv[:, i]
    out[k] = float(np.nansum(col) if k in sums else np.nanmean(col))
  return out


# ----------------------------------------------------------------------------- per-host state


_PER_PROCESS = "__per_process__"


def per_process_state(state: Any) -> Any:
  """Bundle every host's (JSON) state for a checkpoint written once by the
  primary host: ``{"__per_process__": [state_0, state_1, ...]}``. A single
  process keeps its state as is."""
  if jax.process_count() == 1:
    return state
  return {_PER_PROCESS: allgather_json(state)}


def select_process_state(saved: Any, *, what: str = "data iterator state") -> Any:
  """This host's part of :func:`per_process_state`'s bundle, or None (start
  afresh, with a warning) when the checkpoint was written by another number of
  processes: the per-host shards then differ and cannot be resumed exactly."""
  pc, pi = jax.process_count(), jax.process_index()
  if isinstance(saved, dict) and _PER_PROCESS in saved:
    states = saved[_PER_PROCESS]
    if len(states) == pc:
      return states[pi]
    saved_pc = len(states)
  else:
    if pc == 1 or not saved:
      return saved
    saved_pc = 1
  from absl import logging
  logging.warning("The checkpoint's %s was written by %d process(es); this run has %d. The "
                  "data shards differ, so the iterator starts afresh (params, optimizer and "
                  "step are restored).", what, saved_pc, pc)
  return None


# ----------------------------------------------------------------------------- mesh checks


def check_mesh(mesh, batch_axes: Sequence[str] = ()) -> None:
  """A mesh used with process-local batches must put every process's devices on
  a contiguous block of the batch axes (``batch_axes``; default the default
  rules' "batch" entry) of its own (then each host's rows form a
  contiguous slice of the global batch). Raises ``ProcessMeshError`` naming the
  mesh and the processes otherwise. A no-op in a single process."""
  pc = jax.process_count()
  if pc == 1:
    return
  from fbos_jax import sharding as sh
  from jax.sharding import NamedSharding, PartitionSpec
  batch_axes = tuple(batch_axes) or sh.batch_axes()
  axes = tuple(a for a in batch_axes if a in mesh.shape)
  shards = math.prod(mesh.shape[a] for a in axes)
  desc = " x ".join(f"{a}={s}" for a, s in mesh.shape.items())
  procs = sorted({d.process_index for d in mesh.devices.flat})
  if len(procs) != pc:
    raise ProcessMeshError(
        f"the mesh ({desc}) covers the devices of processes {procs}, but there are {pc} "
        "processes: build it over jax.devices() (all processes), not jax.local_devices().")
  if shards % pc:
    raise ProcessMeshError(
        f"the mesh ({desc}) has {shards} batch shards (mesh.{'*'.join(axes)}), which do not "
        f"divide over {pc} processes: each process feeds its own rows, so the batch axes must "
        f"be a multiple of the process count (e.g. --config.mesh.dcn={pc} or a larger "
        "mesh.data/fsdp, with tensor parallelism inside a host).")
  index = NamedSharding(mesh, PartitionSpec(axes or None)).devices_indices_map((shards,))
  blocks: dict[int, set] = {}
  for dev, idx in index.items():
    sl = idx[0]
    blocks.setdefault(dev.process_index, set()).update(range(sl.start or 0, sl.stop or shards))
  for p, rows in sorted(blocks.items()):
    rows = sorted(rows)
    if len(rows) != shards // pc or rows != list(range(rows[0], rows[0] + len(rows))):
      raise ProcessMeshError(
          f"the mesh ({desc}) does not give process {p} a contiguous block of {shards // pc} of "
          f"the {shards} batch shards (it holds shards {rows}): order the mesh's devices by "
          "process (fbos_jax.sharding.make_mesh does), and shard tensor parallelism within a "
          "host.")
