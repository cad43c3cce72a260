"""Reliability probes of the training loop (issue 14): SFT through the verifier pool,
one step counter, config validation, error verdicts, resume config checks,
over-long prompts and the quiet console."""

import os
import random
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from configs import load
from fbos_jax import checkpoint as ckpt_lib
from fbos_jax import metrics as metrics_lib
from fbos_jax.rl import config as config_lib
from fbos_jax.rl import sft
from fbos_jax.rl.trainer import RLTrainer
from fbos_jax.testing.small import one_device_mesh, small_config as small
from fbos_jax.verifiers.base import Verdict

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


VERIFIERS = "fbos_jax.testing.verifiers"


# ---------------------------------------------------------------- item 4: SFT verifies in the pool


@pytest.mark.parametrize("name", ["raising_verifier", "hanging_verifier", "nan_verifier"])
def test_sft_demonstrations_go_through_the_pool(name, tmp_path):
  """A verifier that raises, hangs or returns NaN cannot crash or freeze the warm
  start: every check is an error verdict of the pool, and no unverified
  demonstration is trained on."""
  c = small("configs/fbos.py:tiny", **{"verifier.timeout_s": 0.5, "sft.batch_size": 8})
  c.data.verifier = f"{VERIFIERS}:{name}"
  tr = RLTrainer(c, str(tmp_path), mesh=one_device_mesh())
  examples = next(tr.train_iter)
  t0 = time.monotonic()
  (pp, pr), (cp, cr) = sft.demonstration_rows(tr.ctx, examples, conditional=False,
                                              rng=random.Random(0), num_corrections=2)
  assert time.monotonic() - t0 < 30
  assert pp == [] and cp == []  # nothing verified, nothing kept
  with pytest.raises(ValueError, match="none of the .* demonstrations passed the verifier"):
    state = tr.init_state()
    sft.train_sft(c, tr.ctx, state.params, state.rng, steps=1, progress=False)
  tr.close()


def test_sft_keeps_demonstrations_whose_check_succeeded(tmp_path):
  c = small("configs/fbos.py:tiny", **{"sft.batch_size": 12})
  c.data.verifier = f"{VERIFIERS}:flaky_verifier"
  tr = RLTrainer(c, str(tmp_path), mesh=one_device_mesh())
  examples = next(tr.train_iter) + next(tr.train_iter) + next(tr.train_iter)
  (pp, pr), _ = sft.demonstration_rows(tr.ctx, examples, conditional=False,
                                       rng=random.Random(0))
  assert 0 < len(pp) < len(examples)  # the failed checks dropped their demos, the rest stay
  tr.close()


# ---------------------------------------------------------------- item 6: one step counter


def test_skipped_steps_are_steps(tmp_path, monkeypatch):
  """Every step skipped (non-finite): the loop, the checkpoints and the metrics
  still count 1, 2, 3, 4, and the run ends cleanly (no StepAlreadyExistsError)."""
  import jax.numpy as jnp
  from fbos_jax.rl import objectives
  # a NaN term weight makes every loss non-finite
  monkeypatch.setattr(objectives, "term_weights",
                      lambda ucfg, step: jnp.full((len(ucfg.terms),), jnp.nan))
  c = small("configs/grpo.py:tiny", **{"train.steps": 4, "train.checkpoint_every": 2})
  tr = RLTrainer(c, str(tmp_path), mesh=one_device_mesh())
  init = jax.tree.map(np.asarray, jax.device_get(tr.init_state().params))
  state, hist = tr.train()
  tr.close()
  assert int(state.step) == 4 and int(state.nonfinite_steps) == 4
  assert [h["step"] for h in hist] == [1, 2, 3, 4]
  assert all("skipped_batch_ids" in h for h in hist)
  assert sorted(tr.ckpt.manager.all_steps()) == [2, 4]
  for a, b in zip(jax.tree.leaves(init), jax.tree.leaves(jax.device_get(state.params))):
    np.testing.assert_array_equal(a, np.asarray(b))  # nothing applied
  rows = metrics_lib.read_jsonl(os.path.join(tmp_path, "metrics.jsonl"))
  assert [r["step"] for r in rows] == [1, 2, 3, 4]


# ---------------------------------------------------------------- item 8: meaningless configs


@pytest.mark.parametrize("field,value,message", [
    ("optim.learning_rate", -1e-4, "optim.learning_rate=-0.0001"),
    ("sampling.temperature", 0.0, "sampling.temperature=0.0"),
    ("sampling.max_new_tokens", 0, "sampling.max_new_tokens=0"),
    ("rl.fap_mode", "bogus", "rl.fap_mode='bogus'"),
    ("rl.dual_clip", 0.5, "rl.dual_clip=0.5"),
    ("verifier.backend", "fork", "verifier.backend='fork'"),
    ("verifier.reward_range", (1.0, 0.0), "verifier.reward_range"),
    ("rl.max_staleness", -1, "rl.max_staleness=-1"),
])
def test_meaningless_config_is_refused_naming_the_field(field, value, message):
  c = load("configs/fbos.py:tiny")
  node = c
  *path, last = field.split(".")
  for p in path:
    node = node[p]
  node[last] = value
  with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
    config_lib.validate(c)


