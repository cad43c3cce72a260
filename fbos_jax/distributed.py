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

They go through jax.distributed's key-value store, never through a device
program over every device, and over the processes of this process's
:class:`Side` only (all of them, or one side of a whole-process rollout /
trainer split), each side in its own namespace. Every process writes a
heartbeat there (:func:`start_watchdog`); a process whose heartbeat stops (20 s)
or that reports a failure (:func:`fail_run`) is named by every wait here
(:class:`PeerLostError`) and by the watchdog, which ends a process stuck
elsewhere, well before the coordination service's own heartbeat timeout
(``heartbeat_timeout_s``) would abort it with less to say.
"""

from __future__ import annotations

import dataclasses
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
# Exit status of a process that stopped because another one was gone (start_watchdog).
PEER_LOST_EXIT_CODE = 76


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
               *, timeout_s: int = 300, local_device_ids=None,
               heartbeat_timeout_s: int = 60) -> bool:
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
    if not os.environ.get("JAX_CPU_COLLECTIVES_IMPLEMENTATION"):  # programs over CPU hosts
      jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(initialization_timeout=int(left) + 30,
                               heartbeat_timeout_seconds=int(heartbeat_timeout_s), **kwargs)
  except Exception as e:  # noqa: BLE001 - re-raised with the fix
    raise DistributedInitError(
        f"jax.distributed.initialize failed for coordinator {where} "
        f"with {num_processes or '(auto)'} processes: {e}. Is process 0 "
        "running and reachable on that port?") from None
  finally:
    done.set()
  start_watchdog()
  return True


# ----------------------------------------------------------------------------- sides


class PeerLostError(RuntimeError):
  """A process this one waits for stopped (no heartbeat): names it and its side."""


@dataclasses.dataclass(frozen=True)
class Side:
  """The processes that agree with each other: every process, or one side of a
  whole-process split (``rl.rollout_devices``, :mod:`fbos_jax.rl.split`).
  ``name`` namespaces the side's key-value traffic, so the two sides of a split
  never pair each other's calls."""
  name: str
  processes: tuple

  @property
  def index(self) -> int:
    return self.processes.index(jax.process_index())

  @property
  def count(self) -> int:
    return len(self.processes)


_SIDE: Optional[Side] = None
_ROLES: dict = {}  # process -> the side it is on (for errors)
_SEQ: dict = {}  # side name -> calls made (every process of a side makes the same calls)
_DONE = "fbos/done/"
_ERROR = "fbos/error/"
_BEAT = "fbos/beat/"
_BEATS: dict = {}  # process -> (its last heartbeat seen, when it changed, local clock)
_HEARTBEAT_TIMEOUT_S = [20.0]
_FAILING = threading.Event()
_WATCHING = threading.Event()
_FINISHED = threading.Event()  # finish(): the watchdog stops
_WATCHDOG: list = []  # its thread


def set_heartbeat_timeout(seconds: float):
  """How long a silent peer is waited for before it counts as lost."""
  _HEARTBEAT_TIMEOUT_S[0] = float(seconds)


def set_sides(mine: Side, *others: Side):
  """This process's side (its agreements go over ``mine.processes`` only) and the
  other sides (for naming a lost process)."""
  global _SIDE
  _SIDE = mine
  for s in (mine,) + others:
    _ROLES.update({p: s.name for p in s.processes})


def side() -> Side:
  return _SIDE or Side("all", tuple(range(jax.process_count())))


def process_index() -> int:
  """This process's index on its side (``jax.process_index()`` without a split)."""
  return side().index


def process_count() -> int:
  """The processes of this process's side (``jax.process_count()`` without a split)."""
  return side().count


def describe_process(p: int) -> str:
  return f"process {p} ({_ROLES.get(p, 'all')} side)"


def _client():
  from jax._src import distributed as jd
  if jd.global_state.client is None:
    raise DistributedInitError("several processes but no jax.distributed client; call "
                               "fbos_jax.distributed.initialize first")
  return jd.global_state.client


def _lost_service(e: BaseException) -> PeerLostError:
  return PeerLostError(f"{describe_process(0)}, which hosts the coordination service, is gone "
                       f"({str(e).splitlines()[0]}); {describe_process(jax.process_index())} "
                       "stops too")


