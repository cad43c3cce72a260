"""The verifier protocol, the registry, and the pool that runs verifiers safely.

A **verifier** is any plain callable ``(example: dict, response_text: str) ->
Verdict``. ``example`` is one data record (``prompt``, ``answer`` and whatever
else the dataset carries); ``response_text`` is the decoded response, without
the EOS token. A verifier may also return a ``(reward, feedback)`` or
``(reward, feedback, info)`` tuple; the pool converts it.

The trainer never calls a verifier directly; it calls ``VerifierPool.run`` with
the whole batch. The pool runs the calls concurrently with a per-call timeout,
and turns every failure (exception, timeout, hang, a worker process dying, a
malformed return value, a reward outside ``reward_range`` or not finite, an
example without the reference a verifier needs) into an **error verdict**:
``Verdict(0.0, "", {"error": kind}, error="<kind>: <detail>")``. Its
``is_error`` is True, its reward 0.0 is a placeholder (not a judgement: callers
leave error rows out of groups and accuracies), and its feedback is empty: the
error text is in ``Verdict.error`` only and never reaches a prompt. Each error
kind is logged once per pool (absl logging) and counted in the returned stats,
so one bad verifier call never stops training.

Registry: built-in verifiers register under short names ("procedural", "math",
"ifeval", "code"); a user verifier is named by import path
``"package.module:attr"`` on the command line, e.g.
``--config.data.verifier=my_pkg.checks:my_verifier``. Which verifier an example
gets: an explicit ``data.verifier`` applies to every example; only
``data.verifier="auto"`` routes each example by its own ``"verifier"`` key
(procedural examples say "procedural"; a dataset may carry a column).

A verifier factory (class or function) may declare ``required_fields``, the
example keys it cannot work without (e.g. ``("answer",)``); the data loader
refuses records that lack them, naming the file and line.

Answers are strings. A verifier that grades answers of other JSON types says
so with ``answer_types`` (e.g. ``answer_types = (str, int, list)``): the data
loader passes such answers through unchanged and refuses any other type,
naming the file, line and field (nothing is converted: a JSON ``42`` graded
as the text ``"42"`` would lose ``"0042"``'s zeros, a list would be graded
against its JSON text). ``bool`` is accepted only when named (not as an
``int``); a non-finite number (``1e400``) never.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import heapq
import importlib
import itertools
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
ERROR_PREFIX = "verifier error"  # starts the log line of an error verdict
# Error kinds, each counted in the pool's stats as ``verifier/<kind>``:
#   exception    the verifier raised
#   timeout      no verdict within timeout_s (thread abandoned / process killed)
#   bad_return   not a Verdict or (reward, feedback[, info]) tuple
#   crash        a process-backend worker died
#   bad_reward   a reward that is not finite or is outside reward_range
#   bad_example  the example lacks what the verifier needs (e.g. no answer)
#   sandbox      the code sandbox cannot run (e.g. no namespaces on this host)
ERROR_KINDS = ("exception", "timeout", "bad_return", "crash", "bad_reward",
               "bad_example", "sandbox")
AUTO = "auto"  # data.verifier: route each example by its own "verifier" key
DEFAULT_REWARD_RANGE = (-10.0, 10.0)
# how long a ``VerifierPool.submit`` thread with no call waits for the next one
SUBMIT_IDLE_S = 2.0
DEFAULT_ANSWER_TYPES = (str,)  # what a verifier grades unless it declares more
# Rewards are float32 on the device (largest value 3.4e38): a reward_range
# bound must stay below this, with room to spare.
MAX_ABS_REWARD_BOUND = 3.0e38


@dataclasses.dataclass(frozen=True)
class Verdict:
  """What a verifier says about one response.

  Attributes:
    reward: scalar reward, usually in [0, 1]; 1.0 means fully correct.
    feedback: natural-language feedback saying what is wrong and where
      ("correct" when nothing is). By default it must not reveal the
      reference answer. Empty for an error verdict.
    info: free-form extra data for logging (error kind, parsed answer, ...).
    error: empty for a real verdict; for an error verdict (the call failed,
      see ``ERROR_KINDS``) ``"<kind>: <detail>"``. Its reward is a 0.0
      placeholder, not a judgement of the response.
  """

  reward: float
  feedback: str
  info: dict = dataclasses.field(default_factory=dict)
  error: str = ""

  @property
  def is_error(self) -> bool:
    """True when the verifier failed on this row (exclude it from groups)."""
    return bool(self.error)


Verifier = Callable[[Mapping[str, Any], str], Verdict]


def error_verdict(kind: str, detail: str) -> Verdict:
  """The verdict that stands in for a failed verifier call.

  Reward 0.0 (a placeholder), empty feedback, ``info={"error": kind}`` and
  ``error="<kind>: <detail>"``.
  """
  return Verdict(0.0, "", {"error": kind}, f"{kind}: {detail}")


def coerce_verdict(result: Any) -> Verdict:
  """Converts a verifier's return value into a ``Verdict``.

  Accepts a ``Verdict`` or a ``(reward, feedback[, info])`` tuple with a finite
  reward. Anything else becomes a ``bad_return`` error verdict, a non-finite
  reward a ``bad_reward`` one. Error verdicts pass through unchanged.
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
  if result.is_error:
    return result
  try:
    reward = float(result.reward)
  except (TypeError, ValueError):
    return error_verdict("bad_return",
                         f"reward is not a number: {result.reward!r}")
  if not math.isfinite(reward):
    return error_verdict("bad_reward", f"reward is not finite: {result.reward!r}")
  if reward != result.reward or not isinstance(result.feedback, str):
    result = Verdict(reward, str(result.feedback), dict(result.info or {}))
  return result


