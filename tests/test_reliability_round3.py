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
      "train.compile_at_start": False,  # the console line only: no programs to compile
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
@pytest.mark.slow  # default suite under 15 min (issue 35): .ci/run runs the slow set too
def test_a_sample_of_the_built_pairs_runs_a_step(pair, tmp_path):
  import numpy as np
  from fbos_jax.rl.trainer import RLTrainer
  c = small_config(SPEC, **dict(pair), **{"train.steps": 1, "train.checkpoint_every": 0})
  tr = RLTrainer(c, str(tmp_path), mesh=one_device_mesh())
  state, history = tr.train()
  tr.close()
  m = history[-1]
  assert int(state.step) == 1 and m["policy/finite"] == 1.0 and np.isfinite(m["policy/loss"])
  assert m["round2/rollouts"] > 0  # fbos: round 2 ran (streamed, aggregated, ...)


# ------------------------------------------------ 4. eval and export restore like training


def _two_checkpoints(workdir, params=None, **over):
  """A tiny run's checkpoints at steps 1 and 2 (no training): params x 1 and x 2
  (``params``: the step-1 params, default the run's init). Returns (config, params)."""
  import jax
  import jax.numpy as jnp
  from fbos_jax.rl.trainer import RLTrainer
  c = small_config("configs/fbos.py:tiny", **over)
  tr = RLTrainer(c, str(workdir), mesh=one_device_mesh())
  state = tr.init_state(params)
  for step in (1, 2):
    tr.save(state.replace(step=jnp.asarray(step, jnp.int32),
                          params=jax.tree.map(lambda a, k=step: a * k, state.params)), force=True)
    tr.ckpt.wait()
  tr.close()
  return c, state.params


def _tear(workdir, step):
  import glob
  files = glob.glob(os.path.join(str(workdir), "checkpoints", str(step), "state", "**", "d", "*"),
                    recursive=True)
  assert files
  for f in files:
    with open(f, "wb") as fh:
      fh.write(b"torn")


def test_eval_and_export_fall_back_to_the_newest_readable_checkpoint(tmp_path, caplog):
  """Before: a torn latest checkpoint stopped eval and export with 147 lines of
  TensorStore; training already fell back to the previous one."""
  import logging
  import jax
  import numpy as np
  from fbos_jax.rl.state import restore_params
  c, params = _two_checkpoints(tmp_path)
  _tear(tmp_path, 2)
  with caplog.at_level(logging.WARNING):
    restored, step = restore_params(c, str(tmp_path), mesh=one_device_mesh())
  assert step == 1
  for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(params)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  text = "\n".join(r.getMessage() for r in caplog.records)
  assert os.path.join("checkpoints", "2") in text and "--step" in text
  assert os.path.isdir(tmp_path / "checkpoints" / "2")  # eval and export move nothing


def test_an_unreadable_step_names_itself_and_the_steps_there(tmp_path):
  from fbos_jax import checkpoint as ckpt_lib
  from fbos_jax.rl.state import restore_params
  c, _ = _two_checkpoints(tmp_path)
  _tear(tmp_path, 2)
  with pytest.raises(ckpt_lib.CheckpointRestoreError) as e:
    restore_params(c, str(tmp_path), step=2, mesh=one_device_mesh())
  msg = str(e.value)
  assert os.path.join("checkpoints", "2: ") in msg and "steps [1, 2]" in msg
  assert "--step=N" in msg and "\n" not in msg and len(msg) < 1000
  out = _launch("eval.py", "--config=configs/fbos.py:tiny", f"--workdir={tmp_path}", "--step=2",
                *[f"--config.{k}={v}" for k, v in _SMALL_FLAGS.items()])
  assert out.returncode != 0
  lines = out.stderr.strip().splitlines()
  assert len(lines) < 15, out.stderr[-3000:]
  assert "--step=N" in out.stderr and "Traceback" not in out.stderr


# small_config's fields that decide the params' shapes, as --config flags
_SMALL_FLAGS = {"model.num_layers": 1, "model.hidden_size": 64, "model.intermediate_size": 128,
                "model.num_heads": 2, "model.num_kv_heads": 1, "data.task": "arithmetic",
                "data.difficulty": 1, "data.max_difficulty": 2, "train.eval_prompts": 8}


