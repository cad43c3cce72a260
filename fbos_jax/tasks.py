"""Procedural task families for the CPU configs, with a difficulty knob.

Each family generates short problems (prompts of at most ~40 characters,
answers of at most ~12 at the default difficulties) that a tiny model with a
character tokenizer can learn at the easy levels, while the hard levels stay
beyond it. Every family also knows how to check a response and say **what is
wrong and where**, without revealing the reference answer.

Feedback comes in two wordings (``style``): ``"prose"`` (the default, one
sentence per located error) and ``"compact"`` (the same facts, one short line
per kind of error, e.g. ``"extra: 9(9) 10(9); missing 2; order breaks at 7"``
instead of four sentences). They differ only for ``sort``, whose prose
feedback grows by about 47 characters per extra item: a feedback-augmented
prompt then needs far more tokens than the problem and the answer together
(median 76, 99th percentile 436 tokens on the tiny sorting task after its warm
start, against 41 and 118 in the compact wording).
:func:`longest_feedback_chars` and :func:`longest_prompt_chars` bound what a
family can emit, so a prompt budget can be sized to hold every FAP whole.

Families (``difficulty`` meaning in brackets):
  * ``arithmetic`` [digits per operand]: ``"12+45="`` -> ``"57"``.
  * ``sort`` [list length, >= 2]: ``"sort 5291="`` -> ``"1259"`` (ascending
    single digits; spaces and commas in the response are ignored).
  * ``countdown`` [how many numbers, >= 2]: ``"use 3 5 7 make 22="`` ->
    an expression such as ``"3*5+7"`` using every given number exactly once
    and only ``+ - *`` (parentheses allowed). Any such expression is correct.
  * ``chain`` [operations, 2..8]: ``"7*8 -9 +4 ="`` -> ``"56,47,51"``: the
    results of the operations applied **left to right** (no precedence), each
    written with two digits ("05"), every one in 0..99; the last is the final
    answer. Each operation takes 3 characters in the prompt as each result
    does in the response, so result k sits at a fixed distance from operation
    k. The feedback names the **first wrong result and its correct value**
    (prose "step 2 is 47"; compact, the results as they should start, one
    slot per result: "56,47,__"), but never the final answer: when the first
    wrong result is the last one it says only whether it is too high or too
    low (or missing).
    Problems are drawn so that no intermediate result equals the final answer
    and the final answer is >= 10, so no number the feedback can write (an
    intermediate result, a position or a count <= 8) is ever the final answer
    (:func:`feedback_reveals_answer` checks that, ``tests/test_chain_task.py``
    tries it on adversarial responses). This is the task "whose verifier knows
    what the prompt hides" of issue 24: the located feedback carries an
    intermediate result that blind sampling rarely finds.

Example dicts (what ``make_example`` returns and the data pipeline yields)::

  {"id": "arithmetic/train/0/17", "task": "arithmetic", "prompt": "12+45=",
   "answer": "57", "difficulty": 2, "split": "train", "verifier": "procedural",
   ...family extras (e.g. "numbers", "target")}

(The data pipeline replaces ``"verifier"`` with an explicitly configured
``data.verifier``; see ``data.py``.)

Generation is a pure function of ``(task, seed, index, difficulty range,
split)``. Train and eval are disjoint **by content**: a problem belongs to the
eval split iff a stable hash of its prompt falls in the first
``EVAL_PERCENT`` percent; each split rejection-samples until it draws one of
its own problems. So no eval problem is ever a training problem.
"""

from __future__ import annotations

import ast
import collections
import dataclasses
import hashlib
import random
import re
import sys
from typing import Any, Callable, Mapping, Optional, Sequence

EVAL_PERCENT = 10  # share of the problem space reserved for the eval split


@dataclasses.dataclass(frozen=True)
class Check:
  """The outcome of checking one response against one example.

  Attributes:
    correct: exactly right.
    score: partial-credit fraction in [0, 1] (1.0 iff ``correct``).
    errors: located feedback lines, empty when correct. They never contain
      the reference answer.
    info: extra data for logs.
  """

  correct: bool
  score: float
  errors: tuple[str, ...]
  info: dict = dataclasses.field(default_factory=dict)


