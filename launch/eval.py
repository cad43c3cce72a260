r"""Held-out pass@1 (greedy) and unbiased pass@k of a trained checkpoint.

  python launch/eval.py --config=configs/fbos.py:tiny --workdir=/tmp/fbos_tiny --k=8
"""
import _common  # noqa: F401
import json

from absl import app, flags
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file("config", None, "Config file, e.g. configs/fbos.py:tiny")
flags.DEFINE_string("workdir", None, "Training workdir holding checkpoints/.")
flags.DEFINE_integer("k", 1, "pass@k with k samples per prompt at temperature 1 (1 = greedy only).")
flags.DEFINE_integer("step", -1, "Checkpoint step (-1 = latest).")
FLAGS = flags.FLAGS


def main(argv):
  del argv
  from fbos_jax.rl.trainer import RLTrainer
  config = _CONFIG.value
  trainer = RLTrainer(config, FLAGS.workdir, log_metrics=False)
  try:
    state = trainer.restore_train_state(None if FLAGS.step < 0 else FLAGS.step)
  except FileNotFoundError as e:
    raise app.UsageError(str(e)) from None
  res = trainer.evaluate(state.params, trainer.env.eval_examples(), k=FLAGS.k,
                         step=int(state.step))
  res["step"] = int(state.step)
  print(json.dumps(res, indent=2))
  trainer.close()


if __name__ == "__main__":
  flags.mark_flags_as_required(["config", "workdir"])
  app.run(main)
