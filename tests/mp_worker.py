"""One process of a multi-process (or single-process reference) run, launched by
tests/test_multiprocess.py as a plain script:

  python tests/mp_worker.py --mode=train --process_id=0 --num_processes=2 \
      --coordinator=127.0.0.1:PORT --workdir=DIR --out=OUT.json

Modes:
  train      2 steps of the shrunk FBOS tiny config on a data=8 mesh, over
             jax.distributed (CPU collectives, --local_devices fake devices each);
             a checkpoint at the last step. Writes metrics, the final params
             (process 0), and every verifier call this process made.
  reference  the same run in ONE process over 8 devices, fed the global batch
             (the per-host iterators concatenated in host order).
  restore    ONE process, another mesh (data=2, fsdp=2, tensor=2): restore the
             2-process checkpoint, continue one step.
  bad_mesh   after jax.distributed start-up: meshes that do not fit the processes.
  engine     2 processes, data=8 mesh: each samples its own prompts (3 and 5, and then
             3 and none) with the static sampler and with the continuous engine
             (fbos_jax.engine), greedy and sampled; writes both.
  init_only  only jax.distributed start-up (unreachable coordinator, missing peers).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time

_HERE = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(_HERE)


def _parse():
  p = argparse.ArgumentParser()
  p.add_argument("--mode", required=True,
                 choices=("train", "reference", "restore", "bad_mesh", "init_only", "engine"))
  p.add_argument("--process_id", type=int, default=0)
  p.add_argument("--num_processes", type=int, default=1)
  p.add_argument("--coordinator", default="")
  p.add_argument("--timeout_s", type=int, default=60)
  p.add_argument("--local_devices", type=int, default=4)
  p.add_argument("--workdir", default="")
  p.add_argument("--out", default="")
  p.add_argument("--steps", type=int, default=2)
  return p.parse_args()


ARGS = None
if __name__ == "__main__":  # a worker process (the tests also import numpy_params)
  ARGS = _parse()
  # Must happen before jax is imported.
  # (LLVM -O0: a third less compile time on 2 loaded cores; the programs are tiny)
  os.environ["XLA_FLAGS"] = (f"--xla_force_host_platform_device_count={ARGS.local_devices} "
                             + os.environ.get("MP_WORKER_XLA_FLAGS",
                                              "--xla_backend_optimization_level=0"))
  os.environ["JAX_PLATFORMS"] = "cpu"
  os.environ["JAX_CPU_COLLECTIVES_IMPLEMENTATION"] = "gloo"  # cross-process CPU collectives
  for k, v in (("HF_HUB_OFFLINE", "1"), ("TRANSFORMERS_OFFLINE", "1"),
               ("TOKENIZERS_PARALLELISM", "false")):
    os.environ.setdefault(k, v)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

if __name__ == "__main__":
  jax.config.update("jax_cpu_collectives_implementation", "gloo")

from fbos_jax import distributed  # noqa: E402

EQUIV_MESH = {"dcn": 1, "data": 8, "fsdp": 1, "tensor": 1}
RESTORE_MESH = {"dcn": 1, "data": 2, "fsdp": 2, "tensor": 2}
SPEC = "configs/fbos.py:tiny"


def config(steps: int, mesh: dict):
  from fbos_jax.testing.small import small_config  # the shrinking every trainer test uses
  c = small_config(SPEC, **{"train.steps": steps, "train.checkpoint_every": 2, "train.eval_every": 0,
                     "train.progress": False})
  for k, v in mesh.items():
    c.mesh[k] = v
  # one batch bucket for both rounds and every step: no recompiles in step 2
  # (a host pads its 2 prompts to 16, the 1-process run its 4)
  c.sampling.batch_buckets = (16,)
  return c


def text_hash_verifier(example, response):
  """Deterministic rewards that vary within a group (a random tiny model never
  solves the arithmetic, and all-zero rewards would make every loss 0). Host
  0's first prompt of a step is always solved: host 0 then samples fewer
  round-2 rows than host 1 (padding in the middle of the global batch)."""
  if example.get("_slot") == [0, 0]:
    return 1.0, "correct"
  ok = sum(map(ord, response)) % 3 == 0
  return (1.0, "correct") if ok else (0.0, f"wrong: checksum {sum(map(ord, response)) % 3}")


class CountingVerifier:
  """Wraps a verifier; records the example id of every call it gets."""

  def __init__(self, inner):
    self.inner = inner
    self.calls = []
    self._lock = threading.Lock()

  def __call__(self, example, response):
    with self._lock:
      self.calls.append(str(example.get("id", "")))
    return self.inner(example, response)


def counting_trainer(tr, its):
  """Score ``tr``'s rollouts with the counting text-hash verifier, feeding it
  ``its`` (a list of (host, iterator)) through :class:`Tagged`. Returns the
  verifier and, per step, the example ids of each verify batch (round 1, then
  round 2 if this process sampled one)."""
  counter = CountingVerifier(text_hash_verifier)
  tr.ctx.pool.verifier = counter
  steps = []
  # the trainer's rollout source takes the prompts from it
  tr.train_iter = tr.source.iterator = Tagged(its, on_next=lambda: steps.append([]))
  inner_verify = tr.ctx.verify

  def verify(examples, texts):
    steps[-1].append([str(ex.get("id", "")) for ex in examples])
    return inner_verify(examples, texts)

  tr.ctx.verify = verify
  return counter, steps


class Tagged:
  """Tags each example of ``it``'s batches with ``_slot = [host, index in batch]``."""

  def __init__(self, its, on_next=None):
    self.its = its
    self.on_next = on_next

  def __next__(self):
    if self.on_next:
      self.on_next()
    return [dict(ex, _slot=[host, j]) for host, it in self.its
            for j, ex in enumerate(next(it))]

  def get_state(self):
    return self.its[0][1].get_state() if len(self.its) == 1 else {}

  def set_state(self, state):
    if len(self.its) == 1:
      self.its[0][1].set_state(state)


