"""Metrics: JSONL + TensorBoard event files every step, and PNG curves.

``metrics.jsonl`` is written so that a crash loses at most the line being
written, and a restart never duplicates rows:

* every row is appended as one whole line, flushed and fsynced;
* every rewrite goes to a temporary file that replaces the original with
  ``os.replace`` (atomic), so a failed rewrite leaves the old file intact;
* a torn last line (a kill mid-write) is skipped with a warning naming the
  file; a broken line elsewhere raises ``ValueError("<file>:<line>: ...")``;
* a writer's first row at step ``s`` first drops the file's rows with step
  ``>= s`` (a previous run got past its last checkpoint, or past nothing: a
  fresh start at step 0 drops them all), logging how many.

TensorBoard tags are sanitized (``eval/pass@4`` -> ``eval/pass_at_4``); the
JSONL keys stay as given.
"""

from __future__ import annotations

import json
import math
import os
import re
import tempfile
import time
from typing import Any, Iterable, Optional

from absl import logging
import numpy as np

_TB_INVALID = re.compile(r"[^-/\w.]")


def _scalar(v) -> Optional[float]:
  try:
    f = float(np.asarray(v))
  except (TypeError, ValueError):
    return None
  return f


def tensorboard_tag(key: str) -> str:
  """A metric key as a legal TensorBoard tag: ``@`` -> ``_at_``, any other
  character but letters, digits, ``_ - / .`` -> ``_``, no leading ``/``."""
  return _TB_INVALID.sub("_", key.replace("@", "_at_")).lstrip("/")


class MetricsWriter:
  """Appends one JSON object per step to ``metrics.jsonl`` and mirrors scalars to
  TensorBoard (tensorboardX). Only process 0 writes (``enabled``).

  The first ``write(step, ...)`` of a writer drops the file's rows with step
  ``>= step`` (see the module doc), so constructing a writer and writing from
  the restored step (0 without a checkpoint) is all a resume needs.
  """

  def __init__(self, workdir: str, *, enabled: bool = True, filename: str = "metrics.jsonl",
               tensorboard: bool = True):
    self.enabled = enabled
    self.path = os.path.join(workdir, filename)
    self._tb = None
    self._started = False
    if enabled:
      os.makedirs(workdir, exist_ok=True)
    if enabled and tensorboard:
      self._tb = _EventFile.open(os.path.join(workdir, "tb"))

  def _start(self, step: int) -> None:
    """Drops rows at or past ``step`` (re-run now) and any torn last line."""
    self._started = True
    if not os.path.exists(self.path):
      return
    try:
      rows, clean = _read_rows(self.path)
    except ValueError as e:  # broken in the middle: keep it aside, start anew
      aside = f"{self.path}.corrupt-{time.strftime('%Y%m%d-%H%M%S')}"
      os.replace(self.path, aside)
      logging.warning("%s; moved it to %s and started a new metrics file", e, aside)
      return
    keep = [r for r in rows if _step_of(r) < step]
    if len(keep) != len(rows):
      logging.warning(
          "%s: dropping %d row(s) with step >= %d, written by a run that "
          "stopped after its last checkpoint (they are re-run now)",
          self.path, len(rows) - len(keep), step)
    if len(keep) != len(rows) or not clean:
      _rewrite(self.path, keep)

  def write(self, step: int, metrics: dict[str, Any]):
    if not self.enabled:
      return
    if not self._started:
      self._start(int(step))
    row, scalars = {"step": int(step)}, {}
    for k, v in metrics.items():
      f = _scalar(v)
      if f is not None:
        row[k] = f if math.isfinite(f) else str(f)
        if math.isfinite(f):
          scalars[tensorboard_tag(k)] = f
      elif isinstance(v, (str, list)):
        row[k] = v
    if self._tb is not None and scalars:
      self._tb_write(int(step), scalars)
    line = json.dumps(row) + "\n"
    with open(self.path, "a") as f:
      f.write(line)
      f.flush()
      os.fsync(f.fileno())

  def _tb_write(self, step: int, scalars: dict) -> None:
    """One TensorBoard event of the step's scalars, written and flushed here. An
    OSError (a full disk) drops TensorBoard with one warning; metrics.jsonl goes on,
    or fails loudly, on its own."""
    try:
      self._tb.write(step, scalars)
    except OSError as e:
      logging.warning("writing TensorBoard's event file failed (%s); no more TensorBoard "
                      "events, metrics.jsonl continues", e)
      self._tb.abandon()
      self._tb = None

  def close(self):
    if self._tb is not None:
      try:
        self._tb.close()
      except OSError as e:
        logging.warning("closing TensorBoard's event file failed: %s", e)
      self._tb = None


