"""Orbax checkpoints: train state (params, optimizer, step, PRNG, GFPO history)
plus the data iterator state and run metadata, saved asynchronously every N
steps, keeping the last K. Arrays are written with tensorstore (OCDBT), every
host its own shards; restore reshards onto whatever mesh the caller passes."""

from __future__ import annotations

import base64
import json
import os
from typing import Any, Optional

import jax
import orbax.checkpoint as ocp


class CheckpointMismatchError(ValueError):
  pass


def _to_jsonable(x):
  if isinstance(x, bytes):
    return {"__bytes__": base64.b64encode(x).decode("ascii")}
  if isinstance(x, dict):
    return {str(k): _to_jsonable(v) for k, v in x.items()}
  if isinstance(x, (list, tuple)):
    return [_to_jsonable(v) for v in x]
  return x


def _from_jsonable(x):
  if isinstance(x, dict):
    if set(x) == {"__bytes__"}:
      return base64.b64decode(x["__bytes__"])
    return {k: _from_jsonable(v) for k, v in x.items()}
  if isinstance(x, list):
    return [_from_jsonable(v) for v in x]
  return x


class Checkpointer:
  """Thin wrapper over ``ocp.CheckpointManager`` with our three items."""

  def __init__(self, directory: str, *, save_every: int, keep: int, async_save: bool = True):
    directory = os.path.abspath(directory) if "://" not in directory else directory
    self.directory = directory
    self.manager = ocp.CheckpointManager(
        directory,
        options=ocp.CheckpointManagerOptions(
            save_interval_steps=max(int(save_every), 1), max_to_keep=keep,
            enable_async_checkpointing=async_save, create=True),
        item_names=("state", "data", "meta"),
    )

  def latest_step(self) -> Optional[int]:
    return self.manager.latest_step()

  def save(self, step: int, state: Any, data_state: Any, meta: dict, *, force: bool = False):
    return self.manager.save(
        int(step),
        args=ocp.args.Composite(
            state=ocp.args.StandardSave(state),
            data=ocp.args.JsonSave(_to_jsonable(data_state)),
            meta=ocp.args.JsonSave(_to_jsonable(meta))),
        force=force)

  def restore(self, step: Optional[int], abstract_state: Any, expected_meta: Optional[dict] = None):
    """Restore into ``abstract_state`` (ShapeDtypeStructs carrying the target
    shardings: restore reshards onto the current mesh). Returns
    (state, data_state, meta)."""
    step = self.latest_step() if step is None else step
    if step is None:
      raise FileNotFoundError(f"No checkpoint in {self.directory}")
    meta = _from_jsonable(self.manager.restore(
        step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"])
    if expected_meta is not None:
      saved_model = meta.get("model", {})
      want = expected_meta.get("model", {})
      diff = {k: (saved_model.get(k), want.get(k)) for k in set(saved_model) | set(want)
              if k not in ("param_dtype", "compute_dtype", "remat", "hf_path", "tokenizer_path")
              and saved_model.get(k) != want.get(k)}
      if diff:
        fields = ", ".join(f"model.{k}: checkpoint={a!r} config={b!r}" for k, (a, b) in sorted(diff.items()))
        raise CheckpointMismatchError(
            f"The checkpoint at {self.directory}/{step} was written with a different model "
            f"config ({fields}). Use another --workdir or the matching config.")
    restored = self.manager.restore(
        step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract_state),
                                      data=ocp.args.JsonRestore()))
    return restored["state"], _from_jsonable(restored["data"]), meta

  def wait(self):
    self.manager.wait_until_finished()

  def close(self):
    self.manager.wait_until_finished()
    self.manager.close()


def abstract_with_shardings(tree: Any, mesh=None) -> Any:
  """ShapeDtypeStructs (with shardings) of a live pytree, for restore targets.

  With ``mesh``, a leaf that is not on the mesh's devices (e.g. an uncommitted
  step counter or PRNG key on the default device) is restored replicated over
  the mesh, so that it can enter the mesh's programs (and, with several
  processes, is a global array)."""
  def target(a):
    sharding = a.sharding
    if mesh is not None and set(sharding.device_set) != set(mesh.devices.flat):
      sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    return jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding)
  return jax.tree.map(target, tree)


def write_json(path: str, obj: Any):
  with open(path, "w") as f:
    json.dump(obj, f, indent=2, sort_keys=True)
