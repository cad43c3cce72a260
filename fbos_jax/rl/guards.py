"""What stops a run, or marks a step, after the update: a skipped (non-finite)
optimizer step, a verifier that failed every call for several steps, and (a
warning) updates that leave most params as they were."""

from __future__ import annotations

from absl import logging


class NonFiniteStepError(FloatingPointError):
  """A non-finite loss or gradient with ``rl.skip_nonfinite=False``."""


class VerifierFailingError(RuntimeError):
  """Every verifier call failed for ``verifier.max_failed_steps`` steps in a row."""


class StepGuard:
  """Reads a step's metrics: :meth:`annotate` (before they are logged) names a
  skipped step's batch; :meth:`check` (after) stops the run when it must."""

  def __init__(self, skip_nonfinite: bool, max_failed_steps: int):
    self.skip_nonfinite, self.limit = bool(skip_nonfinite), int(max_failed_steps)
    self.failed_steps = 0  # consecutive steps whose every verifier call failed

  def annotate(self, m: dict, ids: list, step: int):
    """Name a skipped (non-finite) optimizer step of ``step`` in the log and ``m``
    (``ids``: the batch's prompt ids, ``Trajectory.ids``)."""
    if m["policy/finite"] < 1:
      ids = [str(i) for i in ids]
      logging.warning("step %d: an optimizer step was skipped (non-finite loss or gradient); "
                      "batch ids: %s", step, ids)
      m["skipped_batch_ids"] = ids

  def check(self, m: dict, step: int):
    """After step ``step`` is logged: raise on a skipped step without
    ``rl.skip_nonfinite``, and when every verifier call failed in
    ``verifier.max_failed_steps`` steps in a row (0 = never)."""
    if m["policy/finite"] < 1 and not self.skip_nonfinite:
      raise NonFiniteStepError(
          f"non-finite loss or gradient at step {step} (rl.skip_nonfinite=False)")
    calls = m.get("verifier/calls", 0)
    self.failed_steps = self.failed_steps + 1 if calls and m["verifier/errors"] >= calls else 0
    if self.limit and self.failed_steps >= self.limit:
      raise VerifierFailingError(
          f"every verifier call failed in {self.failed_steps} steps in a row (up to step "
          f"{step}; the error kinds are counted in verifier/<kind> in metrics.jsonl and "
          f"each was logged once to log.txt); verifier.max_failed_steps={self.limit}")


class ParamChangeWatch:
  """Warns when ``update/param_change_frac`` (the share of trained elements an
  optimizer step changed) stays under ``threshold`` for ``patience`` steps in a
  row: the params' dtype rounds the updates away at this learning rate (a
  bfloat16 master keeps 8 significant bits, so a step of about lr is lost on every
  weight above ~256 x lr). Warns once per such stretch, naming both."""

  def __init__(self, param_dtype: str, learning_rate: float, *, threshold: float = 0.5,
               patience: int = 5):
    self.param_dtype, self.learning_rate = str(param_dtype), float(learning_rate)
    self.threshold, self.patience = float(threshold), int(patience)
    self.low_steps = 0  # consecutive steps under the threshold
    self.warnings = 0

  def check(self, m: dict, step: int) -> bool:
    """Read step ``step``'s metrics; True when it warned now."""
    frac = m.get("update/param_change_frac")
    if frac is None:
      return False
    self.low_steps = self.low_steps + 1 if frac < self.threshold else 0
    if self.low_steps != self.patience:
      return False
    self.warnings += 1
    logging.warning(
        "step %d: the updates changed only %.3f of the params' elements (under %.2f for %d "
        "steps in a row): model.param_dtype=%s rounds away most steps at "
        "optim.learning_rate=%g; keep a float32 master (--config.model.param_dtype=float32, "
        "the forward runs in model.compute_dtype) or raise the learning rate",
        step, frac, self.threshold, self.patience, self.param_dtype, self.learning_rate)
    return True