FEEDBACK_STYLES = ("prose", "compact")


@dataclasses.dataclass(frozen=True)
class TaskFamily:
  """A procedural task family.

  Attributes:
    name: the ``example["task"]`` value.
    min_difficulty / max_difficulty: the valid difficulty range.
    generate: ``(rng, difficulty) -> dict`` with at least prompt and answer.
    check: ``(example, response_text, style) -> Check``.
    prompt_chars: ``difficulty -> int``, the longest prompt (characters) at
      that difficulty.
    feedback_chars: ``(max_difficulty, response_chars, style) -> int``, an upper
      bound on the characters of the feedback lines of any response of at most
      ``response_chars`` characters to a problem of difficulty at most
      ``max_difficulty``, joined by ``"; "``.
    answer_chars: ``difficulty -> int``, the longest reference answer.
    final_answer: ``example -> str``, the part of the reference answer that
      feedback must never reveal (the whole answer, except ``chain``: its last
      value, since its feedback names intermediate values by design).
    corrupt: ``(example, rng) -> str``, a wrong response that looks like a
      model's failure (the SFT warm start's corrections; :func:`corrupt`), or
      None: one changed character of the answer (``fbos_jax/rl/sft.py``).
  """

  name: str
  min_difficulty: int
  max_difficulty: int
  generate: Callable[[random.Random, int], dict]
  check: Callable[[Mapping[str, Any], str, str], Check]
  prompt_chars: Callable[[int], int]
  feedback_chars: Callable[[int, int, str], int]
  answer_chars: Callable[[int], int]
  final_answer: Callable[[Mapping[str, Any]], str] = lambda ex: str(ex["answer"])
  corrupt: Optional[Callable[[Mapping[str, Any], random.Random], str]] = None


def _positions_chars(first: int, last: int, sep: int) -> int:
  """Characters of the positions first..last written out, ``sep`` between two."""
  if last < first:
    return 0
  return sum(len(str(j)) for j in range(first, last + 1)) + sep * (last - first)


def _join_positions(positions: Sequence[int]) -> str:
  """[2] -> "2"; [1, 3] -> "1 and 3"; [1, 2, 4] -> "1, 2 and 4"."""
  p = [str(x) for x in positions]
  return p[0] if len(p) == 1 else ", ".join(p[:-1]) + " and " + p[-1]


def _plural(n: int, word: str) -> str:
  return f"{n} {word}" if n == 1 else f"{n} {word}s"


# ---------------------------------------------------------------- arithmetic


def _gen_arithmetic(rng: random.Random, d: int) -> dict:
  lo, hi = (0, 9) if d == 1 else (10 ** (d - 1), 10**d - 1)
  a, b = rng.randint(lo, hi), rng.randint(lo, hi)
  return {"prompt": f"{a}+{b}=", "answer": str(a + b)}


def _arithmetic_feedback_chars(d: int, length: int, style: str) -> int:
  """Bound of :func:`_check_arithmetic`'s feedback (one wording for both styles):
  a length line and the wrong digit positions (the answer has <= d + 1 digits)."""
  del style
  k = min(length, d + 1)
  fixed = max(len("the response is empty"), len("the answer is not a number"))
  digits = (len(f"the answer has {length} digits, expected {d + 1}") + 2
            + len("digits  from the right are wrong") + _positions_chars(1, k, 2) + 3)
  return max(fixed, digits)


def _check_arithmetic(example: Mapping[str, Any], response: str,
                      style: str = "prose") -> Check:
  """Feedback: number format, digit count, and wrong digit positions.

  Digit positions count from the right (units digit = 1), so they stay
  meaningful when the answer has the wrong length. One wording for both styles.
  """
  del style
  ans, r = str(example["answer"]), response.strip()
  if not r:
    return Check(False, 0.0, ("the response is empty",))
  if not r.isdigit() or not r.isascii():
    return Check(False, 0.0, ("the answer is not a number",))
  if r == ans:
    return Check(True, 1.0, ())
  errors = []
  if len(r) != len(ans):
    errors.append(
        f"the answer has {_plural(len(r), 'digit')}, expected {len(ans)}")
  wrong = [k for k in range(1, min(len(r), len(ans)) + 1) if r[-k] != ans[-k]]
  if wrong:
    noun = "digit" if len(wrong) == 1 else "digits"
    verb = "is" if len(wrong) == 1 else "are"
    errors.append(f"{noun} {_join_positions(wrong)} from the right {verb} wrong")
  matched = min(len(r), len(ans)) - len(wrong)
  return Check(False, matched / max(len(r), len(ans)), tuple(errors))


