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


def test_drop_from_start_is_the_lowest_eval_below_the_start():
  from fbos_jax.rl.evaluation import drop_from_start
  rows = [{"step": 0, "rollouts": 0, "eval/accuracy": 0.40, "eval/pass@1_sampled": 0.20},
          {"step": 1, "rollouts": 128},  # a step without an eval
          {"step": 5, "rollouts": 640, "eval/accuracy": 0.25, "eval/pass@1_sampled": 0.22},
          {"step": 20, "rollouts": 2560, "eval/accuracy": 0.10, "eval/pass@1_sampled": 0.12},
          {"step": 30, "rollouts": 3840, "eval/accuracy": 0.50, "eval/pass@1_sampled": 0.30}]
  d = drop_from_start(rows)
  assert d["greedy"] == pytest.approx(-0.30) and d["sampled"] == pytest.approx(-0.08)
  early = drop_from_start(rows, within_rollouts=2000)  # the first 2,000 rollouts
  assert early["greedy"] == pytest.approx(-0.15) and early["sampled"] == 0.0
  assert drop_from_start(rows[:1]) == {"greedy": 0.0, "sampled": 0.0}
  assert drop_from_start([{"step": 0, "eval/accuracy": 0.3}])["sampled"] is None
  with pytest.raises(ValueError, match="rollouts"):
    drop_from_start([{"step": 0, "eval/accuracy": 0.3}], within_rollouts=10)


def test_the_sweep_picks_the_best_stable_rate_and_refuses_when_none_is_stable():
  from fbos_jax.rl.evaluation import pick_learning_rate
  sweep = {"1e-05": {"final_sampled": 0.25, "drop_greedy": -0.01},
           "3e-05": {"final_sampled": 0.30, "drop_greedy": -0.02},
           "1e-04": {"final_sampled": 0.35, "drop_greedy": -0.15}}  # best, but unstable
  assert pick_learning_rate(sweep) == 3e-5
  sweep["3e-05"]["final_sampled"] = 0.25  # a tie: the smaller rate
  assert pick_learning_rate(sweep) == 1e-5
  assert pick_learning_rate({"1e-05": {"final_sampled": 0.3, "drop_greedy": -0.04},
                             "3e-05": {"final_sampled": 0.3, "drop_greedy": -0.2}}) is None


def test_a_dead_tensorboard_writer_does_not_block_the_metrics(tmp_path):
  """Before: on a full disk tensorboardX's writer thread died and its bounded queue
  (10 events) blocked the run's next metrics write forever."""
  import threading
  w = metrics_lib.MetricsWriter(str(tmp_path))
  w.write(1, {"a": 1.0})
  if w._tb is None:
    pytest.skip("tensorboardX is not installed")
  w._tb.file_writer.event_writer._worker.stop()  # as a failed write ends it
  done = threading.Event()

  def write_rows():
    for s in range(2, 32):
      w.write(s, {"a": float(s), "b": 2.0})
    w.close()
    done.set()

  threading.Thread(target=write_rows, daemon=True).start()
  assert done.wait(120), "the metrics writer blocked on tensorboardX's full queue"
  assert len(metrics_lib.read_jsonl(w.path)) == 31
