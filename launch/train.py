r"""Train with any algorithm config.

  python launch/train.py --config=configs/fbos.py:tiny --workdir=/tmp/fbos_tiny
  python launch/train.py --config=configs/grpo.py:tiny --config.rl.group_size=16 --workdir=...
  python launch/train.py --config=configs/fbos.py:qwen_8b --dry_run --mesh_devices=32

On a TPU pod every worker runs the same command; on a GPU cluster pass
--coordinator_address / --num_processes / --process_id (or run under SLURM,
where they are read from the environment). See README "Scale-out".
"""

import _common  # noqa: F401  (repo + kernels/ on sys.path)
from absl import app, flags, logging  # noqa: E402
from ml_collections import config_flags  # noqa: E402

_CONFIG = config_flags.DEFINE_config_file("config", None, "Config file, e.g. configs/fbos.py:tiny",
                                          lock_config=True)
flags.DEFINE_string("workdir", None, "Where checkpoints, metrics, plots and caches go.")
flags.DEFINE_bool("dry_run", False, "Build abstractly with jax.eval_shape and print the "
                  "parameter count, mesh, sharding and per-device memory plan; allocate nothing.")
flags.DEFINE_integer("mesh_devices", 0, "Plan for this many devices (abstract mesh) in --dry_run.")
flags.DEFINE_string("init_from_hf", "", "Start from a Hugging Face checkpoint directory.")
flags.DEFINE_bool("plot", True, "Draw metrics.png into the workdir at the end.")
flags.DEFINE_string("coordinator_address", "", "host:port of process 0 (multi-process GPU/CPU).")
flags.DEFINE_integer("num_processes", 0, "Number of processes (multi-process GPU/CPU).")
flags.DEFINE_integer("process_id", -1, "This process's id (multi-process GPU/CPU).")
flags.DEFINE_integer("distributed_timeout_s", 300, "Give up connecting to the coordinator after this.")
FLAGS = flags.FLAGS


def main(argv):
  del argv
  config = _CONFIG.value
  if config is None:
    raise app.UsageError("--config is required, e.g. --config=configs/fbos.py:tiny")
  if FLAGS.dry_run:
    from fbos_jax.plan import HBM_BYTES, format_plan, memory_plan
    n = FLAGS.mesh_devices or config.mesh.num_devices
    if not n:
      import jax
      n = jax.device_count()
    plan = memory_plan(config, n)
    print(format_plan(plan, {k: HBM_BYTES[k] for k in ("v5p", "h100")}))
    return
  if not FLAGS.workdir:
    raise app.UsageError("--workdir is required (checkpoints, metrics and caches go there)")

  from fbos_jax import distributed
  distributed.initialize(FLAGS.coordinator_address, FLAGS.num_processes, FLAGS.process_id,
                         timeout_s=FLAGS.distributed_timeout_s)
  from fbos_jax.rl import run
  run.run_training(config, FLAGS.workdir, init_from_hf=FLAGS.init_from_hf, plot=FLAGS.plot)


if __name__ == "__main__":
  flags.mark_flags_as_required(["config"])
  app.run(main)
