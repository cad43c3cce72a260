r"""The pre-registered verdict of a comparison (``docs/results/verdict_rule.md``).

  python launch/verdict.py --compare=/tmp/verdict/compare.json --out=docs/results

Reads ``compare.json`` (written by ``launch/compare.py``) and writes ``verdict.json``,
``verdict.md`` and ``verdict.png`` to ``--out``. The rule and what it reports:
``fbos_jax/experiments/verdict.py``.
"""
from fbos_jax import cli  # noqa: F401  (quiet libtpu; before jax)

from absl import app, flags

from fbos_jax.experiments import compare_file
from fbos_jax.experiments import verdict

flags.DEFINE_string("compare", None, "compare.json of a finished (or partial) comparison.")
flags.DEFINE_string("out", "docs/results", "Directory for verdict.json, verdict.md, verdict.png.")
flags.DEFINE_string("reference", "grpo", "The reference arm's label.")
flags.DEFINE_string("command", "", "The comparison's command, for the outputs (default: "
                    "the one compare.json records).")
FLAGS = flags.FLAGS


def main(argv):
  del argv
  if not FLAGS.compare:
    raise app.UsageError("--compare=PATH/compare.json is required")
  try:
    data = compare_file.load_compare(FLAGS.compare)
    v = verdict.verdict(data, FLAGS.reference)
  except compare_file.CompareError as e:
    raise SystemExit(f"launch/verdict.py: {e}") from None
  if FLAGS.command:
    v["command"] = FLAGS.command
  print(verdict.write(data, v, FLAGS.out))


if __name__ == "__main__":
  app.run(main)
