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


# ------------------------------------------- 3. every accepted combination builds or is refused


def test_stream_rounds_without_a_round_2_is_refused():
  """Before: GRPO with rl.stream_rounds=True was accepted and did nothing."""
  c = load("configs/grpo.py:tiny", {"sampling.engine": "continuous", "rl.stream_rounds": True})
  assert "rl.stream_rounds=True streams round 2 beside round 1, but rl.round2=False" in _invalid(c)


def test_too_small_engine_pool_is_refused_when_the_run_is_built(tmp_path):
  """Before: found at the first engine call (here mid warm start, 28 s in)."""
  from fbos_jax import engine
  from fbos_jax.rl.context import RolloutContext
  c = small_config("configs/fbos.py:tiny", **{"sampling.engine": "continuous",
                                              "engine.num_pages": 5})
  config_lib.validate(c, process_count=1)
  with pytest.raises(engine.EngineError, match=r"engine's sample_round1 calls: "
                                               r"engine.num_pages=5 per batch shard is too small"):
    RolloutContext.build(c, str(tmp_path), mesh=one_device_mesh(), with_pool=False)
  c.engine.num_pages = 0  # the derived size builds
  RolloutContext.build(c, str(tmp_path), mesh=one_device_mesh(), with_pool=False)


def _bool_and_choice_fields(c) -> dict:
  """{dotted: the values other than the config's} of every boolean field of
  sampling, engine and rl, and every choice field (config_lib.choice_fields)."""
  out = {}
  for section in ("sampling", "engine", "rl"):
    for k, v in c[section].items():
      if isinstance(v, bool):
        out[f"{section}.{k}"] = (not v,)
  choices = config_lib.choice_fields()
  for dotted, options in choices.items():
    *path, last = dotted.split(".")
    node = c
    for p in path:
      node = node[p]
    out[dotted] = tuple(o for o in options if o != node[last])
  # every free-text field of the three sections is a known non-choice
  text = {f"{s}.{k}" for s in ("sampling", "engine", "rl") for k, v in c[s].items()
          if isinstance(v, str)}
  assert text - set(choices) <= {"rl.fcp_positive_feedback"}, text - set(choices)
  return out


def _build(c, workdir, tokenizer):
  """What a run builds before its first step (no training): validation, the typed
  parts and the context (engine pools, FAP budget), the step's shapes, the state."""
  from fbos_jax import sharding as sh
  from fbos_jax.rl import shapes
  from fbos_jax.rl import state as state_lib
  from fbos_jax.rl.context import RolloutContext
  mesh = one_device_mesh()
  config_lib.validate(c, 1, process_count=1)
  ctx = RolloutContext.build(c, workdir, mesh=mesh, tokenizer=tokenizer, with_pool=False)
  shapes.update_shapes(ctx.parts, 1)
  shapes.sampler_shapes(ctx.parts, 1, eval_prompts=c.train.eval_prompts, eval_k=c.train.eval_k)
  shapes.engine_shapes(ctx.parts, eval_prompts=c.train.eval_prompts, eval_k=c.train.eval_k)
  state_lib.abstract_state(ctx.parts, mesh, sh.rules_dict(c.mesh.rules))
  return ctx


def _pairs(c):
  import itertools
  values = [(f, v) for f, vs in _bool_and_choice_fields(c).items() for v in vs]
  return [(a, b) for a, b in itertools.combinations(values, 2) if a[0] != b[0]]


SPEC = "configs/fbos.py:tiny"
# accepted pairs that also run a step (a streamed round 2 on the engine, GOLF's
# aggregated FAPs with replaced rollouts, FCP prompts with pooled advantages)
RUN_A_STEP = [
    (("sampling.engine", "continuous"), ("rl.stream_rounds", True)),
    (("rl.epa_mode", "replace"), ("rl.fap_mode", "aggregated")),
    (("rl.advantage", "batch_std"), ("rl.prompt", "fcp")),
]


def test_every_pair_of_boolean_and_choice_fields_is_refused_or_builds(tmp_path):
  """Each pair of values of the boolean and choice fields of sampling, engine and
  rl (on the tiny config) is refused by validation or at build, by a ValueError
  that names a field, or builds."""
  from fbos_jax.rl.context import RolloutContext
  base = small_config(SPEC)
  tokenizer = RolloutContext.build(base, str(tmp_path), with_pool=False).tokenizer
  pairs = _pairs(base)
  assert len(pairs) > 300
  built, refused, wrong = [], 0, []
  for pair in pairs:
    c = small_config(SPEC, **dict(pair))
    try:
      _build(c, str(tmp_path), tokenizer)
    except ValueError as e:
      refused += 1
      if not any(s in str(e) for s in ("rl.", "sampling.", "engine.", "model.", "templates.")):
        wrong.append((pair, f"refused without naming a field: {e}"))
    except Exception as e:  # pylint: disable=broad-except
      wrong.append((pair, f"{type(e).__name__}: {e}"))
    else:
      built.append(pair)
  assert not wrong, "\n".join(f"{p}: {m}" for p, m in wrong[:20])
  assert built and refused
  for pair in RUN_A_STEP:
    assert tuple(sorted(pair)) in {tuple(sorted(p)) for p in built}, pair


@pytest.mark.parametrize("pair", RUN_A_STEP, ids=lambda p: "+".join(f"{f}={v}" for f, v in p))
def test_a_sample_of_the_built_pairs_runs_a_step(pair, tmp_path):
  import numpy as np
  from fbos_jax.rl.trainer import RLTrainer
  c = small_config(SPEC, **dict(pair), **{"train.steps": 1, "train.checkpoint_every": 0})
  tr = RLTrainer(c, str(tmp_path), mesh=one_device_mesh())
  state, history = tr.train()
  tr.close()
  assert int(state.step) == 1 and np.isfinite(history[-1]["loss"])
