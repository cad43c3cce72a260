"""Tests for the verifiers: procedural tasks, math, IFEval, registry, pool."""

import logging
import random
import re
import time

import pytest

from fbos_jax import tasks
from fbos_jax.verifiers import base
from fbos_jax.verifiers import get_verifier
from fbos_jax.verifiers import register_verifier
from fbos_jax.verifiers import Verdict
from fbos_jax.verifiers import VerifierPool

ARITH = {"task": "arithmetic", "prompt": "12+45=", "answer": "57"}
SORT = {"task": "sort", "prompt": "sort 5291=", "answer": "1259", "items": "5291"}
COUNTDOWN = {"task": "countdown", "prompt": "use 3 5 7 make 22=",
             "answer": "3*5+7", "numbers": [3, 5, 7], "target": 22}


# ------------------------------------------------------------- procedural


@pytest.mark.parametrize("response,feedback", [
    ("58", "digit 1 from the right is wrong"),
    ("47", "digit 2 from the right is wrong"),
    ("68", "digits 1 and 2 from the right are wrong"),
    ("157", "the answer has 3 digits, expected 2"),
    ("5", "the answer has 1 digit, expected 2; digit 1 from the right is wrong"),
    ("5x", "the answer is not a number"),
    ("  ", "the response is empty"),
])
def test_arithmetic_located_feedback(response, feedback):
  v = get_verifier("procedural")(ARITH, response)
  assert (v.reward, v.feedback) == (0.0, feedback)


@pytest.mark.parametrize("response,feedback", [
    ("1295", "item 4 breaks the ascending order"),
    ("9521", "items 2, 3 and 4 break the ascending order"),
    ("125", "the list is missing 1 item"),
    ("12579", "item 4 (7) is not in the input"),
    ("12259", "item 3 (2) appears more times than in the input"),
    ("19", "the list is missing 2 items"),
])
def test_sort_located_feedback(response, feedback):
  v = get_verifier("procedural")(SORT, response)
  assert (v.reward, v.feedback) == (0.0, feedback)


@pytest.mark.parametrize("response,feedback", [
    ("7*3+7", "the expression uses 7 twice; the expression does not use 5; "
              "the expression equals 28, not 22"),
    ("3*5+7+1", "the expression uses 1, which is not given; "
                "the expression equals 23, not 22"),
    ("3*5-7", "the expression equals 8, not 22"),
    ("3*(5+", "the expression is not valid"),
    ("15/5+7", "the expression may only use digits, + - * and parentheses, "
               "found '/'"),
])
def test_countdown_located_feedback(response, feedback):
  v = get_verifier("procedural")(COUNTDOWN, response)
  assert (v.reward, v.feedback) == (0.0, feedback)


@pytest.mark.parametrize("ex,response", [
    (ARITH, " 57\n"), (SORT, "1 2 5 9"), (SORT, "1,2,5,9"),
    (COUNTDOWN, "7+5*3"), (COUNTDOWN, "(5*3)+7"),
])
def test_procedural_correct(ex, response):
  assert get_verifier("procedural")(ex, response) == Verdict(
      1.0, "correct", get_verifier("procedural")(ex, response).info)
  assert get_verifier("procedural")(ex, response).reward == 1.0


def _wrong_responses(ex, rng):
  """Plausible wrong responses: digit flips, drops, additions, shuffles."""
  ans = ex["answer"]
  out = []
  for _ in range(6):
    chars = list(ans)
    k = rng.randrange(len(chars))
    op = rng.randrange(4)
    if op == 0:
      chars[k] = rng.choice("0123456789")
    elif op == 1 and len(chars) > 1:
      del chars[k]
    elif op == 2:
      chars.insert(k, rng.choice("0123456789"))
    else:
      rng.shuffle(chars)
    out.append("".join(chars))
  out.append(str(rng.randint(0, 10**rng.randint(1, 6))))
  return out


def _mentions(feedback: str, answer: str) -> bool:
  """Whether ``answer`` appears in ``feedback`` as a whole token."""
  return re.search(r"(?<![0-9A-Za-z*+\-])" + re.escape(answer) +
                   r"(?![0-9A-Za-z*+\-])", feedback) is not None


