r"""The padded and the packed update on the same long-tailed batch (issue 30).

  python launch/bench_update.py                 # 64 rows, responses up to 384 tokens
  python launch/bench_update.py --rows=128 --iters=5

One batch of ``--rows`` rows: prompts of 8 to ``--prompt_len`` tokens, responses
whose lengths follow the roofline's lognormal model
(``fbos_jax.planning.hardware.ResponseLengths``: median ``--median``, 99th percentile
``--p99``, capped at ``--response_len``), a third of them off-policy (GOLF's
mixed rows: PPO clip and f(u) in one batch). The padded update trains on it as
the rollout builds it today (``[prompt bucket | max_new_tokens]`` rows,
``--micro_batches`` micro-batches); the packed one on the same rows laid end to
end (``fbos_jax/rl/packing.py``) in micro-batches of the same token budget as
one padded micro-batch. Both run the jitted update step (AdamW), timed after a
compile, median of ``--iters``; real tokens/s counts the sequences' tokens
(prompt + response up to its last loss token), the same numerator for both.
Then the loss and the gradient of one step of each (``update.gradients``, float32)
are compared. The last line is JSON.
"""

import json
import statistics
import time

from absl import app, flags

flags.DEFINE_integer("rows", 64, "rows of the batch")
flags.DEFINE_integer("prompt_len", 32, "prompt bucket: prompts of 8 to this many tokens")
flags.DEFINE_integer("response_len", 384, "max_new_tokens: the response bucket")
flags.DEFINE_float("median", 24, "median response length (tokens)")
flags.DEFINE_float("p99", 384, "99th percentile of the response length (tokens)")
flags.DEFINE_integer("micro_batches", 4, "the padded update's micro-batches; the packed "
                     "budget is one padded micro-batch's tokens")
flags.DEFINE_integer("iters", 3, "timed updates of each (after one that compiles)")
flags.DEFINE_integer("seed", 0, "")
FLAGS = flags.FLAGS


def _batch(cfg, seed):
  import numpy as np

  from fbos_jax.planning import hardware
  from fbos_jax.rl import batch as batch_lib
  rng = np.random.default_rng(seed)
  n, p, r = FLAGS.rows, FLAGS.prompt_len, FLAGS.response_len
  lengths = hardware.ResponseLengths(FLAGS.median / r, FLAGS.p99 / r).sample(n, r, seed)
  prompts = [list(rng.integers(3, cfg.vocab_size, size=rng.integers(8, p + 1))) for _ in range(n)]
  tokens = rng.integers(3, cfg.vocab_size, size=(n, r)).astype(np.int32)
  mask = (np.arange(r)[None] < lengths[:, None]).astype(np.int32)
  old = (rng.normal(size=(n, r)) * 0.1 - 2.0).astype(np.float32)
  return batch_lib.make_policy_batch(prompts, tokens, mask, rng.normal(size=n).astype(np.float32),
                                     old, rng.random(n) < 1 / 3, prompt_len=p, num_rows=n), lengths


def _time(fn, *args):
  import jax
  t0 = time.perf_counter()
  jax.block_until_ready(fn(*args))
  compile_s = time.perf_counter() - t0
  times = []
  for _ in range(FLAGS.iters):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - t0)
  return statistics.median(times), compile_s


