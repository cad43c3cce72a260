"""What the launchers in ``launch/`` share: absl flag parsing with a one-line
error for a bad ``--config.*`` override, and a quiet libtpu on machines without
a TPU (launchers import this module first, before jax). The project is installed
(``pip install -r requirements.txt`` installs ``fbos_jax``, ``configs`` and
``fbos_kernels`` in editable mode), so no launcher touches ``sys.path``."""
import glob
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

_GOOGLE_PCI_VENDOR = "0x1ae0"  # every TPU chip is a PCI device of this vendor
_ACCELERATOR_NODES = ("/dev/accel*", "/dev/vfio/[0-9]*", "/dev/nvidia[0-9]*", "/dev/kfd",
                      "/dev/dxg", "/proc/driver/nvidia/gpus/*")


def accelerator_attached() -> bool:
  """Whether this machine may have a TPU or GPU: a Google PCI device (a TPU chip), or a
  TPU / GPU device node. Errs on the side of yes."""
  for vendor in glob.glob("/sys/bus/pci/devices/*/vendor"):
    try:
      with open(vendor) as f:
        if f.read().strip() == _GOOGLE_PCI_VENDOR:
          return True
    except OSError:
      continue
  return any(glob.glob(pattern) for pattern in _ACCELERATOR_NODES)


def choose_cpu_platform_without_accelerator(environ=os.environ) -> bool:
  """On a machine with no TPU and no GPU, run JAX on the CPU (``JAX_PLATFORMS=cpu``).

  With libtpu installed (``requirements-test.txt`` brings it), JAX otherwise loads
  the TPU plugin on every start, and libtpu prints its initialization errors ("Failed
  to find host bounds for accelerator type", "INVALID_ARGUMENT ... TPU_WORKER_HOSTNAMES")
  before falling back to the CPU: a new user reads that as a broken install. Nothing
  changes when the user chose a platform (``JAX_PLATFORMS`` / ``JAX_PLATFORM_NAME``),
  forces TPU initialization (``JAX_FORCE_TPU_INIT``), or when a TPU or GPU may be
  attached (real TPU and GPU runs pick their backend as before). Returns whether it set
  the platform. Must run before jax starts a backend (launchers import this module
  first)."""
  if any(environ.get(k) for k in ("JAX_PLATFORMS", "JAX_PLATFORM_NAME", "JAX_FORCE_TPU_INIT")):
    return False
  if accelerator_attached():
    return False
  environ["JAX_PLATFORMS"] = "cpu"
  if "jax" in sys.modules and environ is os.environ:  # already imported: set the flag too
    sys.modules["jax"].config.update("jax_platforms", "cpu")
  return True


choose_cpu_platform_without_accelerator()


def parse_flags(argv):
  """absl's flag parsing, with a one-line error (no traceback) for a ``--config.*``
  override that names no field or has the wrong type. Pass as ``app.run(main,
  flags_parser=parse_flags)``."""
  from absl import app  # pylint: disable=g-import-not-at-top
  try:
    return app.parse_flags_with_usage(argv)
  except (AttributeError, KeyError, TypeError, ValueError) as e:
    overrides = [a for a in argv[1:] if a.startswith("--config.")]
    sys.stderr.write(f"FATAL Flags parsing error: a --config override does not fit the config "
                     f"({type(e).__name__}: {e}); overrides given: {' '.join(overrides) or '-'}. "
                     "The fields and their defaults are in configs/base.py.\n")
    sys.exit(1)


def define_console_verbosity():
  """The launchers' ``--console_verbosity`` flag (one definition): the console's log
  level; the full log always goes to ``WORKDIR/log.txt`` (``fbos_jax/console.py``)."""
  from absl import flags  # pylint: disable=g-import-not-at-top
  return flags.DEFINE_string("console_verbosity", "warning", "Console log level (debug | info "
                             "| warning | error); the full log always goes to WORKDIR/log.txt.")


def define_config_flag(lock_config: bool = False):
  """``--config`` (an ml_collections config file with ``--config.a.b=v``
  overrides), defined once for every launcher. Returns its holder (``.value``)."""
  from ml_collections import config_flags  # pylint: disable=g-import-not-at-top
  return config_flags.DEFINE_config_file("config", None, "Config file, e.g. configs/fbos.py:tiny",
                                         lock_config=lock_config)


def define_checkpoint_flags():
  """The flags of a launcher that reads a trained run (eval, export), defined once:
  ``--config``, ``--workdir``, ``--step``, ``--init_from_hf`` and ``--console_verbosity``.
  Returns the config flag's holder (``.value``: the ConfigDict with overrides)."""
  from absl import flags  # pylint: disable=g-import-not-at-top
  config = define_config_flag()
  flags.DEFINE_string("workdir", None, "Training workdir holding checkpoints/.")
  flags.DEFINE_integer("step", -1, "Checkpoint step (-1 = latest).")
  flags.DEFINE_string("init_from_hf", "", "The HF checkpoint directory the run started from "
                      "(as in train.py): model fields and tokenizer come from it.")
  define_console_verbosity()
  return config


def setup_console_from_flags():
  """``fbos_jax.console.setup_logging`` for ``--workdir`` at ``--console_verbosity``."""
  from absl import flags  # pylint: disable=g-import-not-at-top
  from fbos_jax import console  # pylint: disable=g-import-not-at-top
  f = flags.FLAGS
  console.setup_logging(f.workdir, verbosity=f.console_verbosity)


def fail(e: BaseException, code: int = 1):
  """Exit with ``e`` as one line (``Type: message``), no traceback and no usage text:
  for errors whose message says what to do (an unreadable checkpoint and ``--step``)."""
  sys.stderr.write(f"{type(e).__name__}: {e}\n")
  sys.exit(code)


def stops_with_threads_behind(e: BaseException) -> bool:
  """Whether ``e`` ends a run that leaves background writers behind: a failed
  checkpoint save (``CheckpointSaveError``) or a full disk anywhere (ENOSPC in
  its chain of causes)."""
  import errno  # pylint: disable=g-import-not-at-top
  seen = e
  while seen is not None:
    if type(seen).__name__ == "CheckpointSaveError" or (
        isinstance(seen, OSError) and seen.errno == errno.ENOSPC):
      return True
    seen = seen.__cause__ or seen.__context__
  return False


def exit_with_cause(e: BaseException, code: int = 1):
  """End the process after ``e`` with its cause as the last line of the output.

  The traceback goes to stderr and ``log.txt`` (whatever of it a full disk takes),
  the logs are flushed, and the process exits at once (``os._exit``): the
  interpreter's shutdown would otherwise finalize what a failed save left behind
  (orbax's unfinished write coroutines, tensorboardX's flush onto the full disk)
  and print their errors after the cause. The checkpoint manager has shut its
  threads down already (``fbos_jax/checkpoint.py``)."""
  import logging  # pylint: disable=g-import-not-at-top
  import traceback  # pylint: disable=g-import-not-at-top
  text = "".join(traceback.format_exception(e))
  from fbos_jax import console  # pylint: disable=g-import-not-at-top
  console.write_to_log_file(text)
  logging.shutdown()  # flush (a failing flush is ignored)
  try:
    sys.stdout.flush()
  except OSError:
    pass
  sys.stderr.write(text)
  sys.stderr.flush()
  os._exit(code)
