"""Reliability probes of the verifiers and the verifier pool (issue 14).

Module-level verifiers here are picklable for the process backend; this module
imports nothing heavy at the top (grain, ml_collections inside the tests) so
that a spawned worker, which imports it, starts quickly."""

import logging
import math
import pickle
import threading

import pytest

from fbos_jax import tasks
from fbos_jax.verifiers import base
from fbos_jax.verifiers import get_verifier
from fbos_jax.verifiers import Verdict
from fbos_jax.verifiers import VerifierPool

ARITH = {"task": "arithmetic", "prompt": "12+45=", "answer": "57"}


# ------------------------------------------- item 2: a missing gold answer


@pytest.mark.parametrize("example", [{"answer": None}, {}, {"answer": "  "}])
@pytest.mark.parametrize("response", [r"\boxed{None}", r"\boxed{}", "None", r"\boxed{0}"])
def test_math_never_rewards_against_a_missing_gold(example, response):
  v = get_verifier("math")(example, response)
  assert v.reward == 0.0
  assert v.is_error and "reference answer" in v.error
  assert v.feedback == ""


# --------------------------------------------- item 5: rewards range-checked


def reward_from_response(example, response):
  return Verdict(float(response), "ok")


def test_pool_turns_out_of_range_and_non_finite_rewards_into_errors():
  responses = ["0.5", "1e39", "1e9", "nan", "inf", "-11", "10", "-10"]
  pool = VerifierPool(reward_from_response, num_workers=2, timeout_s=5)
  verdicts, stats = pool.run([ARITH] * len(responses), responses)
  bad = [r for r, v in zip(responses, verdicts) if v.is_error]
  assert bad == ["1e39", "1e9", "nan", "inf", "-11"]
  assert all(v.reward == 0.0 for v in verdicts if v.is_error)
  assert [v.reward for v in verdicts if not v.is_error] == [0.5, 10.0, -10.0]
  assert "outside verifier reward_range [-10, 10]" in verdicts[2].error
  assert stats["verifier/bad_reward"] == 5 and stats["verifier/errors"] == 5
  # A tighter range is a pool parameter.
  tight = VerifierPool(reward_from_response, num_workers=1, reward_range=(0.0, 1.0))
  verdicts, _ = tight.run([ARITH] * 2, ["1.5", "1"])
  assert [v.is_error for v in verdicts] == [True, False]
  with pytest.raises(ValueError, match="reward_range"):
    VerifierPool(reward_from_response, reward_range=(1.0, 0.0))


# ------------------------------- weaker point: error rows are marked, no text


def raising_verifier(example, response):
  if response == "raise":
    raise ValueError("boom: secret internals")
  return Verdict(1.0, "correct")


def test_error_rows_are_flagged_and_their_text_is_not_feedback():
  pool = VerifierPool(raising_verifier, num_workers=2, timeout_s=5)
  verdicts, stats = pool.run([ARITH] * 3, ["ok", "raise", "ok"])
  assert [v.is_error for v in verdicts] == [False, True, False]
  assert verdicts[1].feedback == ""  # would become FAP feedback otherwise
  assert verdicts[1].error == "exception: ValueError: boom: secret internals"
  assert "boom" not in verdicts[1].feedback
  assert stats["verifier/errors"] == 1
  one = pool.verify_one(ARITH, "raise")  # e.g. for SFT demonstrations
  assert one.is_error and one.feedback == "" and pool.totals["exception"] == 2


# ---------------- weaker point: hung threads are bounded; backend selectable

RELEASE = threading.Event()


def hanging_verifier(example, response):
  if response == "hang":
    RELEASE.wait(30)
  return Verdict(1.0, "correct")


def test_abandoned_threads_are_capped_then_the_pool_switches_to_processes(caplog):
  RELEASE.clear()
  pool = VerifierPool(hanging_verifier, num_workers=4, timeout_s=0.3,
                      max_abandoned_threads=2)
  try:
    with caplog.at_level(logging.WARNING):
      verdicts, stats = pool.run([ARITH] * 4, ["hang", "hang", "hang", "ok"])
    assert [v.is_error for v in verdicts] == [True, True, True, False]
    assert pool.backend == "process"  # 3 abandoned > cap 2: switched
    assert any("max_abandoned_threads" in r.getMessage() for r in caplog.records)
    # The process backend kills hung calls instead of abandoning threads.
    verdicts, stats = pool.run([ARITH] * 2, ["hang", "ok"])
    assert [v.is_error for v in verdicts] == [True, False]
    assert stats["verifier/abandoned_threads"] == 3  # no new ones
  finally:
    RELEASE.set()
    pool.close()


def test_abandoned_thread_cap_fails_loudly_for_unpicklable_verifiers():
  RELEASE.clear()
  pool = VerifierPool(lambda e, r: hanging_verifier(e, r), num_workers=2,
                      timeout_s=0.2, max_abandoned_threads=1)
  try:
    with pytest.raises(RuntimeError, match="verifier.backend='process'"):
      pool.run([ARITH] * 2, ["hang", "hang"])
  finally:
    RELEASE.set()


def test_make_verifier_pool_maps_the_config_and_runs_processes():
  import ml_collections  # pylint: disable=g-import-not-at-top
  from fbos_jax import data  # pylint: disable=g-import-not-at-top
  dc = data.default_data_config()
  vc = ml_collections.ConfigDict(dict(workers=2, timeout_s=5.0, backend="process",
                                      reward_range=(0.0, 1.0),
                                      max_abandoned_threads=8))
  exs = [tasks.make_example("arithmetic", i) for i in range(4)]
  resps = [tasks.solve(e) if i % 2 else "x" for i, e in enumerate(exs)]
  with base.make_verifier_pool(dc, vc) as pool:
    assert (pool.backend, pool.num_workers, pool.reward_range) == ("process", 2, (0.0, 1.0))
    verdicts, stats = pool.run(exs, resps)
  assert [v.reward for v in verdicts] == [0.0, 1.0, 0.0, 1.0]
  assert stats["verifier/errors"] == 0


def test_dispatch_verifier_pickles_after_use():
  from fbos_jax import data  # pylint: disable=g-import-not-at-top
  verify = base.make_verifier(data.default_data_config())
  arith = dict(ARITH, verifier="procedural")
  assert verify(arith, "57").reward == 1.0  # fills the cache
  code_ex = {"verifier": "code", "tests": [{"input": "", "output": "1"}]}
  assert verify(code_ex, "").feedback == "no code found in the response"  # holds a Sandbox
  again = pickle.loads(pickle.dumps(verify))
  assert again(arith, "58").reward == 0.0
  assert math.isclose(again(arith, "57").reward, 1.0)