def test_bad_config_fails_before_the_warm_start(tmp_path):
  """The CLI refuses fap_mode=bogus at once: no SFT is run first, and the
  message names the field (no deep traceback)."""
  out = subprocess.run(
      [sys.executable, "launch/train.py", "--config=configs/fbos.py:tiny",
       f"--workdir={tmp_path}", "--config.rl.fap_mode=bogus"],
      cwd=ROOT, capture_output=True, text=True, timeout=600,
      env=dict(os.environ, JAX_PLATFORMS="cpu"))
  assert out.returncode != 0
  assert "rl.fap_mode='bogus'" in out.stderr
  assert not os.path.exists(tmp_path / "sft")
  unknown = subprocess.run(
      [sys.executable, "launch/train.py", "--config=configs/fbos.py:tiny",
       f"--workdir={tmp_path}", "--config.rl.no_such_field=1"],
      cwd=ROOT, capture_output=True, text=True, timeout=600,
      env=dict(os.environ, JAX_PLATFORMS="cpu"))
  assert unknown.returncode != 0 and "no_such_field" in unknown.stderr
  assert "Traceback" not in unknown.stderr


# ---------------------------------------------------------------- error verdicts leave the groups


def test_error_verdicts_leave_groups_and_never_become_feedback(tmp_path):
  from fbos_jax.rl import rollout as R
  from fbos_jax.rl import rounds
  c = small("configs/fbos.py:tiny")
  c.data.verifier = f"{VERIFIERS}:every_other_error"
  tr = RLTrainer(c, str(tmp_path), mesh=one_device_mesh())
  state = tr.init_state()
  examples = next(tr.train_iter)
  r1 = rounds.round1(tr.ctx, state.params, examples, jax.random.key(0))
  stats = rounds.verify(tr.ctx, r1, examples)
  assert r1.is_error.any() and stats["verifier/errors"] == r1.is_error.sum()
  for p, i in zip(*np.nonzero(r1.is_error)):
    assert r1.feedback[p][i] == ""  # the error text is not feedback
  r2 = rounds.round2(tr.ctx, state.params, examples, r1, jax.random.key(1))
  # no FAP was built from an error row
  assert not r1.is_error[np.arange(len(examples))[:, None].repeat(r2.shape[1], 1)[r2.valid],
                         r2.source[r2.valid]].any()
  rounds.verify(tr.ctx, r2, examples)
  rows, _ = R.epa_rows(tr.ctx, examples, r1, r2)
  on_policy = int((~rows.offpolicy).sum())
  assert on_policy == int(r1.ok.sum())  # error rows are not in the EPA batch
  m = R.rollout_step(tr.ctx, state.params, examples, jax.random.key(2)).metrics
  assert m["verifier/errors"] == m["verifier/errors_round1"] + m["verifier/errors_round2"] > 0
  tr.close()


# ---------------------------------------------------------------- resume with a changed config


def test_resume_with_changed_group_size_is_refused(tmp_path):
  c = small("configs/grpo.py:tiny", **{"train.steps": 2})
  tr = RLTrainer(c, str(tmp_path), mesh=one_device_mesh())
  tr.train()
  tr.close()
  c = small("configs/grpo.py:tiny", **{"train.steps": 4, "rl.group_size": 6})
  tr = RLTrainer(c, str(tmp_path), mesh=one_device_mesh())
  with pytest.raises(ckpt_lib.CheckpointMismatchError, match="rl.group_size"):
    tr.train()
  tr.close()
  tr = RLTrainer(c, str(tmp_path), mesh=one_device_mesh(), allow_config_change=True)
  state, _ = tr.train()
  tr.close()
  assert int(state.step) == 4


# ---------------------------------------------------------------- over-long prompts name the record


def test_over_long_prompt_names_the_record(tmp_path):
  from fbos_jax import buckets
  from fbos_jax.rl import rounds
  c = small("configs/grpo.py:tiny")
  tr = RLTrainer(c, str(tmp_path), mesh=one_device_mesh())
  examples = next(tr.train_iter)
  # longer than the largest prompt bucket (32), within the template budget (656);
  # then longer than the template budget too: each names its own limiting field
  for chars, field in ((200, "sampling.prompt_buckets"), (1000, "templates.max_prompt_tokens")):
    examples[1] = dict(examples[1], prompt="9" * chars, id="long-one")
    with pytest.raises(buckets.BucketError, match=rf"(?s)id 'long-one'.*{field}"
                       r".*data.max_prompt_tokens"):
      rounds.round1(tr.ctx, tr.init_state().params, examples, jax.random.key(0))
  tr.close()


# ---------------------------------------------------------------- a quiet console


@pytest.mark.slow  # default suite under 15 min (issue 35): .ci/run runs the slow set too
def test_console_is_quiet_and_log_txt_is_complete(tmp_path):
  """Two GRPO steps from the CLI: no absl/orbax INFO lines on the console, the
  full log in WORKDIR/log.txt."""
  out = subprocess.run(
      [sys.executable, "launch/train.py", "--config=configs/grpo.py:tiny", f"--workdir={tmp_path}",
       "--config.train.steps=2", "--config.train.warm_start=", "--config.train.eval_every=0",
       "--config.train.checkpoint_every=2", "--config.model.num_layers=1", "--noplot",
       "--config.train.progress=False"],
      cwd=ROOT, capture_output=True, text=True, timeout=900,
      env=dict(os.environ, JAX_PLATFORMS="cpu"))
  assert out.returncode == 0, out.stderr[-3000:]
  console = out.stdout + out.stderr
  assert not [l for l in console.splitlines() if l.startswith("I1") or " INFO " in l], console[:2000]
  log = open(os.path.join(tmp_path, "log.txt")).read()
  assert "step 2:" in log and "orbax" in log.lower()