def main(argv):
  del argv
  import jax
  import jax.numpy as jnp
  import numpy as np
  import optax

  from fbos_jax.model import qwen
  from fbos_jax.rl import config as C
  from fbos_jax.rl import packing
  from fbos_jax.rl import update as U
  from fbos_jax.rl.state import TrainState

  # the tiny configs' model (configs/base.py), float32
  cfg = qwen.ModelConfig(vocab_size=128, hidden_size=128, intermediate_size=384, num_layers=3,
                         num_heads=4, num_kv_heads=2, head_dim=32, rope_theta=10_000.0)
  padded, lengths = _batch(cfg, FLAGS.seed)
  row_len = padded.prompt_len + padded.response_len
  budget = FLAGS.rows // FLAGS.micro_batches * row_len  # one padded micro-batch's tokens
  terms = (C.Term("epa", "policy_gradient", 1.0),)
  u_pad = C.UpdateConfig(terms=terms, micro_batches=FLAGS.micro_batches)
  u_pack = C.UpdateConfig(terms=terms, micro_batch_tokens=budget)
  t0 = time.perf_counter()
  packed = packing.pack_batches({"epa": padded}, u_pack, shards=1)["epa"]
  pack_s = time.perf_counter() - t0
  real = packing.real_tokens(padded)
  assert real == packing.real_tokens(packed)
  print(f"backend={jax.default_backend()} rows={FLAGS.rows} prompt<={FLAGS.prompt_len} "
        f"response<={FLAGS.response_len} (lognormal median {FLAGS.median:g}, p99 {FLAGS.p99:g}: "
        f"sampled median {np.median(lengths):.0f}, p99 {np.percentile(lengths, 99):.0f}, "
        f"mean {lengths.mean():.1f})")
  print(f"padded: {padded.num_rows} rows x {row_len} = {padded.tokens.size:,} positions, "
        f"{FLAGS.micro_batches} micro-batches; packed: {packed.num_rows} rows x {packed.row_len} = "
        f"{packed.tokens.size:,} positions, {packed.micro_batches} micro-batch(es) of "
        f"{budget:,} tokens; real tokens {real:,} (packing took {1e3 * pack_s:.0f} ms on the host)")

  opt = optax.adamw(1e-4, weight_decay=0.0)
  params = qwen.init_params(cfg, jax.random.key(FLAGS.seed))
  state = TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=opt.init(params),
                     rng=jax.random.key_data(jax.random.key(0)),
                     nonfinite_steps=jnp.zeros((), jnp.int32))
  out = {}
  for name, ucfg, batch in (("padded", u_pad, padded), ("packed", u_pack, packed)):
    step = jax.jit(U.make_update_fn(cfg, opt, ucfg))
    dev = jax.device_put({"epa": batch})
    secs, compile_s = _time(step, state, dev)
    grad = jax.jit(lambda p, b, ucfg=ucfg: U.gradients(p, cfg, b, ucfg)[:2])(params, dev)
    out[name] = dict(seconds=secs, compile_s=compile_s, tok_s=real / secs, grads=grad)
    print(f"{name:7s} update {secs:7.3f} s (compile {compile_s:.1f} s): "
          f"{real / secs:10,.0f} real tokens/s, {batch.tokens.size / secs:10,.0f} positions/s")
  (g_pad, l_pad), (g_pack, l_pack) = out["padded"]["grads"], out["packed"]["grads"]
  diff = max(float(jnp.max(jnp.abs(a - b))) for a, b in
             zip(jax.tree.leaves(g_pad), jax.tree.leaves(g_pack)))
  scale = max(float(jnp.max(jnp.abs(a))) for a in jax.tree.leaves(g_pad))
  ratio = out["packed"]["tok_s"] / out["padded"]["tok_s"]
  loss_diff = abs(float(l_pad) - float(l_pack))
  ok = ratio >= 2 and diff <= 1e-5 and loss_diff <= 1e-5
  print(f"packed / padded real tokens/s: {ratio:.2f}x; loss {float(l_pad):.6f} vs "
        f"{float(l_pack):.6f} (diff {loss_diff:.1e}); largest gradient difference {diff:.1e} "
        f"(largest gradient {scale:.1e}); target >= 2x and <= 1e-5: {'PASS' if ok else 'FAIL'}")
  print(json.dumps({
      "padded_tok_s": out["padded"]["tok_s"], "packed_tok_s": out["packed"]["tok_s"],
      "ratio": ratio, "max_grad_diff": diff, "max_grad": scale, "loss_diff": loss_diff,
      "padded_s": out["padded"]["seconds"], "packed_s": out["packed"]["seconds"],
      "real_tokens": real, "padded_positions": int(padded.tokens.size),
      "packed_positions": int(packed.tokens.size), "packed_micro_batches": packed.micro_batches,
      "padded_micro_batches": FLAGS.micro_batches, "rows": FLAGS.rows,
      "response_len": FLAGS.response_len, "backend": jax.default_backend(), "pass": ok}))


if __name__ == "__main__":
  app.run(main)
