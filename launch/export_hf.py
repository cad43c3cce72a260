r"""Write a trained checkpoint out as a Hugging Face model directory (servable by
vLLM / SGLang; loads with transformers.AutoModelForCausalLM.from_pretrained).

  python launch/export_hf.py --config=configs/fbos.py:tiny --workdir=/tmp/fbos_tiny --out=/tmp/fbos_tiny_hf
"""
import _common  # noqa: F401
import os
import shutil

from absl import app, flags
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file("config", None, "Config file, e.g. configs/fbos.py:tiny")
flags.DEFINE_string("workdir", None, "Training workdir holding checkpoints/.")
flags.DEFINE_string("out", None, "Output directory.")
flags.DEFINE_integer("step", -1, "Checkpoint step (-1 = latest).")
flags.DEFINE_string("dtype", "", "Export dtype (default: the params' dtype), e.g. bfloat16.")
FLAGS = flags.FLAGS


def main(argv):
  del argv
  from fbos_jax.model.hf import save_hf_checkpoint
  from fbos_jax.rl.trainer import RLTrainer
  config = _CONFIG.value
  trainer = RLTrainer(config, FLAGS.workdir, log_metrics=False)
  try:
    state = trainer.restore_train_state(None if FLAGS.step < 0 else FLAGS.step)
  except FileNotFoundError as e:
    raise app.UsageError(str(e)) from None
  paths = save_hf_checkpoint(state.params, trainer.model_cfg, FLAGS.out,
                             dtype=FLAGS.dtype or None)
  trainer.env.tokenizer.save_pretrained(FLAGS.out)  # so the directory serves as is
  print(f"wrote {FLAGS.out} ({len(paths)} files) from step {int(state.step)}")
  trainer.close()


if __name__ == "__main__":
  flags.mark_flags_as_required(["config", "workdir", "out"])
  app.run(main)
