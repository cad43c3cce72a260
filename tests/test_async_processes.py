"""The asynchronous loop over several processes (issue 31): 2 processes x 4 CPU
devices, rl.rollout_devices=4 (process 0 trains, process 1 rolls out; weights and
batches cross by JAX's transfer server, tests/async_mp_worker.py).

One run at eta = 0 is killed (SIGKILL of the rollout process) once step 2 is
logged (batch 4 needs version 3, so the rollout cannot have finished: killed after
step 3, it sometimes had sent batch 4 and marked itself done, and the trainer then
finished and waited in jax's exit barrier for the dead peer); the trainer stops
within 60 s naming the lost process; the same command on the same workdir
resumes from the step-2 checkpoint, trains steps 3-4 once each (no
prompt lost or trained twice) and ends with the params of the one-process
synchronous run (4 devices) within 1e-5; each side compiles its set before its
first step, and neither compiles after it. A few minutes on 2 loaded cores (most
of it compiles).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from fbos_jax import metrics as metrics_lib
from fbos_jax.testing.small import free_port

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "async_mp_worker.py")


def _launch(args, log_path):
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # the worker sets its own
  log = open(log_path, "w")
  p = subprocess.Popen([sys.executable, "-u", WORKER, *args], stdout=log,
                       stderr=subprocess.STDOUT, env=env, cwd=os.path.dirname(HERE))
  p.log_path, p.log_file = log_path, log
  return p


def _text(p) -> str:
  p.log_file.flush()
  with open(p.log_path) as f:
    return "".join(line for line in f if not line.startswith("[Gloo]"))


def _pair(workdir, port, log_dir, tag, **kw):
  args = [f"--workdir={workdir}", "--num_processes=2", f"--coordinator=127.0.0.1:{port}",
          "--steps=4", "--eta=0"] + [f"--{k}={v}" for k, v in kw.items()]
  return [_launch(args + [f"--process_id={i}"], log_dir / f"{tag}{i}.log") for i in range(2)]


def _wait(procs, timeout_s):
  deadline = time.time() + timeout_s
  while any(p.poll() is None for p in procs) and time.time() < deadline:
    time.sleep(0.2)
  for p in procs:
    if p.poll() is None:
      p.kill()
      p.wait()
  return [p.returncode for p in procs]


def _steps(workdir) -> list:
  path = os.path.join(workdir, "steps.jsonl")
  return metrics_lib.read_jsonl(path) if os.path.exists(path) else []


@pytest.mark.slow  # default suite under 15 min (issue 35): .ci/run runs the slow set too
def test_two_processes_kill_resume_and_eta0_equals_the_synchronous_run(tmp_path):
  wd = tmp_path / "split"
  ref = _launch([f"--workdir={tmp_path / 'ref'}", "--num_processes=1", "--steps=4", "--eta=0",
                 f"--out={tmp_path / 'ref.npz'}"], tmp_path / "ref.log")
  first = _pair(wd, free_port(), tmp_path, "a")
  deadline = time.time() + 600
  while not any(r["step"] >= 2 for r in _steps(wd)):
    if time.time() > deadline or any(p.poll() is not None for p in first):
      _wait(first + [ref], 0)
      pytest.fail("the split run did not reach step 2:\n" + "\n".join(map(_text, first)))
    time.sleep(0.2)
  first[1].send_signal(signal.SIGKILL)  # the rollout process
  t_kill = time.time()
  rc = _wait(first, 120)
  stopped_s = time.time() - t_kill
  trainer_log = _text(first[0])
  assert rc[1] == -9 and rc[0] not in (0, None), (rc, trainer_log[-3000:])
  assert stopped_s < 60, stopped_s
  # named: as gone (no heartbeat), or as the peer of the transfer that broke
  assert "process 1 (rollout side)" in trainer_log.splitlines()[-1], trainer_log[-3000:]

  second = _pair(wd, free_port(), tmp_path, "b", out=tmp_path / "split.npz")
  rc = _wait(second + [ref], 900)
  assert rc == [0, 0, 0], "\n".join(map(_text, second + [ref]))[-6000:]
  log = _steps(wd)
  assert [r["step"] for r in log] == [1, 2, 3, 4]  # step 3 once, though trained twice
  ref_log = _steps(tmp_path / "ref")
  assert [r["ids"] for r in log] == [r["ids"] for r in ref_log]  # the same prompts, each once
  trained = [i for r in log for i in r["ids"]]
  assert len(trained) == len(set(trained))
  rows = metrics_lib.read_jsonl(os.path.join(wd, "metrics.jsonl"))
  assert [r["step"] for r in rows] == [1, 2, 3, 4]
  assert all(r["staleness/max"] == 0 and "async/rollout_busy" in r for r in rows)
  assert all(r["async/sync_bytes"] > 0 and r["async/pull_bytes"] >= 0 for r in rows)
  # the compile sets, the trainer's and the rollout process's own (issue 29): after the
  # first step of each run (steps 1 and 3) neither side compiles a program
  assert [(r["compile/after_start"], r["rollout/compile_after_start"])
          for r in rows if r["step"] in (2, 4)] == [(0, 0), (0, 0)], rows
  assert "rollout process 1: compile set: " in _text(second[1]), _text(second[1])[-3000:]
  a, b = np.load(tmp_path / "split.npz"), np.load(tmp_path / "ref.npz")
  assert len(a.files) == len(b.files) > 0
  for k in a.files:
    np.testing.assert_allclose(a[k], b[k], atol=1e-5, rtol=0)