def test_eval_and_export_warn_when_the_task_differs_from_the_checkpoints(tmp_path, caplog):
  """Before: tiny_chain's config on a sort checkpoint evaluated without a word."""
  import logging
  from fbos_jax.rl.state import restore_params
  _two_checkpoints(tmp_path)
  other = small_config("configs/fbos.py:tiny", **{"data.task": "sort"})
  with caplog.at_level(logging.WARNING):
    restore_params(other, str(tmp_path), mesh=one_device_mesh())
  text = "\n".join(r.getMessage() for r in caplog.records)
  assert "trained on other data" in text and "data.task: checkpoint='arithmetic' config='sort'" \
      in text
  caplog.clear()
  with caplog.at_level(logging.WARNING):
    restore_params(small_config("configs/fbos.py:tiny"), str(tmp_path), mesh=one_device_mesh())
  assert "other data" not in "\n".join(r.getMessage() for r in caplog.records)


# ---------------------------------------------- 5. the export check applies the sampler's rules


def test_compare_greedy_tells_a_near_tie_from_a_mismatch():
  import numpy as np
  from fbos_jax.rl import export
  scores = [np.zeros(8, np.float32) for _ in range(4)]
  assert export.compare_greedy([1, 2, 3], [1, 2, 3], scores).status == "equal"
  scores[1][[2, 5]] = [4.0, 4.0 + 2e-5]
  r = export.compare_greedy([1, 2, 3], [1, 5, 3], scores)
  assert (r.status, r.position, r.ok) == ("near_tie", 1, True) and r.gap == pytest.approx(2e-5, rel=1e-2)
  scores[1][5] = 4.5
  r = export.compare_greedy([1, 2, 3], [1, 5, 3], scores)
  assert (r.status, r.ok) == ("mismatch", False) and r.gap == pytest.approx(0.5)
  r = export.compare_greedy([1, 2], [1, 2, 3], scores)  # one side stopped
  assert (r.status, r.position, r.gap) == ("mismatch", 2, float("inf"))


def _padded_rows_win(params, limit):
  """Tied embeddings whose rows at and past ``limit`` (beyond the tokenizer) have the
  largest logits everywhere: every token's embedding has a large component k, the
  final norm keeps only k, so h = c * e_k (c > 0) and logit_j = c * E[j, k]."""
  import jax.numpy as jnp
  v = params["embed"].shape[0]
  k = 3
  col = 100.0 + 0.01 * jnp.arange(v, dtype=jnp.float32)[::-1]  # distinct: no ties
  col = col.at[limit:].set(110.0)
  return dict(params, embed=params["embed"].at[:, k].set(col),
              final_norm=jnp.zeros_like(params["final_norm"]).at[k].set(1.0))


def test_export_check_never_draws_beyond_the_tokenizer(tmp_path):
  """Before: transformers' generate drew ids beyond the tokenizer (151,792 of Qwen3's
  151,669), which our samplers never draw, and the check failed a sound export."""
  import torch
  import transformers
  from fbos_jax.rl import export
  from fbos_jax.rl.trainer import RLTrainer
  c = small_config("configs/fbos.py:tiny")
  tr = RLTrainer(c, str(tmp_path / "run"), mesh=one_device_mesh())
  limit = len(tr.ctx.tokenizer)
  params = _padded_rows_win(tr.init_state().params, limit)
  tr.close()
  _two_checkpoints(tmp_path / "run", params)
  out = str(tmp_path / "hf")
  export.export_run(c, str(tmp_path / "run"), out, step=1)
  model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
  free = model.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=3, do_sample=False)
  assert (free[0, 3:] >= limit).all()  # the model prefers ids beyond the tokenizer
  results = export.check_greedy(c, str(tmp_path / "run"), out, 2, step=1)
  assert [r.status for r in results] == ["equal", "equal"], results
  assert all(max(r.ours) < limit for r in results)
  assert "2/2 held-out prompts equal" in export.summarize_greedy(results)


# ---------------------------------------------------- 6. the summary's seconds after a resume


