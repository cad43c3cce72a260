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
from fbos_jax import cli

from absl import app, flags

_CONFIG = cli.define_checkpoint_flags()
flags.DEFINE_string("out", None, "Output directory.")
flags.DEFINE_string("dtype", "", "Export dtype, e.g. float32 (default: export.dtype, else "
                    "the source checkpoint's dtype, else bfloat16; the run's float32 master is "
                    "rounded to it here).")
flags.DEFINE_integer("check_greedy", 0, "After exporting, reload the export with transformers "
                     "and check that its greedy generation on this many held-out prompts equals "
                     "our sampler's, token for token (float32 on both sides, the sampler's "
                     "rules on both: stop ids, no id beyond the tokenizer; a difference at a "
                     "near-tie of the logits is reported, not failed; needs torch).")
flags.adopt_module_key_flags(cli)  # the shared flags in --helpshort
FLAGS = flags.FLAGS


def main(argv):
  del argv
  cli.setup_console_from_flags()
  from fbos_jax.model.hf import CheckpointError
  from fbos_jax.checkpoint import CheckpointMismatchError, CheckpointRestoreError
  from fbos_jax.rl import export as export_lib
  try:
    paths, step = export_lib.export_run(_CONFIG.value, FLAGS.workdir, FLAGS.out, step=FLAGS.step,
                         dtype=FLAGS.dtype, init_from_hf=FLAGS.init_from_hf)
  except (FileNotFoundError, CheckpointError) as e:  # no checkpoint / tokenizer / HF dir
    raise app.UsageError(str(e)) from None
  except (CheckpointRestoreError, CheckpointMismatchError) as e:  # unreadable / another model
    cli.fail(e)
  print(f"wrote {FLAGS.out} ({len(paths)} files) from step {step}")
  if FLAGS.check_greedy:
    results = export_lib.check_greedy(_CONFIG.value, FLAGS.workdir, FLAGS.out,
                                      FLAGS.check_greedy, step=step,
                                      init_from_hf=FLAGS.init_from_hf)
    print(export_lib.summarize_greedy(results))
    if not all(r.ok for r in results):  # a near-tie (float rounding) is not a failure
      raise SystemExit(1)


if __name__ == "__main__":
  flags.mark_flags_as_required(["config", "workdir", "out"])
  app.run(main, flags_parser=cli.parse_flags)
