"""Orbax checkpoints: train state (params, optimizer, step, PRNG, GFPO history)
plus the data iterator state and run metadata, saved asynchronously every N
steps, keeping the last K. Arrays are written with tensorstore (OCDBT), every
host its own shards; restore reshards onto whatever mesh the caller passes.

Reliability:

* ``Checkpointer.restore(None, ...)`` restores the newest *readable*
  checkpoint: an unreadable one (torn files, a node that died mid-save) is
  skipped with a warning naming its directory, and, once an older one has
  restored, moved aside to ``<workdir>/corrupt_checkpoints/<step>`` (kept,
  not deleted) so that its step can be saved again. When no checkpoint
  restores, nothing is moved and the error names every directory tried.
* ``check_resume_config(saved, current, allow=...)`` refuses a resume whose
  config changed in a field that matters (``rl.group_size``, ``algo``, the
  loss fields, the model, the data source, ...), naming each field; the
  fields that do not matter are listed in ``RESUME_IGNORED_FIELDS``.
* An asynchronous save that fails in its background thread (a full disk,
  a lost mount) raises ``CheckpointSaveError`` naming the step, the directory
  and the cause at the next call into the ``Checkpointer`` at the latest
  (``save``, ``wait``, ``close``, ``latest_step``), and at once from
  ``check_errors()``, which costs nothing and is meant for the trainer to call every
  step. The failed save's threads are joined first, so nothing of orbax's
  prints after the error: the cause is the last line of the run.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import sys
import time
from typing import Any, Optional

from absl import logging
import jax
import orbax.checkpoint as ocp


class CheckpointMismatchError(ValueError):
  """The checkpoint was written under a config that differs where it matters."""


class CheckpointRestoreError(RuntimeError):
  """No checkpoint of the directory could be read; names each one tried."""


class CheckpointSaveError(RuntimeError):
  """An asynchronous checkpoint save failed; names the step, directory and cause."""


# Config fields (dotted; a trailing ".*" covers a whole section) whose change
# does not make a resume wrong: run length and bookkeeping, logging and
# progress, host-side concurrency, compile-time buckets and the mesh (restore
# reshards), and model fields that do not change the parameters.
RESUME_IGNORED_FIELDS = (
    "variant",
    "train.steps", "train.log_every", "train.eval_every", "train.eval_prompts",
    "train.eval_k", "train.checkpoint_every", "train.keep_checkpoints",
    "train.progress", "train.warm_start", "train.allow_config_change",
    "verifier.workers", "verifier.timeout_s", "verifier.backend",
    "verifier.max_abandoned_threads",
    "data.read_threads",
    "mesh.*",
    "sampling.batch_buckets", "sampling.prompt_buckets",
    "sampling.fap_prompt_buckets",
    "rl.fixed_row_buckets", "rl.micro_batches",
    "rl.rollout_devices", "rl.buffer_groups", "rl.sync_chunk_mib",  # where, not what, trains
    "model.param_dtype", "model.compute_dtype", "model.remat", "model.hf_path",
    "model.tokenizer_path", "model.attention", "model.attention_block_q",
    "model.attention_block_kv",
)


def flatten_fields(tree: Any, prefix: str = "") -> dict[str, Any]:
  """A nested dict (a config's) as {"section.field": value}."""
  out = {}
  if isinstance(tree, dict):
    for k, v in tree.items():
      out.update(flatten_fields(v, f"{prefix}{k}."))
  else:
    out[prefix[:-1]] = tree
  return out


def _ignored(field: str, ignored: tuple[str, ...]) -> bool:
  return any(field == p or (p.endswith(".*") and field.startswith(p[:-1]))
             for p in ignored)


def check_resume_config(saved: Optional[dict], current: dict, *, allow: bool,
                        ignored: tuple[str, ...] = RESUME_IGNORED_FIELDS,
                        flag: str = "--allow_config_change"
                        ) -> list[tuple[str, Any, Any]]:
  """Compares the config a checkpoint was written with to the current one.

  Args:
    saved: the checkpoint's config (``config.to_dict()`` as stored in its
      metadata, JSON round-tripped), or None for a checkpoint that has none
      (then nothing can be checked: a warning).
    current: ``config.to_dict()`` now.
    allow: resume anyway (the differences are logged as warnings).
    ignored: fields that do not matter (``RESUME_IGNORED_FIELDS``).
    flag: the command-line flag that sets ``allow``, for the message.

  Returns:
    ``[(field, saved_value, current_value), ...]`` for the fields that matter
    and differ (empty: nothing changed that matters).

  Raises:
    CheckpointMismatchError: such fields differ and ``allow`` is False; the
      message names each one.
  """
  if saved is None:
    logging.warning("the checkpoint records no config; cannot check that the "
                    "resumed run uses the same one")
    return []
  a = flatten_fields(json.loads(json.dumps(saved, default=str)))
  b = flatten_fields(json.loads(json.dumps(current, default=str)))
  diffs, unknown = [], []
  for field in sorted(set(a) | set(b)):
    if _ignored(field, ignored):
      continue
    if field not in a or field not in b:  # added or removed by a code change
      unknown.append(f"{field}: checkpoint={a.get(field, '(absent)')!r} "
                     f"config={b.get(field, '(absent)')!r}")
    elif a[field] != b[field]:
      diffs.append((field, a[field], b[field]))
  if unknown:
    logging.warning("config fields present on one side only (not checked): %s",
                    "; ".join(unknown))
  if (a.get("train.steps") != b.get("train.steps")
      and b.get("optim.schedule") == "cosine"):
    logging.warning("train.steps changed from %s to %s: the cosine learning-rate "
                    "schedule is stretched to the new length from here on",
                    a.get("train.steps"), b.get("train.steps"))
  if not diffs:
    return []
  listed = "; ".join(f"{f}: checkpoint={x!r} config={y!r}" for f, x, y in diffs)
  if not allow:
    raise CheckpointMismatchError(
        f"the checkpoint was written with a different config ({listed}). Resuming "
        "would continue a different run. Use the matching config, another "
        f"--workdir, or {flag} to resume with the new values on purpose.")
  logging.warning("resuming with a changed config (%s): %s", flag, listed)
  return diffs


def _quiet_orphaned_writes():
  """When a save fails: orbax runs the save's writes on an event loop that closes
  at the first failure, and TensorStore completes the rest later, each completion
  an unraisable ``RuntimeError: Event loop is closed`` raised in asyncio's
  ``call_soon_threadsafe`` (six lines of traceback each, hundreds in a run).
  Those are logged at debug level instead; every other unraisable exception is
  reported as before. Installed once, by the first Checkpointer (the first such
  completion can come before the failure reaches the Checkpointer)."""
  previous = sys.unraisablehook
  if getattr(previous, "_fbos_orphaned_writes", False):
    return

  def hook(unraisable):
    e, tb = unraisable.exc_value, unraisable.exc_traceback
    while tb is not None and tb.tb_next is not None:
      tb = tb.tb_next
    if (isinstance(e, RuntimeError) and str(e) == "Event loop is closed" and tb is not None
        and tb.tb_frame.f_code.co_name == "_check_closed"):
      logging.debug("a write of the failed checkpoint save completed after its event loop "
                    "closed")
      return
    previous(unraisable)

  hook._fbos_orphaned_writes = True
  sys.unraisablehook = hook


def _cause(e: BaseException, limit: int = 300) -> str:
  """``Type: message`` on one line, cut to ``limit`` characters (a TensorStore error
  can run to a hundred lines)."""
  text = " ".join(str(e).split())
  return f"{type(e).__name__}: {text[:limit]}{' ...' if len(text) > limit else ''}"


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


def multiprocessing_options(processes: Optional[tuple] = None, prefix: str = "fbos_ckpt"):
  """Orbax's options for a save by ``processes`` (default all): with several
  processes its barriers go through jax.distributed's barriers over them only
  (never a device program over every device; a split's other side is not there)."""
  if jax.process_count() == 1:
    return ocp.options.MultiprocessingOptions()
  procs = tuple(processes) if processes is not None else tuple(range(jax.process_count()))
  return ocp.options.MultiprocessingOptions(primary_host=procs[0], active_processes=set(procs),
                                            barrier_sync_key_prefix=prefix)


def savable(tree: Any) -> Any:
  """``tree`` as orbax saves it: in a multi-process run whose state lives on one
  process (one side of a split), its arrays as host numpy arrays, which orbax
  writes from its primary process (it refuses a process-local jax.Array when
  there are several processes); restore places them on the target shardings."""
  if jax.process_count() == 1:
    return tree
  import numpy as np
  return jax.tree.map(lambda x: np.asarray(x) if isinstance(x, jax.Array) and
                      x.is_fully_addressable else x, tree)


def save_without_replica_slices():
  """Orbax writes each replicated array from its first replica, unsliced: its
  default (replica-parallel saving) slices every replicated array on device across
  its replicas, a ``jit(slice)`` compiled per array shape at a run's first save,
  after the compile set (72 programs on the tiny run, at step 10; on a pod a
  compile at a save holds every host). Process-wide: orbax's handler registry for
  ``jax.Array`` (the restore path is unchanged), registered once."""
  global _UNSLICED
  if not _UNSLICED:
    ocp.type_handlers.register_type_handler(
        jax.Array, ocp.type_handlers.ArrayHandler(use_replica_parallel=False), override=True)
    _UNSLICED = True


_UNSLICED = False


class Checkpointer:
  """Thin wrapper over ``ocp.CheckpointManager`` with our three items (replicated
  arrays written unsliced: :func:`save_without_replica_slices`)."""

  def __init__(self, directory: str, *, save_every: int, keep: int, async_save: bool = True,
               processes: Optional[tuple] = None):
    """``processes``: the processes that hold the state and save it together
    (default all); orbax's barriers then go through jax.distributed's barriers
    over them only, never a device program over every device."""
    directory = os.path.abspath(directory) if "://" not in directory else directory
    self.directory = directory
    save_without_replica_slices()
    multi = multiprocessing_options(processes)
    self.primary = multi.primary_host
    if jax.process_count() > 1 and "://" not in directory:  # orbax leaves it to us then
      os.makedirs(directory, exist_ok=True)
    self.manager = ocp.CheckpointManager(
        directory,
        options=ocp.CheckpointManagerOptions(
            save_interval_steps=max(int(save_every), 1), max_to_keep=keep,
            enable_async_checkpointing=async_save, create=jax.process_count() == 1,
            multiprocessing_options=multi),
        item_names=("state", "data", "meta"),
    )
    self.restored_step: Optional[int] = None
    _quiet_orphaned_writes()
    self._save_error: Optional[CheckpointSaveError] = None
    self._pending_step: Optional[int] = None  # the step of the last save started

  # -- failures of asynchronous saves ----------------------------------------

  def _failed_save(self) -> Optional[BaseException]:
    """The exception of a finished background save, or None (never blocks)."""
    ref = getattr(self.manager, "_finalize_thread", None)
    thread = ref.get() if hasattr(ref, "get") else ref
    if thread is not None and not thread.is_alive():
      exc = getattr(thread, "exception", None)
      if exc is not None:
        return exc
    try:
      self.manager.check_for_errors()
    except Exception as e:  # pylint: disable=broad-except
      return e
    return None

  def _raise_save_error(self, exc: BaseException, step: Optional[int]) -> None:
    where = f"{self.directory}/{step}" if step is not None else self.directory
    try:  # let orbax finish cleaning up and shut its threads down now, so it prints
      self.manager.wait_until_finished()  # nothing after this
    except BaseException:  # pylint: disable=broad-except
      pass
    try:
      self.manager.close()
    except BaseException:  # pylint: disable=broad-except
      pass
    err = CheckpointSaveError(
        f"checkpoint save of step {step} to {where} failed, so the run stops (the last "
        f"complete checkpoint is step {self._complete_step()}; fix the cause and "
        f"resume): {type(exc).__name__}: {exc}")
    self._save_error = err
    raise err from exc

  def _complete_step(self) -> Optional[int]:
    try:
      steps = [s for s in self.manager.all_steps() if s != self._pending_step]
      return max(steps) if steps else None
    except Exception:  # pylint: disable=broad-except
      return None

  def check_errors(self) -> None:
    """Raises ``CheckpointSaveError`` (cause chained) if a background save has
    failed; a no-op otherwise. Cheap and non-blocking: call it every step."""
    if self._save_error is not None:
      raise self._save_error
    exc = self._failed_save()
    if exc is not None:
      self._raise_save_error(exc, self._pending_step)

  def _wait_checked(self) -> None:
    """``wait_until_finished``, with a failed save as ``CheckpointSaveError``."""
    self.check_errors()
    try:
      self.manager.wait_until_finished()
    except Exception as e:  # pylint: disable=broad-except
      self._raise_save_error(e, self._pending_step)

  # -- saving ---------------------------------------------------------------

  def latest_step(self) -> Optional[int]:
    self.check_errors()
    return self.manager.latest_step()

  def save(self, step: int, state: Any, data_state: Any, meta: dict, *, force: bool = False):
    """Starts saving ``step`` (asynchronously when enabled). Raises
    ``CheckpointSaveError`` first if an earlier save failed."""
    self.check_errors()
    previous = self._pending_step
    self._pending_step = int(step)
    try:
      return self.manager.save(
          int(step),
          args=ocp.args.Composite(
              state=ocp.args.StandardSave(savable(state)),
              data=ocp.args.JsonSave(_to_jsonable(data_state)),
              meta=ocp.args.JsonSave(_to_jsonable(meta))),
          force=force)
    except Exception as e:  # pylint: disable=broad-except
      if self._failed_save() is not None:  # orbax waited for the previous save
        self._pending_step = previous
        self._raise_save_error(e, previous)
      if isinstance(e, OSError):  # this save could not even start (disk full)
        self._raise_save_error(e, int(step))
      raise

  def restore(self, step: Optional[int], abstract_state: Any, expected_meta: Optional[dict] = None):
    """Restore into ``abstract_state`` (ShapeDtypeStructs carrying the target
    shardings: restore reshards onto the current mesh). Returns
    (state, data_state, meta); ``self.restored_step`` is the step restored.

    With ``step=None`` the newest readable checkpoint is restored: unreadable
    newer ones are skipped with a warning and moved aside (see the module
    doc). ``expected_meta``: {"model": the model config's dict, "layout": the
    run's ``fbos_jax.rl.state.StateLayout``}; a model-config or layout mismatch
    (``CheckpointMismatchError``) is raised at once. ``CheckpointRestoreError``
    when none can be read."""
    s, out, failures = self._newest_readable(
        step, lambda s: self._restore_step(s, abstract_state, expected_meta))
    self.restored_step = s
    if failures:
      self._move_aside([f for f, _ in failures])
      logging.warning("restored checkpoint %s instead of the newest, unreadable %s",
                      self._step_dir(s), ", ".join(self._step_dir(f) for f, _ in failures))
    return out

  def _newest_readable(self, step: Optional[int], read) -> tuple:
    """(step, ``read(step)``, failures) of the newest checkpoint that ``read``
    restores (``step`` given: that one only); each unreadable one is warned about
    and listed in failures as (step, error). A ``CheckpointMismatchError`` is
    raised at once; none readable raises ``CheckpointRestoreError`` naming each
    step tried and its cause (one line)."""
    steps = sorted(self.manager.all_steps(), reverse=True) if step is None else [int(step)]
    if not steps:
      raise FileNotFoundError(f"No checkpoint in {self.directory}")
    failures = []
    for s in steps:
      try:
        return s, read(s), failures
      except CheckpointMismatchError:
        raise
      except Exception as e:  # pylint: disable=broad-except
        failures.append((s, e))
        logging.warning("checkpoint %s is unreadable (%s)%s", self._step_dir(s), _cause(e),
                        "; trying the previous one" if s != steps[-1] else "")
    listed = "; ".join(f"{self._step_dir(s)}: {_cause(e)}" for s, e in failures)
    raise CheckpointRestoreError(f"no checkpoint could be restored ({listed})") from failures[0][1]

  def _step_dir(self, step: int) -> str:
    return f"{self.directory}/{step}"

  def _move_aside(self, steps: list[int]) -> None:
    """Moves unreadable step directories to ``<parent>/corrupt_checkpoints``."""
    if jax.process_index() != self.primary or "://" in self.directory:
      return
    target = os.path.join(os.path.dirname(self.directory), "corrupt_checkpoints")
    for s in steps:
      src = self._step_dir(s)
      if not os.path.isdir(src):
        continue
      os.makedirs(target, exist_ok=True)
      dst = os.path.join(target, str(s))
      if os.path.exists(dst):
        dst += time.strftime("-%Y%m%d-%H%M%S")
      shutil.move(src, dst)
      logging.warning("moved unreadable checkpoint %s to %s (kept for inspection; "
                      "step %d will be saved again)", src, dst, s)
    self.manager.reload()

  def _restore_step(self, step: int, abstract_state: Any, expected_meta: Optional[dict]):
    meta = _from_jsonable(self.manager.restore(
        step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"])
    if expected_meta is not None:
      _check_model(meta.get("model", {}), expected_meta.get("model", {}),
                   f"{self.directory}/{step}")
    if expected_meta is not None:
      _check_layout(meta.get("layout"), expected_meta.get("layout"), f"{self.directory}/{step}")
    restored = self.manager.restore(
        step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract_state),
                                      data=ocp.args.JsonRestore()))
    return restored["state"], _from_jsonable(restored["data"]), meta

  def restore_params(self, step: Optional[int], abstract_params: Any,
                     expected_meta: Optional[dict] = None):
    """Only the params of checkpoint ``step`` (newest readable if None), into
    ``abstract_params`` (ShapeDtypeStructs with the target shardings): what
    eval and export need, whatever the rest of the state's layout (KL
    reference, optimizer) was. A model-config mismatch names the field and
    both values. Returns (params, step, meta).

    Like training's :meth:`restore`, ``step=None`` falls back to the newest
    checkpoint that reads, with a warning naming the unreadable ones (nothing is
    moved: eval and export only read). An unreadable ``step`` asked for, or none
    readable, raises ``CheckpointRestoreError`` naming each step tried (the
    cause cut to one line) and the ``--step`` values that are there."""
    try:
      s, out, failures = self._newest_readable(
          step, lambda s: self._restore_params_step(s, abstract_params, expected_meta))
    except CheckpointRestoreError as e:
      raise CheckpointRestoreError(
          f"{e}; the checkpoints there are steps {sorted(self.manager.all_steps())}: choose a "
          "readable one with --step=N") from e.__cause__
    if failures:
      logging.warning("restored the params of checkpoint %s instead of the newest, "
                      "unreadable %s (choose one with --step)", self._step_dir(s),
                      ", ".join(self._step_dir(f) for f, _ in failures))
    return out

  def _restore_params_step(self, step: int, abstract_params: Any,
                           expected_meta: Optional[dict]):
    meta = _from_jsonable(self.manager.restore(
        step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"])
    if expected_meta is not None:
      _check_model(meta.get("model", {}), expected_meta.get("model", {}),
                   f"{self.directory}/{step}")
    restored = self.manager.restore(
        step, args=ocp.args.Composite(state=ocp.args.PyTreeRestore(
            item={"params": abstract_params}, partial_restore=True,
            restore_args=jax.tree.map(
                lambda a: ocp.ArrayRestoreArgs(sharding=a.sharding, dtype=a.dtype),
                {"params": abstract_params}))))
    return restored["state"]["params"], step, meta

  def wait(self):
    """Blocks until the pending save is written; ``CheckpointSaveError`` if it failed."""
    self._wait_checked()

  def close(self):
    """Finishes the pending save and closes; ``CheckpointSaveError`` if it failed
    (the manager is closed all the same)."""
    try:
      self._wait_checked()
    finally:
      try:
        self.manager.close()
      except Exception:  # pylint: disable=broad-except
        if self._save_error is None:
          raise


_MODEL_FIELDS_IGNORED = ("param_dtype", "compute_dtype", "remat", "hf_path", "tokenizer_path",
                         "attention", "attention_block_q", "attention_block_kv")


def _check_model(saved: dict, want: dict, where: str):
  """The model fields that shape the params must match: raise naming each one."""
  diff = {k: (saved.get(k), want.get(k)) for k in set(saved) | set(want)
          if k not in _MODEL_FIELDS_IGNORED and saved.get(k) != want.get(k)}
  if diff:
    fields = ", ".join(f"model.{k}: checkpoint={a!r} config={b!r}"
                       for k, (a, b) in sorted(diff.items()))
    raise CheckpointMismatchError(
        f"The checkpoint at {where} was written with a different model config ({fields}). "
        "Use another --workdir or the matching config.")


def _check_layout(saved: Optional[dict], want, where: str):
  """The fields that shape the rest of the TrainState must match for a resume:
  ``want`` (the run's ``fbos_jax.rl.state.StateLayout``) against ``saved`` (the
  layout the checkpoint recorded, :meth:`StateLayout.record`'s format); raise
  naming each field that differs and both values. Checkpoints written before the
  layout was recorded are not checked."""
  if want is None:
    return
  diff = want.differences(saved)
  if diff:
    fields = ", ".join(f"{k}: checkpoint={a!r} config={b!r}" for k, (a, b) in sorted(diff.items()))
    raise CheckpointMismatchError(
        f"The checkpoint at {where} holds a training state of another layout ({fields}): "
        "these fields decide what the state holds (the KL reference, the GFPO "
        "history, the optimizer state), so it cannot resume this config. Use another "
        "--workdir, or set the fields back; eval and export read only the params and are "
        "not affected.")


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
