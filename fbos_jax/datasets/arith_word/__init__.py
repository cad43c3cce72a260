r"""Arithmetic word problems: a small, deterministic math dataset for the real-tokenizer path.

Regenerate the committed files (byte-identical for the same arguments)::

  python -m fbos_jax.datasets.arith_word                # seed 0: 400 train, 100 test
  python -m fbos_jax.datasets.arith_word --out_dir=/tmp/aw --seed=1 --num_train=1000

Each JSONL record::

  {"id": "arith_word-train-00000", "kind": "add", "prompt": "Mia has 7 apples. ...",
   "answer": "12", "solution": "Mia starts with 7 apples ... 7 + 5 = 12.\n#### 12",
   "verifier": "math"}

Use it as ``--config.data.source=jsonl
--config.data.path=fbos_jax/datasets/arith_word/train.jsonl
--config.data.eval_path=fbos_jax/datasets/arith_word/test.jsonl`` (:data:`TRAIN_PATH`,
:data:`TEST_PATH`).

* ``prompt``: the question (read by ``data.prompt_field``, default ``"prompt"``).
* ``answer``: the plain number (``data.answer_field``, default ``"answer"``),
  what the ``math`` verifier compares a response's ``\boxed{...}`` with.
* ``solution``: a short worked solution ending in the GSM8K form ``#### 12``
  (even-numbered records) or the MATH form ``The answer is $\boxed{12}$.`` (odd);
  either one parses as a reference answer too (``--config.data.answer_field=solution``).
  Usable as SFT demonstrations.
* ``kind``: the problem template (one of :data:`KINDS`).
* ``verifier``: ``"math"`` (``fbos_jax/verifiers/math.py``).

Problems use one or two operations on small numbers (sums and differences of
numbers up to 20, products of one-digit numbers, exact divisions), so a small
model can solve them in principle. Train and test are disjoint: no two records
share a template and its numbers, which also rules out equal prompts.
"""

from __future__ import annotations

import json
import os
import random
from typing import Callable, Iterator

NAME = "arith_word"
VERIFIER = "math"  # every record's "verifier" column (data.verifier="auto" reads it)
DATA_DIR = os.path.dirname(os.path.abspath(__file__))
TRAIN_PATH = os.path.join(DATA_DIR, "train.jsonl")
TEST_PATH = os.path.join(DATA_DIR, "test.jsonl")
DEFAULT_SEED = 0
DEFAULT_NUM_TRAIN = 400
DEFAULT_NUM_TEST = 100

NAMES = ("Mia", "Liam", "Ava", "Noah", "Emma", "Omar", "Sofia", "Ken", "Lena", "Ravi", "Zoe",
         "Sam")
ITEMS = ("apples", "pencils", "stickers", "marbles", "books", "cookies", "stamps", "shells",
         "cards", "balloons")


def _add(r: random.Random):
  a, b = r.randint(2, 20), r.randint(2, 20)
  name, item = r.choice(NAMES), r.choice(ITEMS)
  q = (f"{name} has {a} {item}. {name} gets {b} more {item}. "
       f"How many {item} does {name} have now?")
  steps = [f"{name} starts with {a} {item} and gets {b} more, so {a} + {b} = {a + b}."]
  return (a, b), q, steps, a + b


def _sub(r: random.Random):
  a = r.randint(5, 20)
  b = r.randint(1, a - 1)
  name, item = r.choice(NAMES), r.choice(ITEMS)
  q = f"{name} had {a} {item} and gave {b} of them away. How many {item} does {name} have left?"
  steps = [f"{name} had {a} {item} and gave away {b}, so {a} - {b} = {a - b} are left."]
  return (a, b), q, steps, a - b


def _mul(r: random.Random):
  a, b = r.randint(2, 9), r.randint(2, 9)
  item = r.choice(ITEMS)
  q = f"There are {a} boxes with {b} {item} in each box. How many {item} are there in total?"
  steps = [f"Each of the {a} boxes holds {b} {item}, so {a} * {b} = {a * b}."]
  return (a, b), q, steps, a * b


def _div(r: random.Random):
  b, each = r.randint(2, 9), r.randint(2, 9)
  a = b * each
  name, item = r.choice(NAMES), r.choice(ITEMS)
  q = (f"{name} shares {a} {item} equally among {b} friends. "
       f"How many {item} does each friend get?")
  steps = [f"{a} {item} split into {b} equal shares is {a} / {b} = {each}."]
  return (a, b), q, steps, each


