"""Issue 24: the feedback-reading probe. Its controls (feedback swapped, feedback
removed, attempt removed, a fresh sample from q) are built from the SAME failed
round-1 rollouts as the real FAPs, and its log-probabilities are teacher-forced
log p(gold | context)."""

import jax
import numpy as np
import pytest

from fbos_jax import sampling
from fbos_jax.rl import probe
from fbos_jax.rl import rounds
from fbos_jax.rl.trainer import RLTrainer
from fbos_jax.testing.small import one_device_mesh, small_config as small


@pytest.fixture(scope="module")
def trainer(tmp_path_factory):
  # two-step chains ("3+9 *5 =" -> "12,60"): their feedback differs from problem to
  # problem even for a random model, whose rollouts all fail
  c = small("configs/fbos.py:tiny_chain", **{
      "rl.prompts_per_step": 8, "rl.group_size": 4, "sampling.max_new_tokens": 6,
      "data.task": "chain", "data.difficulty": 2, "data.max_difficulty": 2})
  tr = RLTrainer(c, str(tmp_path_factory.mktemp("probe")), mesh=one_device_mesh())
  yield tr
  tr.close()


def test_the_controls_are_computed_on_the_same_rollouts(trainer, monkeypatch):
  tr = trainer
  ctx = tr.ctx
  fap = lambda ex, text, fb: ctx.prompts.fap(ex["prompt"], text, fb).token_ids
  params = tr.init_state().params  # a random model: almost every rollout fails
  examples = next(tr.train_iter)
  calls = []
  real_round1 = rounds.round1
  monkeypatch.setattr(rounds, "round1",
                      lambda *a, **k: calls.append(1) or real_round1(*a, **k))
  r1, pr = probe.probe_rows(ctx, params, examples, jax.random.key(3))
  assert calls == [1]  # one round 1: every kind is built on its rollouts
  failed = r1.ok & (r1.rewards < ctx.threshold)
  assert sorted(map(tuple, pr.rows)) == sorted(map(tuple, np.argwhere(failed)))
  assert len(pr.rows) >= 16
  for kind in probe.KINDS:
    assert len(pr.contexts[kind]) == len(pr.rows) == len(pr.solved[kind])
  swapped = 0
  for j, (p, i) in enumerate(pr.rows):
    ex, text, fb = examples[p], r1.texts[p][i], r1.feedback[p][i]
    assert fb and r1.rewards[p, i] < ctx.threshold
    assert pr.contexts["fap"][j] == fap(ex, text, fb)
    assert pr.contexts["no_feedback"][j] == fap(ex, text, "")
    assert pr.contexts["no_attempt"][j] == fap(ex, "", fb)
    assert pr.contexts["q"][j] == ctx.prompt_ids(ex)
    pp, pi = pr.rows[pr.partner[j]]
    assert pp != p  # another prompt's rollout's feedback, on this rollout's attempt
    assert pr.contexts["swapped"][j] == fap(ex, text, r1.feedback[pp][pi])
    swapped += r1.feedback[pp][pi] != fb
    allfail = not ((r1.rewards[p] >= ctx.threshold) & r1.ok[p]).any()
    assert pr.allfail[j] == allfail
  assert swapped > 0
  for kind in probe.KINDS:
    assert pr.valid[kind].all() and np.isfinite(pr.logp_gold[kind]).all()
    assert (pr.logp_gold[kind] < 0).all()
  # log p(gold | q) is the teacher-forced log-probability of the gold response
  j = 0
  p = pr.rows[j][0]
  gold = probe.gold_ids(ctx, examples[p])
  q = pr.contexts["q"][j]
  lp = sampling.teacher_forced_logprobs(params, tr.parts.model, np.asarray([q]),
                                        np.ones((1, len(q)), np.int32), np.asarray([gold]),
                                        np.ones((1, len(gold)), np.int32),
                                        vocab_limit=tr.parts.update.loss.vocab_limit)
  assert float(np.sum(lp)) == pytest.approx(float(pr.logp_gold["q"][j]), abs=1e-3)


def test_the_probe_pools_sums_over_batches(trainer):
  tr = trainer
  b1 = next(tr.train_iter)
  b2 = next(tr.train_iter)
  params = tr.init_state().params
  s1 = probe.probe_batch(tr.ctx, params, b1, jax.random.key(1))
  s2 = probe.probe_batch(tr.ctx, params, b2, jax.random.key(2))
  out = probe.summarize(probe.pool([s1, s2]))
  n = s1["n_failed"] + s2["n_failed"]
  assert out["failed_rows"] == n and out["batches"] == 2
  want = (s1["sum_solve_fap"] + s2["sum_solve_fap"]) / n
  assert out["solve_fap"] == pytest.approx(want)
  assert out["logp_gold_fap"] == pytest.approx(
      (s1["sum_logp_fap"] + s2["sum_logp_fap"]) / n)
  assert out["all_fail_groups"] == pytest.approx(
      (s1["n_allfail_groups"] + s2["n_allfail_groups"]) / 16)
  md = probe.markdown({"x": out})
  assert "fix/resample all-fail" in md and "| x, all-fail groups |" in md


def test_summarize_divides_by_the_rows_of_each_kind():
  sums = {"n_prompts": 4, "n_rollouts": 16, "n_solved_r1": 2, "n_allfail_groups": 3}
  for sub in probe.SUBSETS:
    sums.update({f"n_failed{sub}": 10, f"sum_resample_r1{sub}": 1.0, f"n_raises{sub}": 10,
                 f"sum_raises{sub}": 7})
    for kind in probe.KINDS:
      sums.update({f"n_{kind}{sub}": 10, f"sum_solve_{kind}{sub}": 2,
                   f"sum_logp_{kind}{sub}": -30.0})
  sums["sum_solve_fap"] = 4
  sums["sum_solve_q_allfail"] = 0
  out = probe.summarize(probe.pool([sums]))
  assert out["solve_fap"] == 0.4 and out["solve_q"] == 0.2 and out["fix_over_resample"] == 2.0
  assert out["fix_over_resample_allfail"] == float("inf")  # FAP fixes, resampling never does
  assert out["fap_raises_logp"] == 0.7 and out["logp_gold_q"] == -3.0
  assert out["round1_solved"] == 2 / 16 and out["all_fail_groups"] == 0.75