def numpy_params(c):
  """qwen.init_params' recipe drawn with numpy (the jitted init costs a 7 s
  compile on 2 loaded cores); identical on every process."""
  from fbos_jax.model import qwen
  rng = np.random.default_rng(c.seed)

  def leaf(path, a):
    name = path[-1].key
    if name.endswith("norm"):
      return np.ones(a.shape, a.dtype)
    if name.endswith("bias"):
      return np.zeros(a.shape, a.dtype)
    return (0.02 * rng.standard_normal(a.shape)).astype(a.dtype)

  return jax.tree_util.tree_map_with_path(
      leaf, qwen.abstract_params(qwen.ModelConfig.from_dict(c.model)))


def canonical_state(tr):
  """``tr.init_state()`` with the shardings the update step's outputs have.

  (RLTrainer.init_state places params with specs like P(None, None) and leaves
  step/rng uncommitted; the update returns P() / mesh-replicated arrays, so the
  second step recompiles the update and sampling programs. A pass through jit
  gives the first step the same shardings: same values, half the compiles.)"""
  state = tr.init_state()
  return jax.jit(lambda s: jax.tree.map(lambda x: x * jnp.ones((), x.dtype), s))(state)


def params_to_host(state) -> dict:
  """Every param leaf as numpy, gathered over processes when needed (all processes call)."""
  from jax.experimental import multihost_utils
  out = {}
  for path, x in jax.tree_util.tree_flatten_with_path(state.params)[0]:
    if not x.is_fully_addressable:
      x = multihost_utils.process_allgather(x, tiled=True)
    out[jax.tree_util.keystr(path)] = np.asarray(x)
  return out


def shardings_of(state) -> dict:
  return {jax.tree_util.keystr(p): str(x.sharding.spec)
          for p, x in jax.tree_util.tree_flatten_with_path(state.params)[0]}


def write(result: dict, params: dict | None = None):
  with open(ARGS.out, "w") as f:
    json.dump(result, f, default=float)
  if params is not None:
    np.savez(ARGS.out.replace(".json", ".npz"), **params)


def clean(history):
  return [{k: v for k, v in h.items() if isinstance(v, (int, float))} for h in history]