def _add_sub(r: random.Random):
  a, b = r.randint(3, 20), r.randint(2, 15)
  c = r.randint(1, a + b - 1)
  name, item = r.choice(NAMES), r.choice(ITEMS)
  q = (f"{name} has {a} {item}, buys {b} more, and then gives {c} to a friend. "
       f"How many {item} does {name} have now?")
  steps = [f"After buying, {name} has {a} + {b} = {a + b} {item}.",
           f"After giving {c} away, {name} has {a + b} - {c} = {a + b - c}."]
  return (a, b, c), q, steps, a + b - c


def _mul_add(r: random.Random):
  a, b, c = r.randint(2, 9), r.randint(2, 9), r.randint(1, 20)
  name, item = r.choice(NAMES), r.choice(ITEMS)
  q = (f"{name} already has {c} {item} and buys {a} packs with {b} {item} in each pack. "
       f"How many {item} does {name} have in total?")
  steps = [f"The packs hold {a} * {b} = {a * b} {item}.",
           f"Together with the {c} {name} had, that is {a * b} + {c} = {a * b + c}."]
  return (a, b, c), q, steps, a * b + c


def _change(r: random.Random):
  a, b = r.randint(1, 9), r.randint(2, 9)
  bill = next(x for x in (20, 50, 100) if x > a * b)
  name = r.choice(NAMES)
  q = (f"A notebook costs {a} dollars. {name} buys {b} notebooks and pays with a {bill}-dollar "
       f"bill. How many dollars of change does {name} get?")
  steps = [f"{b} notebooks cost {b} * {a} = {a * b} dollars.",
           f"The change is {bill} - {a * b} = {bill - a * b} dollars."]
  return (a, b, bill), q, steps, bill - a * b


KINDS: dict[str, Callable] = {"add": _add, "sub": _sub, "mul": _mul, "div": _div,
                              "add_sub": _add_sub, "mul_add": _mul_add, "change": _change}


def solution_text(steps: list[str], answer: int, form: str) -> str:
  """Worked steps then the final answer in GSM8K (``"gsm8k"``) or MATH (``"math"``) form."""
  if form == "gsm8k":
    return "\n".join(steps) + f"\n#### {answer}"
  if form == "math":
    return " ".join(steps) + f" The answer is $\\boxed{{{answer}}}$."
  raise ValueError(f"unknown solution form {form!r}; expected 'gsm8k' or 'math'")


def _unique_problems(seed: int) -> Iterator[tuple]:
  """Distinct (kind, numbers, prompt, steps, answer), kinds in turn, forever (or until
  every kind is exhausted)."""
  r = random.Random(seed)
  seen: set = set()
  kinds = list(KINDS)
  misses = 0
  while misses < 10_000:
    kind = kinds[r.randrange(len(kinds))]
    nums, q, steps, ans = KINDS[kind](r)
    if (kind, nums) in seen:
      misses += 1
      continue
    misses = 0
    seen.add((kind, nums))
    yield kind, nums, q, steps, ans


def generate(seed: int = DEFAULT_SEED, num_train: int = DEFAULT_NUM_TRAIN,
             num_test: int = DEFAULT_NUM_TEST) -> dict[str, list[dict]]:
  """``{"train": [...], "test": [...]}`` records (see module doc), deterministic in ``seed``.

  The first ``num_test`` distinct problems form the test split and the next
  ``num_train`` the train split, so the splits share no (template, numbers).
  """
  problems = _unique_problems(seed)
  out: dict[str, list[dict]] = {}
  for split, n in (("test", num_test), ("train", num_train)):
    records = []
    for i in range(n):
      try:
        kind, _, q, steps, ans = next(problems)
      except StopIteration:
        raise ValueError(f"only {len(records)} distinct problems left for the {split} split "
                         f"(asked for {n})") from None
      form = "gsm8k" if i % 2 == 0 else "math"
      records.append({"id": f"{NAME}-{split}-{i:05d}", "kind": kind, "prompt": q,
                      "answer": str(ans), "solution": solution_text(steps, ans, form),
                      "verifier": VERIFIER})
    out[split] = records
  return out


def write_jsonl(records: list[dict], path: str) -> None:
  with open(path, "w", encoding="utf-8") as f:
    for rec in records:
      f.write(json.dumps(rec, ensure_ascii=False) + "\n")


def write(out_dir: str = DATA_DIR, **kwargs) -> dict[str, str]:
  """Generates and writes ``out_dir/train.jsonl`` and ``out_dir/test.jsonl``."""
  os.makedirs(out_dir, exist_ok=True)
  paths = {}
  for split, records in generate(**kwargs).items():
    paths[split] = os.path.join(out_dir, f"{split}.jsonl")
    write_jsonl(records, paths[split])
  return paths
