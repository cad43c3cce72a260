"""The committed arithmetic word-problem dataset (fbos_jax/datasets/arith_word): it is the
generator's output, splits are disjoint, every worked solution is right, and both answer
forms (GSM8K ``#### n`` and MATH ``\\boxed{n}``) go through the data pipeline and the math
verifier."""
import json
import re

import pytest

from fbos_jax import data as data_lib
from fbos_jax.datasets import arith_word as aw
from fbos_jax.verifiers.base import make_verifier
from fbos_jax.verifiers.math import MathVerifier, extract_boxed

GSM8K_FINAL = re.compile(r"(?m)^####\s*(\S+)\s*$")
EQUATION = re.compile(r"(\d+) ([-+*/]) (\d+) = (\d+)")


def read(path):
  with open(path, encoding="utf-8") as f:
    return [json.loads(line) for line in f if line.strip()]


@pytest.fixture(scope="module")
def splits():
  return {"train": read(aw.TRAIN_PATH), "test": read(aw.TEST_PATH)}


def final_answer(solution: str) -> tuple[str, str]:
  """(form, answer) of a worked solution."""
  m = GSM8K_FINAL.findall(solution)
  boxed, unclosed = extract_boxed(solution)
  assert not unclosed
  assert bool(m) != bool(boxed), solution  # exactly one form
  return ("gsm8k", m[-1]) if m else ("math", boxed[-1])


def test_committed_files_are_the_generators_output(tmp_path):
  paths = aw.write(str(tmp_path))  # default seed and sizes
  for split, committed in (("train", aw.TRAIN_PATH), ("test", aw.TEST_PATH)):
    assert open(paths[split], "rb").read() == open(committed, "rb").read(), split
  other = aw.generate(seed=1, num_train=50, num_test=10)
  assert [r["prompt"] for r in other["test"]] != [r["prompt"] for r in aw.generate(
      num_train=50, num_test=10)["test"]]


def test_sizes_fields_and_ids(splits):
  assert len(splits["train"]) == aw.DEFAULT_NUM_TRAIN == 400
  assert len(splits["test"]) == aw.DEFAULT_NUM_TEST == 100
  ids = [r["id"] for s in splits.values() for r in s]
  assert len(set(ids)) == len(ids)
  for s in splits.values():
    for r in s:
      assert set(r) == {"id", "kind", "prompt", "answer", "solution", "verifier"}
      assert r["verifier"] == "math"
      assert r["kind"] in aw.KINDS and r["answer"] == str(int(r["answer"]))


def test_train_and_test_do_not_overlap(splits):
  def signature(r):  # the template and its numbers: the same problem under another name
    return r["kind"], tuple(re.findall(r"\d+", r["prompt"]))
  train = {signature(r) for r in splits["train"]}
  test = {signature(r) for r in splits["test"]}
  assert len(train) == 400 and len(test) == 100  # no duplicates inside a split either
  assert not train & test
  assert not {r["prompt"] for r in splits["train"]} & {r["prompt"] for r in splits["test"]}


def test_solutions_are_correct_and_use_both_forms(splits):
  for s in splits.values():
    forms = []
    for r in s:
      eqs = EQUATION.findall(r["solution"])
      assert eqs, r["solution"]
      for a, op, b, c in eqs:  # every step of the worked solution is right
        a, b, c = int(a), int(b), int(c)
        assert {"+": a + b, "-": a - b, "*": a * b, "/": a / b}[op] == c, r["solution"]
      assert eqs[-1][3] == r["answer"], r  # the last step gives the answer
      form, ans = final_answer(r["solution"])
      assert ans == r["answer"], r
      forms.append(form)
      assert 0 <= int(r["answer"]) <= 100  # small numbers
    assert 0.4 < forms.count("gsm8k") / len(forms) < 0.6


def pipeline(split: str, answer_field: str = "answer") -> list[dict]:
  """Every example of ``split`` as a run reads it: train.jsonl with test.jsonl as the
  held-out file, data.verifier "auto" (the records' own "verifier" column)."""
  dc = data_lib.default_data_config()
  dc.source, dc.path, dc.eval_path = "jsonl", aw.TRAIN_PATH, aw.TEST_PATH
  dc.split, dc.shuffle, dc.num_epochs, dc.drop_remainder = split, False, 1, False
  dc.answer_field = answer_field
  it = data_lib.make_prompt_iterator(dc, batch_size=50, process_index=0, process_count=1)
  return [ex for batch in it for ex in batch]


def test_read_through_the_data_pipeline(splits):
  for split, records in (("eval", splits["test"]), ("train", splits["train"])):
    examples = pipeline(split)
    assert sorted((ex["id"], ex["prompt"], ex["answer"]) for ex in examples) == sorted(
        (r["id"], r["prompt"], r["answer"]) for r in records), split
    assert all(isinstance(ex["answer"], str) and ex["verifier"] == "math" for ex in examples)


@pytest.mark.parametrize("answer_field", ["answer", "solution"])
def test_math_verifier_accepts_both_forms(splits, answer_field):
  """Every 7th example of each split (both forms, every kind), verified the way a run
  does: data pipeline (answer_field) -> make_verifier(config.data)."""
  dc = data_lib.default_data_config()
  dc.verifier, dc.answer_field = "math", answer_field
  verifier = make_verifier(dc)
  gsm8k = MathVerifier(answer_pattern=GSM8K_FINAL.pattern)
  by_id = {r["id"]: r for s in splits.values() for r in s}
  sample = [ex for split in ("eval", "train")
            for ex in sorted(pipeline(split, answer_field), key=lambda e: e["id"])[::7]]
  assert {final_answer(by_id[ex["id"]]["solution"])[0] for ex in sample} == {"gsm8k", "math"}
  assert {by_id[ex["id"]]["kind"] for ex in sample} == set(aw.KINDS)
  for ex in sample:
    r = by_id[ex["id"]]
    assert ex["answer"] == r[answer_field]  # the reference the verifier grades against
    right, wrong = int(r["answer"]), int(r["answer"]) + 1
    assert verifier(ex, f"So the result is \\boxed{{{right}}}.").reward == 1.0, r
    assert verifier(ex, f"So the result is \\boxed{{{wrong}}}.").reward == 0.0, r
    # the worked solution itself is a correct response in its own form
    form, _ = final_answer(r["solution"])
    judge = verifier if form == "math" else gsm8k
    assert judge(ex, r["solution"]).reward == 1.0, r
