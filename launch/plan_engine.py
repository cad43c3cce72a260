r"""Compile the continuous engine's programs for a TPU topology and report memory.

  python launch/plan_engine.py --config=configs/fbos.py:qwen_8b_long --topology=v5p:2x4x4
  python launch/plan_engine.py --config=configs/fbos.py:qwen3_0_6b --topology=v5e:2x4 --slots=128

For each round of the config (round 1 on ``sampling.prompt_buckets``, round 2 on
``sampling.fap_prompt_buckets`` when the config has a second round) it builds the
engine (``--slots`` slots over the config's mesh, a page pool sized from the
config: every slot can reach the longest prompt + ``max_new_tokens``, plus the
staged rows), takes its programs at their largest shapes
(``fbos_jax.engine.plan.abstract_programs``: the decode window, and the prefill
of one ``--prefill_chunk`` chunk for every slot) and compiles them with XLA's TPU
compiler (libtpu; no TPU needed), printing per-device memory as XLA reports it
and whether each fits ``plan.FIT_FRACTION`` of the chip's HBM. The last line is
JSON. Slots default to the round's rows per step (rl.prompts_per_step x the
round's samples per prompt).
"""

import json
import os
import sys
import time

import _common  # noqa: F401  (repo + kernels/ on sys.path)
from absl import app, flags  # noqa: E402
from ml_collections import config_flags  # noqa: E402

_CONFIG = config_flags.DEFINE_config_file("config", None, "Config file, e.g. "
                                          "configs/fbos.py:qwen_8b_long", lock_config=True)
flags.DEFINE_string("topology", "v5p:2x4x4", "TPU topology, e.g. v5p:2x4x4, v5e:2x4.")
flags.DEFINE_integer("slots", 0, "engine.slots (0 = the round's rows per step).")
flags.DEFINE_integer("staged", -1, "engine.staged (-1 = as many as slots, 0 = off).")
flags.DEFINE_integer("page_size", 16, "engine.page_size")
flags.DEFINE_integer("window", 32, "engine.window")
flags.DEFINE_integer("prefill_chunk", 512, "engine.prefill_chunk")
flags.DEFINE_list("rounds", ["round1", "round2"], "Which rounds to plan.")
FLAGS = flags.FLAGS


def main(argv):
  del argv
  for k, v in (("ALLOW_MULTIPLE_LIBTPU_LOAD", "1"), ("TPU_STDERR_LOG_LEVEL", "3"),
               ("TPU_MIN_LOG_LEVEL", "3")):
    os.environ.setdefault(k, v)
  import jax
  jax.config.update("jax_platforms", "cpu")
  from fbos_jax import engine as engine_lib
  from fbos_jax import plan as plan_lib
  from fbos_jax import sampling
  from fbos_jax import sharding as sh
  from fbos_jax.engine import plan as eplan
  from fbos_jax.model import qwen

  config = _CONFIG.value
  devices = plan_lib.topology_devices(FLAGS.topology)
  mesh = plan_lib.target_mesh(config, devices, FLAGS.topology)
  hbm = plan_lib.hbm_bytes(devices[0])
  budget = plan_lib.fit_fraction(devices[0]) * hbm
  model_cfg = qwen.ModelConfig.from_dict(config.model)
  rules = sh.rules_dict(config.mesh.rules)
  sc, rl = config.sampling, config.rl
  rounds = {"round1": (tuple(sc.prompt_buckets), rl.group_size)}
  if rl.round2:  # P x m rows either way (single: P*m prompts x 1, aggregated: P x m)
    rounds["round2"] = (tuple(sc.fap_prompt_buckets), rl.round2_size)
  gib = 1024 ** 3
  print(f"topology {FLAGS.topology}: {len(devices)} x {devices[0].device_kind}, HBM "
        f"{hbm / gib:.2f} GiB per device; mesh "
        + " x ".join(f"{k}={v}" for k, v in mesh.shape.items()))
  report, fits = {}, True
  for name in FLAGS.rounds:
    if name not in rounds:
      continue
    prompt_buckets, n = rounds[name]
    slots = FLAGS.slots or rl.prompts_per_step * n
    scfg = sampling.make_config(
        max_new_tokens=int(sc.max_new_tokens), temperature=float(sc.temperature) or 1.0,
        top_k=int(sc.top_k), top_p=float(sc.top_p),
        stop_token_ids=(model_cfg.vocab_size - 1,), prompt_buckets=prompt_buckets)
    ecfg = engine_lib.EngineConfig(slots=slots, staged=FLAGS.staged, page_size=FLAGS.page_size,
                                   window=FLAGS.window, prefill_chunk=FLAGS.prefill_chunk)
    progs = eplan.abstract_programs(model_cfg, scfg, ecfg, mesh, rules)
    eng = progs.pop("engine")
    desc = eplan.describe(eng)
    print(f"\n{name}: {slots} slots + {desc['staged']} staged over {desc['batch_shards']} batch "
          f"shards; prompts up to {eng.max_prompt} + {eng.R} new tokens = {desc['pages_per_row']} "
          f"pages of {desc['page_size']}; pool {desc['pages_per_shard']} pages per shard = "
          f"{desc['pool_bytes_per_device'] / gib:.2f} GiB per device; attention "
          f"{desc['attention']}; window {desc['window']} steps; prefill chunk "
          f"{desc['prefill_chunk']}")
    for pname, (fn, args) in progs.items():
      t0 = time.time()
      prog = plan_lib.Program(pname, fn, args, 0.0, "", "engine.slots, engine.staged, "
                              "engine.num_pages, sampling.max_new_tokens, prompt buckets")
      rep = plan_lib.compile_program(prog, mesh)
      ok = not rep.error and rep.peak <= budget
      fits &= ok
      key = f"{name}/{pname}"
      report[key] = {"peak_bytes": None if rep.error else rep.peak, "argument_bytes": rep.argument,
                     "temp_bytes": rep.temp, "output_bytes": rep.output, "alias_bytes": rep.alias,
                     "fits": ok, "error": rep.error or None, "compile_s": time.time() - t0,
                     **{k: v for k, v in desc.items()}}
      if rep.error:
        print(f"  {pname:<16} does not compile: {rep.error}")
      else:
        print(f"  {pname:<16} args {rep.argument / gib:7.2f}  out {rep.output / gib:6.2f}  alias "
              f"{rep.alias / gib:6.2f}  temp {rep.temp / gib:6.2f}  peak {rep.peak / gib:7.2f} "
              f"GiB = {100 * rep.peak / hbm:4.0f}% HBM {'fits' if ok else 'DOES NOT FIT'} "
              f"(compiled in {time.time() - t0:.0f} s)", flush=True)
  print(json.dumps({"topology": FLAGS.topology, "hbm_bytes": hbm, "fits": fits,
                    "programs": report}))
  if not fits:
    sys.exit(1)


if __name__ == "__main__":
  flags.mark_flags_as_required(["config"])
  app.run(main, flags_parser=_common.parse_flags)
