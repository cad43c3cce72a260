"""Issue 24: the chain task family, whose feedback names the first wrong step and its
correct intermediate result but never the final answer; the FAP budget holds its
longest FAP; a config that forbids it refuses, at start, a feedback that reveals it."""

import random

import pytest

from configs import load

from fbos_jax import tasks
from fbos_jax import tokenizer as tk
from fbos_jax.rl import config as config_lib
from fbos_jax.rl import fap_budget
from fbos_jax.verifiers import procedural


def _examples(n=300, lo=2, hi=8, split="train"):
  return [tasks.make_example("chain", i, difficulty=lo, max_difficulty=hi, split=split)
          for i in range(n)]


def test_chain_problems_and_their_answers():
  for ex in _examples() + _examples(100, split="eval"):
    values = ex["values"]
    results = ex["answer"].split(",")
    d = ex["difficulty"]
    assert len(results) == d == len(values)
    assert all(0 <= v <= tasks.CHAIN_MAX_VALUE for v in values)
    assert values[-1] >= tasks.CHAIN_MIN_FINAL and values[-1] not in values[:-1]
    assert tasks.final_answer(ex) == str(values[-1])
    # the results are the prompt's operations, left to right, two digits each
    v = int(ex["prompt"][0])
    for k, result in enumerate(results):
      op, x, space = ex["prompt"][1 + 3 * k:4 + 3 * k]
      v = v + int(x) if op == "+" else v - int(x) if op == "-" else v * int(x)
      assert result == f"{v:02d}" and space == " "
    assert ex["prompt"].endswith("=") and len(ex["prompt"]) == 3 * d + 2
    assert len(ex["answer"]) == 3 * d - 1
    assert tasks.check(ex, ex["answer"]).correct
    assert tasks.check(ex, " " + ex["answer"].replace(",", ", ") + " ", "compact").correct
    wrong = tasks.corrupt(ex, random.Random(d))
    assert not tasks.check(ex, wrong).correct and len(wrong.split(",")) >= d


def test_chain_feedback_names_the_first_wrong_step_and_its_value():
  ex = tasks.make_example("chain", 3, difficulty=4)
  assert ex["prompt"] == "3+9 *5 -4 +8 =" and ex["answer"] == "12,60,56,64"
  cases = {  # response: (prose, compact)
      "12,61,57,65": (("step 2 is 60",), ("12,60,__,__",)),
      "13,60,56,64": (("step 1 is 12",), ("12,__,__,__",)),
      "12,60,56,60": (("step 4 is too low",), ("12,60,56,lo",)),
      "12,60,56,70": (("step 4 is too high",), ("12,60,56,hi",)),
      "12,60,56,6x": (("step 4 is not a number",), ("12,60,56,??",)),
      "12,60,56": (("write 4 results, you wrote too few", "step 4 is missing"),
                   ("too few: 12,60,56,??",)),
      "12,60,56,64,01": (("write 4 results, you wrote too many",), ("too many: 12,60,56,ok",)),
      "12,60": (("write 4 results, you wrote too few", "step 3 is 56"),
                ("too few: 12,60,56,__",)),
      "": (("the response is empty",), ("too few: 12,__,__,__",)),
  }
  for response, (prose, compact) in cases.items():
    for style, errors in (("prose", prose), ("compact", compact)):
      got = tasks.check(ex, response, style)
      assert not got.correct and got.errors == errors, (response, style, got.errors)


def test_chain_feedback_never_contains_the_final_answer():
  """Over 600 problems of 2-8 steps and every wrong response tasks.wrong_responses
  builds (the final answer alone, repeated, in every position, its neighbours,
  leading zeros, prefixes and extensions of the reference, one step changed,
  non-ASCII digits, noise), plus the model-like responses that get every step
  right but one: no feedback contains the final answer as a number or number word."""
  rng = random.Random(0)
  verifiers = (procedural.ProceduralVerifier(), procedural.CompactProceduralVerifier())
  checked = 0
  for ex in _examples(400) + _examples(200, split="eval"):
    responses = tasks.wrong_responses(ex, rng, 80)
    results = ex["answer"].split(",")
    for k in range(len(results)):  # every result right but result k, off by one or ten
      for dv in (-10, -1, 1, 10):
        v = f"{max(int(results[k]) + dv, 0):02d}"
        responses.append(",".join(results[:k] + [v] + results[k + 1:]))
    responses += [tasks.corrupt(ex, rng) for _ in range(8)]
    for response in responses:
      if tasks.check(ex, response).correct:
        continue
      for verify in verifiers:
        verdict = verify(ex, response)
        assert verdict.reward == 0.0, response
        assert not tasks.feedback_reveals_answer(verdict.feedback, ex), (ex, response, verdict)
        checked += 1
  assert checked > 40_000
  # the detector itself: it finds the answer where it is
  ex = tasks.make_example("chain", 3, difficulty=4)
  for leak in ("the answer is 64", "12,60,56,64", "expected 064"):
    assert tasks.feedback_reveals_answer(leak, ex), leak
  for fine in ("step 2 is 60", "12,60,56,lo", "write 4 results", "not 640"):
    assert not tasks.feedback_reveals_answer(fine, ex), fine
  assert tasks.feedback_reveals_answer("item three is wrong", {"task": "arithmetic",
                                                               "answer": "3"})
  with_answer = procedural.ProceduralVerifier(feedback_reveals_answer=True)
  assert tasks.feedback_reveals_answer(with_answer(ex, "12,61").feedback, ex)