def check_peers(processes=None, what: str = ""):
  """Raise :class:`PeerLostError` naming a process of ``processes`` (default all)
  that reported a failure, or whose heartbeat (:func:`start_watchdog`) stopped
  for ``heartbeat_timeout_s`` without its having finished. (The coordination
  service's own liveness call is a barrier over the processes asked, so it
  cannot be polled by one side alone.)"""
  me = jax.process_index()
  procs = [p for p in (range(jax.process_count()) if processes is None else processes) if p != me]
  try:
    for p in range(jax.process_count()):
      msg = get_key(f"{_ERROR}{p}", strict=True)
      if msg is not None and p != me:
        raise PeerLostError(f"{describe_process(p)} failed: {msg}")
    now, lost = time.time(), []
    for p in procs:
      beat = get_key(f"{_BEAT}{p}", strict=True)
      seen = _BEATS.get(p)
      if seen is None or seen[0] != beat:
        _BEATS[p] = (beat, now)
      elif now - seen[1] > _HEARTBEAT_TIMEOUT_S[0] and get_key(f"{_DONE}{p}", strict=True) is None:
        lost.append(p)
  except PeerLostError:
    raise
  except Exception as e:  # noqa: BLE001 - the coordination service itself is gone
    raise _lost_service(e) from None
  if lost:
    raise PeerLostError(
        f"{', '.join(describe_process(p) for p in lost)} stopped (no heartbeat for "
        f"{_HEARTBEAT_TIMEOUT_S[0]:.0f} s: it died or was killed)"
        f"{' while ' + what if what else ''}; {describe_process(me)} stops too. Restart the "
        "same command on the same workdir to resume from the last checkpoint.")


def get_key(key: str, strict: bool = False) -> Optional[str]:
  """The value of ``key`` in jax.distributed's key-value store, or None (not set;
  with ``strict``, any other error raises)."""
  try:
    return _client().key_value_try_get(key)
  except Exception as e:  # noqa: BLE001 - NOT_FOUND
    if strict and "NOT_FOUND" not in str(e):
      raise
    return None


def wait_key(key: str, what: str, *, processes=None, timeout_s: Optional[float] = None,
             poll_s: float = 1.0) -> bytes:
  """The value of ``key`` in jax.distributed's key-value store, once some process
  sets it; raises :class:`PeerLostError` (naming it) as soon as a process of
  ``processes`` (default all) is gone, TimeoutError after ``timeout_s``."""
  client = _client()
  t0 = time.time()
  while True:
    try:
      return client.blocking_key_value_get_bytes(key, int(poll_s * 1000))
    except Exception as e:  # noqa: BLE001 - a deadline: look at the peers, wait again
      if "DEADLINE_EXCEEDED" not in str(e):
        raise _lost_service(e) from None
    check_peers(processes, what)
    if timeout_s is not None and time.time() - t0 > timeout_s:
      raise TimeoutError(f"{describe_process(jax.process_index())} waited {timeout_s:.0f} s "
                         f"for {what} ({key})")


def put_key(key: str, value: bytes):
  _client().key_value_set_bytes(key, value, allow_overwrite=True)


def _leave(code: int):
  sys.stdout.flush()
  sys.stderr.flush()
  os._exit(code)


def finish():
  """This process is done: mark it (so that peers do not take its silence for a
  crash) and wait until every process is; then they all leave through jax's
  exit-time shutdown barrier."""
  if jax.process_count() == 1:
    return
  put_key(f"{_DONE}{jax.process_index()}", b"1")
  for p in range(jax.process_count()):
    wait_key(f"{_DONE}{p}", "the end of the run")
  # no daemon thread inside a call to the coordination service at exit (the
  # interpreter's end unwinding it there aborts the process: "exception not rethrown")
  _FINISHED.set()
  for t in _WATCHDOG:
    t.join()


def fail_run(error: BaseException, wait_s: float = 30.0):
  """This process of a multi-process run fails with ``error``: tell the others
  (their waits and watchdogs raise it, naming this process), print it, and leave
  without jax's exit-time shutdown (which would abort loudly once the
  coordination service is gone). Process 0, which hosts the service, first
  waits (up to ``wait_s``) until the others' heartbeats stop. Never returns."""
  import traceback
  _FAILING.set()  # the watchdog says nothing more
  traceback.print_exception(error, file=sys.stderr)
  me = jax.process_index()
  try:
    put_key(f"{_ERROR}{me}", f"{type(error).__name__}: {error}"[:4000].encode())
    t0, last = time.time(), {}
    while me == 0 and time.time() - t0 < wait_s:
      beats = {p: get_key(f"{_BEAT}{p}") for p in range(1, jax.process_count())}
      now = time.time()
      last = {p: (b, last[p][1] if p in last and last[p][0] == b else now)
              for p, b in beats.items()}
      if all(now - t > 3.0 for _, t in last.values()):
        break
      time.sleep(0.2)
  except Exception:  # noqa: BLE001 - the service is gone already
    pass
  print(f"[fbos_jax.distributed] {describe_process(me)} stops: "
        f"{type(error).__name__}: {str(error)[:2000]}", file=sys.stderr, flush=True)
  _leave(1)


def start_watchdog(poll_s: float = 1.0):
  """A daemon thread (started by :func:`initialize`) that writes this process's
  heartbeat (every ``poll_s``) and ends this process (exit status
  ``PEER_LOST_EXIT_CODE``, the lost process named on stderr) when another one is
  gone, whatever this one is doing then (e.g. waiting inside a collective
  program), before the coordination service's own heartbeat timeout aborts it
  with less to say."""
  if jax.process_count() == 1 or _WATCHING.is_set():
    return
  _WATCHING.set()
  me = jax.process_index()

  def watch():
    beat = 0
    while not _FINISHED.is_set():
      try:
        beat += 1
        put_key(f"{_BEAT}{me}", str(beat).encode())
        check_peers(what="watching the peers")
      except PeerLostError as e:
        if _FAILING.is_set():
          return
        print(f"[fbos_jax.distributed] {e}", file=sys.stderr, flush=True)
        _leave(PEER_LOST_EXIT_CODE)
      except Exception:  # noqa: BLE001 - shut down
        return
      _FINISHED.wait(poll_s)

  _WATCHDOG.append(threading.Thread(target=watch, name="fbos-peer-watchdog", daemon=True))
  _WATCHDOG[-1].start()


