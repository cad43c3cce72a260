r"""Side-by-side comparison of the algorithms at small scale, and FBOS ablations.

  python launch/compare.py --algos=grpo,golf,gfpo,fbos --seeds=3 --workdir=/tmp/cmp
  python launch/compare.py --quick --workdir=/tmp/cmp_quick        # smoke test (~minutes)
  # the pre-registered FBOS ablation (issue 16), GRPO as the reference:
  python launch/compare.py --ablations --seeds=3 --workdir=/tmp/abl --note="alone on the machine"
  # the regime where feedback should matter (most groups all-fail after the warm start):
  python launch/compare.py --variant=tiny_hard --algos=grpo,golf,fbos --seeds=3 --workdir=/tmp/hard
  python launch/compare.py --arms=fbos,fbos_alternate --seeds=1 --workdir=/tmp/two  # any arms
  python launch/compare.py --resummarize --workdir=/tmp/abl   # rebuild table + PNG from compare.json

Every arm is a named entry of :data:`ARMS` (config file, flavors, stopping rule);
:data:`ABLATIONS` is the pre-registered list, and every arm that ran is reported,
whatever it shows. For each seed one warm start (SFT) is trained and cached in
WORKDIR/sft_s{seed} (``--shared_warm_start``: one, seed 0, in WORKDIR/sft) and
every arm of that seed starts from it and sees the same prompt order. Arms stop
at the same number of *generated rollouts* (round 2 and GOLF's refinements
count), except arms marked ``steps``, which stop at the number of steps the
GRPO reference takes for the budget (equal steps, not equal rollouts; every
output labels them so).

After each warm start, ``--probe_batches`` batches are sampled without training
(round 1 and a FAP round 2): round-1 success, all-fail and all-equal groups,
FAP truncation and the fix rate per round-1 success bucket of the warm start.
Then the feedback-reading probe (``fbos_jax/rl/probe.py``, ``--feedback_probe``)
on as many fresh batches: on the failed round-1 rollouts, log p(gold | FAP)
against log p(gold | q), the fix rate from the FAP against a fresh sample from
q, overall and on all-fail groups, and the controls on the same rollouts
(feedback swapped with another prompt's rollout's, feedback removed, attempt
removed). ``--probe_only`` writes them to WORKDIR/probe.json and probe.md:

  python launch/compare.py --probe_only --variant=tiny_chain --seeds=1 --workdir=/tmp/chain_probe

Writes WORKDIR/compare.json (every number, the command, the note), compare.md
(the tables) and compare.png (the curves).
"""

import shlex
import sys

from absl import app, flags

from fbos_jax import cli
from fbos_jax.experiments import compare

flags.DEFINE_string("workdir", None, "Output directory.")
flags.DEFINE_string("variant", "tiny", "Config variant every arm runs (tiny | tiny_hard | ...).")
flags.DEFINE_list("algos", ["grpo", "golf", "gfpo", "fbos"], "Config names to compare.")
flags.DEFINE_list("arms", [], "Arm labels of ARMS to run (overrides --algos / --ablations).")
flags.DEFINE_integer("seeds", 3, "Seeds per arm.")
flags.DEFINE_integer("budget", 0, "Generated rollouts per run (0 = 128 x train.steps of the variant).")
flags.DEFINE_integer("eval_every", 0, "Evaluate every N steps (0 = default).")
flags.DEFINE_bool("quick", False, "Tiny budget and model for a smoke test: checks the files, "
                  "not the results.")
flags.DEFINE_bool("ablations", False, "Run the pre-registered FBOS ablation (ABLATIONS) "
                  "instead of --algos.")
flags.DEFINE_bool("shared_warm_start", False, "One warm start (seed 0) for every seed, instead "
                  "of one per seed.")
flags.DEFINE_integer("probe_batches", 10, "Batches sampled after each warm start to measure it "
                 "(round-1 success, all-fail groups, fix rates); 0 = none.")
flags.DEFINE_bool("probe_only", False, "Train and probe the warm starts, then stop.")
flags.DEFINE_bool("feedback_probe", True, "Also run the feedback-reading probe "
                  "(fbos_jax/rl/probe.py: log p(gold | FAP) vs log p(gold | q), the fix rate "
                  "vs a fresh resample, and the controls) on --probe_batches batches.")
flags.DEFINE_string("note", "", "What else shared the machine (written into every output).")
flags.DEFINE_bool("resummarize", False, "Rebuild compare.md / compare.png / the table in "
                  "compare.json from the runs already in WORKDIR/compare.json (no training).")
flags.DEFINE_bool("resume", False, "Keep the finished runs of WORKDIR/compare.json (a partial "
                  "comparison that was stopped) and run only the missing ones; refused when "
                  "the variant, arms or budget differ.")
flags.DEFINE_string("task", "", "Override data.task (e.g. arithmetic).")
flags.DEFINE_multi_string("set", [], "Extra overrides for every run, e.g. --set=rl.terms.ecc.weight=0.5")
flags.DEFINE_list("lrs", [], "Learning-rate sweep (docs/results/verdict_rule.md): each arm runs "
                  "one seed (--sweep_seed) per rate on the validation split, and its seeds run "
                  "at the best stable rate; an arm with no stable rate is reported, not run. "
                  "Empty: every arm at its config's rate.")
flags.DEFINE_integer("sweep_seed", 0, "The seed of the sweep's runs.")
flags.DEFINE_integer("valid_prompts", 0, "Validation problems for the sweep (0 = "
                     "train.eval_prompts): the eval split's next distinct problems after the "
                     "test set's, never the test set.")
_CONSOLE_VERBOSITY = cli.define_console_verbosity()
flags.adopt_module_key_flags(cli)  # the shared flags in --helpshort
FLAGS = flags.FLAGS


def main(argv):
  del argv
  if not FLAGS.workdir:
    raise app.UsageError("--workdir is required")
  from fbos_jax import console  # pylint: disable=g-import-not-at-top
  console.setup_logging(FLAGS.workdir, verbosity=_CONSOLE_VERBOSITY.value)
  if FLAGS.resummarize:
    compare.resummarize(FLAGS.workdir)
    return
  try:
    opts = compare.Options(
        workdir=FLAGS.workdir, arms=tuple(compare.select_arms(FLAGS.arms, FLAGS.ablations,
                                                              FLAGS.algos)),
        variant=FLAGS.variant, seeds=FLAGS.seeds, budget=FLAGS.budget,
        eval_every=FLAGS.eval_every, quick=FLAGS.quick,
        shared_warm_start=FLAGS.shared_warm_start, probe_batches=FLAGS.probe_batches,
        probe_only=FLAGS.probe_only, feedback_probe=FLAGS.feedback_probe, note=FLAGS.note,
        resume=FLAGS.resume, task=FLAGS.task, set=tuple(FLAGS.set),
        lrs=tuple(float(x) for x in FLAGS.lrs), sweep_seed=FLAGS.sweep_seed,
        valid_prompts=FLAGS.valid_prompts)
    compare.run(opts, command=" ".join(shlex.quote(a) for a in ["python"] + sys.argv))
  except compare.FlagError as e:
    raise app.UsageError(str(e)) from None


if __name__ == "__main__":
  app.run(main)
