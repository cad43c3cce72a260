"""Metrics: JSONL + TensorBoard event files every step, and PNG curves."""

from __future__ import annotations

import json
import math
import os
from typing import Any, Iterable, Optional

import numpy as np


def _scalar(v) -> Optional[float]:
  try:
    f = float(np.asarray(v))
  except (TypeError, ValueError):
    return None
  return f


class MetricsWriter:
  """Appends one JSON object per step to ``metrics.jsonl`` and mirrors scalars to
  TensorBoard (tensorboardX). Only process 0 writes."""

  def __init__(self, workdir: str, *, enabled: bool = True, filename: str = "metrics.jsonl"):
    self.enabled = enabled
    self.path = os.path.join(workdir, filename)
    self._tb = None
    if enabled:
      os.makedirs(workdir, exist_ok=True)
      try:
        from tensorboardX import SummaryWriter
        self._tb = SummaryWriter(os.path.join(workdir, "tb"))
      except Exception:  # tensorboardX missing: JSONL still works
        self._tb = None

  def write(self, step: int, metrics: dict[str, Any]):
    if not self.enabled:
      return
    row = {"step": int(step)}
    for k, v in metrics.items():
      f = _scalar(v)
      if f is not None:
        row[k] = f if math.isfinite(f) else str(f)
        if self._tb is not None and math.isfinite(f):
          self._tb.add_scalar(k, f, int(step))
      elif isinstance(v, (str, list)):
        row[k] = v
    with open(self.path, "a") as f:
      f.write(json.dumps(row) + "\n")

  def close(self):
    if self._tb is not None:
      self._tb.close()


def read_jsonl(path: str) -> list[dict]:
  rows = []
  if not os.path.exists(path):
    return rows
  with open(path) as f:
    for line in f:
      line = line.strip()
      if line:
        rows.append(json.loads(line))
  return rows


def truncate_jsonl(path: str, max_step: int):
  """Drop rows after ``max_step`` (on resume, steps past the checkpoint re-run)."""
  rows = [r for r in read_jsonl(path) if r.get("step", 0) <= max_step]
  with open(path, "w") as f:
    for r in rows:
      f.write(json.dumps(r) + "\n")


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