def run_train():
  from fbos_jax import sharding as sh
  from fbos_jax.rl.trainer import RLTrainer
  c = config(ARGS.steps, EQUIV_MESH)
  mesh = sh.make_mesh(c.mesh)
  tr = RLTrainer(c, ARGS.workdir, mesh=mesh, init_params=numpy_params(c))
  counter, batches = counting_trainer(tr, [(jax.process_index(), tr.train_iter)])
  state, hist = tr.train(canonical_state(tr))
  tr.close()
  params = params_to_host(state)
  write({"process_index": jax.process_index(), "process_count": jax.process_count(),
         "devices": jax.device_count(), "local_devices": jax.local_device_count(),
         "history": clean(hist), "step": int(state.step),
         "verifier_calls": counter.calls, "verify_batches": batches,
         "pool_calls": int(tr.ctx.pool.totals["calls"]),
         "latest_checkpoint": tr.ckpt.latest_step()},
        params if jax.process_index() == 0 else None)


def run_reference():
  from fbos_jax import data as data_lib
  from fbos_jax import sharding as sh
  from fbos_jax.rl import state as state_lib
  from fbos_jax.rl.trainer import RLTrainer
  c = config(ARGS.steps, EQUIV_MESH)
  c.train.checkpoint_every = 0
  tr = RLTrainer(c, ARGS.workdir, mesh=sh.make_mesh(c.mesh), init_params=numpy_params(c))
  its = [data_lib.make_prompt_iterator(c.data, batch_size=c.rl.prompts_per_step // 2,
                                       process_index=i, process_count=2,
                                       seed=state_lib.data_seed(c.seed, c.data.shuffle_seed),
                                       tokenizer=tr.ctx.tokenizer)
         for i in range(2)]
  counter, batches = counting_trainer(tr, list(enumerate(its)))  # host 0's rows, then host 1's
  state, hist = tr.train(canonical_state(tr))
  tr.close()
  write({"history": clean(hist), "step": int(state.step), "verifier_calls": counter.calls,
         "verify_batches": batches, "devices": jax.device_count()}, params_to_host(state))


def run_restore():
  from fbos_jax import sharding as sh
  from fbos_jax.rl.trainer import RLTrainer
  c = config(ARGS.steps, RESTORE_MESH)
  tr = RLTrainer(c, ARGS.workdir, mesh=sh.make_mesh(c.mesh), init_params=numpy_params(c))
  state = tr.init_state()  # the restore target (its values are overwritten)
  state, resumed = tr.maybe_restore(state)
  restored_step = int(state.step)
  restored = params_to_host(state)
  np.savez(ARGS.out.replace(".json", "_restored.npz"), **restored)
  specs = shardings_of(state)
  mesh_shape = dict(next(iter(jax.tree.leaves(state.params))).sharding.mesh.shape)
  state, hist = tr.train(state)
  tr.close()
  write({"resumed": resumed, "restored_step": restored_step, "step": int(state.step),
         "history": clean(hist), "param_specs": specs, "mesh_shape": mesh_shape})


def run_bad_mesh():
  from fbos_jax import sharding as sh
  from fbos_jax.rl.trainer import RLTrainer
  errors = {}
  try:  # sized for one host (4 devices) but launched on 2 processes x 4 devices
    sh.make_mesh({"dcn": 1, "data": 4, "fsdp": 1, "tensor": 1})
    errors["fixed_size"] = None
  except Exception as e:  # noqa: BLE001
    errors["fixed_size"] = f"{type(e).__name__}: {e}"
  try:  # all 8 devices on the tensor axis: the batch cannot split over the 2 hosts
    c = config(2, {"dcn": 1, "data": 1, "fsdp": 1, "tensor": 8})
    RLTrainer(c, ARGS.workdir, mesh=sh.make_mesh(c.mesh))
    errors["batch_axes"] = None
  except Exception as e:  # noqa: BLE001
    errors["batch_axes"] = f"{type(e).__name__}: {e}"
  write({"errors": errors, "process_count": jax.process_count()})


