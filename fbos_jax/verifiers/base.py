"""The verifier protocol, the registry, and the pool that runs verifiers safely.

A **verifier** is any plain callable ``(example: dict, response_text: str) ->
Verdict``. ``example`` is one data record (``prompt``, ``answer`` and whatever
else the dataset carries); ``response_text`` is the decoded response, without
the EOS token. A verifier may also return a ``(reward, feedback)`` or
``(reward, feedback, info)`` tuple; the pool converts it.

The trainer never calls a verifier directly; it calls ``VerifierPool.run`` with
the whole batch. The pool runs the calls concurrently with a per-call timeout,
and turns every failure (exception, timeout, hang, a worker process dying, a
malformed return value) into ``Verdict(0.0, "verifier error: <kind>: ...",
{"error": kind})``, so one bad verifier call never stops training. Each error
kind is logged once per pool (absl logging) and counted in the returned stats.

Registry: built-in verifiers register under short names ("procedural", "math",
"ifeval", "code"); a user verifier is named by import path
``"package.module:attr"`` on the command line, e.g.
``--config.data.verifier=my_pkg.checks:my_verifier``.
"""

from __future__ import annotations

import dataclasses
import importlib
import math
import multiprocessing
import multiprocessing.connection
import pickle
import queue
import threading
import time
from typing import Any, Callable, Mapping, Sequence

from absl import logging

CORRECT_FEEDBACK = "correct"  # feedback of a fully correct response
ERROR_PREFIX = "verifier error"
ERROR_KINDS = ("exception", "timeout", "bad_return", "crash")


@dataclasses.dataclass(frozen=True)
class Verdict:
  """What a verifier says about one response.

  Attributes:
    reward: scalar reward, usually in [0, 1]; 1.0 means fully correct.
    feedback: natural-language feedback saying what is wrong and where
      ("correct" when nothing is). By default it must not reveal the
      reference answer.
    info: free-form extra data for logging (error kind, parsed answer, ...).
  """

  reward: float
  feedback: str
  info: dict = dataclasses.field(default_factory=dict)


Verifier = Callable[[Mapping[str, Any], str], Verdict]


def error_verdict(kind: str, detail: str) -> Verdict:
  """The verdict that stands in for a failed verifier call (reward 0)."""
  return Verdict(0.0, f"{ERROR_PREFIX}: {kind}: {detail}", {"error": kind})


def coerce_verdict(result: Any) -> Verdict:
  """Converts a verifier's return value into a ``Verdict``.

  Accepts a ``Verdict`` or a ``(reward, feedback[, info])`` tuple with a finite
  reward. Anything else becomes a ``bad_return`` error verdict.
  """
  if isinstance(result, tuple) and len(result) in (2, 3):
    info = dict(result[2]) if len(result) == 3 else {}
    try:
      result = Verdict(float(result[0]), str(result[1]), info)
    except (TypeError, ValueError):
      pass
  if not isinstance(result, Verdict):
    return error_verdict(
        "bad_return", f"expected a Verdict, got {type(result).__name__}")
  try:
    reward = float(result.reward)
  except (TypeError, ValueError):
    reward = math.nan
  if not math.isfinite(reward):
    return error_verdict("bad_return", f"reward is not finite: {result.reward!r}")
  if reward != result.reward or not isinstance(result.feedback, str):
    result = Verdict(reward, str(result.feedback), dict(result.info or {}))
  return result


# ----------------------------------------------------------------------------
# Registry.

_REGISTRY: dict[str, Callable[..., Verifier]] = {}
# Built-in name -> module under fbos_jax.verifiers, imported on first use.
_BUILTIN_MODULES = {"procedural": "procedural", "math": "math",
                    "ifeval": "ifeval", "code": "code"}


def register_verifier(name: str):
  """Decorator: registers a verifier factory (a class or function) by name.

  ``get_verifier(name, **kwargs)`` then returns ``factory(**kwargs)``.

  Example::

    @register_verifier("exact")
    class ExactMatch:
      def __call__(self, example, response):
        ok = response.strip() == example["answer"]
        return Verdict(float(ok), "correct" if ok else "wrong answer")
  """

  def decorate(factory):
    _REGISTRY[name] = factory
    return factory

  return decorate


def _load_builtins(names=None) -> None:
  for name in _BUILTIN_MODULES if names is None else names:
    if name in _BUILTIN_MODULES:
      importlib.import_module(f"fbos_jax.verifiers.{_BUILTIN_MODULES[name]}")


