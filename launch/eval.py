r"""Held-out pass@1 (greedy) and unbiased pass@k of a trained checkpoint.

  python launch/eval.py --config=configs/fbos.py:tiny --workdir=/tmp/fbos_tiny --k=8
  # a run started with --init_from_hf: the same flag takes the architecture and tokenizer from DIR
  python launch/eval.py --config=configs/fbos.py:qwen3_0_6b --init_from_hf=/ckpt/Qwen3-0.6B \
      --workdir=/tmp/q
"""
from fbos_jax import cli
import json

from absl import app, flags

_CONFIG = cli.define_checkpoint_flags()
flags.DEFINE_integer("k", 1, "pass@k with k samples per prompt at temperature 1 (1 = greedy only).")
flags.adopt_module_key_flags(cli)  # the shared flags in --helpshort
FLAGS = flags.FLAGS


def main(argv):
  del argv
  cli.setup_console_from_flags()
  from fbos_jax.model.hf import CheckpointError
  from fbos_jax.checkpoint import CheckpointMismatchError, CheckpointRestoreError
  from fbos_jax.rl import evaluation
  try:
    res = evaluation.evaluate_checkpoint(_CONFIG.value, FLAGS.workdir, k=FLAGS.k,
                                         step=FLAGS.step, init_from_hf=FLAGS.init_from_hf)
  except (FileNotFoundError, CheckpointError) as e:  # no checkpoint / tokenizer / HF dir
    raise app.UsageError(str(e)) from None
  except (CheckpointRestoreError, CheckpointMismatchError) as e:  # unreadable / another model
    cli.fail(e)
  print(json.dumps(res, indent=2))


if __name__ == "__main__":
  flags.mark_flags_as_required(["config", "workdir"])
  app.run(main, flags_parser=cli.parse_flags)
