r"""Train with any algorithm config.

  python launch/train.py --config=configs/fbos.py:tiny --workdir=/tmp/fbos_tiny
  python launch/train.py --config=configs/grpo.py:tiny --config.rl.group_size=16 --workdir=...
  python launch/train.py --config=configs/fbos.py:qwen_8b --dry_run --mesh_devices=32

On a TPU pod every worker runs the same command; on a GPU cluster pass
--coordinator_address / --num_processes / --process_id (or run under SLURM,
where they are read from the environment). See README "Scale-out".
"""

from fbos_jax import cli
from absl import app, flags, logging  # noqa: E402
from ml_collections import config_flags  # noqa: E402

_CONFIG = cli.define_config_flag(lock_config=True)
flags.DEFINE_string("workdir", None, "Where checkpoints, metrics, plots and caches go.")
flags.DEFINE_bool("dry_run", False, "Plan without training or allocating: with --topology, "
                  "compile every program of a step for that TPU topology and print XLA's "
                  "per-device memory, FLOPs and a roofline step time (exit 1 if anything does "
                  "not fit); with --mesh_devices, a quick abstract estimate.")
flags.DEFINE_string("topology", "", "--dry_run target, a TPU topology such as v5p:2x4x4, "
                    "v5e:2x4, v6e:2x4, v4:2x2x2 (needs `pip install libtpu==0.0.42.1`).")
flags.DEFINE_string("programs", "", "With --dry_run --topology: compile only this program "
                    "(e.g. update, sample_round2); the roofline still times every call.")
flags.DEFINE_bool("fit_micro_batches", False, "With --dry_run --topology: compile the update "
                  "at 1, 2, 4, ... micro-batches and print the fewest that fit.")
flags.DEFINE_integer("mesh_devices", 0, "Plan for this many devices (abstract mesh) in --dry_run.")
flags.DEFINE_string("init_from_hf", "", "Start from a Hugging Face checkpoint directory.")
flags.DEFINE_bool("plot", True, "Draw metrics.png into the workdir at the end.")
flags.DEFINE_string("coordinator_address", "", "host:port of process 0 (multi-process GPU/CPU).")
flags.DEFINE_integer("num_processes", 0, "Number of processes (multi-process GPU/CPU).")
flags.DEFINE_integer("process_id", -1, "This process's id (multi-process GPU/CPU).")
flags.DEFINE_integer("distributed_timeout_s", 300, "Give up connecting to the coordinator after this.")
flags.DEFINE_bool("allow_config_change", False, "Resume a workdir whose checkpoint was written "
                  "with a config that differs in a field that matters (named in the error).")
_CONSOLE_VERBOSITY = cli.define_console_verbosity()
flags.adopt_module_key_flags(cli)  # the shared flags in --helpshort
FLAGS = flags.FLAGS


def main(argv):
  del argv
  config = _CONFIG.value
  if config is None:
    raise app.UsageError("--config is required, e.g. --config=configs/fbos.py:tiny")
  from fbos_jax.rl import config as config_lib
  try:  # every bad field at once, before anything is built (the mesh is checked later)
    config_lib.validate(config, num_batch_shards=1, process_count=1,
                        overrides=config_flags.get_override_values(FLAGS["config"]))
  except ValueError as e:
    raise app.UsageError(str(e)) from None
  if FLAGS.dry_run and FLAGS.init_from_hf:  # plan the checkpoint's real architecture
    from fbos_jax.rl.config import with_checkpoint_model
    config = with_checkpoint_model(config, FLAGS.init_from_hf)
  if FLAGS.dry_run and FLAGS.topology:
    return _compiled_dry_run(config, FLAGS.topology)
  if FLAGS.dry_run:
    from fbos_jax.planning.hardware import HBM_BYTES
    from fbos_jax.planning.programs import format_plan, memory_plan
    n = FLAGS.mesh_devices or config.mesh.num_devices
    if not n:
      import jax
      n = jax.device_count()
    plan = memory_plan(config, n)
    print(format_plan(plan, {k: HBM_BYTES[k] for k in ("v5p", "h100")}))
    return
  if not FLAGS.workdir:
    raise app.UsageError("--workdir is required (checkpoints, metrics and caches go there)")

  from fbos_jax import console, distributed
  distributed.initialize(FLAGS.coordinator_address, FLAGS.num_processes, FLAGS.process_id,
                         timeout_s=FLAGS.distributed_timeout_s)
  import jax
  pi = jax.process_index()
  console.setup_logging(FLAGS.workdir, verbosity=_CONSOLE_VERBOSITY.value,
                        filename="log.txt" if pi == 0 else f"log.{pi}.txt")
  from fbos_jax.rl import run
  try:
    run.run_training(config, FLAGS.workdir, init_from_hf=FLAGS.init_from_hf, plot=FLAGS.plot,
                     allow_config_change=FLAGS.allow_config_change)
  except Exception as e:  # pylint: disable=broad-except
    if cli.stops_with_threads_behind(e):  # a failed save, a full disk: the cause last
      cli.exit_with_cause(e)
    raise


def _compiled_dry_run(config, topology: str):
  """Compile every program of a step for ``topology``; the last line is JSON."""
  import json
  import os
  import sys
  # the compiler only: no local TPU runtime, no libtpu process lock, quiet libtpu logs
  for k, v in (("ALLOW_MULTIPLE_LIBTPU_LOAD", "1"), ("TPU_STDERR_LOG_LEVEL", "3"),
               ("TPU_MIN_LOG_LEVEL", "3")):
    os.environ.setdefault(k, v)
  import jax
  jax.config.update("jax_platforms", "cpu")  # before any backend starts
  from fbos_jax.planning import hardware
  from fbos_jax.planning import programs as plan_lib
  say = lambda m: print(m, file=sys.stderr, flush=True)
  if FLAGS.fit_micro_batches:
    try:
      m, tried = plan_lib.fit_micro_batches(config, topology, progress=say)
    except hardware.PlanError as e:
      raise app.UsageError(str(e)) from None
    print(json.dumps({"topology": topology, "fewest_fitting_micro_batches": m,
                      "peak_bytes": tried}))
    if not m:
      sys.exit(1)
    return
  try:
    plan = plan_lib.compile_plan(config, topology, progress=say, only=FLAGS.programs or None)
  except hardware.PlanError as e:
    raise app.UsageError(str(e)) from None
  print(plan_lib.format_compiled_plan(plan))
  print(json.dumps(plan_lib.plan_json(plan)))
  if not plan["fits"]:
    sys.exit(1)


if __name__ == "__main__":
  flags.mark_flags_as_required(["config"])
  app.run(main, flags_parser=cli.parse_flags)