def check_reward_range(verdict: Verdict,
                       reward_range: tuple[float, float]) -> Verdict:
  """``verdict``, or a ``bad_reward`` error verdict when its reward is not
  finite or lies outside ``[lo, hi]`` (a reward of 1e39 is finite in float64
  but inf in float32, and 1e9 would swamp every advantage and accuracy)."""
  if verdict.is_error:
    return verdict
  lo, hi = reward_range
  r = verdict.reward
  if not math.isfinite(r):
    return error_verdict("bad_reward", f"reward is not finite: {r!r}")
  if not lo <= r <= hi:
    return error_verdict(
        "bad_reward", f"reward {r!r} is outside verifier reward_range "
        f"[{lo:g}, {hi:g}]")
  return verdict


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


def _import_attr(name_or_path: str) -> Any:
  module_name, attr = name_or_path.split(":", 1)
  obj: Any = importlib.import_module(module_name)
  for part in attr.split("."):
    obj = getattr(obj, part)
  return obj


def verifier_factory(name_or_path: str) -> Any:
  """The registered factory or import-path object for a verifier name,
  without building it (raises like ``get_verifier`` for unknown names)."""
  if ":" in name_or_path:
    return _import_attr(name_or_path)
  if name_or_path not in _REGISTRY:
    _load_builtins([name_or_path])
  if name_or_path not in _REGISTRY:
    raise KeyError(
        f"unknown verifier {name_or_path!r}; registered: {sorted(_REGISTRY)}; "
        "or pass an import path 'package.module:attr'")
  return _REGISTRY[name_or_path]


def required_fields(name_or_path: str) -> tuple[str, ...]:
  """Example keys the verifier cannot work without (its factory's
  ``required_fields`` attribute; () when it declares none, and for "auto")."""
  if name_or_path in ("", "none", AUTO):
    return ()
  return tuple(getattr(verifier_factory(name_or_path), "required_fields", ()))


def answer_types(name_or_path: str) -> tuple[type, ...]:
  """The answer types the verifier grades (its factory's ``answer_types``
  attribute; ``(str,)`` when it declares none, and for "auto")."""
  if name_or_path in ("", "none", AUTO):
    return DEFAULT_ANSWER_TYPES
  declared = getattr(verifier_factory(name_or_path), "answer_types", None)
  if declared is None:
    return DEFAULT_ANSWER_TYPES
  declared = tuple(declared) if isinstance(declared, (tuple, list)) else (declared,)
  if not declared or not all(isinstance(t, type) for t in declared):
    raise TypeError(f"verifier {name_or_path!r}: answer_types must be a tuple of "
                    f"types, got {declared!r}")
  return declared


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
    obj = _import_attr(name_or_path)
    if isinstance(obj, type) or kwargs:
      obj = obj(**kwargs)
    if not callable(obj):
      raise TypeError(f"verifier {name_or_path!r} is not callable")
    return obj
  return verifier_factory(name_or_path)(**kwargs)