def test_summary_seconds_stay_consistent_after_a_resume(tmp_path, monkeypatch):
  """Before: after a resume total_seconds (this part only) was smaller than
  rl_seconds (both parts): 46 against 70. The first part is made 1000 s longer
  by the checkpoint's record, as a long run killed late would be."""
  import json
  from fbos_jax import checkpoint as ckpt_lib
  from fbos_jax.rl.run import run_training
  from fbos_jax.rl.trainer import RLTrainer
  over = {"train.steps": 3, "train.eval_every": 0, "train.eval_prompts": 0,
          "train.checkpoint_every": 1}

  def stop(step, *_):
    if step == 2:
      raise KeyboardInterrupt  # killed after step 2's checkpoint
  orig = RLTrainer.train
  monkeypatch.setattr(RLTrainer, "train", lambda self, *a, **k: orig(self, *a, on_step=stop, **k))
  with pytest.raises(KeyboardInterrupt):
    run_training(small_config("configs/grpo.py:tiny", **over), str(tmp_path), plot=False)
  monkeypatch.setattr(RLTrainer, "train", orig)
  restore = ckpt_lib.Checkpointer.restore

  def longer(self, *a, **k):
    state, data, meta = restore(self, *a, **k)
    return state, data, dict(meta, rl_seconds=meta["rl_seconds"] + 1000.0,
                             total_seconds=meta["total_seconds"] + 1000.0)
  monkeypatch.setattr(ckpt_lib.Checkpointer, "restore", longer)
  _, summary = run_training(small_config("configs/grpo.py:tiny", **over), str(tmp_path),
                            plot=False)
  saved = json.load(open(tmp_path / "summary.json"))
  assert summary["resumed"] and saved["rl_seconds"] > 1000.0
  assert saved["total_seconds"] >= saved["rl_seconds"], saved


# ------------------------------------------------------------------ 7. a real full disk


def _small_tmpfs_command(mountpoint, size, argv):
  """``argv`` run with a fresh tmpfs of ``size`` at ``mountpoint`` (a private mount
  namespace: nothing to clean up), or None when this machine cannot make one."""
  import shutil
  unshare = shutil.which("unshare")
  if unshare is None:
    return None
  wrap = [unshare, "--user", "--map-root-user", "--mount", "sh", "-c",
          'mount -t tmpfs -o size="$1" tmpfs "$2" && shift 2 && exec "$@"', "sh", size,
          str(mountpoint)]
  probe = subprocess.run(wrap + ["true"], capture_output=True, text=True)
  return wrap + list(argv) if probe.returncode == 0 else None


def _run_or_dump_stacks(cmd, timeout):
  """``cmd`` run to its end; past ``timeout`` it gets SIGABRT and the test fails with
  every thread's stack (faulthandler) instead of a bare timeout."""
  import signal
  proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True, env=dict(ENV, PYTHONFAULTHANDLER="1"))
  try:
    stdout, stderr = proc.communicate(timeout=timeout)
  except subprocess.TimeoutExpired:
    proc.send_signal(signal.SIGABRT)
    stdout, stderr = proc.communicate(timeout=60)
    pytest.fail(f"the run hung for {timeout} s; its threads:\n" + stderr[-6000:])
  return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)


@pytest.mark.slow  # default suite under 15 min (issue 35): .ci/run runs the slow set too
def test_a_real_full_disk_ends_the_run_with_the_cause_last(tmp_path):
  """Before: on a real full disk the CheckpointSaveError came on line 712 of 1,047,
  followed by ~335 lines of orbax's "Event loop is closed" and, last, an unrelated
  ImportError of the interpreter's shutdown. The run's workdir is a 1 MiB tmpfs:
  its first checkpoints fit, a later one does not."""
  mnt = tmp_path / "mnt"
  mnt.mkdir()
  flags = dict(_SMALL_FLAGS, **{"rl.prompts_per_step": 4, "rl.group_size": 4,
                                "sampling.max_new_tokens": 6, "train.steps": 6,
                                "train.checkpoint_every": 1, "train.warm_start": "",
                                "train.eval_every": 0, "train.progress": False})
  cmd = _small_tmpfs_command(mnt, "1m", [
      sys.executable, os.path.join(ROOT, "launch", "train.py"), "--config=configs/grpo.py:tiny",
      f"--workdir={mnt}/run", *[f"--config.{k}={v}" for k, v in flags.items()]])
  if cmd is None:
    pytest.skip("cannot mount a small tmpfs here (no unshare, or user and mount namespaces "
                "are not allowed)")
  out = _run_or_dump_stacks(cmd, timeout=600)
  lines = out.stderr.strip().splitlines()
  assert out.returncode != 0 and lines, out.stdout[-2000:]
  last = lines[-1]
  assert last.startswith("fbos_jax.checkpoint.CheckpointSaveError: checkpoint save of step "), \
      "\n".join(lines[-30:])
  assert "the last complete checkpoint is step" in last
  assert "No space left on device" in last or "RESOURCE_EXHAUSTED" in last, last
  assert "Exception ignored" not in out.stderr  # nothing of the shutdown after it
  assert "Event loop is closed" not in out.stderr  # orbax's orphaned writes, quiet
  assert "--- Logging error ---" not in out.stderr  # log.txt on the full disk: one line
  assert out.stderr.count("can no longer be written") <= 1