# ---------------------------------------------------------------------- sort


def _gen_sort(rng: random.Random, d: int) -> dict:
  items = "".join(rng.choice("0123456789") for _ in range(d))
  return {"prompt": f"sort {items}=", "answer": "".join(sorted(items)),
          "items": items}


def _check_sort(example: Mapping[str, Any], response: str,
                style: str = "prose") -> Check:
  """Feedback: items not in the input, extra copies, missing items, order breaks.

  Item positions are 1-based positions in the response (after dropping spaces
  and commas). ``prose``: one sentence per misplaced item ("item 3 (2) appears
  more times than in the input"); ``compact``: one line per kind ("not in
  input: 4(7) 6(x)", "extra: 3(2)", "missing 2", "order breaks at 4 5").
  """
  ans = str(example["answer"])
  want = collections.Counter(ans)
  r = response.strip().replace(" ", "").replace(",", "")
  if not r:
    return Check(False, 0.0, ("the response is empty",))
  if r == ans:
    return Check(True, 1.0, ())
  errors, not_in, extra = [], [], []
  seen: collections.Counter = collections.Counter()
  for j, c in enumerate(r, start=1):
    seen[c] += 1
    if c not in want:
      not_in.append(f"{j}({c})")
      if style == "prose":
        errors.append(f"item {j} ({c}) is not in the input")
    elif seen[c] > want[c]:
      extra.append(f"{j}({c})")
      if style == "prose":
        errors.append(f"item {j} ({c}) appears more times than in the input")
  if style == "compact":
    if not_in:
      errors.append("not in input: " + " ".join(not_in))
    if extra:
      errors.append("extra: " + " ".join(extra))
  bad = len(not_in) + len(extra)
  missing = sum((want - collections.Counter(r)).values())
  breaks = [j for j in range(2, len(r) + 1) if r[j - 1] < r[j - 2]]
  if style == "compact":
    if missing:
      errors.append(f"missing {missing}")
    if breaks:
      errors.append("order breaks at " + " ".join(map(str, breaks)))
  else:
    if missing:
      errors.append(f"the list is missing {_plural(missing, 'item')}")
    if breaks:
      noun, verb = ("item", "breaks") if len(breaks) == 1 else ("items", "break")
      errors.append(f"{noun} {_join_positions(breaks)} {verb} the ascending order")
  if not errors:  # unreachable for single-char items; kept as a safe default
    errors.append("the list is wrong")
  score = max(0.0, 1.0 - (bad + missing + len(breaks)) / max(len(ans), len(r)))
  return Check(False, score, tuple(errors))


def _sort_feedback_chars(d: int, length: int, style: str) -> int:
  """Bound of :func:`_check_sort`'s feedback for a response of ``length``
  characters (each item one character) to a list of at most ``d`` items.

  Every response position is at most one not-in-input or extra entry; the
  missing count is at most ``d``; order breaks are at positions 2..length."""
  empty = len("the response is empty")
  if length < 1:
    return empty
  if style == "compact":
    items = (len("not in input: ") + len("extra: ") + _positions_chars(1, length, 1)
             + 3 * length + 1)  # "j(c)" each, one space between, one more split
    missing = len(f"missing {d}")
    breaks = len("order breaks at ") + _positions_chars(2, length, 1)
    return max(empty, items + missing + breaks + 2 * 3)
  items = sum(len(f"item {j} (c) appears more times than in the input") + 2
              for j in range(1, length + 1))  # the longer sentence, "; " after each
  missing = len(f"the list is missing {d} items") + 2
  breaks = len("items  break the ascending order") + _positions_chars(2, length, 2) + 3
  return max(empty, items + missing + breaks, len("the list is wrong"))


# ----------------------------------------------------------------- countdown

_COUNT_WORDS = {1: "once", 2: "twice", 3: "three times"}
_OPS = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*"}


