"""Code verifier: run the candidate program against test cases in the sandbox.

Example fields:
  * ``tests``: a list (or a JSON string of a list) of ``{"input": str,
    "output": str}``.
  * ``fn_name`` (optional): call-based tests (LeetCode style). Each test's
    ``input`` is a JSON list of arguments and ``output`` the JSON result; the
    program must define ``fn_name`` (or ``class Solution`` with that method).
    Without it, tests are stdin/stdout: ``input`` is fed on stdin and stdout
    must equal ``output`` up to trailing whitespace on each line and trailing
    blank lines.

The program is the last fenced ```python block of the response (or the whole
response if it has no fence). Each test is one sandboxed run (see
``sandbox.py``); the tests stop at the first failure unless
``reward_mode="fraction"``. Feedback is the first failing test's input,
expected and actual output, or the tail of its error, each truncated to
``max_field_chars``, e.g.::

  test 2 failed: wrong answer
  input: 3 4
  expected: 7
  got: 12

An example without tests is a ``bad_example`` error verdict, and a sandbox that
cannot run (e.g. no namespaces on this host, see ``sandbox.py``) a ``sandbox``
error verdict: neither is ever a reward.
"""

from __future__ import annotations

import json
import re
from typing import Any, Mapping

from fbos_jax.verifiers.base import CORRECT_FEEDBACK
from fbos_jax.verifiers.base import error_verdict
from fbos_jax.verifiers.base import register_verifier
from fbos_jax.verifiers.base import Verdict
from fbos_jax.verifiers.sandbox import Sandbox
from fbos_jax.verifiers.sandbox import SandboxError
from fbos_jax.verifiers.sandbox import SandboxLimits

_FENCE = re.compile(r"```[ \t]*(?:python3?|py)?[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)

_CALL_HARNESS = '''

# --- test harness (added by the verifier) ---
import json as _json, sys as _sys
_args = _json.loads(_sys.stdin.read())
_f = globals().get({fn!r})
if _f is None and "Solution" in globals():
    _f = getattr(Solution(), {fn!r})
if _f is None:
    raise NameError("the program does not define {fn}")
print(_json.dumps(_f(*_args)))
'''


def extract_code(response: str) -> str:
  """The last fenced python block, else the whole response."""
  blocks = _FENCE.findall(response)
  return blocks[-1] if blocks else response


def _clip(text: str, n: int) -> str:
  text = text.rstrip("\n")
  return text if len(text) <= n else text[:n] + " ...[truncated]"


def _tail(text: str, n: int) -> str:
  text = text.strip()
  return text if len(text) <= n else "...[truncated] " + text[-n:]


def _normalize(out: str) -> list[str]:
  lines = [line.rstrip() for line in out.replace("\r\n", "\n").split("\n")]
  while lines and not lines[-1]:
    lines.pop()
  return lines


@register_verifier("code")
class CodeVerifier:
  """Runs programs against ``example["tests"]`` in a ``Sandbox``.

  Args:
    wall_s / cpu_s / memory_mb / max_processes: per-test sandbox limits.
    reward_mode: "all" (1 iff every test passes; stops at the first failure)
      or "fraction" (passed / total; runs every test).
    max_field_chars: truncation of each feedback field.
    sandbox: an existing ``Sandbox`` to share (else one is made).
    feedback_reveals_answer: accepted for a uniform interface; the feedback
      shows a failing test (that is the spec), never a reference solution.
    isolation: the ``Sandbox`` isolation when one is made here
      ("namespaces", the default, refuses to run without them).
  """

  required_fields = ("tests",)  # the data loader refuses records without it

  def __init__(
      self,
      wall_s: float = 5.0,
      cpu_s: float = 4.0,
      memory_mb: int = 512,
      max_processes: int = 16,
      reward_mode: str = "all",
      max_field_chars: int = 200,
      sandbox: Sandbox | None = None,
      feedback_reveals_answer: bool = False,
      isolation: str = "namespaces",
  ):
    if reward_mode not in ("all", "fraction"):
      raise ValueError("reward_mode must be 'all' or 'fraction'")
    del feedback_reveals_answer
    self.limits = SandboxLimits(wall_s=wall_s, cpu_s=cpu_s,
                                memory_mb=memory_mb,
                                max_processes=max_processes)
    self.sandbox = sandbox or Sandbox(self.limits, isolation=isolation)
    self.reward_mode = reward_mode
    self.max_field_chars = max_field_chars

  def __call__(self, example: Mapping[str, Any], response: str) -> Verdict:
    tests = example.get("tests")
    if isinstance(tests, str):
      tests = json.loads(tests)
    if not tests:
      return error_verdict("bad_example", f"the example has no tests ({tests!r}); "
                           f"example id {example.get('id', '?')}")
    try:
      return self._verify(example, response, tests)
    except SandboxError as e:
      return error_verdict("sandbox", str(e))

  def _verify(self, example, response, tests) -> Verdict:
    code = extract_code(response)
    if not code.strip():
      return Verdict(0.0, "no code found in the response",
                     {"passed": 0, "total": len(tests)})
    fn = example.get("fn_name")
    program = code + (_CALL_HARNESS.format(fn=fn) if fn else "")
    passed, first_failure, statuses = 0, None, []
    for k, test in enumerate(tests, start=1):
      stdin = test["input"]
      if not isinstance(stdin, str):
        stdin = json.dumps(stdin)
      res = self.sandbox.run(program, stdin, limits=self.limits)
      failure = self._failure(k, test, res, call_based=bool(fn))
      statuses.append(res.status if failure is None or res.status != "ok"
                      else "wrong_answer")
      if failure is None:
        passed += 1
        continue
      first_failure = first_failure or failure
      if self.reward_mode == "all":
        break
    info = {"passed": passed, "total": len(tests), "statuses": statuses}
    if passed == len(tests):
      return Verdict(1.0, CORRECT_FEEDBACK, info)
    reward = passed / len(tests) if self.reward_mode == "fraction" else 0.0
    return Verdict(reward, first_failure, info)

  def _failure(self, k: int, test: Mapping[str, Any], res,
               call_based: bool) -> str | None:
    """The feedback for test ``k``, or None if it passed."""
    n = self.max_field_chars
    shown_in = test["input"] if isinstance(test["input"], str) else json.dumps(
        test["input"])
    where = f"input: {_clip(shown_in, n)}"
    if res.status == "timeout":
      return (f"test {k} failed: time limit exceeded ({self.limits.wall_s:g} s "
              f"wall, {self.limits.cpu_s:g} s CPU)\n{where}")
    if res.status == "memory":
      return (f"test {k} failed: memory limit exceeded "
              f"({self.limits.memory_mb} MB)\n{where}")
    if res.status == "output_limit":
      return f"test {k} failed: output limit exceeded\n{where}"
    if res.status != "ok":
      err = _tail(res.stderr, n) or f"exit status {res.returncode}"
      return f"test {k} failed: runtime error\n{where}\nerror: {err}"
    expected = test["output"]
    if call_based:
      want = json.loads(expected) if isinstance(expected, str) else expected
      try:
        ok = json.loads(res.stdout) == want
      except json.JSONDecodeError:
        ok = False
      expected_text = json.dumps(want)
    else:
      ok = _normalize(res.stdout) == _normalize(str(expected))
      expected_text = str(expected)
    if ok:
      return None
    return (f"test {k} failed: wrong answer\n{where}\n"
            f"expected: {_clip(expected_text, n)}\n"
            f"got: {_clip(res.stdout, n) or '(no output)'}")
