"""Reliability probes of run state (issue 14): checkpoints, resume config checks,
metrics.jsonl, console logging and TensorBoard tags."""

import glob
import importlib.util
import io
import json
import logging
import os

import pytest

from fbos_jax import checkpoint as ckpt_lib
from fbos_jax import metrics as metrics_lib
from fbos_jax.model import qwen
from fbos_jax.rl.config import OptimConfig
from fbos_jax.rl.state import StateLayout

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ---------------------------------- a corrupt latest checkpoint falls back


def test_corrupt_latest_checkpoint_falls_back_to_the_previous_one(tmp_path, caplog):
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  directory = str(tmp_path / "checkpoints")
  ck = ckpt_lib.Checkpointer(directory, save_every=1, keep=5, async_save=False)
  for step in (1, 2, 3):
    ck.save(step, {"w": jnp.arange(4.0) * step}, {"pos": step}, {"model": {}})
  ck.close()
  for f in glob.glob(os.path.join(directory, "3", "state", "**", "d", "*"), recursive=True):
    with open(f, "wb") as fh:
      fh.write(b"torn")  # e.g. a node died while the async save was flushing
  ck = ckpt_lib.Checkpointer(directory, save_every=1, keep=5, async_save=False)
  abstract = ckpt_lib.abstract_with_shardings({"w": jnp.zeros(4)})
  with caplog.at_level(logging.WARNING):
    state, data_state, _ = ck.restore(None, abstract)
  assert data_state == {"pos": 2} and float(state["w"][1]) == 2.0
  assert ck.restored_step == 2
  text = "\n".join(r.getMessage() for r in caplog.records)
  assert os.path.join(directory, "3") in text
  # Nothing is lost: the unreadable checkpoint is moved aside, not deleted,
  # and step 3 can be saved again.
  moved = glob.glob(os.path.join(str(tmp_path), "corrupt_checkpoints", "3*"))
  assert len(moved) == 1 and os.path.isdir(moved[0])
  assert ck.latest_step() == 2
  ck.save(3, {"w": jnp.ones(4)}, {"pos": 3}, {"model": {}}, force=True)
  ck.close()


def test_all_checkpoints_unreadable_raises_and_moves_nothing(tmp_path):
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  directory = str(tmp_path / "checkpoints")
  ck = ckpt_lib.Checkpointer(directory, save_every=1, keep=5, async_save=False)
  ck.save(1, {"w": jnp.arange(4.0)}, {"pos": 1}, {"model": {}})
  ck.close()
  ck = ckpt_lib.Checkpointer(directory, save_every=1, keep=5, async_save=False)
  wrong = ckpt_lib.abstract_with_shardings({"w": jnp.zeros(4), "extra": jnp.zeros(2)})
  with pytest.raises(Exception, match=os.path.join(directory, "1")):
    ck.restore(None, wrong)
  assert ck.latest_step() == 1 and not os.path.exists(tmp_path / "corrupt_checkpoints")


# ---------------------------------------- resume with a changed config


def _load_config(spec):
  path, _, arg = spec.partition(":")
  spec_ = importlib.util.spec_from_file_location("cfg_rel_" + os.path.basename(path)[:-3],
                                                 os.path.join(ROOT, path))
  mod = importlib.util.module_from_spec(spec_)
  spec_.loader.exec_module(mod)
  return mod.get_config(arg)


def test_resume_with_a_changed_config_names_the_fields(caplog):
  cfg = _load_config("configs/fbos.py:tiny")
  saved = json.loads(json.dumps(cfg.to_dict()))  # as stored in checkpoint meta
  assert ckpt_lib.check_resume_config(saved, cfg.to_dict(), allow=False) == []
  changed = cfg.to_dict()
  changed["rl"]["group_size"] = 16
  changed["model"]["num_layers"] = changed["model"]["num_layers"] + 1
  changed["train"]["steps"] = 500  # does not matter for resuming
  changed["train"]["progress"] = False
  with pytest.raises(ckpt_lib.CheckpointMismatchError) as e:
    ckpt_lib.check_resume_config(saved, changed, allow=False)
  msg = str(e.value)
  assert "rl.group_size: checkpoint=8 config=16" in msg and "model.num_layers" in msg
  assert "train.steps" not in msg and "train.progress" not in msg
  with caplog.at_level(logging.WARNING):
    diffs = ckpt_lib.check_resume_config(saved, changed, allow=True)
  assert {d[0] for d in diffs} == {"rl.group_size", "model.num_layers"}
  assert any("rl.group_size" in r.getMessage() for r in caplog.records)
  only_steps = cfg.to_dict()
  only_steps["train"]["steps"] = 500
  assert ckpt_lib.check_resume_config(saved, only_steps, allow=False) == []


# ------------------------------------------------------------ metrics.jsonl


def _rows(path):
  with open(path) as f:
    return [json.loads(line) for line in f if line.strip()]