def _times(k: int) -> str:
  return _COUNT_WORDS.get(k, f"{k} times")


def _gen_countdown(rng: random.Random, d: int) -> dict:
  while True:
    nums = [rng.randint(1, 9) for _ in range(d)]
    order = nums[:]
    rng.shuffle(order)
    expr = str(order[0])
    for n in order[1:]:
      expr += rng.choice("+-*") + str(n)
    target = eval(expr, {"__builtins__": {}})  # only digits and + - *
    if 0 < target <= 999:
      break
  return {
      "prompt": f"use {' '.join(map(str, nums))} make {target}=",
      "answer": expr,
      "numbers": nums,
      "target": target,
  }


class _BadExpression(Exception):
  pass


def _eval_countdown(node: ast.AST, used: list[int]) -> int:
  """Evaluates a + - * integer expression AST, recording the literals."""
  if isinstance(node, ast.Expression):
    return _eval_countdown(node.body, used)
  if isinstance(node, ast.Constant) and type(node.value) is int:
    used.append(node.value)
    return node.value
  if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
    a = _eval_countdown(node.left, used)
    b = _eval_countdown(node.right, used)
    return a + b if isinstance(node.op, ast.Add) else (
        a - b if isinstance(node.op, ast.Sub) else a * b)
  if isinstance(node, ast.BinOp):
    raise _BadExpression(type(node.op).__name__)
  raise _BadExpression("other")


def _countdown_feedback_chars(d: int, length: int, style: str) -> int:
  """A loose bound of :func:`_check_countdown`'s feedback (one wording): the
  bad-character line, or one line per distinct literal (at most (length+1)/2,
  their digits at most ``length``), one per given number, and the value line
  (a + - * expression of ``length`` characters has at most ``length + 1``
  characters of value, sign included)."""
  del style
  # up to three reprs of a bad character (at most 12 characters each: '\U000e0001')
  bad_chars = len("the expression may only use digits, + - * and parentheses, found ") + 3 * 12 + 2
  literals = (length + 1) // 2
  times = max(len("three times"), len(f"{length} times"))
  per_line = len("the expression uses , but it is given ") + 2 * times + 2  # + "; "
  valid = (literals * per_line + length  # the literals' digits: at most length in all
           + d * (per_line + 1)  # the given numbers are single digits
           + len("the expression equals , not 999") + length + 1)
  return max(bad_chars, len("the expression is too long"), valid)


def _check_countdown(example: Mapping[str, Any], response: str,
                     style: str = "prose") -> Check:
  """Feedback: syntax, allowed operators, number usage, and the value (one
  wording for both styles)."""
  del style
  r = response.strip()
  nums = collections.Counter(int(n) for n in example["numbers"])
  target = int(example["target"])
  if not r:
    return Check(False, 0.0, ("the response is empty",))
  if len(r) > 200 or not all(c in "0123456789+-*() " for c in r):
    bad = sorted({c for c in r if c not in "0123456789+-*() "})
    if bad:
      return Check(False, 0.0, (
          "the expression may only use digits, + - * and parentheses, "
          f"found {' '.join(repr(c) for c in bad[:3])}",))
    return Check(False, 0.0, ("the expression is too long",))
  used: list[int] = []
  try:
    value = _eval_countdown(ast.parse(r, mode="eval"), used)
  except (SyntaxError, _BadExpression, RecursionError, ValueError):
    return Check(False, 0.0, ("the expression is not valid",))
  got = collections.Counter(used)
  errors = []
  for n, k in got.items():
    if n not in nums:
      errors.append(f"the expression uses {n}, which is not given")
    elif k > nums[n]:
      tail = "" if nums[n] == 1 else f", but it is given {_times(nums[n])}"
      errors.append(f"the expression uses {n} {_times(k)}{tail}")
  for n, k in nums.items():
    if got[n] < k:
      errors.append(f"the expression does not use {n}" if got[n] == 0 else
                    f"the expression uses {n} {_times(got[n])}, but it is "
                    f"given {_times(k)}")
  numbers_ok = not errors
  if value != target:
    errors.append(f"the expression equals {value}, not {target}")
  if not errors:
    return Check(True, 1.0, ())
  score = (numbers_ok + 0.0) / 2.0  # half credit for using the numbers right
  return Check(False, score, tuple(errors), {"value": value})