def test_feedback_never_reveals_the_answer_by_default():
  verify = get_verifier("procedural")
  reveal = get_verifier("procedural", feedback_reveals_answer=True)
  rng = random.Random(0)
  checked = 0
  for task, levels in (("arithmetic", (2, 3, 5)), ("sort", (3, 6, 9)),
                       ("countdown", (2, 3, 4))):
    for d in levels:
      for i in range(40):
        ex = tasks.make_example(task, i, difficulty=d)
        for r in _wrong_responses(ex, rng):
          v = verify(ex, r)
          if v.reward == 1.0:
            continue  # a perturbation can still be right (e.g. countdown)
          checked += 1
          assert not _mentions(v.feedback, ex["answer"]), (ex, r, v.feedback)
          assert "correct answer" not in v.feedback
          rv = reveal(ex, r)
          assert rv.feedback == v.feedback + "; the correct answer is " + ex["answer"]
  assert checked > 1500


def test_partial_credit_is_opt_in():
  assert get_verifier("procedural")(ARITH, "58").reward == 0.0
  v = get_verifier("procedural", partial_credit=0.5)(ARITH, "58")
  assert v.reward == pytest.approx(0.5 * 0.5)  # one of two digits right
  assert get_verifier("procedural", partial_credit=0.5)(ARITH, "57").reward == 1.0


@pytest.mark.parametrize("task", sorted(tasks.FAMILIES))
def test_generation_is_deterministic_short_and_solvable(task):
  fam = tasks.FAMILIES[task]
  verify = get_verifier("procedural")
  for d in range(fam.min_difficulty, min(fam.max_difficulty, 6) + 1):
    for i in range(20):
      ex = tasks.make_example(task, i, seed=3, difficulty=d)
      assert ex == tasks.make_example(task, i, seed=3, difficulty=d)
      assert ex["difficulty"] == d and ex["task"] == task
      # short: within a 24-token response budget (chain's 6 results: 17 characters)
      assert len(ex["prompt"]) <= min(40, fam.prompt_chars(d))
      assert len(ex["answer"]) <= min(23, fam.answer_chars(d))
      assert verify(ex, tasks.solve(ex)).reward == 1.0
  mixed = {tasks.make_example(task, i, difficulty=fam.min_difficulty,
                              max_difficulty=fam.min_difficulty + 2)["difficulty"]
           for i in range(60)}
  assert mixed == set(range(fam.min_difficulty, fam.min_difficulty + 3))


@pytest.mark.parametrize("task,d", [("arithmetic", 1), ("arithmetic", 2),
                                    ("sort", 3), ("countdown", 2)])
def test_train_and_eval_problems_are_disjoint(task, d):
  train = {tasks.make_example(task, i, difficulty=d)["prompt"] for i in range(300)}
  evals = {tasks.make_example(task, i, difficulty=d, split="eval")["prompt"]
           for i in range(100)}
  assert evals and train and not train & evals


def test_bad_task_arguments():
  with pytest.raises(KeyError):
    tasks.make_example("nope", 0)
  with pytest.raises(ValueError):
    tasks.make_example("sort", 0, difficulty=1)  # sort needs >= 2 items
  with pytest.raises(ValueError):
    tasks.make_example("arithmetic", 0, split="test")


# ------------------------------------------------------------------- math


@pytest.mark.parametrize("gold,response,feedback", [
    ("3/4", r"so $\boxed{\frac{3}{4}}$", "correct"),
    ("3/4", r"\boxed{0.75}", "correct"),
    ("x^2+1", r"\boxed{1+x^2}", "correct"),
    ("7", "the answer is 7",
     r"no final answer found: write the final answer as \boxed{...}"),
    ("7", r"\boxed{7", r"format violation: a \boxed{ is never closed"),
    ("7", r"\boxed{ }", "format violation: the final answer is empty"),
    ("7", r"\boxed{@@#}", "the final answer could not be parsed: '@@#'"),
    ("-5", r"\boxed{3}", "the final answer is wrong: its sign is wrong"),
    ("-5", r"\boxed{5}", "the final answer is wrong"),  # a hint would reveal it
    ("7", r"\boxed{1000}", "the final answer is wrong: it is more than 10 times too large"),
    ("700", r"\boxed{3}", "the final answer is wrong: it is more than 10 times too small"),
    ("7", r"\boxed{70}", "the final answer is wrong"),  # 10x exactly: no hint
    ("7", r"\boxed{8}", "the final answer is wrong"),
    ("(1,2]", r"\boxed{3}", "the final answer is wrong: it should be an interval, not a number"),
])
def test_math_verifier(gold, response, feedback):
  v = get_verifier("math")({"answer": gold}, response)
  assert v.feedback == feedback
  assert v.reward == (1.0 if feedback == "correct" else 0.0)
  if v.reward == 0.0:
    assert not _mentions(v.feedback, gold.lstrip("-"))


