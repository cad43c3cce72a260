"""One process of the asynchronous loop over several processes (issue 31), launched by
tests/test_async_processes.py as a plain script; every process of a run gets the
same arguments but its --process_id:

  python tests/async_mp_worker.py --process_id=0 --num_processes=2 \
      --coordinator=127.0.0.1:PORT --workdir=DIR --eta=0 --steps=4 [--out=PARAMS.npz]

The shrunk tiny FBOS config (fbos_jax.testing.small) through the real entry
(fbos_jax.rl.run.run_training): with 2 processes of 4 CPU devices and
rl.rollout_devices=4, process 0 trains and process 1 rolls out; with
--num_processes=1 it is the one-process synchronous reference on 4 devices.
Process 0 writes the final params to --out.
"""

from __future__ import annotations

import argparse
import os


def _parse():
  p = argparse.ArgumentParser()
  p.add_argument("--process_id", type=int, default=0)
  p.add_argument("--num_processes", type=int, default=1)
  p.add_argument("--coordinator", default="")
  p.add_argument("--workdir", required=True)
  p.add_argument("--eta", type=int, default=0)
  p.add_argument("--steps", type=int, default=4)
  p.add_argument("--out", default="")
  return p.parse_args()


def main():
  args = _parse()
  os.environ["XLA_FLAGS"] = ("--xla_force_host_platform_device_count=4 "
                             "--xla_backend_optimization_level=0")
  os.environ["JAX_PLATFORMS"] = "cpu"
  from fbos_jax import distributed
  if args.num_processes > 1:
    distributed.initialize(args.coordinator, args.num_processes, args.process_id, timeout_s=120)
  import jax
  import numpy as np
  from fbos_jax.rl import run
  from fbos_jax.testing.small import small_config
  over = {"train.steps": args.steps, "train.checkpoint_every": 2, "train.eval_prompts": 0,
          "rl.max_staleness": args.eta, "data.verifier": "fbos_jax.testing.small:parity_reward"}
  if args.num_processes > 1:
    over["rl.rollout_devices"] = 4
  state, _ = run.run_training(small_config("configs/fbos.py:tiny", **over), args.workdir,
                              plot=False)
  if args.out and jax.process_index() == 0:
    leaves = [np.asarray(x) for x in jax.tree.leaves(jax.device_get(state.params))]
    np.savez(args.out, *leaves)
  print("done", flush=True)


if __name__ == "__main__":
  main()