def list_verifiers() -> list[str]:
  """Names of the registered verifiers (built-ins included)."""
  _load_builtins()
  return sorted(_REGISTRY)


def get_verifier(name_or_path: str, **kwargs: Any) -> Verifier:
  """Returns a verifier by registered name or by ``"module.path:attr"``.

  Args:
    name_or_path: a registered name ("procedural", "math", "ifeval", "code",
      or one added with ``register_verifier``), or an import path
      ``"pkg.module:attr"`` (``attr`` may be dotted). For an import path, a
      class, or any callable when ``kwargs`` are given, is called with
      ``kwargs`` to build the verifier; otherwise ``attr`` is the verifier.
    **kwargs: options for the verifier factory (e.g.
      ``feedback_reveals_answer=True``).

  Raises:
    KeyError: unknown name (the message lists the known ones).
    ImportError / AttributeError: a bad import path.
  """
  if ":" in name_or_path:
    module_name, attr = name_or_path.split(":", 1)
    obj: Any = importlib.import_module(module_name)
    for part in attr.split("."):
      obj = getattr(obj, part)
    if isinstance(obj, type) or kwargs:
      obj = obj(**kwargs)
    if not callable(obj):
      raise TypeError(f"verifier {name_or_path!r} is not callable")
    return obj
  if name_or_path not in _REGISTRY:
    _load_builtins([name_or_path])
  if name_or_path not in _REGISTRY:
    raise KeyError(
        f"unknown verifier {name_or_path!r}; registered: {sorted(_REGISTRY)}; "
        "or pass an import path 'package.module:attr'")
  return _REGISTRY[name_or_path](**kwargs)


class DispatchVerifier:
  """Routes each example to the verifier named by ``example["verifier"]``.

  Examples without that key use ``default``. Verifiers are built on first
  use with ``kwargs`` (registered names and classes) and cached, so a mixed
  dataset (procedural + math + code) needs one pool.
  """

  def __init__(self, default: str, **kwargs: Any):
    self.default = default
    self.kwargs = kwargs
    self._cache: dict[str, Verifier] = {}

  def get(self, name: str) -> Verifier:
    if name not in self._cache:
      self._cache[name] = get_verifier(name, **self.kwargs)
    return self._cache[name]

  def __call__(self, example: Mapping[str, Any], response: str) -> Verdict:
    return coerce_verdict(
        self.get(example.get("verifier") or self.default)(example, response))


def make_verifier(data_config) -> Verifier:
  """The verifier a data config asks for (``data.default_data_config()``).

  Uses ``data_config.verifier`` as the default name, per-example
  ``"verifier"`` keys when present, and passes ``feedback_reveals_answer=True``
  only when the config turns it on (so a plain-function verifier given by
  import path works with the default config).
  """
  kwargs = {}
  if data_config.get("feedback_reveals_answer", False):
    kwargs["feedback_reveals_answer"] = True
  return DispatchVerifier(data_config.verifier, **kwargs)


# ----------------------------------------------------------------------------
# The pool.


def _call(verifier: Verifier, example, response) -> tuple[str, Any]:
  """Runs one call; returns ("ok", Verdict) or ("exception", message)."""
  try:
    return "ok", coerce_verdict(verifier(example, response))
  except BaseException as e:  # pylint: disable=broad-except
    return "exception", f"{type(e).__name__}: {e}"


def _process_worker_main(conn, verifier) -> None:
  """Loop of a process-backend worker: receive (i, ex, resp), send result."""
  while True:
    try:
      msg = conn.recv()
    except EOFError:
      return
    if msg is None:
      return
    i, example, response = msg
    t0 = time.monotonic()
    status, payload = _call(verifier, example, response)
    conn.send((i, status, payload, time.monotonic() - t0))


class _ProcessWorker:
  """One persistent verifier process, killed and replaced when it hangs."""

  def __init__(self, ctx, verifier):
    self.conn, child = ctx.Pipe()
    self.proc = ctx.Process(
        target=_process_worker_main, args=(child, verifier), daemon=True)
    self.proc.start()
    child.close()

  def kill(self) -> None:
    try:
      self.proc.kill()
      self.proc.join(timeout=5)
    except Exception:  # pylint: disable=broad-except
      pass
    self.conn.close()