def test_math_categories_reveal_and_options():
  v = get_verifier("math")({"answer": "7"}, r"\boxed{3} and \boxed{7}")
  assert v.reward == 1.0  # the last boxed answer counts by default
  strict = get_verifier("math", multiple_answers="error")
  v = strict({"answer": "7"}, r"\boxed{3} and \boxed{7}")
  assert v.feedback == "format violation: 2 different final answers; give exactly one"
  assert v.info["category"] == "format"
  v = get_verifier("math", feedback_reveals_answer=True)({"answer": "-5"}, r"\boxed{3}")
  assert v.feedback == "the final answer is wrong: its sign is wrong; the correct answer is -5"
  pattern = get_verifier("math", answer_pattern=r"(?im)^answer:\s*(.+)$")
  assert pattern({"answer": "12"}, "work...\nAnswer: 12").reward == 1.0
  assert pattern({"answer": "12"}, "work").info["category"] == "missing"


# ------------------------------------------------------------------ ifeval


def test_ifeval_one_line_per_violated_constraint():
  ex = {"constraints": [
      {"type": "max_words", "n": 5}, {"type": "min_sentences", "n": 3},
      {"type": "include_keywords", "keywords": ["apple", "pear", "plum"]},
      {"type": "forbidden_keywords", "keywords": ["banana"]},
      {"type": "lowercase"}, {"type": "json"}]}
  v = get_verifier("ifeval")(ex, "I like Banana and apple. A lot!")
  assert v.feedback.split("\n") == [
      "the response has 7 words; the maximum is 5",
      "the response has 2 sentences; the minimum is 3",
      "the response must mention 'pear' and 'plum'",
      "the response must not mention 'banana'",
      "the response must be all lowercase; found uppercase letters in 3 words, first in 'I'",
      "the response is not valid JSON (Expecting value at line 1 column 1)",
  ]
  assert v.reward == 0.0  # none of the six hold
  ok = {"constraints": [{"type": "json"}, {"type": "uppercase"},
                        {"type": "max_words", "n": 3}]}
  assert get_verifier("ifeval")(ok, '```json\n{"A": 1}\n```').feedback == (
      "the response must be all uppercase; found lowercase letters in 1 word, first in '```json'")
  assert get_verifier("ifeval")(ok, '{"A": 1}').reward == 1.0


def test_ifeval_reward_modes_and_ifeval_format():
  ex = {"instruction_id_list": ["length_constraints:number_words",
                                "keywords:existence", "change_case:english_capital"],
        "kwargs": [{"relation": "less than", "num_words": 3},
                   {"keywords": ["cat"]}, {}]}
  frac = get_verifier("ifeval")(ex, "A BIG DOG")
  assert frac.reward == pytest.approx(1 / 3)
  assert frac.feedback == ("the response has 3 words; the maximum is 2\n"
                           "the response must mention 'cat'")
  assert get_verifier("ifeval", reward_mode="all")(ex, "A BIG DOG").reward == 0.0
  assert get_verifier("ifeval", reward_mode="all")(ex, "A CAT").reward == 1.0
  with pytest.raises(ValueError, match="unsupported"):
    get_verifier("ifeval")({"instruction_id_list": ["x:y"], "kwargs": [{}]}, "a")


# ---------------------------------------------------------------- registry


def plain_function_verifier(example, response):
  return (1.0 if response == example["answer"] else 0.0, "checked")


def test_registry_names_and_import_paths():
  assert {"procedural", "math", "ifeval", "code"} <= set(base.list_verifiers())
  v = get_verifier("fbos_jax.verifiers.procedural:ProceduralVerifier",
                   feedback_reveals_answer=True)
  assert v(ARITH, "58").feedback.endswith("the correct answer is 57")
  f = get_verifier(f"{__name__}:plain_function_verifier")
  assert f is plain_function_verifier
  with pytest.raises(KeyError, match="registered"):
    get_verifier("no_such_verifier")
  with pytest.raises(AttributeError):
    get_verifier("fbos_jax.verifiers.base:nope")


def test_register_custom_verifier():
  @register_verifier("test_exact")
  class Exact:  # pylint: disable=unused-variable
    def __init__(self, strip=True):
      self.strip = strip

    def __call__(self, example, response):
      ok = (response.strip() if self.strip else response) == example["answer"]
      return Verdict(float(ok), "correct" if ok else "wrong")

  assert get_verifier("test_exact")(ARITH, " 57 ").reward == 1.0
  assert get_verifier("test_exact", strip=False)(ARITH, " 57 ").reward == 0.0


