r"""Memory benchmark: chunked vs naive token log-probs + entropy.

  python launch/bench_logprobs.py                      # B=4 T=2048 D=1024 V=151936, bf16
  python launch/bench_logprobs.py --grad=false --vocab_chunk=16384

Compiles both versions from abstract shapes (``jax.ShapeDtypeStruct``; nothing
is allocated, so it runs on a laptop CPU) and reads the temporary-buffer size
from ``compiled.memory_analysis()``. With ``--grad`` (default) the measured
program is ``value_and_grad`` of ``sum(logp) + sum(entropy)`` w.r.t. the hidden
states and the unembedding, i.e. what a training step needs. The last line of
output is JSON. Target: chunked temp bytes <= 1/8 of naive.
"""

import json
import os
import sys

from absl import app, flags  # noqa: E402

flags.DEFINE_integer("batch", 4, "B")
flags.DEFINE_integer("time", 2048, "T")
flags.DEFINE_integer("hidden", 1024, "D")
flags.DEFINE_integer("vocab", 151936, "V (Qwen's vocabulary)")
flags.DEFINE_string("dtype", "bfloat16", "dtype of hidden states and unembedding")
flags.DEFINE_integer("time_chunk", 256, "chunked: time steps per block")
flags.DEFINE_integer("vocab_chunk", 8192, "chunked: vocabulary columns per block")
flags.DEFINE_bool("grad", True, "also measure fwd+bwd (value_and_grad w.r.t. hidden and unembed)")
FLAGS = flags.FLAGS


def _measure(fn, args):
    import jax

    compiled = jax.jit(fn).lower(*args).compile()
    ma = compiled.memory_analysis()
    if ma is None:  # some backends do not implement it
        return None
    return dict(temp=int(ma.temp_size_in_bytes), argument=int(ma.argument_size_in_bytes),
                output=int(ma.output_size_in_bytes))


def main(argv):
    del argv
    import jax
    import jax.numpy as jnp

    import fbos_kernels as K

    B, T, D, V = FLAGS.batch, FLAGS.time, FLAGS.hidden, FLAGS.vocab
    dt = jnp.dtype(FLAGS.dtype)
    args = (jax.ShapeDtypeStruct((B, T, D), dt), jax.ShapeDtypeStruct((D, V), dt),
            jax.ShapeDtypeStruct((B, T), jnp.int32))
    chunk_kw = dict(time_chunk=FLAGS.time_chunk, vocab_chunk=FLAGS.vocab_chunk)

    def forward(impl, **kw):
        def f(h, w, y):
            return impl(h, w, y, **kw)
        return f

    def train(impl, **kw):
        def loss(h, w, y):
            logp, ent = impl(h, w, y, **kw)
            return jnp.sum(logp) + jnp.sum(ent)

        def f(h, w, y):
            return jax.value_and_grad(loss, argnums=(0, 1))(h, w, y)
        return f

    programs = [("forward", forward)] + ([("fwd+bwd", train)] if FLAGS.grad else [])
    result = dict(B=B, T=T, D=D, V=V, dtype=str(dt), backend=jax.default_backend(), **chunk_kw,
                  logits_f32_bytes=B * T * V * 4)
    print(f"backend={jax.default_backend()} B={B} T={T} D={D} V={V} dtype={dt} "
          f"time_chunk={FLAGS.time_chunk} vocab_chunk={FLAGS.vocab_chunk}")
    print(f"one [B,T,V] float32 logits array = {B * T * V * 4 / 2**20:,.1f} MiB")
    for name, make in programs:
        naive = _measure(make(K.naive_logprobs_and_entropy), args)
        chunked = _measure(make(K.token_logprobs_and_entropy, **chunk_kw), args)
        if naive is None or chunked is None:
            print(f"{name}: memory_analysis() unavailable on this backend")
            result[name] = None
            continue
        ratio = chunked["temp"] / max(naive["temp"], 1)
        print(f"{name:8s} temp bytes: naive {naive['temp']:>15,d} ({naive['temp'] / 2**20:10,.1f} MiB)   "
              f"chunked {chunked['temp']:>15,d} ({chunked['temp'] / 2**20:8,.1f} MiB)   "
              f"ratio {ratio:.4f} (1/{1 / max(ratio, 1e-12):.1f})   target <= 0.125: "
              f"{'PASS' if ratio <= 0.125 else 'FAIL'}")
        result[name] = dict(naive_temp_bytes=naive["temp"], chunked_temp_bytes=chunked["temp"], ratio=ratio,
                            meets_target=bool(ratio <= 0.125), naive=naive, chunked=chunked)
    print(json.dumps(result))


if __name__ == "__main__":
    app.run(main)