def test_torn_last_line_is_tolerated_and_named(tmp_path, caplog):
  path = tmp_path / "metrics.jsonl"
  path.write_text('{"step": 1, "a": 1.0}\n{"step": 2, "a": 2.0}\n{"step": 3, "a"')
  with caplog.at_level(logging.WARNING):
    rows = metrics_lib.read_jsonl(str(path))
  assert [r["step"] for r in rows] == [1, 2]
  assert any(str(path) in r.getMessage() and "torn" in r.getMessage()
             for r in caplog.records)
  # A torn line in the middle is not a crash artefact: it names file:line.
  path.write_text('{"step": 1}\n{"step": 2\n{"step": 3}\n')
  with pytest.raises(ValueError, match=f"{path}:2"):
    metrics_lib.read_jsonl(str(path))


def test_resume_after_a_torn_line_appends_clean_rows(tmp_path):
  (tmp_path / "metrics.jsonl").write_text('{"step": 1, "a": 1.0}\n{"step": 2, "a"')
  w = metrics_lib.MetricsWriter(str(tmp_path))
  w.write(2, {"a": 2.5})
  w.write(3, {"a": 3.5})
  w.close()
  assert [(r["step"], r["a"]) for r in _rows(tmp_path / "metrics.jsonl")] == [
      (1, 1.0), (2, 2.5), (3, 3.5)]


def test_truncate_rewrites_atomically(tmp_path, monkeypatch):
  path = tmp_path / "metrics.jsonl"
  original = "".join(json.dumps({"step": s}) + "\n" for s in range(5))
  path.write_text(original)
  real_dumps = json.dumps
  calls = []

  def failing_dumps(obj, *a, **kw):
    calls.append(obj)
    if len(calls) == 2:
      raise OSError("disk full")
    return real_dumps(obj, *a, **kw)

  monkeypatch.setattr(metrics_lib.json, "dumps", failing_dumps)
  with pytest.raises(OSError):
    metrics_lib.truncate_jsonl(str(path), 3)
  assert path.read_text() == original  # nothing lost on a failed rewrite
  monkeypatch.setattr(metrics_lib.json, "dumps", real_dumps)
  metrics_lib.truncate_jsonl(str(path), 3)
  assert [r["step"] for r in _rows(path)] == [0, 1, 2, 3]


def test_restart_before_the_first_checkpoint_leaves_no_duplicate_rows(tmp_path):
  w = metrics_lib.MetricsWriter(str(tmp_path))
  for s in range(4):  # killed at step 3, before any checkpoint
    w.write(s, {"loss": float(s)})
  w.close()
  w = metrics_lib.MetricsWriter(str(tmp_path))  # restarts from scratch
  w.write(0, {"loss": 10.0})
  w.write(1, {"loss": 11.0})
  w.close()
  rows = _rows(tmp_path / "metrics.jsonl")
  assert [(r["step"], r["loss"]) for r in rows] == [(0, 10.0), (1, 11.0)]


def test_tensorboard_tags_are_sanitized_but_jsonl_keys_are_not(tmp_path, caplog):
  assert metrics_lib.tensorboard_tag("eval/pass@4") == "eval/pass_at_4"
  assert metrics_lib.tensorboard_tag("reward/round1") == "reward/round1"
  with caplog.at_level(logging.DEBUG):
    w = metrics_lib.MetricsWriter(str(tmp_path))
    w.write(1, {"eval/pass@4": 0.5})
    w.close()
  assert not [r for r in caplog.records if "illegal" in r.getMessage()]
  assert _rows(tmp_path / "metrics.jsonl")[0]["eval/pass@4"] == 0.5


# ------------------------------------------------------------------ console


@pytest.fixture
def clean_logging():
  root = logging.getLogger()
  saved = (list(root.handlers), root.level,
           {n: logging.getLogger(n).level for n in ("absl", "orbax")})
  yield
  from fbos_jax import console  # pylint: disable=g-import-not-at-top
  console.teardown_logging()
  for h in list(root.handlers):
    if h not in saved[0]:
      root.removeHandler(h)
  root.setLevel(saved[1])
  for n, level in saved[2].items():
    logging.getLogger(n).setLevel(level)


def test_console_quiet_by_default_and_full_log_in_workdir(tmp_path, clean_logging):
  from absl import logging as absl_logging  # pylint: disable=g-import-not-at-top
  from fbos_jax import console  # pylint: disable=g-import-not-at-top
  stream = io.StringIO()
  log_path = console.setup_logging(str(tmp_path), console_stream=stream)
  absl_logging.info("orbax-like info line")
  logging.getLogger("orbax.checkpoint").info("[process=0] Finished saving")
  logging.getLogger("fbos").warning("a real warning")
  console.flush()
  assert log_path == os.path.join(str(tmp_path), "log.txt")
  text = open(log_path).read()
  assert "orbax-like info line" in text and "Finished saving" in text
  assert "a real warning" in text
  shown = stream.getvalue()
  assert "a real warning" in shown
  assert "orbax-like info line" not in shown and "Finished saving" not in shown
  # --verbosity=info (or an absl-style 0) brings the INFO lines back.
  console.setup_logging(str(tmp_path), verbosity="info", console_stream=stream)
  absl_logging.info("second info line")
  console.flush()
  assert "second info line" in stream.getvalue()
  assert console.parse_verbosity(0) == logging.INFO
  assert console.parse_verbosity("debug") == logging.DEBUG
  with pytest.raises(ValueError, match="verbosity"):
    console.parse_verbosity("loud")