def test_make_verifier_from_data_config_dispatches_per_example():
  from fbos_jax import data  # pylint: disable=g-import-not-at-top
  cfg = data.default_data_config()  # data.verifier="auto": route by the key
  verify = base.make_verifier(cfg)
  math_ex = {"answer": "7", "verifier": "math"}
  arith = dict(ARITH, verifier="procedural")
  assert verify(arith, "58").feedback == "digit 1 from the right is wrong"
  assert verify(math_ex, r"\boxed{7}").reward == 1.0
  assert verify(ARITH, "57").is_error  # no key to route by: an error, not a guess
  cfg.feedback_reveals_answer = True
  assert base.make_verifier(cfg)(arith, "58").feedback.endswith(
      "; the correct answer is 57")
  plain = data.default_data_config()
  plain.verifier = f"{__name__}:plain_function_verifier"
  assert base.make_verifier(plain)({"answer": "x"}, "x") == Verdict(1.0, "checked")


# -------------------------------------------------------------------- pool


def flaky_verifier(example, response):
  """Module-level so that the process backend can pickle it."""
  if response == "raise":
    raise ValueError("boom")
  if response == "hang":
    time.sleep(30)
  if response == "bad":
    return "not a verdict"
  if response == "crash":
    import os  # pylint: disable=g-import-not-at-top
    os._exit(3)  # pylint: disable=protected-access
  return plain_function_verifier(example, response)


def _check_batch(verdicts, stats, responses):
  for r, v in zip(responses, verdicts):
    if r == "57":
      assert v == Verdict(1.0, "checked", {})
    elif r == "raise":
      assert v.reward == 0.0 and v.is_error and v.feedback == ""
      assert v.error == "exception: ValueError: boom"
      assert v.info == {"error": "exception"}
    elif r == "hang":
      assert v.reward == 0.0 and v.is_error and v.feedback == ""
      assert v.error.startswith("timeout: no verdict within")
    elif r == "bad":
      assert v.error == "bad_return: expected a Verdict, got str"
    if r != "57":
      assert v.is_error and not v.feedback  # error text never becomes feedback
  assert stats["verifier/calls"] == len(responses)
  assert stats["verifier/exception"] == responses.count("raise")
  assert stats["verifier/timeout"] == responses.count("hang")
  assert stats["verifier/errors"] == sum(responses.count(k) for k in
                                         ("raise", "hang", "bad", "crash"))


def test_pool_threads_survive_exceptions_and_hangs(caplog):
  responses = ["57", "raise", "hang", "57", "bad", "hang", "57", "raise"]
  examples = [ARITH] * len(responses)
  pool = VerifierPool(flaky_verifier, num_workers=4, timeout_s=0.5)
  with caplog.at_level(logging.WARNING):
    t0 = time.monotonic()
    verdicts, stats = pool.run(examples, responses)
    elapsed = time.monotonic() - t0
    verdicts2, _ = pool.run(examples, responses)  # errors again: not re-logged
  # Two hung calls run in parallel with the rest; the batch does not wait 30 s.
  assert elapsed < 3.0
  _check_batch(verdicts, stats, responses)
  assert verdicts2 == verdicts
  assert stats["verifier/abandoned_threads"] >= 2
  logged = [r.getMessage() for r in caplog.records if "verifier error" in r.getMessage()]
  assert len(logged) == 3  # once per kind: exception, timeout, bad_return
  assert pool.totals["timeout"] == 4 and pool.totals["calls"] == 16


def test_pool_timeout_counts_from_call_start():
  # 1 worker, 3 quick calls behind a hang: each quick call gets its own budget.
  pool = VerifierPool(flaky_verifier, num_workers=1, timeout_s=0.3)
  verdicts, stats = pool.run([ARITH] * 4, ["hang", "57", "57", "57"])
  assert [v.reward for v in verdicts] == [0.0, 1.0, 1.0, 1.0]
  assert stats["verifier/timeout"] == 1


