"""Math final-answer verifier: extract ``\\boxed{...}``, check with math-verify.

Feedback categories (``info["category"]``), in the order they are checked:
  * ``missing``: no final answer (no ``\\boxed{`` / no match of the pattern):
    ``"no final answer found: write the final answer as \\boxed{...}"``.
  * ``format``: a format violation: an unclosed or empty ``\\boxed{}``, or
    (with ``multiple_answers="error"``) several different boxed answers.
  * ``unparsable``: the final answer is not a mathematical expression that
    math-verify can parse.
  * ``wrong``: parsed but not equivalent to the reference. A hint of what kind
    is added only when it does not give the answer away:
      - the sign, when both values are non-zero reals of different sign and
        different magnitude (for ``-x`` vs ``x`` "the sign is wrong" would
        reveal the answer, so no hint);
      - the magnitude, when the ratio is beyond 10x and not an exact power of
        ten (a power of ten would reveal the digits);
      - the kind of object (number vs interval vs set vs ...), when it differs.
  * ``correct``: equivalent (math-verify ``verify(gold, pred)``).

An example whose reference answer is missing (no key, ``None`` or blank) gets
a ``bad_example`` error verdict, never a reward: ``str(None)`` would otherwise
make ``\\boxed{None}`` "correct".

math-verify's own timeouts use ``signal.alarm``, which only works in the main
thread; in worker threads they are disabled and the ``VerifierPool`` timeout is
what bounds a slow call.
"""

from __future__ import annotations

import logging
import re
import threading
from typing import Any, Mapping

from fbos_jax.verifiers.base import CORRECT_FEEDBACK
from fbos_jax.verifiers.base import error_verdict
from fbos_jax.verifiers.base import register_verifier
from fbos_jax.verifiers.base import Verdict

BOXED = "boxed"  # the default answer_pattern: brace-matched \boxed{...}
_BOXED_OPEN = re.compile(r"\\(?:boxed|fbox)\s*\{")


def extract_boxed(text: str) -> tuple[list[str], bool]:
  """Returns the contents of every ``\\boxed{...}`` (brace-matched), and
  whether one was left unclosed."""
  out, unclosed = [], False
  for m in _BOXED_OPEN.finditer(text):
    depth, i = 1, m.end()
    while i < len(text) and depth:
      depth += {"{": 1, "}": -1}.get(text[i], 0)
      i += 1
    if depth:
      unclosed = True
    else:
      out.append(text[m.end():i - 1])
  return out, unclosed


def _kind(x: Any) -> str:
  """A coarse, answer-free description of a parsed sympy object."""
  import sympy  # pylint: disable=g-import-not-at-top

  if isinstance(x, sympy.MatrixBase):
    return "a matrix"
  if isinstance(x, sympy.Interval) or isinstance(x, sympy.Union):
    return "an interval"
  if isinstance(x, sympy.FiniteSet):
    return "a set"
  if isinstance(x, (tuple, list, sympy.Tuple)):
    return "a tuple"
  if isinstance(x, (sympy.Eq, sympy.core.relational.Relational)):
    return "an equation or inequality"
  if isinstance(x, sympy.Basic) and x.is_number:
    return "a number"
  if isinstance(x, sympy.Basic):
    return "an expression"
  return "something else"


def _wrong_hint(gold: Any, pred: Any) -> str:
  """The "what kind of wrong" hint; "" when it would reveal the answer."""
  kg, kp = _kind(gold), _kind(pred)
  if kg != kp:
    return f"it should be {kg}, not {kp}"
  if kg != "a number":
    return ""
  try:
    if not (gold.is_real and pred.is_real):
      return ""
    g, p = float(gold), float(pred)
  except (TypeError, ValueError):
    return ""
  if g == 0 or p == 0 or abs(g) == abs(p):
    return ""
  if (g > 0) != (p > 0):
    return "its sign is wrong"
  ratio = abs(p) / abs(g)
  for k in range(-30, 31):  # an exact power of ten would reveal the digits
    if abs(ratio - 10.0**k) <= 1e-9 * 10.0**k:
      return ""
  if ratio > 10:
    return "it is more than 10 times too large"
  if ratio < 0.1:
    return "it is more than 10 times too small"
  return ""


