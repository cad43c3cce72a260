"""Misbehaving verifiers for the reliability tests, by import path
(``--config.data.verifier=fbos_jax.testing.verifiers:raising_verifier``)."""

from __future__ import annotations

import time


def raising_verifier(example, response):
  raise RuntimeError("boom")


def hanging_verifier(example, response):
  time.sleep(60)
  return 1.0, "correct"


def nan_verifier(example, response):
  return float("nan"), "?"


def _flaky_factory():
  """Every third call raises; the rest are the procedural verifier."""
  from fbos_jax.verifiers.procedural import ProceduralVerifier
  inner, calls = ProceduralVerifier(), [0]

  def verify(example, response):
    calls[0] += 1
    if calls[0] % 3 == 0:
      raise RuntimeError("flaky")
    return inner(example, response)
  return verify


flaky_verifier = _flaky_factory()


def every_other_error(example, response):
  """A verifier whose every other call fails (odd-length responses: an error verdict)."""
  from fbos_jax.verifiers.procedural import ProceduralVerifier
  if len(response) % 2:
    raise RuntimeError("flaky")
  return ProceduralVerifier()(example, response)


class LatencyVerifier:
  """``inner``'s verdicts, each after ``latency_s`` of latency (a sleep, no CPU: a
  remote sandbox or judge service); the slow-verifier workload of
  ``launch/bench_rollout.py``."""

  def __init__(self, inner, latency_s: float = 0.02):
    self.inner, self.latency_s = inner, float(latency_s)

  def __call__(self, example, response):
    time.sleep(self.latency_s)
    return self.inner(example, response)
