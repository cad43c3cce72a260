"""Jitted programs kept per static key: built once, compiled once per shape bucket.

The samplers (``fbos_jax.sampling``, ``fbos_jax.engine.programs``) key their
jitted functions by everything static about them (model config, static options,
mesh, rules), so two trainers or tests with the same shapes share one compile.

A :class:`CompileWatch` sees every XLA compilation while it is open (any
thread); a compilation inside a call of a :func:`tracked` program (the
samplers', the engine's and the update's) names that program and the shapes of
the call, which is how a run names a program compiled after its compile set
(``fbos_jax/compile_set.py``).
"""

from __future__ import annotations

import contextlib
import threading
from typing import Callable, Hashable, NamedTuple

import jax
import numpy as np

BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"


class CompileEvent(NamedTuple):
  """One XLA compilation: the function's name (``jit(_window)``), the seconds
  it took and, inside a call of a :func:`tracked` program, that program's name
  and the shapes of the call's arguments (else "")."""
  fun_name: str
  seconds: float
  call: str = ""

  def describe(self) -> str:
    return self.call or f"{self.fun_name} (not a program of the compile set)"


_CALL = threading.local()  # the tracked call in progress on this thread: (name, args)
_WATCHES: list = []
_WATCH_LOCK = threading.Lock()


def describe_args(args) -> str:
  """The shapes of a call's arguments, compactly: ``f32[64,42]`` per array; a
  pytree of many leaves (params, a KV pool, a train state) as ``(N arrays)``."""
  out = []
  for a in args:
    leaves = jax.tree.leaves(a)
    if len(leaves) > 16:
      out.append(f"({len(leaves)} arrays)")
      continue
    shapes = []
    for x in leaves:
      shape = getattr(x, "shape", None)
      if shape is None:
        shapes.append(type(x).__name__)
      else:
        dt = np.dtype(getattr(x, "dtype", np.float32))
        shapes.append(f"{dt.kind}{8 * dt.itemsize}[{','.join(map(str, shape))}]")
    out.append(shapes[0] if len(shapes) == 1 else "(" + " ".join(shapes) + ")")
  return " ".join(out)


class _Tracked:
  """A jitted function whose calls name themselves to the open watches' compile
  events (its name and the call's argument shapes). Everything else (``lower``,
  ``_cache_size``, ...) is the jitted function's."""

  def __init__(self, fn: Callable, name: str):
    self.fn, self.name = fn, name

  def __call__(self, *args, **kwargs):
    if not _WATCHES:
      return self.fn(*args, **kwargs)
    prev = getattr(_CALL, "what", None)
    _CALL.what = (self.name, args)
    try:
      return self.fn(*args, **kwargs)
    finally:
      _CALL.what = prev

  def __getattr__(self, attr):
    return getattr(self.fn, attr)


def tracked(fn: Callable, name: str) -> Callable:
  """``fn`` (a jitted function), whose compilations a :class:`CompileWatch`
  names as program ``name`` with the shapes of the call."""
  return _Tracked(fn, name)


class CompileWatch:
  """Every XLA backend compilation from construction until :meth:`close` (any
  thread), as :class:`CompileEvent`s in ``events``; :meth:`take` hands out
  the events since the last take."""

  def __init__(self):
    self.events: list = []
    self._taken = 0
    self._lock = threading.Lock()
    jax.monitoring.register_event_duration_secs_listener(self._listener)
    with _WATCH_LOCK:
      _WATCHES.append(self)

  def _listener(self, event, duration, **kw):
    if event != BACKEND_COMPILE:
      return
    what = getattr(_CALL, "what", None)
    call = f"{what[0]} {describe_args(what[1])}" if what is not None else ""
    with self._lock:
      self.events.append(CompileEvent(str(kw.get("fun_name", "")), float(duration), call))

  def take(self) -> list:
    """The events since the last take (or the start)."""
    with self._lock:
      out = self.events[self._taken:]
      self._taken = len(self.events)
    return out

  def close(self):
    jax.monitoring.unregister_event_duration_listener(self._listener)
    with _WATCH_LOCK:
      if self in _WATCHES:
        _WATCHES.remove(self)


class ProgramCache:
  """{static key: jitted function}, thread-safe (the rollout worker of the
  asynchronous loop and the trainer may build programs at once)."""

  def __init__(self):
    self._lock = threading.Lock()
    self._fns: dict = {}

  def get(self, key: Hashable, build: Callable[[], Callable], name: str = "") -> Callable:
    """The function of ``key``, built by ``build()`` the first time (and
    :func:`tracked` as ``name`` when given)."""
    with self._lock:
      fn = self._fns.get(key)
      if fn is None:
        fn = build()
        fn = self._fns[key] = tracked(fn, name) if name else fn
      return fn

  def compiled_programs(self) -> int:
    """How many programs its functions have compiled in this process (all buckets)."""
    with self._lock:
      fns = list(self._fns.values())
    return int(sum(f._cache_size() for f in fns))  # pylint: disable=protected-access


@contextlib.contextmanager
def count_compiles():
  """Counts XLA backend compilations (any jitted function, any thread) inside the
  block: ``with count_compiles() as events: ...; len(events)`` (each a
  :class:`CompileEvent`)."""
  watch = CompileWatch()
  try:
    yield watch.events
  finally:
    watch.close()
