"""Metrics plotting: overlaid panels, moving averages, and a clear error on an empty log."""

import json
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
  from fbos_jax.experiments.compare import pick_learning_rate
  sweep = {"1e-05": {"final_sampled": 0.25, "drop_greedy": -0.01},
           "3e-05": {"final_sampled": 0.30, "drop_greedy": -0.02},
           "1e-04": {"final_sampled": 0.35, "drop_greedy": -0.15}}  # best, but unstable
  assert pick_learning_rate(sweep) == 3e-5
  sweep["3e-05"]["final_sampled"] = 0.25  # a tie: the smaller rate
  assert pick_learning_rate(sweep) == 1e-5
  assert pick_learning_rate({"1e-05": {"final_sampled": 0.3, "drop_greedy": -0.04},
                             "3e-05": {"final_sampled": 0.3, "drop_greedy": -0.2}}) is None


def _events(logdir):
  """The (step, {tag: value}) of every scalar event in ``logdir``'s event files
  (TFRecord: length, its crc, the Event proto, its crc)."""
  import glob
  import struct
  from tensorboardX.proto import event_pb2
  out = []
  for path in sorted(glob.glob(os.path.join(logdir, "events.out.tfevents.*"))):
    data = open(path, "rb").read()
    i = 0
    while i < len(data):
      (n,) = struct.unpack("Q", data[i:i + 8])
      ev = event_pb2.Event.FromString(data[i + 12:i + 12 + n])
      i += 12 + n + 4
      if ev.HasField("summary"):
        out.append((ev.step, {v.tag: v.simple_value for v in ev.summary.value}))
  return out


def test_tensorboard_events_hold_every_steps_finite_scalars(tmp_path):
  w = metrics_lib.MetricsWriter(str(tmp_path))
  w.write(1, {"reward/round1": 0.25, "eval/pass@4": 0.5, "bad": float("nan"), "s": "text"})
  w.write(2, {"reward/round1": 0.5})
  w.close()
  assert _events(tmp_path / "tb") == [(1, {"reward/round1": 0.25, "eval/pass_at_4": 0.5}),
                                      (2, {"reward/round1": 0.5})]


def test_a_full_disk_under_tensorboard_drops_it_and_metrics_go_on(tmp_path, caplog):
  """Before: tensorboardX's writer thread died on the OSError (a full disk) and its
  bounded queue then blocked add_scalar forever, also when the caller was already
  waiting for a slot as the thread died (the CI hang of the full-disk test). The
  event file is now written in the caller: the error drops TensorBoard with one
  warning and metrics.jsonl goes on."""
  import logging
  import threading
  w = metrics_lib.MetricsWriter(str(tmp_path))
  w.write(1, {"a": 1.0})
  raw = w._tb._w._py_recordio_writer._writer

  class Full:
    def __getattr__(self, name):
      return getattr(raw, name)

    def write(self, data):
      raise OSError(28, "No space left on device")
  w._tb._w._py_recordio_writer._writer = Full()
  done = threading.Event()

  def run():
    for step in range(2, 50):  # far past tensorboardX's queue of 10
      w.write(step, {"a": float(step), "b": 2.0})
    w.close()
    done.set()
  with caplog.at_level(logging.WARNING):
    threading.Thread(target=run, daemon=True).start()
    assert done.wait(60), "a metrics write blocked on the full disk's TensorBoard file"
  assert w._tb is None and raw.closed
  assert len([r for r in caplog.records if "TensorBoard" in r.getMessage()]) == 1
  rows = [json.loads(l) for l in open(tmp_path / "metrics.jsonl")]
  assert [r["step"] for r in rows] == list(range(1, 50))
  assert _events(tmp_path / "tb") == [(1, {"a": 1.0})]