# --------------------------------------------------------------------- chain

CHAIN_MAX_VALUE = 99  # every intermediate value lies in 0..99, written with 2 digits
CHAIN_MIN_FINAL = 10  # > every number the feedback writes besides values (positions, counts)
_CHAIN_MAX_OPS = 8


def _chain_apply(v: int, op: str, x: int) -> int:
  return v + x if op == "+" else (v - x if op == "-" else v * x)


def _gen_chain(rng: random.Random, d: int) -> dict:
  while True:
    v = start = rng.randint(1, 9)
    steps = []
    for _ in range(d):
      x = rng.randint(1, 9)
      choices = [op for op, ok in (("+", v + x <= CHAIN_MAX_VALUE), ("-", v - x >= 0),
                                   ("*", x >= 2 and v * x <= CHAIN_MAX_VALUE)) if ok]
      op = rng.choice(choices)  # never empty: v > 90 allows "-", v <= 90 allows "+"
      v = _chain_apply(v, op, x)
      steps.append((op, x, v))
    values = [s[2] for s in steps]
    # the feedback may name any intermediate value: none may be the final answer
    if values[-1] >= CHAIN_MIN_FINAL and values[-1] not in values[:-1]:
      break
  # Each operation takes 3 characters ("*8 "), as each result does ("56,"): step k
  # of the response sits at a fixed distance from operation k of the prompt.
  prompt = str(start) + "".join(f"{op}{x} " for op, x, _ in steps) + "="
  return {"prompt": prompt, "answer": ",".join(f"{v:02d}" for v in values), "values": values}


def _chain_final(example: Mapping[str, Any]) -> str:
  return str(example["answer"]).split(",")[-1]


def _check_chain(example: Mapping[str, Any], response: str, style: str = "prose") -> Check:
  """Feedback on a chain: the first wrong (or missing) result and its correct
  value, unless it is the last step (then only whether it is too high or too
  low, missing or not a number), and whether there are too many or too few
  results. Results are the comma-separated parts of the response (two digits
  each), 1-based; spaces are ignored. Nothing of the response is echoed (an
  echoed number could be the final answer).

  ``prose``: "step 2 is 47" / "step 4 is too high" / "step 4 is missing" /
  "step 4 is not a number", after "write 4 results, you wrote too many" when
  the count is wrong. ``compact``: the results as they should start, one slot
  per result, up to the first wrong one, "__" after it: "12,47,__,__"; a wrong
  last result is "hi" / "lo" / "??" and "ok" marks a right one (a count note,
  "too many: " / "too few: ", goes before the slots). The slots have the
  length of a response, and they end the feedback, so in a FAP that ends
  with the problem each slot sits at a fixed distance from the result it
  speaks of."""
  gold = str(example["answer"]).split(",")
  d = len(gold)
  r = response.strip()
  if not r and style != "compact":
    return Check(False, 0.0, ("the response is empty",))
  parts = [p.replace(" ", "") for p in r.split(",")] if r else []
  if parts == gold:
    return Check(True, 1.0, ())
  k = next((i for i in range(min(len(parts), d)) if parts[i] != gold[i]), min(len(parts), d))
  last = None  # what is wrong with the last result, when it is the first wrong one
  if k == d - 1:
    if k >= len(parts):
      last = "missing"
    elif not (parts[k].isascii() and parts[k].isdigit()):
      last = "not a number"
    else:
      last = "too high" if int(parts[k]) > int(gold[k]) else "too low"
  many = len(parts) > d
  score = k / max(d, len(parts), 1)
  info = {"first_wrong": k + 1}
  if style == "compact":
    slots = [gold[i] if i <= k and i < d - 1 else "__" for i in range(d)]
    if k >= d - 1:
      slots[d - 1] = {"missing": "??", "not a number": "??", "too high": "hi",
                      "too low": "lo", None: "ok"}[last]
    note = "" if len(parts) == d else ("too many: " if many else "too few: ")
    return Check(False, score, (note + ",".join(slots),), info)
  errors = []
  if len(parts) != d:
    errors.append(f"write {d} results, you wrote too {'many' if many else 'few'}")
  if k < d - 1:
    errors.append(f"step {k + 1} is {gold[k]}")
  elif last is not None:
    errors.append(f"step {d} is {last}")
  return Check(False, score, tuple(errors), info)