@register_verifier("math")
class MathVerifier:
  """Verifies math final answers against ``example[answer_field]``.

  Args:
    feedback_reveals_answer: append ``"the correct answer is X"`` to wrong
      answers' feedback (off by default).
    answer_pattern: ``"boxed"`` (brace-matched ``\\boxed{...}``, the last one
      counts) or a regex whose group 1 is the answer (last match counts), e.g.
      ``r"(?im)^answer:\\s*(.+)$"``.
    multiple_answers: ``"last"`` (use the last boxed answer) or ``"error"``
      (several *different* boxed answers are a format violation).
    answer_field: the example key holding the reference answer.
    timeout_s: math-verify's own parse/verify timeout, used only when called
      from the main thread (see module doc).
  """

  required_fields = ("answer",)  # the data loader refuses records without it

  def __init__(
      self,
      feedback_reveals_answer: bool = False,
      answer_pattern: str = BOXED,
      multiple_answers: str = "last",
      answer_field: str = "answer",
      timeout_s: int = 5,
  ):
    if multiple_answers not in ("last", "error"):
      raise ValueError("multiple_answers must be 'last' or 'error'")
    self.feedback_reveals_answer = feedback_reveals_answer
    self.answer_pattern = answer_pattern
    self._regex = None if answer_pattern == BOXED else re.compile(answer_pattern)
    self.multiple_answers = multiple_answers
    self.answer_field = answer_field
    self.timeout_s = timeout_s

  def _where(self) -> str:
    return ("\\boxed{...}" if self._regex is None
            else f"a line matching {self.answer_pattern!r}")

  def extract(self, response: str) -> tuple[str | None, str, str]:
    """Returns ``(answer_text or None, category, feedback)``; category is
    "" when an answer was extracted."""
    if self._regex is not None:
      found = [m.group(1) for m in self._regex.finditer(response)]
      unclosed = False
    else:
      found, unclosed = extract_boxed(response)
    if not found and not unclosed:
      return None, "missing", f"no final answer found: write the final answer as {self._where()}"
    if unclosed and self._regex is None:
      return None, "format", "format violation: a \\boxed{ is never closed"
    answer = found[-1].strip()
    if not answer:
      return None, "format", "format violation: the final answer is empty"
    distinct = {" ".join(a.split()) for a in found}
    if self.multiple_answers == "error" and len(distinct) > 1:
      return None, "format", (
          f"format violation: {len(distinct)} different final answers; give "
          "exactly one")
    return answer, "", ""

  def _parse(self, text: str):
    from math_verify import parse  # pylint: disable=g-import-not-at-top
    from math_verify.parser import ExprExtractionConfig  # pylint: disable=g-import-not-at-top
    from math_verify.parser import LatexExtractionConfig  # pylint: disable=g-import-not-at-top

    parsed = parse(f"${text}$",
                   extraction_config=[LatexExtractionConfig(),
                                      ExprExtractionConfig()],
                   parsing_timeout=self._timeout())
    # parse() returns [sympy_obj, str] on success and [str] (or []) otherwise.
    return parsed if parsed and not isinstance(parsed[0], str) else None

  def _timeout(self):
    on_main = threading.current_thread() is threading.main_thread()
    if not on_main:
      # math_verify's own timeout uses signals, which work on the main thread only;
      # in the pool's workers the pool's per-call timeout (verifier.timeout_s)
      # bounds the call instead, so math_verify's warning about it is noise
      logging.getLogger("math_verify").setLevel(logging.ERROR)
    return self.timeout_s if on_main else None

  def __call__(self, example: Mapping[str, Any], response: str) -> Verdict:
    from math_verify import verify  # pylint: disable=g-import-not-at-top

    gold_raw = example.get(self.answer_field)
    gold_text = "" if gold_raw is None else str(gold_raw).strip()
    if not gold_text:
      return error_verdict(
          "bad_example", f"the example's reference answer "
          f"{self.answer_field!r} is missing ({gold_raw!r}); example id "
          f"{example.get('id', '?')}")
    answer, category, feedback = self.extract(response)
    info: dict[str, Any] = {"extracted": answer}
    if answer is None:
      return self._wrong(category, feedback, gold_text, info)
    pred = self._parse(answer)
    if pred is None:
      shown = answer if len(answer) <= 60 else answer[:57] + "..."
      return self._wrong("unparsable",
                         f"the final answer could not be parsed: {shown!r}",
                         gold_text, info)
    gold = self._parse(extract_boxed(gold_text)[0][-1]
                       if "\\boxed" in gold_text else gold_text)
    if gold is None:
      raise ValueError(f"reference answer {gold_text!r} could not be parsed")
    if verify(gold, pred, timeout_seconds=self._timeout()):
      info["category"] = "correct"
      return Verdict(1.0, CORRECT_FEEDBACK, info)
    hint = _wrong_hint(gold[0], pred[0])
    return self._wrong("wrong", "the final answer is wrong" +
                       (f": {hint}" if hint else ""), gold_text, info)

  def _wrong(self, category: str, feedback: str, gold_text: str,
             info: dict) -> Verdict:
    info["category"] = category
    if self.feedback_reveals_answer:
      feedback += f"; the correct answer is {gold_text}"
    return Verdict(0.0, feedback, info)
