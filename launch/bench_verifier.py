r"""Host overhead of verifying a batch: ``VerifierPool.run`` (thread backend)
against a thread started per call (the pool's scheme before 2026-12-04).

  python launch/bench_verifier.py                     # 1,280 calls (one tiny eval), 2 workers
  python launch/bench_verifier.py --calls=4096 --workers=8

The verifier returns at once, so the times are the pool's own cost: handing
calls to threads, collecting verdicts in order, the stats. Both sides run in
this process, alternated, ``--repeats`` times each; medians and their ratio.
The last line of output is JSON.
"""

import json
import queue
import statistics
import threading
import time

from absl import app, flags

flags.DEFINE_integer("calls", 1280, "verifier calls per batch (a tiny eval: 256 greedy + 1,024 sampled)")
flags.DEFINE_integer("workers", 2, "VerifierPool(num_workers=...)")
flags.DEFINE_integer("repeats", 15, "batches per side")
FLAGS = flags.FLAGS


def _thread_per_call(verifier, examples, responses, workers: int) -> list:
  """The baseline: at most ``workers`` calls at once, each in a thread of its own."""
  done, out, running, nxt = queue.SimpleQueue(), [None] * len(examples), set(), 0

  def work(i):
    done.put((i, verifier(examples[i], responses[i])))

  while nxt < len(examples) or running:
    while nxt < len(examples) and len(running) < workers:
      running.add(nxt)
      threading.Thread(target=work, args=(nxt,), daemon=True).start()
      nxt += 1
    i, v = done.get()
    running.discard(i)
    out[i] = v
  return out


def main(argv):
  del argv
  from fbos_jax.verifiers.base import Verdict, VerifierPool

  def verifier(example, response):
    return Verdict(reward=1.0, feedback="")

  examples, responses = [{"id": i} for i in range(FLAGS.calls)], ["x"] * FLAGS.calls
  pool = VerifierPool(verifier, num_workers=FLAGS.workers, timeout_s=60.0)
  times = {"pool_run": [], "thread_per_call": []}
  for _ in range(FLAGS.repeats):
    t = time.perf_counter()
    verdicts, _ = pool.run(examples, responses)
    times["pool_run"].append(time.perf_counter() - t)
    assert len(verdicts) == FLAGS.calls and not any(v.is_error for v in verdicts)
    t = time.perf_counter()
    _thread_per_call(verifier, examples, responses, FLAGS.workers)
    times["thread_per_call"].append(time.perf_counter() - t)
  pool.close()
  med = {k: statistics.median(v) for k, v in times.items()}
  res = {"calls": FLAGS.calls, "workers": FLAGS.workers, "repeats": FLAGS.repeats,
         "pool_run_ms": round(1e3 * med["pool_run"], 2),
         "thread_per_call_ms": round(1e3 * med["thread_per_call"], 2),
         "ratio": round(med["pool_run"] / med["thread_per_call"], 3)}
  print(f"{FLAGS.calls} calls on {FLAGS.workers} workers: VerifierPool.run "
        f"{res['pool_run_ms']} ms, a thread per call {res['thread_per_call_ms']} ms "
        f"(median of {FLAGS.repeats}; {res['ratio']}x)")
  print(json.dumps(res))


if __name__ == "__main__":
  app.run(main)