# the "layout" a checkpoint's meta holds, as every checkpoint so far recorded it (written
# by the former fbos_jax.rl.state.layout(parts)): a KL run with the adaptive GFPO history
# and gradient clipping, and a run with none of them
RECORDED_FULL = {"rl.kl_beta > 0": True, "rl.gfpo_adaptive": True, "rl.gfpo_history": 64,
                 "optim.opt_state_dtype": "float32", "optim.grad_clip > 0": True}
RECORDED_BARE = {"rl.kl_beta > 0": False, "rl.gfpo_adaptive": False, "rl.gfpo_history": None,
                 "optim.opt_state_dtype": "bfloat16", "optim.grad_clip > 0": False}


def _layout(**kw):
  optim = OptimConfig(learning_rate=1e-6, grad_clip=kw.pop("grad_clip", 1.0),
                      opt_state_dtype=kw.pop("opt_state_dtype", "float32"))
  return StateLayout(model=qwen.ModelConfig(), optim=optim, **kw)


def test_the_state_layout_records_and_reads_the_checkpoints_format():
  """StateLayout.record() keeps the format checkpoints recorded (so theirs still
  resume), and a checkpoint of the same layout, read back from its JSON meta,
  shows no difference."""
  full = _layout(kl_reference=True, gfpo_history=64)
  bare = _layout(grad_clip=0.0, opt_state_dtype="bfloat16")
  assert full.record() == RECORDED_FULL and bare.record() == RECORDED_BARE
  for lay, recorded in ((full, RECORDED_FULL), (bare, RECORDED_BARE)):
    assert lay.differences(json.loads(json.dumps(recorded))) == {}
    ckpt_lib._check_layout(json.loads(json.dumps(recorded)), lay, "W")
  assert full.differences(RECORDED_BARE).keys() == RECORDED_FULL.keys()
  ckpt_lib._check_layout(None, full, "W")  # written before the layout was recorded
  ckpt_lib._check_layout({}, full, "W")


def test_a_layout_field_the_state_no_longer_has_resumes_only_at_its_none_value():
  """rl.staleness (the simulated stale-params history, removed) recorded as 0
  held nothing: such a checkpoint resumes. Recorded > 0 it held a history this
  state has no place for: refused, naming the field, as is any one-sided field."""
  want = _layout()
  saved = want.record()
  ckpt_lib._check_layout(dict(saved, **{"rl.staleness": 0}), want, "W")
  with pytest.raises(ckpt_lib.CheckpointMismatchError, match=r"rl.staleness: checkpoint=2 config=None"):
    ckpt_lib._check_layout(dict(saved, **{"rl.staleness": 2}), want, "W")
  older = {k: v for k, v in saved.items() if k != "optim.grad_clip > 0"}
  with pytest.raises(ckpt_lib.CheckpointMismatchError,
                     match=r"optim.grad_clip > 0: checkpoint=None config=True"):
    ckpt_lib._check_layout(older, want, "W")
  with pytest.raises(ckpt_lib.CheckpointMismatchError, match=r"rl.kl_beta > 0: checkpoint=True"):
    ckpt_lib._check_layout(dict(saved, **{"rl.kl_beta > 0": True}), want, "W")


def test_a_save_compiles_nothing_for_replicated_arrays(tmp_path):
  """A run's first checkpoint save compiles no program (the compile set is fixed
  at start): orbax's replica-parallel default sliced each replicated array on
  device across its replicas, a ``jit(slice)`` per array shape at the first save
  (72 on the tiny run, logged as compile/after_start at step 11)."""
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np
  from jax.sharding import NamedSharding, PartitionSpec as P
  from fbos_jax import checkpoint as ckpt_lib
  from fbos_jax import sharding as sh
  from fbos_jax.program_cache import CompileWatch
  mesh = sh.make_mesh({"data": 8})
  state = {"w": jax.device_put(np.ones((24, 7), np.float32), NamedSharding(mesh, P())),  # shapes
           "b": jax.device_put(np.ones((40, 3), np.float32), NamedSharding(mesh, P("data")))}
  ck = ckpt_lib.Checkpointer(str(tmp_path / "ck"), save_every=1, keep=1)
  watch = CompileWatch()
  try:
    ck.save(1, state, {}, {})
    ck.wait()
    assert [e.fun_name for e in watch.take()] == []
  finally:
    watch.close()
    ck.close()
