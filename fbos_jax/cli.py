"""What the launchers in ``launch/`` share: absl flag parsing with a one-line
error for a bad ``--config.*`` override. The project is installed
(``pip install -r requirements.txt`` installs ``fbos_jax``, ``configs`` and
``fbos_kernels`` in editable mode), so no launcher touches ``sys.path``."""
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


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