def test_the_fap_budget_holds_every_chain_fap(tmp_path):
  """tasks.longest_feedback_chars bounds every feedback, and the tiny_chain budget
  (templates.max_prompt_tokens) holds the longest FAP longest_fap_tokens finds."""
  rng = random.Random(1)
  hi = 8
  for style in tasks.FEEDBACK_STYLES:
    bound = tasks.longest_feedback_chars("chain", hi, 200, style=style)
    longest = 0
    for ex in _examples(300, hi=hi):
      longest_kind = ",".join(ex["answer"].split(",")[:-1] + ["xx", "00"])  # count + last
      for response in tasks.wrong_responses(ex, rng, 40) + [longest_kind]:
        fb = "; ".join(tasks.check(ex, response, style).errors)
        longest = max(longest, len(fb))
        assert len(fb) <= bound, (style, response, fb)
    assert longest == bound, style  # the bound is tight, not a guess
  assert all(len(ex["prompt"]) <= tasks.longest_prompt_chars("chain", hi)
             for ex in _examples(300, hi=hi))
  c = load("configs/fbos.py:tiny_chain")
  tok = tk.load_tokenizer(tk.build_char_tokenizer(tmp_path / "tok"))
  need = fap_budget.longest_fap_tokens(c, config_lib.build_parts(c), tok)
  assert need is not None and need["fap"] <= c.templates.max_prompt_tokens
  assert need["fap"] <= max(c.sampling.fap_prompt_buckets)
  assert c.data.verifier == procedural.COMPACT_PATH
  assert all(len(tasks.solve(ex)) + 1 <= c.sampling.max_new_tokens
             for ex in _examples(200, c.data.difficulty, c.data.max_difficulty))


def test_a_feedback_that_reveals_the_answer_is_refused_at_start():
  c = load("configs/fbos.py:tiny_chain")
  assert c.data.require_hidden_answer is True
  ok = procedural.check_config_answer_hidden(c, procedural.ProceduralVerifier())
  assert ok and ok >= 64 * 20
  c.data.feedback_reveals_answer = True
  with pytest.raises(procedural.FeedbackRevealsAnswerError,
                     match=r"(?s)data.require_hidden_answer=True.*task 'chain'.*"
                           r"Example record id 'chain/train/0/\d+': prompt '.*', answer "):
    procedural.check_config_answer_hidden(
        c, procedural.ProceduralVerifier(feedback_reveals_answer=True))
  c.data.require_hidden_answer = False  # allowed: nothing is checked
  assert procedural.check_config_answer_hidden(
      c, procedural.ProceduralVerifier(feedback_reveals_answer=True)) is None
  # a family whose feedback can write the answer's digits is refused too
  a = load("configs/grpo.py:tiny")
  a.data.task, a.data.difficulty, a.data.max_difficulty = "arithmetic", 1, 1
  a.data.require_hidden_answer = True
  with pytest.raises(procedural.FeedbackRevealsAnswerError, match="task 'arithmetic'"):
    procedural.check_config_answer_hidden(a, procedural.ProceduralVerifier())


@pytest.mark.parametrize("algo", ["grpo", "golf", "fbos", "fcp", "sft"])
def test_tiny_chain_builds_and_validates_for_every_algorithm(algo):
  from fbos_jax.rl.config import validate
  c = load(f"configs/{algo}.py:tiny_chain")
  validate(c)
  assert c.data.task == "chain" and len(c.sft.stages) == 2
  assert sum(st["steps"] for st in c.sft.stages) == c.sft.steps
  if algo in ("golf", "fbos"):  # equal rollouts per step: half the prompts of GRPO
    assert c.rl.prompts_per_step == load("configs/grpo.py:tiny_chain").rl.prompts_per_step // 2
