"""End-to-end trainer: every config runs 2 steps; resume is exact."""

import os

import jax
import numpy as np
import pytest

import configs
from fbos_jax import metrics as metrics_lib
from fbos_jax.rl import update as update_lib
from fbos_jax.rl.trainer import RLTrainer
from fbos_jax.testing.small import assert_resume_matches_straight


SPECS = ["configs/grpo.py:tiny", "configs/grpo.py:tiny,drgrpo", "configs/gfpo.py:tiny",
         "configs/gfpo.py:tiny,adaptive", "configs/golf.py:tiny", "configs/fbos.py:tiny",
         "configs/fcp.py:tiny"]


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.slow  # default suite under 15 min (issue 35): .ci/run runs the slow set too
def test_every_config_runs_two_steps(spec, tmp_path, small, one_device_mesh):
  c = small(spec)
  tr = RLTrainer(c, str(tmp_path), mesh=one_device_mesh)
  state, hist = tr.train()
  tr.close()
  assert int(state.step) == 2
  rows = metrics_lib.read_jsonl(os.path.join(tmp_path, "metrics.jsonl"))
  assert [r["step"] for r in rows] == [1, 2]
  for key in ("reward/round1", "policy/entropy", "policy/grad_norm", "response/length",
              "time/update_s", "tokens/per_s"):
    assert key in rows[-1], key
  if c.rl.round2:
    assert "reward/round2" in rows[-1] and "epa/injected" in rows[-1]
  assert tr.ckpt.latest_step() == 2


def test_default_task_runs(tmp_path, small, one_device_mesh):
  """Two FBOS steps on the tiny variant's own task and answer budget, with a
  held-out eval of distinct problems reported per difficulty."""
  c = small("configs/fbos.py:tiny", **{"train.eval_every": 2, "train.eval_prompts": 16})
  d = configs.load("configs/fbos.py:tiny")
  c.data, c.sampling.max_new_tokens = d.data, d.sampling.max_new_tokens
  tr = RLTrainer(c, str(tmp_path), mesh=one_device_mesh)
  evals = tr.eval_examples
  assert len({ex["prompt"] for ex in evals}) == len(evals) == 16
  assert all(ex["task"] == d.data.task for ex in evals)
  state, hist = tr.train()
  tr.close()
  assert int(state.step) == 2
  levels = {k for k in hist[-1] if k.startswith("eval/accuracy_d")}
  assert levels == {f"eval/accuracy_d{ex['difficulty']}" for ex in evals}


def test_decoupled_run(tmp_path, small, one_device_mesh):
  c = small("configs/grpo.py:tiny,decoupled")
  tr = RLTrainer(c, str(tmp_path), mesh=one_device_mesh)
  state, _ = tr.train()
  tr.close()
  assert int(state.step) == 2


def _params_np(state):
  return [np.asarray(x) for x in jax.tree.leaves(jax.device_get(state.params))]


def test_resume_is_exact(tmp_path, small, one_device_mesh):
  spec = "configs/fbos.py:tiny"
  a = tmp_path / "straight"
  tr = RLTrainer(small(spec, **{"train.steps": 4}), str(a), mesh=one_device_mesh)
  s_straight, _ = tr.train()
  tr.close()

  b = tmp_path / "resumed"
  tr = RLTrainer(small(spec, **{"train.steps": 4}), str(b), mesh=one_device_mesh)
  state = tr.init_state()
  state, _ = tr.train(state, steps=2)
  tr.close()
  tr = RLTrainer(small(spec, **{"train.steps": 4}), str(b), mesh=one_device_mesh)  # a fresh process would do this
  s_resumed, _ = tr.train()
  tr.close()
  for x, y in zip(_params_np(s_straight), _params_np(s_resumed)):
    np.testing.assert_array_equal(x, y)
  ra = metrics_lib.read_jsonl(os.path.join(a, "metrics.jsonl"))
  rb = metrics_lib.read_jsonl(os.path.join(b, "metrics.jsonl"))
  drop = lambda r: {k: v for k, v in r.items()
                    if not k.startswith(("time/", "tokens/per_s", "async/"))}
  assert [drop(r) for r in ra] == [drop(r) for r in rb]


def test_update_compiles_once(tmp_path, small, one_device_mesh):
  """Step 2 must reuse step 1's update program: the update's output state has the
  same shardings as the state it was given (out_shardings), so nothing recompiles."""
  c = small("configs/grpo.py:tiny", **{"train.steps": 3, "train.checkpoint_every": 0})
  tr = RLTrainer(c, str(tmp_path), mesh=one_device_mesh)
  state = tr.init_state()
  shardings = jax.tree.map(lambda a: a.sharding, state)
  state, _ = tr.train(state)
  tr.close()
  assert int(state.step) == 3
  assert update_lib.compiled_update(tr.parts, tr.mesh, tr.rules)._cache_size() == 1
  assert jax.tree.map(lambda a: a.sharding, state) == shardings


def _resume_matches_straight(tmp_path, small, mesh, spec, **over):
  """4 steps straight vs 2 steps + a fresh trainer resuming for 2 more: identical
  params, GFPO history and identical metrics."""
  over = {"train.steps": 4, "data.verifier": "fbos_jax.testing.small:length_reward", **over}
  s_straight, s_resumed = assert_resume_matches_straight(
      lambda wd: RLTrainer(small(spec, **over), wd, mesh=mesh), str(tmp_path))
  assert int(s_resumed.step) == int(s_straight.step) == 4
  return s_straight


def test_resume_is_exact_with_adaptive_gfpo(tmp_path, small, one_device_mesh):
  """GFPO's adaptive difficulty history is part of the state."""
  s = _resume_matches_straight(tmp_path, small, one_device_mesh,
                               "configs/gfpo.py:tiny,adaptive")
  assert int(s.gfpo.count) == 4 * 4  # 4 steps x 4 prompts pushed into the history


def test_packed_run_trains_on_real_tokens(tmp_path, small, one_device_mesh):
  """rl.micro_batch_tokens: the SFT warm start and an FBOS step train on packed
  batches, whose positions are mostly real tokens where the padded ones are not."""
  from fbos_jax.rl import sft as sft_lib
  c = small("configs/fbos.py:tiny", **{"train.steps": 1})
  padded = RLTrainer(c, str(tmp_path / "padded"), mesh=one_device_mesh)
  _, hist_pad = padded.train()
  padded.close()
  longest = max(c.sampling.fap_prompt_buckets) + c.sampling.max_new_tokens
  # the tiny config's rl.fixed_row_buckets: each batch at its most micro-batches, the
  # empty ones skipped (tests/test_compile_set.py runs the bucketed layout)
  c = small("configs/fbos.py:tiny", **{"train.steps": 1, "rl.micro_batch_tokens": longest,
                                       "sft.batch_size": 8,
                                       "sft.fap_fraction": 0.25, "sft.corrections": "corrupt"})
  tr = RLTrainer(c, str(tmp_path / "packed"), mesh=one_device_mesh)
  state = tr.init_state()
  params, sft_hist = sft_lib.train_sft(c, tr.ctx, state.params, state.rng, steps=1,
                                       progress=False)
  assert np.isfinite(sft_hist[-1]["nll"]) and sft_hist[-1]["corrections"] > 0
  assert 0 < sft_hist[-1]["real_token_frac"] <= 1
  state, hist = tr.train(tr.init_state(params))
  tr.close()
  assert int(state.step) == 1
  assert hist[-1]["update/real_token_frac"] > 1.5 * hist_pad[-1]["update/real_token_frac"]