class VerifierPool:
  """Runs a verifier over a batch concurrently, with a per-call timeout.

  Backends:
    * ``"thread"`` (default): each call runs in its own daemon thread, at most
      ``num_workers`` at once. A call that exceeds ``timeout_s`` gets an error
      verdict and its thread is **abandoned**: Python cannot kill a thread, so
      a truly hung verifier keeps a thread (and whatever it holds) until the
      process exits. ``stats["verifier/abandoned_threads"]`` counts the ones
      still alive; a new call never waits for them. Use this backend for
      verifiers that release the GIL or do their heavy work in a subprocess
      (the code verifier's sandbox does).
    * ``"process"``: ``num_workers`` persistent worker processes (``spawn``
      start method, safe alongside JAX's threads). A call past its timeout
      gets its worker SIGKILLed and replaced, so hangs are truly ended. The
      verifier must be picklable (a module-level function or an instance of
      a module-level class).

  The timeout of a call starts when the call starts, not when the batch is
  submitted, so a batch of N calls takes at most about
  ``ceil(N / num_workers) * timeout_s``.
  """

  def __init__(
      self,
      verifier: Verifier,
      *,
      num_workers: int = 8,
      timeout_s: float = 10.0,
      backend: str = "thread",
      mp_start_method: str = "spawn",
  ):
    if backend not in ("thread", "process"):
      raise ValueError(f"backend must be 'thread' or 'process', got {backend!r}")
    if num_workers < 1 or timeout_s <= 0:
      raise ValueError("num_workers must be >= 1 and timeout_s > 0")
    self.verifier = verifier
    self.num_workers = int(num_workers)
    self.timeout_s = float(timeout_s)
    self.backend = backend
    self._logged_kinds: set[str] = set()
    self._abandoned: list[threading.Thread] = []
    self._workers: list[_ProcessWorker] = []
    self._ctx = None
    # Running totals since construction (for checkpoint-independent metrics).
    self.totals: dict[str, int] = {"calls": 0, "errors": 0}
    self.totals.update({k: 0 for k in ERROR_KINDS})
    if backend == "process":
      try:
        pickle.dumps(verifier)
      except Exception as e:
        raise ValueError(
            "the process backend needs a picklable verifier (a module-level "
            f"function or class instance): {e}") from e
      self._ctx = multiprocessing.get_context(mp_start_method)

  # -- public API --------------------------------------------------------------

  def run(
      self, examples: Sequence[Mapping[str, Any]], responses: Sequence[str]
  ) -> tuple[list[Verdict], dict[str, float]]:
    """Verifies ``responses[i]`` against ``examples[i]`` for all i.

    Args:
      examples: length-N sequence of example dicts.
      responses: length-N sequence of decoded response strings.

    Returns:
      ``(verdicts, stats)``: N verdicts in input order, and a flat metrics dict
      with keys ``verifier/{calls, errors, error_rate, exception, timeout,
      bad_return, crash, latency_mean_s, latency_max_s, wall_s,
      abandoned_threads}``.
    """
    if len(examples) != len(responses):
      raise ValueError(
          f"{len(examples)} examples but {len(responses)} responses")
    t0 = time.monotonic()
    n = len(examples)
    if self.backend == "thread":
      raw = self._run_threads(examples, responses)
    else:
      raw = self._run_processes(examples, responses)
    verdicts: list[Verdict] = []
    counts = {k: 0 for k in ERROR_KINDS}
    latencies = []
    for i, (status, payload, latency) in enumerate(raw):
      latencies.append(latency)
      if status == "ok":
        verdict = payload
      else:
        verdict = error_verdict(status, payload)
      kind = verdict.info.get("error") if verdict.feedback.startswith(
          ERROR_PREFIX) else None
      if kind in counts:
        counts[kind] += 1
        if kind not in self._logged_kinds:
          self._logged_kinds.add(kind)
          logging.warning(
              "%s (first of its kind in this pool; example id %s). Later "
              "errors of this kind are counted in verifier/%s, not logged.",
              verdict.feedback, examples[i].get("id", i), kind)
      verdicts.append(verdict)
    errors = sum(counts.values())
    self.totals["calls"] += n
    self.totals["errors"] += errors
    for k, v in counts.items():
      self.totals[k] += v
    self._abandoned = [t for t in self._abandoned if t.is_alive()]
    stats = {
        "verifier/calls": float(n),
        "verifier/errors": float(errors),
        "verifier/error_rate": errors / n if n else 0.0,
        "verifier/latency_mean_s": sum(latencies) / n if n else 0.0,
        "verifier/latency_max_s": max(latencies, default=0.0),
        "verifier/wall_s": time.monotonic() - t0,
        "verifier/abandoned_threads": float(len(self._abandoned)),
    }
    stats.update({f"verifier/{k}": float(v) for k, v in counts.items()})
    return verdicts, stats

  __call__ = run

  def close(self) -> None:
    """Stops process workers (threads abandoned on timeout cannot be)."""
    for w in self._workers:
      try:
        w.conn.send(None)
      except Exception:  # pylint: disable=broad-except
        pass
      w.kill()
    self._workers = []

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()

  def __del__(self):
    try:
      self.close()
    except Exception:  # pylint: disable=broad-except
      pass

  # -- backends ----------------------------------------------------------------

  def _timeout_detail(self) -> str:
    return f"no verdict within {self.timeout_s:g} s"

  def _run_threads(self, examples, responses):
    """Returns a list of (status, payload, latency_s) in input order."""
    done: queue.SimpleQueue = queue.SimpleQueue()
    out: list[Any] = [None] * len(examples)
    running: dict[int, tuple[float, threading.Thread]] = {}
    verifier = self.verifier

    def work(i):
      start = time.monotonic()
      status, payload = _call(verifier, examples[i], responses[i])
      done.put((i, status, payload, time.monotonic() - start))

    next_i = 0
    while next_i < len(examples) or running:
      while next_i < len(examples) and len(running) < self.num_workers:
        th = threading.Thread(
            target=work, args=(next_i,), daemon=True, name=f"verifier-{next_i}")
        running[next_i] = (time.monotonic(), th)
        th.start()
        next_i += 1
      deadline = min(t for t, _ in running.values()) + self.timeout_s
      try:
        i, status, payload, latency = done.get(
            timeout=max(0.0, deadline - time.monotonic()))
        if i in running:  # else: an abandoned call finishing late
          del running[i]
          out[i] = (status, payload, latency)
      except queue.Empty:
        pass
      now = time.monotonic()
      for i, (start, th) in list(running.items()):
        if now - start >= self.timeout_s:
          del running[i]
          self._abandoned.append(th)
          out[i] = ("timeout", self._timeout_detail(), now - start)
    return out

  def _run_processes(self, examples, responses):
    """Returns a list of (status, payload, latency_s) in input order."""
    out: list[Any] = [None] * len(examples)
    idle = list(self._workers)
    busy: dict[Any, tuple[_ProcessWorker, int, float]] = {}  # conn -> ...
    next_i = 0
    while next_i < len(examples) or busy:
      while next_i < len(examples) and len(busy) < self.num_workers:
        worker = idle.pop() if idle else _ProcessWorker(self._ctx, self.verifier)
        if worker not in self._workers:
          self._workers.append(worker)
        try:
          worker.conn.send((next_i, examples[next_i], responses[next_i]))
        except Exception as e:  # pylint: disable=broad-except
          # e.g. an unpicklable example; the worker itself is fine.
          out[next_i] = ("exception", f"{type(e).__name__}: {e}", 0.0)
          idle.append(worker)
          next_i += 1
          continue
        busy[worker.conn] = (worker, next_i, time.monotonic())
        next_i += 1
      deadline = min(t for _, _, t in busy.values()) + self.timeout_s
      ready = multiprocessing.connection.wait(
          list(busy), timeout=max(0.0, deadline - time.monotonic()))
      for conn in ready:
        worker, i, start = busy.pop(conn)
        try:
          _, status, payload, latency = conn.recv()
          out[i] = (status, payload, latency)
          idle.append(worker)
        except (EOFError, OSError):
          worker.proc.join(timeout=1)
          out[i] = ("crash", f"worker process exited with code "
                    f"{worker.proc.exitcode}", time.monotonic() - start)
          worker.kill()
          self._workers.remove(worker)
      now = time.monotonic()
      for conn, (worker, i, start) in list(busy.items()):
        if now - start >= self.timeout_s:
          del busy[conn]
          worker.kill()  # a hung call ends here, for real
          self._workers.remove(worker)
          out[i] = ("timeout", self._timeout_detail(), now - start)
    return out
