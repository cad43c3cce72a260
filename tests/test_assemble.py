"""Host-side assembly of the FBOS-RL knobs on hand-built rewards."""

import numpy as np
import pytest

from fbos_jax.rl import assemble as A


def test_fap_sources_and_round_robin_plan():
  r1 = np.asarray([[1, 0, 1, 0], [1, 1, 1, 1], [0, 0, 0, 0]], np.float32)
  sel = A.select_fap_sources(r1, "failed", 1.0)
  np.testing.assert_array_equal(sel, r1 < 1)
  prompts, sources = A.round2_plan(sel, 3, "single")
  # prompt 1 had no failures: no round 2 for it
  np.testing.assert_array_equal(prompts, [0, 0, 0, 2, 2, 2])
  np.testing.assert_array_equal(sources, [1, 3, 1, 0, 1, 2])  # round-robin over the failed ones
  prompts, sources = A.round2_plan(sel, 2, "aggregated")
  np.testing.assert_array_equal(prompts, [0, 0, 2, 2])
  assert (sources == -1).all()
  assert A.select_fap_sources(r1, "all", 1.0).all()
  with pytest.raises(ValueError, match="rl.fap_from"):
    A.select_fap_sources(r1, "bad", 1.0)


def _groups(**kw):
  r1 = np.asarray([[0, 0, 0, 0], [1, 0, 1, 1]], np.float32)
  r2 = np.asarray([1, 0, 1, 1, 0, 1], np.float32)
  r2_prompt = np.asarray([0, 0, 0, 1, 1, 1])
  r2_source = np.asarray([0, 1, 2, 1, 1, 1])
  args = dict(select="correct", mode="append", trigger="always", tau=0.25, max_per_prompt=4,
              threshold=1.0, enabled=True, rng=np.random.default_rng(0))
  args.update(kw)
  return r1, A.epa_groups(r1, r2, r2_prompt, r2_source, **args)


def test_epa_append_correct():
  r1, g = _groups()
  assert g.member.shape == (2, 8)
  np.testing.assert_array_equal(g.member[0, 4:6], [0, 2])  # the correct round-2 rows of prompt 0
  np.testing.assert_array_equal(g.member[1, 4:6], [3, 5])
  assert g.offpolicy[:, 4:6].all() and not g.offpolicy[:, :4].any()
  assert g.valid.sum() == 8 + 4 and g.injected == 4
  np.testing.assert_array_equal(g.rewards[0, :6], [0, 0, 0, 0, 1, 1])


def test_epa_adaptive_trigger_and_replace():
  # adaptive: only prompt 0 (mean 0 < 0.25) gets samples
  _, g = _groups(trigger="adaptive")
  assert g.injected == 2 and not g.valid[1, 4:].any()
  # replace (GOLF): one failed round-1 slot of prompt 0 is swapped for a correct refinement
  _, g = _groups(mode="replace", max_per_prompt=1, trigger="adaptive")
  assert g.member.shape == (2, 4) and g.injected == 1
  assert g.offpolicy[0].sum() == 1 and g.rewards[0].sum() == 1
  assert not g.offpolicy[1].any()


def test_epa_improved_and_disabled():
  _, g = _groups(select="improved")
  # prompt 1's source (index 1) had reward 0, so r2=1 rows 3 and 5 improved on it
  np.testing.assert_array_equal(g.member[1, 4:6], [3, 5])
  _, g = _groups(enabled=False)
  assert g.member.shape == (2, 4) and g.injected == 0


def test_ecc_advantages_group_and_improvement():
  r1 = np.asarray([[0, 0], [1, 0]], np.float32)
  r2 = np.asarray([1, 0, 1, 1], np.float32)
  prompts = np.asarray([0, 0, 1, 1])
  sources = np.asarray([0, 1, 1, 1])
  a = A.ecc_advantages(r1, r2, prompts, sources, mode="group", estimator="grpo", eps=1e-6)
  np.testing.assert_allclose(a, [0.70710, -0.70710, 0, 0], atol=1e-4)
  a = A.ecc_advantages(r1, r2, prompts, sources, mode="improvement", estimator="drgrpo", eps=1e-6)
  # improvements: [1, 0] for prompt 0 -> centred [0.5, -0.5]; [1, 1] for prompt 1 -> 0
  np.testing.assert_allclose(a, [0.5, -0.5, 0, 0], atol=1e-6)


def test_pass_at_k_unbiased():
  assert A.pass_at_k(10, 0, 1) == 0.0
  assert A.pass_at_k(10, 10, 5) == 1.0
  assert abs(A.pass_at_k(10, 3, 1) - 0.3) < 1e-12
  # 1 - C(7,2)/C(10,2) = 1 - 21/45
  assert abs(A.pass_at_k(10, 3, 2) - (1 - 21 / 45)) < 1e-12


def test_all_zero_group_fraction():
  r1 = np.asarray([[0, 0], [1, 0], [1, 1]], np.float32)
  assert abs(A.all_zero_group_fraction(r1) - 2 / 3) < 1e-9