class DispatchVerifier:
  """The verifier of a data config: one named verifier, or per-example routing.

  Args:
    default: a verifier name or import path, applied to **every** example
      (an example's own ``"verifier"`` key is ignored: the configured one
      wins); or ``"auto"``: each example names its verifier in
      ``example["verifier"]`` (an example without one gets a ``bad_example``
      error verdict).
    per_example: override the routing (default: ``default == "auto"``);
      with True, examples without a key use ``default``.
    **kwargs: options passed to every verifier factory.

  Verifiers are built on first use and cached, so a mixed dataset
  (procedural + math + code) needs one pool. Picklable (the cache is not
  pickled), so it runs on the pool's process backend.
  """

  def __init__(self, default: str, *, per_example: bool | None = None,
               **kwargs: Any):
    self.default = default
    self.per_example = (default == AUTO) if per_example is None else per_example
    self.kwargs = kwargs
    self._cache: dict[str, Verifier] = {}

  def get(self, name: str) -> Verifier:
    if name not in self._cache:
      self._cache[name] = get_verifier(name, **self.kwargs)
    return self._cache[name]

  def name_for(self, example: Mapping[str, Any]) -> str | None:
    """The verifier name this example is routed to (None: it names none)."""
    if not self.per_example:
      return self.default
    name = example.get("verifier")
    if name:
      return str(name)
    return None if self.default == AUTO else self.default

  def __call__(self, example: Mapping[str, Any], response: str) -> Verdict:
    name = self.name_for(example)
    if name is None:
      return error_verdict(
          "bad_example", "the example has no 'verifier' key and "
          "data.verifier='auto'; set data.verifier to a verifier name")
    return coerce_verdict(self.get(name)(example, response))

  def __getstate__(self):
    state = dict(self.__dict__)
    state["_cache"] = {}  # built verifiers may hold locks / sandboxes
    return state


def make_verifier(data_config) -> Verifier:
  """The verifier a data config asks for (``data.default_data_config()``).

  ``data_config.verifier`` is a registered name or ``"pkg.module:attr"``,
  used for every example, or ``"auto"`` to route each example by its own
  ``"verifier"`` key (see ``DispatchVerifier``). An explicit name is built
  here, so a typo fails now rather than at the first verification. Passes
  ``feedback_reveals_answer=True`` only when the config turns it on (so a
  plain-function verifier given by import path works with the default
  config).
  """
  kwargs = {}
  if data_config.get("feedback_reveals_answer", False):
    kwargs["feedback_reveals_answer"] = True
  verify = DispatchVerifier(data_config.verifier, **kwargs)
  if not verify.per_example:
    verify.get(verify.default)
  return verify


def make_verifier_pool(data_config, verifier_config=None,
                       **overrides: Any) -> "VerifierPool":
  """``VerifierPool(make_verifier(data_config), ...)`` from the config sections.

  Reads ``verifier_config`` (``config.verifier``) fields ``workers``,
  ``timeout_s``, ``backend`` ("thread" | "process"), ``reward_range`` and
  ``max_abandoned_threads`` when present (pool defaults otherwise);
  ``overrides`` win over both.
  """
  vc = verifier_config if verifier_config is not None else {}
  get = vc.get if hasattr(vc, "get") else (lambda k, d=None: d)
  kwargs = {}
  for field, arg in (("workers", "num_workers"), ("timeout_s", "timeout_s"),
                     ("backend", "backend"), ("reward_range", "reward_range"),
                     ("max_abandoned_threads", "max_abandoned_threads")):
    value = get(field, None)
    if value is not None:
      kwargs[arg] = tuple(value) if arg == "reward_range" else value
  kwargs.update(overrides)
  return VerifierPool(make_verifier(data_config), **kwargs)


# ----------------------------------------------------------------------------
# The pool.


def _call(verifier: Verifier, example, response) -> tuple[str, Any]:
  """Runs one call; returns ("ok", Verdict) or ("exception", message)."""
  try:
    return "ok", coerce_verdict(verifier(example, response))
  except BaseException as e:  # pylint: disable=broad-except
    return "exception", f"{type(e).__name__}: {e}"