def _corrupt_chain(example: Mapping[str, Any], rng: random.Random) -> str:
  """A wrong chain as a small model gets them wrong: one result off by a little
  (1-10), the later ones computed from it, each right or off a little again.
  Never correct."""
  values = [int(v) for v in str(example["answer"]).split(",")]
  ops = [(example["prompt"][1 + 3 * i], int(example["prompt"][2 + 3 * i]))
         for i in range(len(values))]
  v, k = int(example["prompt"][0]), rng.randrange(len(values))
  out = []
  for i, (op, x) in enumerate(ops):
    v = _chain_apply(v, op, x)
    if i == k or (i > k and rng.random() < 0.4):
      v += rng.choice([-1, 1]) * rng.randint(1, 10)
    v = min(max(v, 0), CHAIN_MAX_VALUE)
    out.append(f"{v:02d}")
  text = ",".join(out)
  return text if text != example["answer"] else text + ",00"


def _chain_feedback_chars(d: int, length: int, style: str) -> int:
  """Bound of :func:`_check_chain`'s feedback; it does not depend on the
  response (nothing of it is echoed): prose, a count line, "; " and a step
  line; compact, the count note and the slots."""
  del length
  if style == "compact":
    return len("too many: ") + 3 * d - 1
  count = len(f"write {d} results, you wrote too many")
  step = max(len(f"step {d} is {CHAIN_MAX_VALUE}"), len(f"step {d} is not a number"),
             len(f"step {d} is missing"), len(f"step {d} is too high"))
  return max(len("the response is empty"), count + 2 + step)


# ----------------------------------------------------------------- registry

FAMILIES: dict[str, TaskFamily] = {
    f.name: f
    for f in (
        TaskFamily("arithmetic", 1, 12, _gen_arithmetic, _check_arithmetic,
                   prompt_chars=lambda d: 2 * d + 2, feedback_chars=_arithmetic_feedback_chars,
                   answer_chars=lambda d: d + 1),
        TaskFamily("sort", 2, 30, _gen_sort, _check_sort,
                   prompt_chars=lambda d: len("sort =") + d, feedback_chars=_sort_feedback_chars,
                   answer_chars=lambda d: d),
        TaskFamily("countdown", 2, 6, _gen_countdown, _check_countdown,
                   prompt_chars=lambda d: len("use  make 999=") + 2 * d - 1,
                   feedback_chars=_countdown_feedback_chars, answer_chars=lambda d: 2 * d - 1),
        TaskFamily("chain", 2, _CHAIN_MAX_OPS, _gen_chain, _check_chain,
                   prompt_chars=lambda d: 3 * d + 2, feedback_chars=_chain_feedback_chars,
                   answer_chars=lambda d: 3 * d - 1, final_answer=_chain_final,
                   corrupt=_corrupt_chain),
    )
}


def get_family(name: str) -> TaskFamily:
  if name not in FAMILIES:
    raise KeyError(f"unknown task family {name!r}; known: {sorted(FAMILIES)}")
  return FAMILIES[name]


def _in_eval_split(task: str, prompt: str) -> bool:
  h = hashlib.sha256(f"{task}|{prompt}".encode()).digest()
  return int.from_bytes(h[:8], "big") % 100 < EVAL_PERCENT