# ----------------------------------------------------------------------------- reductions


def allgather_bytes(blob: bytes) -> list:
  """Every process's ``blob`` on this process's side, in side order, through
  jax.distributed's key-value store (no device program; every process of the
  side calls it, in the same order)."""
  s = side()
  if s.count == 1:
    return [blob]
  seq = _SEQ.get(s.name, 0)
  _SEQ[s.name] = seq + 1
  key = f"fbos/{s.name}/{seq}"
  put_key(f"{key}/{s.index}", blob)
  out = [blob if i == s.index else wait_key(f"{key}/{i}", f"agreement {seq} of the {s.name} "
                                             "side", processes=s.processes)
         for i in range(s.count)]
  if seq >= 2:  # every peer has read our key of two calls ago (it is past that call)
    _client().key_value_delete(f"fbos/{s.name}/{seq - 2}/{s.index}")
  return out


def allgather_json(obj: Any) -> list:
  """Every process's JSON-serialisable ``obj`` on this side, in side order (small
  objects: metric names, data iterator states)."""
  if process_count() == 1:
    return [obj]
  blobs = allgather_bytes(json.dumps(obj, sort_keys=True).encode("utf-8"))
  return [json.loads(b.decode("utf-8")) for b in blobs]


def allgather_ints(*values: int) -> np.ndarray:
  """[processes of this side, len(values)] int64: every process's ``values``
  (every process of the side must call it, in the same order)."""
  local = [int(v) for v in values]
  return np.asarray(allgather_json(local), np.int64).reshape(-1, len(local))


def agree_max(*values: int) -> tuple[int, ...]:
  """The element-wise max of some ints over this side's processes (every process
  must call it, in the same order). Hosts use it to agree on shape buckets, so
  that their process-local batches assemble into one global array."""
  if process_count() == 1:
    return tuple(int(v) for v in values)
  return tuple(int(v) for v in allgather_ints(*values).max(0))


def _is_number(v) -> bool:
  return isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, (bool, np.bool_))


def mean_over_processes(metrics: dict, sum_keys: Sequence[str] = (),
                        max_keys: Sequence[str] = ()) -> dict:
  """Reduce the numeric metrics of this side's processes: the mean (hosts have
  equal local batches), the sum for ``sum_keys`` (counts, throughput), the
  largest for ``max_keys``. A
  metric some hosts lack (e.g. round-2 stats on a host that sampled no round 2)
  is averaged over the hosts that have it. Floats travel exactly (as hex)."""
  if process_count() == 1:
    return metrics
  mine = {k: float(v).hex() for k, v in metrics.items() if _is_number(v)}
  every = allgather_json(mine)
  out = dict(metrics)
  sums, maxes = set(sum_keys), set(max_keys)
  for k in sorted(set().union(*every)):
    col = np.asarray([float.fromhex(d[k]) for d in every if k in d], np.float64)
    out[k] = float(np.nansum(col) if k in sums else np.nanmax(col) if k in maxes
                   else np.nanmean(col))
  return out


# ----------------------------------------------------------------------------- per-host state


_PER_PROCESS = "__per_process__"


def per_process_state(state: Any) -> Any:
  """Bundle every host's (JSON) state for a checkpoint written once by the
  primary host: ``{"__per_process__": [state_0, state_1, ...]}``. A single
  process keeps its state as is."""
  if process_count() == 1:
    return state
  return {_PER_PROCESS: allgather_json(state)}


def select_process_state(saved: Any, *, what: str = "data iterator state") -> Any:
  """This host's part of :func:`per_process_state`'s bundle, or None (start
  afresh, with a warning) when the checkpoint was written by another number of
  processes: the per-host shards then differ and cannot be resumed exactly."""
  pc, pi = process_count(), process_index()
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
  pc = process_count()
  if pc == 1:
    return
  from fbos_jax import sharding as sh
  from jax.sharding import NamedSharding, PartitionSpec
  batch_axes = tuple(batch_axes) or sh.batch_axes()
  axes = tuple(a for a in batch_axes if a in mesh.shape)
  shards = math.prod(mesh.shape[a] for a in axes)
  desc = " x ".join(f"{a}={s}" for a, s in mesh.shape.items())
  procs = sorted({d.process_index for d in mesh.devices.flat})
  if procs != sorted(side().processes):
    raise ProcessMeshError(
        f"the mesh ({desc}) covers the devices of processes {procs}, but the {side().name} "
        f"side has processes {list(side().processes)}: build it over all their devices "
        "(jax.devices()), not jax.local_devices().")
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