def _process_worker_main(conn, verifier) -> None:
  """Loop of a process-backend worker: say "ready", then receive
  (i, ex, resp) and send results."""
  conn.send("ready")
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
    self.ready = False

  def wait_ready(self, timeout_s: float) -> bool:
    """Waits for the worker's start-up (interpreter + imports); its time does
    not count against a call's timeout. False if it died or took too long."""
    if self.ready:
      return True
    try:
      if self.conn.poll(timeout_s) and self.conn.recv() == "ready":
        self.ready = True
    except (EOFError, OSError):
      pass
    return self.ready

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
      (the code verifier's sandbox does). At most ``max_abandoned_threads``
      may be alive at once: past that cap the pool switches itself to the
      process backend (with a warning) when the verifier is picklable, and
      raises ``RuntimeError`` otherwise, rather than leak without bound.
    * ``"process"``: ``num_workers`` persistent worker processes (``spawn``
      start method, safe alongside JAX's threads). A call past its timeout
      gets its worker SIGKILLed and replaced, so hangs are truly ended. The
      verifier must be picklable (a module-level function or an instance of
      a module-level class).

  The timeout of a call starts when the call starts, not when the batch is
  submitted, so a batch of N calls takes at most about
  ``ceil(N / num_workers) * timeout_s``.

  Every verdict's reward is checked against ``reward_range``: a reward that is
  not finite or lies outside it becomes a ``bad_reward`` error verdict.
  Error verdicts (``Verdict.is_error``) carry their text in ``Verdict.error``,
  never in ``feedback``; callers must leave those rows out of groups.
  SFT and evaluation can use the same pool (``run`` on any batch) to get the
  same timeouts and fault isolation.

  Args:
    verifier: the verifier (e.g. ``make_verifier(config.data)``).
    num_workers: concurrent calls (threads or worker processes).
    timeout_s: per-call limit, counted from the call's start (a worker
      process's start-up is not counted).
    backend: "thread" or "process" (config: ``verifier.backend``).
    mp_start_method: the process backend's start method.
    reward_range: ``(lo, hi)``, finite; rewards outside are ``bad_reward``
      errors (config: ``verifier.reward_range``).
    max_abandoned_threads: cap on hung threads alive at once (thread
      backend; config: ``verifier.max_abandoned_threads``).
    startup_timeout_s: how long a new worker process may take to start.
  """

  def __init__(
      self,
      verifier: Verifier,
      *,
      num_workers: int = 8,
      timeout_s: float = 10.0,
      backend: str = "thread",
      mp_start_method: str = "spawn",
      reward_range: tuple[float, float] = DEFAULT_REWARD_RANGE,
      max_abandoned_threads: int = 16,
      startup_timeout_s: float = 120.0,
  ):
    if backend not in ("thread", "process"):
      raise ValueError(
          f"verifier backend must be 'thread' or 'process', got {backend!r}")
    if num_workers < 1 or timeout_s <= 0:
      raise ValueError("num_workers must be >= 1 and timeout_s > 0")
    try:
      lo, hi = (float(x) for x in reward_range)
    except (TypeError, ValueError) as e:
      raise ValueError(f"reward_range must be a pair (lo, hi): {reward_range!r}") from e
    if not (math.isfinite(lo) and math.isfinite(hi) and lo < hi):
      raise ValueError(
          f"reward_range must be finite with lo < hi: {reward_range!r}")
    if max(abs(lo), abs(hi)) >= MAX_ABS_REWARD_BOUND:
      raise ValueError(
          f"reward_range={reward_range!r}: each bound must satisfy |bound| < "
          f"{MAX_ABS_REWARD_BOUND:g} (rewards are float32 on the device, whose "
          "largest value is 3.4e38)")
    if max_abandoned_threads < 0:
      raise ValueError("max_abandoned_threads must be >= 0")
    self.verifier = verifier
    self.num_workers = int(num_workers)
    self.timeout_s = float(timeout_s)
    self.backend = backend
    self.reward_range = (lo, hi)
    self.max_abandoned_threads = int(max_abandoned_threads)
    self.mp_start_method = mp_start_method
    self.startup_timeout_s = float(startup_timeout_s)
    self._startup_failure = ""
    self._logged_kinds: set[str] = set()
    self._abandoned: list[threading.Thread] = []
    self._workers: list[_ProcessWorker] = []
    self._free: list[_ProcessWorker] = []  # started workers no call is using
    # concurrent ``run`` calls (``submit``: one row each, as rollouts stop) share the
    # bookkeeping below and the process workers (a call checks out its own)
    self._lock = threading.Condition()  # notified when a process worker is freed
    self._ctx = None
    # Running totals since construction (for checkpoint-independent metrics).
    self.totals: dict[str, int] = {"calls": 0, "errors": 0}
    self.totals.update({k: 0 for k in ERROR_KINDS})
    # ``submit``'s calls: queued (priority, seq, ...), running {seq: (deadline, ...)}
    self._sub = threading.Condition()
    self._sub_queue: list = []
    self._sub_running: dict = {}
    self._sub_seq = itertools.count()
    self._sub_names = itertools.count()
    self._watchdog = None  # the watchdog thread of ``submit``'s timeouts
    # submit threads with no call, each waiting (SUBMIT_IDLE_S) on its mailbox [call]
    self._sub_idle: list = []
    self._sub_closed = False
    if backend == "process":
      self._check_picklable()
      self._ctx = multiprocessing.get_context(mp_start_method)

  def _check_picklable(self) -> None:
    try:
      pickle.dumps(self.verifier)
    except Exception as e:
      raise ValueError(
          "the process backend needs a picklable verifier (a module-level "
          f"function or class instance): {e}") from e

  # -- public API --------------------------------------------------------------

  def run(
      self, examples: Sequence[Mapping[str, Any]], responses: Sequence[str]
  ) -> tuple[list[Verdict], dict[str, float]]:
    """Verifies ``responses[i]`` against ``examples[i]`` for all i.

    Args:
      examples: length-N sequence of example dicts.
      responses: length-N sequence of decoded response strings.

    Returns:
      ``(verdicts, stats)``: N verdicts in input order (``v.is_error`` marks
      the rows whose verification failed), and a flat metrics dict with keys
      ``verifier/{calls, errors, error_rate, <each of ERROR_KINDS>,
      latency_mean_s, latency_max_s, wall_s, abandoned_threads}``.

    Raises:
      RuntimeError: more than ``max_abandoned_threads`` hung threads are
        alive and the verifier cannot move to the process backend.
    """
    if len(examples) != len(responses):
      raise ValueError(
          f"{len(examples)} examples but {len(responses)} responses")
    t0 = time.monotonic()
    if self.backend == "thread":
      raw = self._run_threads(examples, responses)
    else:
      raw = self._run_processes(examples, responses)
    verdicts, stats = self._verdicts(examples, raw, t0)
    if self.backend == "thread" and len(self._abandoned) > self.max_abandoned_threads:
      self._abandoned_cap_reached()
    return verdicts, stats

  def _verdicts(self, examples, raw: list, t0: float) -> tuple[list[Verdict], dict]:
    """``raw`` [(status, payload, latency_s)] of ``examples`` as (verdicts, stats)
    (``run``'s result), the pool's totals updated."""
    n = len(examples)
    verdicts: list[Verdict] = []
    counts = {k: 0 for k in ERROR_KINDS}
    latencies = []
    for i, (status, payload, latency) in enumerate(raw):
      latencies.append(latency)
      if status == "ok":
        verdict = check_reward_range(payload, self.reward_range)
      else:
        verdict = error_verdict(status, payload)
      if verdict.is_error:
        kind = str(verdict.info.get("error", "exception"))
        counts[kind] = counts.get(kind, 0) + 1
        if kind not in self._logged_kinds:
          self._logged_kinds.add(kind)
          logging.warning(
              "%s: %s (example id %s; first of its kind in this pool). Later "
              "errors of this kind are counted in verifier/%s, not logged.",
              ERROR_PREFIX, verdict.error, examples[i].get("id", i), kind)
      verdicts.append(verdict)
    errors = sum(counts.values())
    with self._lock:
      self.totals["calls"] += n
      self.totals["errors"] += errors
      for k, v in counts.items():
        self.totals[k] = self.totals.get(k, 0) + v
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

  def verify_one(self, example: Mapping[str, Any], response: str) -> Verdict:
    """One call with the pool's timeout, fault isolation and range check."""
    return self.run([example], [response])[0][0]

  def submit(self, example: Mapping[str, Any], response: str, *,
             priority: int = 0) -> concurrent.futures.Future:
    """One call, not waited for: a Future of ``run([example], [response])``'s
    result (one verdict, its stats), with the same timeout, fault isolation
    and range check (the continuous engine's rollouts, verified one by one as
    they stop: ``fbos_jax/rl/stream.py``).

    At most ``num_workers`` submitted calls run at once (``run`` counts its
    own); the others wait, lower ``priority`` first, then in submission order
    (a waiting call's Future may be cancelled).
    Thread backend: each call runs in a submit thread, which resolves the
    Future itself, so no second thread waits on it, and then takes the next
    waiting call (at most ``num_workers`` calls run at once), or waits up to
    ``SUBMIT_IDLE_S`` for one to be submitted; a call past ``timeout_s``
    is resolved as a timeout error by a watchdog thread and its thread is
    abandoned (as in ``run``), freeing its place at once. Process backend: the
    call runs ``run`` on a worker process (its timeout kills the worker)."""
    fut: concurrent.futures.Future = concurrent.futures.Future()
    with self._sub:
      heapq.heappush(self._sub_queue, (int(priority), next(self._sub_seq), example,
                                       response, fut, time.monotonic()))
      self._sub_start()
    return fut

  def _sub_start(self) -> None:
    """Starts queued ``submit`` calls while fewer than ``num_workers`` run
    (``self._sub`` held)."""
    while len(self._sub_running) < self.num_workers:
      call = self._sub_pop()
      if call is None:
        return
      key, example, response, fut, t0 = call
      if self._sub_idle:  # an idle submit thread takes it
        th, box = self._sub_idle.pop()
        box.append(call)
        self._sub_register(key, th, example, fut, t0)
        self._sub.notify_all()
        continue
      th = threading.Thread(target=self._sub_work, args=call,
                            daemon=True, name=f"verifier-submit-{next(self._sub_names)}")
      self._sub_register(key, th, example, fut, t0)
      th.start()

  def _sub_register(self, key, th, example, fut, t0: float) -> None:
    """Call ``key`` runs in thread ``th`` from now, under the watchdog (thread
    backend; the process backend times its own calls) (``self._sub`` held)."""
    timed = self.backend == "thread"
    self._sub_running[key] = (time.monotonic() + self.timeout_s if timed else math.inf,
                              th, example, fut, t0)
    if timed and self._watchdog is None:
      self._watchdog = threading.Thread(target=self._sub_watch, daemon=True,
                                        name="verifier-watchdog")
      self._watchdog.start()
    elif timed:  # a waiting watchdog sees the new deadline
      self._sub.notify_all()

  def _sub_work(self, key, example, response, fut, t0: float) -> None:
    """Submitted calls in one thread: the call, then its Future; then the next
    waiting call in the same thread, or the next one submitted within
    ``SUBMIT_IDLE_S`` (not a thread started per call: 128 a tiny FBOS step on
    the engine, whose rollouts stop a few at a time), until none comes, the
    pool closes, or this call timed out (its thread abandoned: the watchdog
    has started the next one elsewhere)."""
    while True:
      if self.backend == "thread":
        start = time.monotonic()
        status, payload = _call(self.verifier, example, response)
        raw = (status, payload, time.monotonic() - start)
      else:
        try:
          raw = self._run_processes([example], [response])[0]
        except BaseException as e:  # pylint: disable=broad-except
          raw = ("crash", f"{type(e).__name__}: {e}", 0.0)
      with self._sub:
        mine = self._sub_running.pop(key, None) is not None  # else: timed out
        nxt = self._sub_take() if mine else None
        if nxt is None:
          self._sub_start()
      if mine:
        self._sub_settle(fut, example, raw, t0)
        if nxt is None:
          nxt = self._sub_wait_idle()
      if nxt is None:
        return
      key, example, response, fut, t0 = nxt

  def _sub_wait_idle(self):
    """This submit thread, idle: the call ``_sub_start`` hands it within
    ``SUBMIT_IDLE_S`` (registered as running in it), or None (the thread ends)."""
    box: list = []
    me = (threading.current_thread(), box)
    end = time.monotonic() + SUBMIT_IDLE_S
    with self._sub:
      # one that came while this thread settled its last, if a worker's place is free
      call = self._sub_take() if len(self._sub_running) < self.num_workers else None
      if call is not None:
        return call
      self._sub_idle.append(me)
      while not box and not self._sub_closed and time.monotonic() < end:
        self._sub.wait(end - time.monotonic())
      if not box:
        self._sub_idle.remove(me)
        return None
    return box[0]

  def _sub_pop(self):
    """The next waiting call (key, example, response, future, t0), cancelled ones
    dropped, or None (``self._sub`` held)."""
    while self._sub_queue:
      _, key, example, response, fut, t0 = heapq.heappop(self._sub_queue)
      if fut.set_running_or_notify_cancel():  # else: cancelled while it waited
        return key, example, response, fut, t0
    return None

  def _sub_take(self):
    """The next waiting call, registered as running in this thread (``self._sub``
    held), or None."""
    call = self._sub_pop()
    if call is not None:
      key, example, _, fut, t0 = call
      self._sub_register(key, threading.current_thread(), example, fut, t0)
    return call

  def _sub_watch(self) -> None:
    """The watchdog of submitted thread-backend calls: a call past its deadline
    is resolved as a timeout and its thread abandoned (daemon; ends with ``close``)."""
    me = threading.current_thread()
    while True:
      with self._sub:
        if self._watchdog is not me:  # closed (a later submit starts another)
          return
        now = time.monotonic()
        late = [(k, v) for k, v in self._sub_running.items() if v[0] <= now]
        for k, _ in late:
          del self._sub_running[k]
        if late:
          self._sub_start()
        else:
          due = min((v[0] for v in self._sub_running.values()), default=math.inf)
          self._sub.wait(None if due == math.inf else due - now)
          continue
      for _, (_, th, example, fut, t0) in late:
        with self._lock:
          self._abandoned.append(th)
        self._sub_settle(fut, example, ("timeout", self._timeout_detail(), self.timeout_s), t0)

  def _sub_settle(self, fut, example, raw: tuple, t0: float) -> None:
    """A submitted call's result (or ``run``'s exception) into its Future."""
    try:
      out = self._verdicts([example], [raw], t0)
      if self.backend == "thread" and len(self._abandoned) > self.max_abandoned_threads:
        self._abandoned_cap_reached()
    except BaseException as e:  # pylint: disable=broad-except
      fut.set_exception(e)
      return
    fut.set_result(out)

  def _abandoned_cap_reached(self) -> None:
    """Too many hung threads: move to processes (which can be killed), or fail."""
    detail = (f"{len(self._abandoned)} verifier calls hung past "
              f"timeout_s={self.timeout_s:g} and their threads are still alive "
              f"(max_abandoned_threads={self.max_abandoned_threads}); a thread "
              "cannot be killed")
    try:
      self._check_picklable()
    except ValueError as e:
      raise RuntimeError(
          f"{detail}. Use verifier.backend='process' (its hung calls are "
          f"killed), which needs a picklable verifier: {e}") from None
    logging.warning("%s: switching this pool to verifier.backend='process', "
                    "whose hung calls are killed.", detail)
    self._ctx = multiprocessing.get_context(self.mp_start_method)
    self.backend = "process"

  __call__ = run

  def close(self) -> None:
    """Stops process workers (threads abandoned on timeout cannot be)."""
    sub = getattr(self, "_sub", None)
    if sub is not None:  # the submit watchdog ends
      with sub:
        self._watchdog = None
        self._sub_closed = True  # idle submit threads end
        sub.notify_all()
    for w in self._workers:
      if w is None:  # still starting (another thread's call)
        continue
      try:
        w.conn.send(None)
      except Exception:  # pylint: disable=broad-except
        pass
      w.kill()
    self._workers = []
    self._free = []

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
    """Returns a list of (status, payload, latency_s) in input order.

    ``num_workers`` threads each take the next call when their last one is
    done (not a thread started per call: 1,280 for one eval of the tiny run).
    A call past ``timeout_s`` (from its own start) is a timeout: its thread is
    abandoned (it takes no further call) and another takes its place."""
    n = len(examples)
    done: queue.SimpleQueue = queue.SimpleQueue()  # one item per call settled by a thread
    out: list[Any] = [None] * n
    calls = iter(range(n))
    running: dict[int, tuple[float, threading.Thread]] = {}  # in flight: i -> (start, thread)
    lock = threading.Lock()
    verifier = self.verifier

    def work():
      me = threading.current_thread()
      while True:
        with lock:
          i = next(calls, None)
          if i is None:
            return
          running[i] = (time.monotonic(), me)
        start = time.monotonic()
        status, payload = _call(verifier, examples[i], responses[i])
        with lock:
          if running.pop(i, None) is None:  # timed out: this thread is abandoned
            return
          out[i] = (status, payload, time.monotonic() - start)
        done.put(i)

    def spawn(k):
      for _ in range(k):
        threading.Thread(target=work, daemon=True,
                         name=f"verifier-{next(self._sub_names)}").start()

    spawn(min(self.num_workers, n))
    left = n
    while left:
      with lock:
        first = min((t for t, _ in running.values()), default=time.monotonic())
      try:
        done.get(timeout=max(0.0, first + self.timeout_s - time.monotonic()))
        left -= 1
      except queue.Empty:
        pass
      now = time.monotonic()
      with lock:
        late = [(i, s, th) for i, (s, th) in running.items() if now - s >= self.timeout_s]
        for i, s, th in late:
          del running[i]
          out[i] = ("timeout", self._timeout_detail(), now - s)
      with self._lock:
        self._abandoned.extend(th for _, _, th in late)
      left -= len(late)
      spawn(len(late))  # the abandoned threads' places
    return out

  def _new_workers(self, n: int) -> list[_ProcessWorker]:
    """Starts ``n`` workers in parallel and returns those that came up."""
    started = [_ProcessWorker(self._ctx, self.verifier) for _ in range(n)]
    ready = []
    for w in started:
      if w.wait_ready(self.startup_timeout_s):
        ready.append(w)
      else:
        self._startup_failure = (
            f"verifier worker process failed to start within "
            f"{self.startup_timeout_s:g} s (exit code {w.proc.exitcode})")
        w.kill()
    with self._lock:
      self._workers.extend(ready)
    return ready

  def _checkout(self, want: int) -> list[_ProcessWorker]:
    """Up to ``want`` workers for one call, no other call using them: idle ones,
    then new ones while the pool has fewer than ``num_workers``."""
    with self._lock:
      while True:  # all num_workers busy in other calls: wait for one
        got = [self._free.pop() for _ in range(min(want, len(self._free)))]
        start = max(0, min(want - len(got), self.num_workers - len(self._workers)))
        if got or start:
          break
        self._lock.wait()
      self._workers.extend([None] * start)  # places held while they start
    try:
      return got + self._new_workers(start) if start else got
    finally:
      with self._lock:
        for _ in range(start):
          self._workers.remove(None)
        self._lock.notify_all()

  def _retire(self, worker: _ProcessWorker) -> None:
    with self._lock:
      self._workers.remove(worker)
      self._lock.notify_all()

  def _run_processes(self, examples, responses):
    """Returns a list of (status, payload, latency_s) in input order."""
    out: list[Any] = [None] * len(examples)
    # start-up is not part of any call's time
    idle = self._checkout(min(self.num_workers, len(examples)))
    busy: dict[Any, tuple[_ProcessWorker, int, float]] = {}  # conn -> ...
    try:
      self._run_on(idle, busy, out, examples, responses)
    finally:  # back for the next call (a worker of an interrupted call is killed)
      for worker, _, _ in busy.values():
        worker.kill()
        self._retire(worker)
      with self._lock:
        self._free.extend(idle)
        self._lock.notify_all()
    return out

  def _run_on(self, idle, busy, out, examples, responses) -> None:
    """The calls of ``_run_processes`` on its workers ``idle``."""
    next_i = 0
    while next_i < len(examples) or busy:
      while next_i < len(examples) and len(busy) < self.num_workers:
        if not idle:
          idle.extend(self._new_workers(1))
          if not idle:
            out[next_i] = ("crash", self._startup_failure, 0.0)
            next_i += 1
            continue
        worker = idle.pop()
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
      if not busy:
        continue
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
          self._retire(worker)
      now = time.monotonic()
      for conn, (worker, i, start) in list(busy.items()):
        if now - start >= self.timeout_s:
          del busy[conn]
          worker.kill()  # a hung call ends here, for real
          self._retire(worker)
          out[i] = ("timeout", self._timeout_detail(), now - start)