def run_engine():
  """Static sampler vs engine on this process's prompts, on the shared data=8 mesh."""
  from jax.sharding import NamedSharding, PartitionSpec

  from fbos_jax import engine as engine_lib
  from fbos_jax import sampling
  from fbos_jax import sharding as sh
  from fbos_jax.model import qwen
  from fbos_jax.testing.flips import assert_same_rows
  mesh = sh.make_mesh(EQUIV_MESH)
  cfg = qwen.ModelConfig(model_type="qwen3", vocab_size=97, hidden_size=64,
                         intermediate_size=96, num_layers=2, num_heads=4, num_kv_heads=2,
                         head_dim=16, rope_theta=10000.0)
  rng = np.random.default_rng(0)  # the same weights and prompts on every process
  host = jax.tree.map(
      lambda s: (1.0 + 0.2 * rng.standard_normal(s[0]) if len(s[0]) < 3 and s[1][-1] == "norm"
                 else 0.12 * rng.standard_normal(s[0])).astype(np.float32),
      qwen.param_shapes(cfg), is_leaf=lambda x: isinstance(x, tuple) and isinstance(x[0], tuple))
  rep = NamedSharding(mesh, PartitionSpec())
  params = jax.tree.map(lambda x: jax.make_array_from_callback(x.shape, rep, lambda i: x[i]), host)
  prompts = [rng.integers(1, cfg.vocab_size, int(k)).tolist() for k in (5, 9, 2, 7, 4, 11, 3, 6)]
  first = 0 if jax.process_index() == 0 else 3  # global index of this process's first prompt
  mine = prompts[first:first + (3 if first == 0 else 5)]
  ecfg = engine_lib.EngineConfig(slots=8, page_size=4, window=4, prefill_chunk=8)
  key = jax.random.key_data(jax.random.key(5))
  out = {"process_index": jax.process_index(), "calls": []}
  base = dict(max_new_tokens=10, prompt_buckets=(12,), batch_buckets=(8,))
  for name, kw, local in (("greedy", dict(temperature=0.0), mine),
                          ("sampled", dict(temperature=0.8), mine),
                          ("one_process_empty", dict(temperature=0.8),
                           mine if jax.process_index() == 0 else [])):
    kw = dict(base, **kw)
    static = sampling.sample(params, cfg, local, key=key, n_per_prompt=2, mesh=mesh,
                             rules=sh.DEFAULT_RULES, **kw)
    stats = engine_lib.EngineStats()
    eng = engine_lib.sample(params, cfg, local, key=key, n_per_prompt=2, mesh=mesh,
                            rules=sh.DEFAULT_RULES, engine_config=ecfg, stats=stats, **kw)
    try:  # this process's rows, proven on its own device (host params, global stream ids)
      flips, flip_error = len(assert_same_rows(
          static, eng, host, cfg, key=key, n_per_prompt=2,
          stream_ids=first + np.arange(len(local)), **kw)), None
    except AssertionError as e:
      flips, flip_error = None, str(e)[-3000:]
    out["calls"].append({
        "flips": flips, "flip_error": flip_error,
        "name": name, "rows": int(eng.num_rows),
        "static_tokens": static.tokens.tolist(), "engine_tokens": eng.tokens.tolist(),
        "static_logprobs": static.logprobs.tolist(), "engine_logprobs": eng.logprobs.tolist(),
        "static_lengths": static.lengths.tolist(), "engine_lengths": eng.lengths.tolist(),
        "stats": stats.as_dict()})
  write(out)


def main():
  t0 = time.time()
  if ARGS.mode in ("train", "bad_mesh", "init_only", "engine"):
    try:
      ok = distributed.initialize(ARGS.coordinator, ARGS.num_processes, ARGS.process_id,
                                  timeout_s=ARGS.timeout_s)
    except distributed.DistributedInitError as e:
      print(f"DistributedInitError after {time.time() - t0:.1f}s: {e}", flush=True)
      sys.exit(3)
    print(f"process {jax.process_index()}/{jax.process_count()} up ({ok}), "
          f"{jax.device_count()} devices", flush=True)
    if ARGS.mode == "init_only":
      return
  {"train": run_train, "reference": run_reference, "restore": run_restore,
   "bad_mesh": run_bad_mesh, "engine": run_engine}[ARGS.mode]()
  if ARGS.mode in ("train", "bad_mesh", "engine"):  # as a run ends: none leaves before the
    distributed.finish()                           # others (their peer watchdogs poll it)
  print(f"{ARGS.mode} done in {time.time() - t0:.1f}s", flush=True)


if __name__ == "__main__":
  main()
