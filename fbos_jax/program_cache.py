"""Jitted programs kept per static key: built once, compiled once per shape bucket.

The samplers (``fbos_jax.sampling``, ``fbos_jax.engine.programs``) key their
jitted functions by everything static about them (model config, static options,
mesh, rules), so two trainers or tests with the same shapes share one compile.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Callable, Hashable

import jax


class ProgramCache:
  """{static key: jitted function}, thread-safe (the rollout worker of the
  asynchronous loop and the trainer may build programs at once)."""

  def __init__(self):
    self._lock = threading.Lock()
    self._fns: dict = {}

  def get(self, key: Hashable, build: Callable[[], Callable]) -> Callable:
    """The function of ``key``, built by ``build()`` the first time."""
    with self._lock:
      fn = self._fns.get(key)
      if fn is None:
        fn = self._fns[key] = build()
      return fn

  def compiled_programs(self) -> int:
    """How many programs its functions have compiled in this process (all buckets)."""
    with self._lock:
      fns = list(self._fns.values())
    return int(sum(f._cache_size() for f in fns))  # pylint: disable=protected-access


@contextlib.contextmanager
def count_compiles():
  """Counts XLA backend compilations (any jitted function, any thread) inside the
  block: ``with count_compiles() as events: ...; len(events)``."""
  events = []

  def listener(event, duration, **kw):
    del kw
    if event == "/jax/core/compile/backend_compile_duration":
      events.append(duration)

  jax.monitoring.register_event_duration_secs_listener(listener)
  try:
    yield events
  finally:
    jax.monitoring.unregister_event_duration_listener(listener)