def test_pool_process_backend_kills_hung_calls():
  responses = ["57", "raise", "hang", "crash", "57"]
  with VerifierPool(flaky_verifier, num_workers=2, timeout_s=2.0,
                    backend="process") as pool:
    verdicts, stats = pool.run([ARITH] * len(responses), responses)
    _check_batch(verdicts, stats, responses)
    assert verdicts[3].error.startswith("crash: worker process exited")
    assert stats["verifier/crash"] == 1
    hung = [w for w in pool._workers if not w.proc.is_alive()]  # pylint: disable=protected-access
    assert not hung  # the hung worker was killed and dropped
    verdicts, _ = pool.run([ARITH, ARITH], ["57", "58"])  # workers are reused
    assert [v.reward for v in verdicts] == [1.0, 0.0]


def test_pool_process_backend_under_concurrent_calls():
  """Issue 32: the streamed rounds verify each rollout alone as it stops, from
  several threads at once. Each call checks out its own workers: every verdict
  is its own row's, and the pool never holds more than num_workers processes."""
  import concurrent.futures
  from fbos_jax.testing.small import parity_reward
  from fbos_jax.testing.verifiers import LatencyVerifier
  responses = ["ab", "a", "abcd", "abc", "", "abcde", "xy", "x"]
  with VerifierPool(LatencyVerifier(parity_reward, 0.05), num_workers=2, timeout_s=30.0,
                    backend="process") as pool:
    with concurrent.futures.ThreadPoolExecutor(4) as ex:
      got = list(ex.map(lambda r: pool.verify_one({"prompt": "q"}, r), responses))
    assert [v.reward for v in got] == [float(len(r) % 2 == 0) for r in responses]
    assert len(pool._workers) <= 2  # pylint: disable=protected-access
    assert pool.totals["calls"] == len(responses) and pool.totals["errors"] == 0


def test_pool_rejects_unpicklable_for_process_backend():
  with pytest.raises(ValueError, match="picklable"):
    VerifierPool(lambda e, r: Verdict(1.0, ""), backend="process")


def test_pool_with_builtin_verifier_in_order():
  exs = [tasks.make_example("arithmetic", i, difficulty=2) for i in range(50)]
  resps = [tasks.solve(e) if i % 2 else "0" for i, e in enumerate(exs)]
  verdicts, stats = VerifierPool(get_verifier("procedural"), num_workers=8).run(exs, resps)
  assert [v.reward for v in verdicts] == [float(i % 2) for i in range(50)]
  assert stats["verifier/errors"] == 0


def test_pool_submit_resolves_in_the_calls_own_thread():
  """Issue 32: a rollout verified as it stops is one call in its own thread,
  which resolves the Future itself: no second thread waits on the call."""
  import threading
  seen, gate, done = {}, threading.Event(), threading.Event()

  def verifier(example, response):
    seen["call"] = threading.get_ident()
    gate.wait(30)  # not done before the callback below is attached
    return Verdict(reward=1.0, feedback="")

  pool = VerifierPool(verifier, num_workers=2, timeout_s=30.0)
  fut = pool.submit({"id": 0}, "x")
  fut.add_done_callback(lambda f: (seen.setdefault("resolved", threading.get_ident()),
                                   done.set()))
  gate.set()
  assert done.wait(30)
  (v,), stats = fut.result()
  assert v.reward == 1.0 and stats["verifier/calls"] == 1 and pool.totals["calls"] == 1
  assert seen["resolved"] == seen["call"] != threading.get_ident()
  pool.close()


def test_pool_submit_runs_waiting_calls_by_priority_and_drops_cancelled():
  """Calls waiting for a worker start lower priority first (round-1 verdicts,
  which start round-2 rows, ahead of round-2 ones), then in submission order;
  a cancelled waiting call never runs."""
  import threading
  gate, order = threading.Event(), []

  def verifier(example, response):
    if response == "first":
      gate.wait(30)
    order.append(response)
    return Verdict(reward=1.0, feedback="")

  pool = VerifierPool(verifier, num_workers=1, timeout_s=60.0)
  futs = [pool.submit({"id": 0}, "first", priority=0)]
  futs += [pool.submit({"id": i}, r, priority=p)
           for i, (r, p) in enumerate([("r2a", 2), ("r1a", 1), ("r2b", 2), ("r1b", 1)], 1)]
  dropped = pool.submit({"id": 9}, "dropped", priority=0)
  assert dropped.cancel()
  gate.set()
  for f in futs:
    f.result(timeout=30)
  assert order == ["first", "r1a", "r1b", "r2a", "r2b"]
  assert dropped.cancelled() and pool.totals["calls"] == 5
  pool.close()


