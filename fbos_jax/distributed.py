"""Multi-process start-up through JAX's own runtime (no home-made cluster layer).

* TPU pods: ``jax.distributed.initialize()`` discovers everything itself.
* GPU / CPU clusters: coordinator, process count and id from flags, else from
  the environment (``JAX_COORDINATOR_ADDRESS``/``JAX_NUM_PROCESSES``/
  ``JAX_PROCESS_ID``, or SLURM's variables, which JAX's cluster detection reads).
* A single process needs nothing.
"""

from __future__ import annotations

import os
import socket

import jax


class DistributedInitError(RuntimeError):
  pass


def _on_tpu_pod() -> bool:
  return bool(os.environ.get("TPU_WORKER_HOSTNAMES") or os.environ.get("MEGASCALE_COORDINATOR_ADDRESS"))


def _on_slurm() -> bool:
  return "SLURM_JOB_ID" in os.environ and int(os.environ.get("SLURM_NTASKS", "1")) > 1


def initialize(coordinator_address: str = "", num_processes: int = 0, process_id: int = -1,
               *, timeout_s: int = 300, local_device_ids=None) -> bool:
  """Initialise jax.distributed when there is more than one process.

  Returns True if it initialised. An unreachable coordinator raises
  ``DistributedInitError`` after ``timeout_s`` instead of hanging.
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
  if explicit and process_id != 0:
    host, _, port = coordinator_address.rpartition(":")
    try:  # fail fast with a clear message if the coordinator's host does not resolve
      socket.getaddrinfo(host, int(port))
    except (socket.gaierror, ValueError) as e:
      raise DistributedInitError(
          f"coordinator {coordinator_address!r} cannot be resolved ({e}); check "
          "--coordinator_address (host:port of process 0)") from None
  kwargs = {}
  if explicit:
    kwargs = dict(coordinator_address=coordinator_address, num_processes=num_processes,
                  process_id=process_id)
  if local_device_ids is not None:
    kwargs["local_device_ids"] = local_device_ids
  try:
    jax.distributed.initialize(initialization_timeout=int(timeout_s), **kwargs)
  except Exception as e:  # noqa: BLE001 - re-raised with the fix
    raise DistributedInitError(
        f"jax.distributed.initialize failed for coordinator {coordinator_address or '(auto)'} "
        f"with {num_processes or '(auto)'} processes after up to {timeout_s}s: {e}. Is process 0 "
        "running and reachable on that port?") from None
  return True
