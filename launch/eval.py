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
  state = trainer.init_state()
  if trainer.ckpt.latest_step() is None:
    raise app.UsageError(f"no checkpoint in {FLAGS.workdir}/checkpoints")
  from fbos_jax import checkpoint as ckpt_lib
  full, _, _ = trainer.ckpt.restore(None if FLAGS.step < 0 else FLAGS.step,
                                    ckpt_lib.abstract_with_shardings(trainer._full_state(state)),
                                    {"model": config.model.to_dict()})
  res = trainer.evaluate(full["train"].params, trainer.env.eval_examples(), k=FLAGS.k,
                         step=int(full["train"].step))
  res["step"] = int(full["train"].step)
  print(json.dumps(res, indent=2))
  trainer.close()


if __name__ == "__main__":
  flags.mark_flags_as_required(["config", "workdir"])
  app.run(main)