class _EventFile:
  """A TensorBoard event file written synchronously: one ``Event`` per step with
  all of the step's scalars, flushed at once (tensorboardX's record format).

  Not ``tensorboardX.SummaryWriter``: its writer thread dies on an OSError (a
  full disk) and its bounded queue then blocks ``add_scalar`` forever, also when
  the thread dies while the caller already waits for a slot (a hang no liveness
  check before the call can see). Here a failed write raises in the caller."""

  def __init__(self, writer, event_pb2, summary_pb2):
    self._w, self._event, self._summary = writer, event_pb2.Event, summary_pb2.Summary

  @classmethod
  def open(cls, logdir: str) -> Optional["_EventFile"]:
    """The event file in ``logdir``, or None without tensorboardX (JSONL works)."""
    try:
      from tensorboardX.event_file_writer import EventsWriter  # pylint: disable=g-import-not-at-top
      from tensorboardX.proto import event_pb2, summary_pb2  # pylint: disable=g-import-not-at-top
    except ImportError:
      return None
    try:
      os.makedirs(logdir, exist_ok=True)
      return cls(EventsWriter(os.path.join(logdir, "events")), event_pb2, summary_pb2)
    except OSError as e:
      logging.warning("no TensorBoard events: %s cannot be written (%s); metrics.jsonl only",
                      logdir, e)
      return None

  def write(self, step: int, scalars: dict) -> None:
    values = [self._summary.Value(tag=k, simple_value=v) for k, v in scalars.items()]
    self._w.write_event(self._event(wall_time=time.time(), step=step,
                                    summary=self._summary(value=values)))
    self._w.flush()

  def close(self) -> None:
    self._w.close()

  def abandon(self) -> None:
    """Close the file after a failed write (a full disk): its descriptor is released
    even though the flush of what is buffered fails again."""
    for close in (self._w.close, self._w._py_recordio_writer.close):  # pylint: disable=protected-access
      try:
        close()
        return
      except OSError:
        pass


def _step_of(row: dict) -> float:
  try:
    return float(row.get("step", 0))
  except (TypeError, ValueError):
    return 0.0


def _read_rows(path: str) -> tuple[list[dict], bool]:
  """Rows of a JSONL file and whether it is clean (no torn last line, ends
  with a newline). A bad line that is not the last raises."""
  with open(path, "rb") as f:
    data = f.read()
  lines = data.split(b"\n")
  clean = data.endswith(b"\n") or not data
  numbered = [(i, ln) for i, ln in enumerate(lines, start=1) if ln.strip()]
  rows = []
  for k, (lineno, line) in enumerate(numbered):
    try:
      row = json.loads(line)
      if not isinstance(row, dict):
        raise ValueError(f"expected a JSON object, got {type(row).__name__}")
    except ValueError as e:  # json.JSONDecodeError and UnicodeDecodeError too
      if k == len(numbered) - 1 and not data.endswith(b"\n"):
        logging.warning("%s:%d: skipping a torn last line (a run was killed "
                        "while writing it): %r", path, lineno, line[:80])
        return rows, False
      raise ValueError(f"{path}:{lineno}: not a JSON object line ({e})") from None
    rows.append(row)
  return rows, clean


def read_jsonl(path: str) -> list[dict]:
  """The rows of a metrics JSONL file ([] if it does not exist).

  A torn last line is skipped with a warning naming the file; a broken line
  elsewhere raises ``ValueError("<file>:<line>: ...")``.
  """
  if not os.path.exists(path):
    return []
  return _read_rows(path)[0]


