r"""Draw a workdir's metrics.jsonl to PNG curves.

  python launch/plot.py /tmp/fbos_tiny            # writes /tmp/fbos_tiny/metrics.png
"""
from fbos_jax import cli
from absl import app, flags

from fbos_jax import metrics

flags.DEFINE_string("out", "", "PNG path (default WORKDIR/metrics.png).")
FLAGS = flags.FLAGS


def main(argv):
  if len(argv) != 2:
    raise app.UsageError("usage: python launch/plot.py WORKDIR")
  import os
  workdir = argv[1]
  rows = metrics.read_jsonl(os.path.join(workdir, "metrics.jsonl"))
  if not rows:
    raise app.UsageError(f"no metrics in {workdir}/metrics.jsonl")
  print(metrics.plot_metrics(rows, FLAGS.out or os.path.join(workdir, "metrics.png"),
                             title=os.path.basename(os.path.normpath(workdir))))


if __name__ == "__main__":
  app.run(main)
