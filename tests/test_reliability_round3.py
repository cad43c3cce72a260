"""Reliability probes, round three (issue 34): the SFT stages, combinations that
validation accepts, eval and export on a bad checkpoint, the export check's
sampling rules, the summary after a resume and a real full disk. See
docs/reliability.md, "Round three"."""
import os
import subprocess
import sys

import pytest

from configs import load

from fbos_jax.rl import config as config_lib
from fbos_jax.rl import sft as sft_lib
from fbos_jax.testing.small import one_device_mesh, small_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.path.join(ROOT, "kernels")]))


def _launch(script, *args, timeout=600):
  return subprocess.run([sys.executable, os.path.join(ROOT, "launch", script), *args], cwd=ROOT,
                        capture_output=True, text=True, timeout=timeout, env=ENV)


def _invalid(config, **kw) -> str:
  with pytest.raises(ValueError) as e:
    config_lib.validate(config, process_count=1, **kw)
  return str(e.value)


# --------------------------------------------------------------- 2. the SFT stages


def _chain_with_stage(i, **fields):
  c = load("configs/fbos.py:tiny_chain")
  stages = [dict(st) for st in c.sft.stages]
  stages[i].update(fields)
  c.sft.stages = tuple(stages)
  return c


@pytest.mark.parametrize("stage,fields,message", [
    (1, {"learning_rate": -3e-4}, "sft.stages[1].learning_rate=-0.0003: must be > 0"),
    (1, {"fap_fraction": 1.5}, "sft.stages[1].fap_fraction=1.5: must be in [0, 1]"),
    (1, {"corrections": "bogus"}, "sft.stages[1].corrections='bogus': expected one of"),
    (0, {"batch_size": 0}, "sft.stages[0].batch_size=0: must be an integer >= 1"),
    (1, {"self_samples": 2.5}, "sft.stages[1].self_samples=2.5: must be an integer >= 1"),
    (1, {"learnign_rate": 1.0}, "sft.stages[1] ('own_failures'): unknown sft field(s) "
                                "['learnign_rate']"),
])
def test_each_sft_stage_is_validated_at_start_naming_its_field(stage, fields, message):
  """Before: a negative learning rate in a stage trained (gradient ascent) with exit
  0, a bad field of stage 2 surfaced after stage 1 had trained, unnamed, and
  fap_fraction=1.5 failed as 'none of the demonstrations passed the verifier'."""
  assert message in _invalid(_chain_with_stage(stage, **fields))


def test_an_sft_stage_that_is_not_a_dict_is_named():
  c = load("configs/fbos.py:tiny_chain")
  c.sft.stages = (dict(c.sft.stages[0]), [("steps", 100)])
  assert "sft.stages[1]=[('steps', 100)]: must be a dict of sft fields" in _invalid(c)


def test_the_flat_sft_fields_keep_their_rules():
  c = load("configs/fbos.py:tiny")
  c.sft.learning_rate = -1e-3
  c.sft.self_corrections_from = 2.0
  msg = _invalid(c)
  assert "sft.learning_rate=-0.001: must be > 0" in msg
  assert "sft.self_corrections_from=2.0: must be in [0, 1]" in msg


def test_flat_sft_steps_that_the_stages_would_ignore_is_refused():
  """Before: --config.sft.steps=10 on tiny_chain trained 800 steps (the stages')."""
  c = load("configs/fbos.py:tiny_chain", {"sft.steps": 10})
  msg = _invalid(c)
  assert "sft.steps=10, but the steps of sft.stages total 800 (demos 700 + own_failures 100)" \
      in msg
  sft_lib.set_total_steps(c, 10)  # what compare.py --quick does: the recipe's proportions
  config_lib.validate(c, process_count=1)
  assert sft_lib.describe_steps(c) == "10 steps (demos 9 + own_failures 1)"


def test_a_flat_sft_override_that_a_stage_sets_is_refused():
  """Before: --config.sft.learning_rate=1e-5 on tiny_chain was ignored by both stages."""
  c = load("configs/fbos.py:tiny_chain", {"sft.learning_rate": 1e-5})
  msg = _invalid(c, overrides=["sft.learning_rate"])
  assert "sft.learning_rate=1e-05 would be ignored" in msg
  assert "sft.stages[0].learning_rate=0.003 ('demos')" in msg
  config_lib.validate(c, process_count=1, overrides=["sft.batch_size"])  # no stage sets it


def test_train_refuses_ignored_sft_overrides_before_anything_runs(tmp_path):
  out = _launch("train.py", "--config=configs/fbos.py:tiny_chain", "--config.sft.steps=10",
                "--config.sft.fap_fraction=0.5", f"--workdir={tmp_path}")
  assert out.returncode != 0
  assert "sft.steps=10, but the steps of sft.stages total 800" in out.stderr
  assert "sft.fap_fraction=0.5 would be ignored" in out.stderr
  assert not os.path.exists(tmp_path / "sft")


def test_console_reports_the_steps_the_stages_run(tmp_path, monkeypatch, capsys):
  """Before: "warm start (SFT, 1 steps)" while the stages trained 6."""
  from fbos_jax.rl import run
  c = small_config("configs/fbos.py:tiny", **{
      "train.warm_start": "sft", "train.steps": 0, "train.eval_prompts": 0, "sft.steps": 6,
      "sft.stages": ({"name": "demos", "steps": 2}, {"name": "fixes", "steps": 4})})
  seen = []
  monkeypatch.setattr(sft_lib, "warm_start",
                      lambda config, ctx, state, cache_dir: seen.append(1) or (state.params, True))
  run.run_training(c, str(tmp_path), plot=False)
  assert seen and "warm start (SFT, 6 steps (demos 2 + fixes 4)): cached" in capsys.readouterr().out