def _rewrite(path: str, rows: list[dict]) -> None:
  """Writes ``rows`` to a temp file, fsyncs it, and atomically replaces
  ``path``: a failure leaves the old file as it was."""
  directory = os.path.dirname(os.path.abspath(path))
  fd, tmp = tempfile.mkstemp(prefix=os.path.basename(path) + ".", suffix=".tmp",
                             dir=directory)
  try:
    with os.fdopen(fd, "w") as f:
      for r in rows:
        f.write(json.dumps(r) + "\n")
      f.flush()
      os.fsync(f.fileno())
    os.replace(tmp, path)
  except BaseException:
    try:
      os.remove(tmp)
    except OSError:
      pass
    raise


def truncate_jsonl(path: str, max_step: int):
  """Drop rows after ``max_step`` (on resume, steps past the checkpoint re-run);
  ``max_step=-1`` drops every row (a fresh start). Atomic (see ``_rewrite``);
  a torn last line is dropped too."""
  if not os.path.exists(path):
    return
  rows = [r for r in read_jsonl(path) if _step_of(r) <= max_step]
  _rewrite(path, rows)


# one panel per entry; "a|b" overlays metrics a and b in one panel
DEFAULT_PLOT_KEYS = (
    "eval/accuracy|eval/pass@1_sampled", "reward/round1", "reward/round2", "feedback/fix_rate",
    "loss/epa", "loss/ecc", "policy/entropy", "policy/grad_norm",
    "response/length", "epa/injected", "groups/all_equal_frac", "time/step_s",
)


def plot_metrics(rows: list[dict], out_png: str, keys: Iterable[str] = DEFAULT_PLOT_KEYS,
                 title: str = ""):
  """Draw one small panel per metric against step; returns the PNG path."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  keys = [k for k in keys if any(m in r for m in k.split("|") for r in rows)]
  if not keys:
    raise ValueError(f"none of the metrics to plot are in the log ({out_png})")
  cols = 3
  nrows = -(-len(keys) // cols)
  fig, axes = plt.subplots(nrows, cols, figsize=(4.2 * cols, 2.8 * nrows), squeeze=False)
  for ax, panel in zip(axes.flat, keys):
    names = panel.split("|")
    for i, k in enumerate(names):
      pts = [(r["step"], r[k]) for r in rows if k in r and isinstance(r[k], (int, float))]
      if not pts:
        continue
      xs, ys = zip(*pts)
      noisy = len(xs) >= 20  # per-step curves: faint raw line + 10-step moving average
      ax.plot(xs, ys, color=f"C{i}", alpha=0.35 if noisy else 1.0,
              marker=None if noisy else ".", label=k if len(names) > 1 else None)
      if noisy:
        w = 10
        avg = np.convolve(ys, np.ones(w) / w, mode="valid")
        ax.plot(xs[w - 1:], avg, color=f"C{i}", lw=2)
    if len(names) > 1:
      ax.legend(fontsize=7)
    ax.set_title(" | ".join(names), fontsize=9)
    ax.set_xlabel("step", fontsize=8)
    ax.grid(alpha=0.3)
  for ax in list(axes.flat)[len(keys):]:
    ax.axis("off")
  if title:
    fig.suptitle(title)
  fig.tight_layout()
  fig.savefig(out_png, dpi=90)
  plt.close(fig)
  return out_png


SUMMARY_KEYS = ("reward/round1", "reward/round2", "feedback/fix_rate", "epa/injected", "loss/epa",
                "loss/ecc", "policy/entropy", "policy/grad_norm", "eval/accuracy", "time/step_s")


def summary_line(m: dict) -> str:
  """The log line of a step: a few headline metrics as ``name=value``."""
  return " ".join(f"{k.split('/')[-1]}={m[k]:.4g}" for k in SUMMARY_KEYS if k in m
                  and isinstance(m[k], (int, float)))


def progress(it, enabled: bool, desc: str):
  """``it`` with a tqdm progress bar when ``enabled`` (process 0 of a run)."""
  if not enabled:
    return it
  from tqdm.auto import tqdm
  return tqdm(it, desc=desc, dynamic_ncols=True)
