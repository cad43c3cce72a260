r"""Memory benchmark: dense vs blocked (flash in XLA) vs Pallas splash attention.

  python launch/bench_attention.py                       # T = 1024, 4096, 16384
  python launch/bench_attention.py --lengths=4096 --no_tpu

Compiles the forward + backward of one attention call (one row, Qwen3-8B heads:
32 query / 8 key-value heads, head_dim 128, bf16) from abstract shapes and reads
the temporary bytes from ``compiled.memory_analysis()``: dense and blocked for
this CPU; Pallas splash and blocked for one chip of an abstract TPU v5p
(``jax.experimental.topologies``, needs libtpu: ``pip install -r
requirements-test.txt``). Nothing is allocated. The dense kernel's float32
score matrix alone is 32 x T x T x 4 bytes. The last line of output is JSON.
"""

import json
import time

from fbos_jax import cli
import jax
import jax.numpy as jnp
from absl import app, flags
from jax.sharding import SingleDeviceSharding

from fbos_jax.model import attention as A

flags.DEFINE_list("lengths", ["1024", "4096", "16384"], "Sequence lengths T.")
flags.DEFINE_bool("tpu", True, "Also compile for one abstract TPU v5p chip (needs libtpu).")
FLAGS = flags.FLAGS

HEADS, KV_HEADS, HEAD_DIM, ROWS = 32, 8, 128, 1


def temp_bytes(impl: str, t: int, device=None) -> int:
  """Temp bytes of grad(sum(attention)) w.r.t. q, k, v: [rows, T, heads, head_dim]."""
  q = jax.ShapeDtypeStruct((ROWS, t, HEADS, HEAD_DIM), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((ROWS, t, KV_HEADS, HEAD_DIM), jnp.bfloat16)
  mask = jax.ShapeDtypeStruct((ROWS, t), jnp.int32)
  fn = {"dense": A.dense, "blocked": A.blocked, "pallas": A.pallas}[impl]

  def loss(q, k, v, m):
    return jnp.sum(fn(q, k, v, m).astype(jnp.float32))

  kw = {}
  if device is not None:
    s = SingleDeviceSharding(device)
    kw = dict(in_shardings=(s, s, s, s))
  compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2)), **kw).lower(q, kv, kv, mask).compile()
  return compiled.memory_analysis().temp_size_in_bytes


def main(argv):
  del argv
  tpu = None
  if FLAGS.tpu:
    try:
      from jax.experimental import topologies
      tpu = topologies.get_topology_desc(platform="tpu", topology_name="v5p:2x2x1").devices[0]
    except Exception as e:  # pylint: disable=broad-except
      print(f"no TPU compiler ({type(e).__name__}: {e}); CPU figures only")
  rows = []
  for t in map(int, FLAGS.lengths):
    t0 = time.perf_counter()
    r = {"T": t, "dense_scores_MiB": ROWS * HEADS * t * t * 4 / 2**20}
    for impl in ("dense", "blocked"):
      r[f"cpu_{impl}_MiB"] = temp_bytes(impl, t) / 2**20
    if tpu is not None:
      for impl in ("pallas", "blocked"):
        r[f"v5p_{impl}_MiB"] = temp_bytes(impl, t, tpu) / 2**20
    r["compile_s"] = time.perf_counter() - t0
    rows.append({k: round(v, 1) if isinstance(v, float) else v for k, v in r.items()})
    print(f"T={t}: " + ", ".join(f"{k} {v}" for k, v in rows[-1].items() if k != "T"), flush=True)
  print(json.dumps({"rows": rows}))


if __name__ == "__main__":
  app.run(main)
