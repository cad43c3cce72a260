r"""Write a trained checkpoint out as a Hugging Face model directory (servable by
vLLM / SGLang; loads with transformers.AutoModelForCausalLM.from_pretrained).

  python launch/export_hf.py --config=configs/fbos.py:tiny --workdir=/tmp/fbos_tiny --out=/tmp/fbos_tiny_hf
  # a run started with --init_from_hf: the same flag takes the architecture and tokenizer from DIR
  python launch/export_hf.py --config=configs/fbos.py:qwen3_0_6b --init_from_hf=/ckpt/Qwen3-0.6B \
      --workdir=/tmp/q --out=/tmp/q_hf

The directory gets the safetensors, ``config.json`` (keys we do not own, such as
``max_position_embeddings`` and the eos/bos ids, kept from the source checkpoint's
``config.json`` when the run came from one), the tokenizer files (copied verbatim
from the run's tokenizer directory) and the source's ``generation_config.json``.
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
flags.DEFINE_string("init_from_hf", "", "The HF checkpoint directory the run started from (as "
                    "in train.py): model fields and tokenizer come from it.")
FLAGS = flags.FLAGS

GENERATION_CONFIG = "generation_config.json"


def export(config, workdir: str, out: str, *, step: int = -1, dtype: str = "",
           init_from_hf: str = "") -> tuple[list[str], int]:
  """Exports checkpoint ``step`` (-1 = latest) of ``workdir`` to ``out``.

  ``init_from_hf`` (or ``config.model.hf_path``): the source HF directory; the
  model fields are set from its ``config.json`` (``apply_hf_config``) and its
  ``config.json`` / ``generation_config.json`` keys are kept in the export.

  Returns:
    (files written, the checkpoint's step).
  """
  import jax
  from fbos_jax import tokenizer as tok_lib
  from fbos_jax.model import hf
  from fbos_jax.rl.trainer import RLTrainer
  src = init_from_hf or config.model.get("hf_path", "")
  if src:
    config = hf.apply_hf_config(config, src)
  tok_dir = tok_lib.resolve_tokenizer_path(config, workdir)  # a clear error before any work
  trainer = RLTrainer(config, workdir, log_metrics=False)
  try:
    state = trainer.restore_train_state(None if step < 0 else step)
    paths = hf.save_hf_checkpoint(state.params, trainer.model_cfg, out, dtype=dtype or None,
                                  base_config=hf.read_hf_config(src) if src else None)
    if jax.process_index() == 0:
      written = tok_lib.copy_tokenizer_files(tok_dir, out)
      if not written:  # so the directory serves as is
        written = list(trainer.env.tokenizer.save_pretrained(out))
      paths += written
      if src and os.path.isfile(os.path.join(src, GENERATION_CONFIG)):
        shutil.copyfile(os.path.join(src, GENERATION_CONFIG), os.path.join(out, GENERATION_CONFIG))
        paths.append(os.path.join(out, GENERATION_CONFIG))
    return paths, int(state.step)
  finally:
    trainer.close()


def main(argv):
  del argv
  from fbos_jax.model.hf import CheckpointError
  try:
    paths, step = export(_CONFIG.value, FLAGS.workdir, FLAGS.out, step=FLAGS.step,
                         dtype=FLAGS.dtype, init_from_hf=FLAGS.init_from_hf)
  except (FileNotFoundError, CheckpointError) as e:  # no checkpoint / tokenizer / HF dir
    raise app.UsageError(str(e)) from None
  print(f"wrote {FLAGS.out} ({len(paths)} files) from step {step}")


if __name__ == "__main__":
  flags.mark_flags_as_required(["config", "workdir", "out"])
  app.run(main, flags_parser=_common.parse_flags)
