"""Metrics plotting: overlaid panels, moving averages, and a clear error on an empty log."""

import os

import pytest

from fbos_jax import metrics as metrics_lib


def test_plot_overlays_and_smooths(tmp_path):
  rows = [{"step": s, "reward/round1": 0.3 + 0.01 * s, "policy/entropy": 0.7} for s in range(1, 31)]
  rows += [{"step": s, "eval/accuracy": 0.3 + s / 100, "eval/pass@1_sampled": 0.25 + s / 200}
           for s in (0, 10, 20, 30)]
  out = metrics_lib.plot_metrics(rows, str(tmp_path / "m.png"), title="t")
  assert os.path.getsize(out) > 10_000  # a real PNG with several panels


def test_plot_without_known_metrics_names_the_file(tmp_path):
  with pytest.raises(ValueError, match="m.png"):
    metrics_lib.plot_metrics([{"step": 1, "other": 1.0}], str(tmp_path / "m.png"))