def make_example(
    task: str,
    index: int,
    *,
    seed: int = 0,
    difficulty: int = 1,
    max_difficulty: int | None = None,
    split: str = "train",
) -> dict:
  """Generates example ``index`` of a family, deterministically.

  Args:
    task: family name ("arithmetic", "sort", "countdown").
    index: any non-negative int; the same arguments always give the same
      example.
    seed: generation seed.
    difficulty: the difficulty, or the lower end of a range.
    max_difficulty: if set, the difficulty is drawn uniformly from
      ``[difficulty, max_difficulty]`` per example.
    split: "train" or "eval"; the two draw from disjoint problem sets.

  Returns:
    The example dict (see module doc).
  """
  fam = get_family(task)
  if split not in ("train", "eval"):
    raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
  hi = difficulty if max_difficulty is None else max_difficulty
  if not fam.min_difficulty <= difficulty <= hi <= fam.max_difficulty:
    raise ValueError(
        f"{task}: difficulty range [{difficulty}, {hi}] outside "
        f"[{fam.min_difficulty}, {fam.max_difficulty}]")
  want_eval = split == "eval"
  for attempt in range(10_000):
    # A str seed goes through sha512, so this is stable across processes.
    rng = random.Random(f"{task}|{seed}|{index}|{attempt}")
    d = rng.randint(difficulty, hi)
    ex = fam.generate(rng, d)
    if _in_eval_split(task, ex["prompt"]) == want_eval:
      break
  else:  # pragma: no cover - needs a problem space with no eval members
    raise RuntimeError(f"{task}: no {split} problem at difficulty {d}")
  return {
      "id": f"{task}/{split}/{seed}/{index}",
      "task": task,
      "prompt": ex.pop("prompt"),
      "answer": ex.pop("answer"),
      "difficulty": d,
      "split": split,
      "verifier": "procedural",
      **ex,
  }


def solve(example: Mapping[str, Any]) -> str:
  """The reference response text (for SFT demonstrations); no EOS."""
  return str(example["answer"])


def check(example: Mapping[str, Any], response: str, style: str = "prose") -> Check:
  """Checks ``response`` against a procedural example of any family; ``style``
  picks the feedback wording (``FEEDBACK_STYLES``)."""
  if style not in FEEDBACK_STYLES:
    raise ValueError(f"feedback style {style!r}; expected one of {FEEDBACK_STYLES}")
  return get_family(example["task"]).check(example, response, style)


def corrupt(example: Mapping[str, Any], rng: random.Random) -> Optional[str]:
  """A model-like wrong response to a procedural example (``TaskFamily.corrupt``),
  or None when its family has no such generator (or it is not procedural)."""
  fam = FAMILIES.get(str(example.get("task", "")))
  return fam.corrupt(example, rng) if fam and fam.corrupt else None


def final_answer(example: Mapping[str, Any]) -> str:
  """The part of an example's reference answer that feedback must not reveal
  (``TaskFamily.final_answer``; the whole answer for a non-procedural record)."""
  fam = FAMILIES.get(str(example.get("task", "")))
  return fam.final_answer(example) if fam else str(example["answer"])


_NUMBER_WORDS = dict(
    [(w, i) for i, w in enumerate(
        "zero one two three four five six seven eight nine ten eleven twelve thirteen "
        "fourteen fifteen sixteen seventeen eighteen nineteen twenty".split())]
    + [(w, i + 1) for i, w in enumerate(
        "first second third fourth fifth sixth seventh eighth ninth tenth".split())]
    + [("once", 1), ("twice", 2)])


def _canonical_int(text: str) -> bool:
  return text.isascii() and text.isdigit() and (text == "0" or not text.startswith("0"))


def feedback_reveals_answer(feedback: str, example: Mapping[str, Any]) -> bool:
  """Whether ``feedback`` contains the example's final answer (:func:`final_answer`)
  as a number: a run of digits equal to it as an integer ("047" is 47), or a
  number word ("three", "third") of it; a non-numeric answer, as a substring."""
  final = final_answer(example).strip()
  if not final:
    return False
  if not _canonical_int(final):
    return final in feedback or any(t == final for t in re.findall(r"\d+", feedback))
  want = int(final)
  if any(int(t) == want for t in re.findall(r"\d+", feedback)):
    return True
  return any(_NUMBER_WORDS.get(w) == want for w in re.findall(r"[a-z]+", feedback.lower()))