def test_pool_submit_runs_waiting_calls_in_the_threads_it_has():
  """A call that finishes takes the next waiting one in its own thread: 40 calls
  on 2 workers run in 2 threads, not 40 (a thread per call cost ~0.3 ms of start
  and hand-off each, 128 per tiny FBOS step on the engine)."""
  import threading
  gate, names = threading.Event(), []

  def verifier(example, response):
    gate.wait(30)
    names.append(threading.current_thread().name)
    return Verdict(reward=1.0, feedback="")

  pool = VerifierPool(verifier, num_workers=2, timeout_s=60.0)
  futs = [pool.submit({"id": i}, str(i)) for i in range(40)]
  gate.set()
  assert all(f.result(timeout=30)[0][0].reward == 1.0 for f in futs)
  assert len(names) == 40 and len(set(names)) == 2
  assert pool.totals["calls"] == 40
  pool.close()


def test_pool_run_takes_calls_in_the_threads_it_has():
  """``run``'s thread backend: 40 calls on 2 workers run in 2 threads, not a
  thread per call (1,280 per eval of the tiny run, about 0.09 ms of start and
  hand-off each: ``python launch/bench_verifier.py``)."""
  import threading
  gate, names = threading.Event(), []

  def verifier(example, response):
    gate.wait(30)  # both workers hold a call before any finishes
    names.append(threading.current_thread().name)
    return Verdict(reward=1.0, feedback=response)

  pool = VerifierPool(verifier, num_workers=2, timeout_s=60.0)
  threading.Timer(0.3, gate.set).start()
  verdicts, stats = pool.run([{"id": i} for i in range(40)], [str(i) for i in range(40)])
  assert [v.feedback for v in verdicts] == [str(i) for i in range(40)]  # input order
  assert len(names) == 40 and len(set(names)) == 2
  assert stats["verifier/calls"] == 40 and stats["verifier/errors"] == 0
  pool.close()


def test_pool_run_replaces_the_thread_of_a_hung_call():
  """One worker, its first call hangs: after ``timeout_s`` that call is a timeout,
  its thread is abandoned and a new one verifies the rest (none waits 30 s)."""
  pool = VerifierPool(flaky_verifier, num_workers=1, timeout_s=0.3)
  responses = ["hang", "57", "57", "hang", "57"]
  t0 = time.monotonic()
  verdicts, stats = pool.run([ARITH] * len(responses), responses)
  assert time.monotonic() - t0 < 3.0
  assert [v.is_error for v in verdicts] == [r == "hang" for r in responses]
  assert all(v.reward == 1.0 for v, r in zip(verdicts, responses) if r == "57")
  assert stats["verifier/timeout"] == 2 and stats["verifier/abandoned_threads"] >= 2
  pool.close()


def test_pool_submit_reuses_an_idle_thread_for_calls_that_come_one_by_one():
  """Rollouts stop a few at a time (the engine retires them between windows), so
  each call used to find no call waiting, end its thread, and the next submit
  started a new one (757 thread starts in 6 tiny FBOS steps on the engine). An idle
  submit thread now waits SUBMIT_IDLE_S for the next call: 20 calls submitted one
  after another's verdict run in one thread, and a closed pool's idle thread ends."""
  import threading
  names = []

  def verifier(example, response):
    names.append(threading.current_thread().name)
    return Verdict(reward=1.0, feedback="")

  pool = VerifierPool(verifier, num_workers=2, timeout_s=60.0)
  for i in range(20):
    assert pool.submit({"id": i}, str(i)).result(timeout=30)[0][0].reward == 1.0
  assert len(names) == 20 and len(set(names)) == 1
  (idle,) = [t for t in threading.enumerate() if t.name == names[0]]
  pool.close()
  idle.join(5)
  assert not idle.is_alive()


def test_pool_submit_times_out_a_hung_call_and_frees_its_place():
  """Issue 32's bad input: a hung call resolves as a timeout error after
  ``timeout_s`` and its place goes to the next call; other calls are not held."""
  pool = VerifierPool(flaky_verifier, num_workers=1, timeout_s=0.3)
  hung = pool.submit(ARITH, "hang")
  after = pool.submit(ARITH, "57")
  (v,), st = after.result(timeout=30)
  assert v.reward == 1.0 and not v.is_error
  (h,), hst = hung.result(timeout=30)
  assert h.is_error and h.error.startswith("timeout: no verdict within")
  assert hst["verifier/timeout"] == 1 and pool.totals["timeout"] == 1
  assert hst["verifier/abandoned_threads"] >= 1
  pool.close()