def wrong_responses(example: Mapping[str, Any], rng: random.Random, k: int = 64) -> list[str]:
  """Up to ``k`` wrong responses to ``example``, adversarial to a feedback that
  could leak the answer: the final answer alone, repeated or in every position,
  its neighbours, prefixes and extensions of the reference, one value changed,
  leading zeros, signs, non-ASCII digits, separators only, long noise and
  random digit strings. Every one is checked wrong (``check``)."""
  ans, final = str(example["answer"]), final_answer(example)
  parts = ans.split(",")
  cands = ["", " ", ",", ",,,", final, f"{final},{final}", ",".join([final] * len(parts)),
           final + ",", "," + final, "0" + final, "-" + final, final + "0", ans + ",",
           ans + "," + final, ans + ",0", ",".join(parts[:-1]), ans[:-1], ans + "9",
           "\u0663" + final, final * 30, "x" * 70, ans.replace(",", ";"), ans.replace(",", " ")]
  if _canonical_int(final):
    f = int(final)
    cands += [str(f + dx) for dx in (-10, -2, -1, 1, 2, 10) if f + dx >= 0]
  for i in range(len(parts)):  # one value changed, everything else right
    for v in (final, "0", str(rng.randint(0, 99)), parts[i] + "0", "a"):
      cands.append(",".join(parts[:i] + [v] + parts[i + 1:]))
    cands.append(",".join(parts[:i]))  # a prefix
  while len(cands) < 4 * k:
    n = rng.randint(1, 24)
    cands.append("".join(rng.choice("0123456789,") for _ in range(n)))
  out, seen = [], set()
  for c in cands:
    if c not in seen and not check(example, c).correct:
      seen.add(c)
      out.append(c)
  rng.shuffle(out)
  return out[:k]


def _families(task: str | Sequence[str]) -> list[TaskFamily]:
  names = [t.strip() for t in task.split(",") if t.strip()] if isinstance(task, str) else task
  return [get_family(t) for t in names]


def longest_prompt_chars(task: str | Sequence[str], max_difficulty: int) -> int:
  """The longest prompt (characters) of the families ``task`` (a name or a
  comma list, as ``data.task``) up to ``max_difficulty``."""
  return max(f.prompt_chars(max_difficulty) for f in _families(task))


def longest_feedback_chars(task: str | Sequence[str], max_difficulty: int,
                           response_chars: int, *, style: str = "prose",
                           reveals_answer: bool = False) -> int:
  """An upper bound on the feedback (characters) the procedural verifier can
  write for any response of at most ``response_chars`` characters to a problem
  of the families ``task`` up to ``max_difficulty``: the longest prompt of a
  feedback-augmented prompt budget (``fbos_jax.rl.fap_budget.longest_fap_tokens``).
  ``reveals_answer``: ``data.feedback_reveals_answer`` appends the answer."""
  if style not in FEEDBACK_STYLES:
    raise ValueError(f"feedback style {style!r}; expected one of {FEEDBACK_STYLES}")
  out = 0
  for f in _families(task):
    n = f.feedback_chars(max_difficulty, response_chars, style)
    if reveals_answer:
      n += len("; the correct answer is ") + f.answer_chars(max_difficulty)
    out = max(out, n)
  return out


class ProceduralSource:
  """A random-access source of procedural examples (grain-compatible).

  ``source[i]`` is ``make_example(tasks[i % k], i // k, ...)`` for the
  ``k`` families in ``tasks``, so a mixture is interleaved round-robin. With
  ``num_examples=None`` the source is "infinite": ``len`` is ``sys.maxsize``.
  """

  def __init__(
      self,
      tasks: str | Sequence[str],
      *,
      seed: int = 0,
      difficulty: int = 1,
      max_difficulty: int | None = None,
      split: str = "train",
      num_examples: int | None = None,
  ):
    if isinstance(tasks, str):
      tasks = [t.strip() for t in tasks.split(",") if t.strip()]
    self.tasks = list(tasks)
    for t in self.tasks:
      get_family(t)
    self.kwargs = dict(seed=seed, difficulty=difficulty,
                       max_difficulty=max_difficulty, split=split)
    self.num_examples = num_examples

  def __len__(self) -> int:
    return sys.maxsize if self.num_examples is None else self.num_examples

  def __getitem__(self, index: int) -> dict:
    if index < 0 or index >= len(self):
      raise IndexError(index)
    k = len(self.tasks)
    return make_example(self.tasks[index % k], index // k, **self.kwargs)

  def __repr__(self) -> str:
    return (f"ProceduralSource(tasks={self.tasks}, {self.kwargs}, "
            f"num_examples={self.num_examples})")
