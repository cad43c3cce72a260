"""Multi-process runs through JAX's own runtime on one machine (issue 7).

Two local processes start ``jax.distributed`` (coordinator on 127.0.0.1, gloo
CPU collectives, 4 fake CPU devices each) and train the shrunk FBOS tiny config
for 2 steps on a data=8 mesh; then a single process with 8 devices runs the
same global batch (the two hosts' data iterators concatenated in host order)
while another single process restores the 2-process checkpoint on another mesh.
Workers are plain scripts (tests/mp_worker.py) with timeouts; a worker that
fails or hangs is killed and its log tail is shown. About 3 minutes on 2 loaded
cores (most of it XLA compiles: ~40 s per process).

  1. equivalence: per-step losses/metrics and final params within 1e-5;
  2. the 2-process checkpoint restores in 1 process on another mesh
     (data=2, fsdp=2, tensor=2) and continues one step;
  3. each process verifies only its own rollouts (1/P of round 1; every
     rollout exactly once over the hosts);
  bad input: a mesh that does not fit the processes, an unreachable
  coordinator / missing peers (clear message, no hang), a checkpoint of another
  model config (CheckpointMismatchError through RLTrainer.maybe_restore).
"""

from __future__ import annotations

import collections
import json
import os
import shutil
import subprocess
import sys
import time
import warnings

import jax
import numpy as np
import pytest

from fbos_jax.testing.small import free_port

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "mp_worker.py")
GLOBAL_PROMPTS, GROUP = 4, 4  # fbos_jax/testing/small.py:small_config
# the same per-step metrics in both runs (counts are summed over hosts)
COMPARED = ("loss/epa", "loss/ecc", "policy/loss", "policy/grad_norm", "policy/entropy",
            "policy/epa_entropy", "policy/ecc_entropy", "policy/clipfrac", "policy/kl",
            "policy/epa_tokens", "policy/ecc_tokens", "reward/round1", "reward/round1_solved",
            "groups/all_equal_frac", "response/length", "tokens/generated", "rollouts/generated",
            "round2/rollouts", "epa/injected")


def launch(args, log_path):
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # the worker sets its own
  log = open(log_path, "w")
  p = subprocess.Popen([sys.executable, "-u", WORKER, *args], stdout=log,
                       stderr=subprocess.STDOUT, env=env, cwd=os.path.dirname(HERE))
  p.log_path = log_path
  p.log_file = log
  return p


def tail(p, n=3000) -> str:
  if not p.log_file.closed:
    p.log_file.flush()
  with open(p.log_path) as f:
    text = "".join(line for line in f if not line.startswith("[Gloo]"))
  return f"--- {os.path.basename(p.log_path)} (rc={p.returncode}) ---\n{text[-n:]}"


def wait_all(procs, timeout_s: float, *, peer_grace_s: float = 30.0, check=True):
  """Wait for every process; kill all on timeout, or the rest soon after one fails
  (its peers would wait in a collective). Returns the exit statuses."""
  deadline = time.time() + timeout_s
  failed_at = None
  while any(p.poll() is None for p in procs):
    now = time.time()
    if failed_at is None and any(p.poll() not in (None, 0) for p in procs):
      failed_at = now
    if now > deadline or (failed_at is not None and now > failed_at + peer_grace_s):
      for p in procs:
        if p.poll() is None:
          p.kill()
          p.wait()
      break
    time.sleep(0.2)
  for p in procs:
    if not p.log_file.closed:
      p.log_file.close()
  if check and any(p.returncode != 0 for p in procs):
    pytest.fail("worker(s) failed or timed out:\n" + "\n".join(tail(p) for p in procs))
  return [p.returncode for p in procs]


def load(path):
  with open(path) as f:
    return json.load(f)


@pytest.fixture(scope="module")
def bad_input_runs(tmp_path_factory):
  """Light workers for the bad-input tests, started at once (they mostly wait
  on timeouts, so they overlap with the training runs when those are selected)."""
  d = tmp_path_factory.mktemp("bad")
  port = free_port()
  procs = {
      "dir": d,
      # 2 processes whose meshes do not fit them
      "bad_mesh": [launch(["--mode=bad_mesh", f"--process_id={i}", "--num_processes=2",
                           f"--coordinator=127.0.0.1:{port}", "--timeout_s=90",
                           f"--workdir={d / 'w'}", f"--out={d / f'b{i}.json'}"],
                          d / f"b{i}.log") for i in range(2)],
      # process 1 of 2, nobody listening on the coordinator's port
      "lone_worker": launch(["--mode=init_only", "--process_id=1", "--num_processes=2",
                             f"--coordinator=127.0.0.1:{free_port()}", "--timeout_s=3"],
                            d / "worker.log"),
      # process 0 of 2 (it hosts the coordinator); its peer never comes
      "lone_coordinator": launch(["--mode=init_only", "--process_id=0", "--num_processes=2",
                                  f"--coordinator=127.0.0.1:{free_port()}", "--timeout_s=4"],
                                 d / "coordinator.log"),
  }
  yield procs
  left = [p for v in procs.values() if not isinstance(v, os.PathLike)
          for p in (v if isinstance(v, list) else [v]) if p.poll() is None]
  if left:  # their tests were not selected
    wait_all(left, timeout_s=0, check=False)


@pytest.fixture(scope="module")
def runs(tmp_path_factory, bad_input_runs):
  """The 2-process run, then the 1-process reference together with the restore
  of the 2-process checkpoint on another mesh (whose test waits for it): two
  busy processes at a time on 2 cores."""
  del bad_input_runs  # only started first, to overlap
  d = tmp_path_factory.mktemp("mp")
  port = free_port()
  t0 = time.time()
  hosts = [launch(["--mode=train", f"--process_id={i}", "--num_processes=2",
                   f"--coordinator=127.0.0.1:{port}", "--timeout_s=90",
                   f"--workdir={d / 'mp'}", f"--out={d / f'p{i}.json'}"], d / f"p{i}.log")
           for i in range(2)]
  wait_all(hosts, timeout_s=420)
  ref = launch(["--mode=reference", "--local_devices=8", f"--workdir={d / 'ref'}",
                f"--out={d / 'ref.json'}"], d / "ref.log")
  shutil.copytree(d / "mp", d / "restore")  # a 1-process run on another mesh resumes it
  restore = launch(["--mode=restore", "--local_devices=8", "--steps=3",
                    f"--workdir={d / 'restore'}", f"--out={d / 'restore.json'}"],
                   d / "restore.log")
  try:
    wait_all([ref], timeout_s=300)
  except BaseException:
    wait_all([restore], timeout_s=0, check=False)
    raise
  out = {"dir": d, "seconds": time.time() - t0, "restore": restore,
         "hosts": [load(d / f"p{i}.json") for i in range(2)], "ref": load(d / "ref.json")}
  out["params"] = dict(np.load(d / "p0.npz"))
  out["ref_params"] = dict(np.load(d / "ref.npz"))
  yield out
  if restore.poll() is None:  # its test was not selected
    wait_all([restore], timeout_s=0, check=False)


@pytest.mark.slow  # default suite under 15 min (issue 35): .ci/run runs the slow set too
def test_two_processes_match_one_process(runs):
  h0, h1 = runs["hosts"]
  ref = runs["ref"]
  for h in (h0, h1):
    assert (h["process_count"], h["devices"], h["local_devices"]) == (2, 8, 4)
    assert h["step"] == 2 and h["latest_checkpoint"] == 2
  assert ref["devices"] == 8 and ref["step"] == 2
  assert h0["history"] == h1["history"]  # metrics are reduced over hosts
  assert len(h0["history"]) == len(ref["history"]) == 2
  for got, want in zip(h0["history"], ref["history"]):
    for k in COMPARED:
      assert got[k] == pytest.approx(want[k], abs=1e-5), (got["step"], k, got[k], want[k])
  # not a trivial equivalence: real gradients, and round 2 split unevenly over the hosts
  assert all(r["policy/grad_norm"] > 1e-3 and r["loss/epa"] != 0 for r in ref["history"])
  r2 = [[sum(map(len, step[1:])) for step in h["verify_batches"]] for h in (h0, h1)]
  assert any(a != b for a, b in zip(*r2)), r2
  p, q = runs["params"], runs["ref_params"]
  assert sorted(p) == sorted(q)
  worst = max(float(np.max(np.abs(p[k] - q[k]))) for k in p)
  assert worst <= 1e-5, worst


def test_each_process_verifies_only_its_own_rollouts(runs):
  h0, h1 = runs["hosts"]
  ref = runs["ref"]
  steps = 2
  for h in (h0, h1):
    # per step: a verify batch for round 1 (1/P of the global one), one for round 2
    # when this host sampled round-2 rows
    assert len(h["verify_batches"]) == steps
    for step in h["verify_batches"]:
      assert len(step[0]) == GLOBAL_PROMPTS * GROUP // 2 and len(step) <= 2
    n = sum(len(b) for step in h["verify_batches"] for b in step)
    assert len(h["verifier_calls"]) == n == h["pool_calls"]
  for s in range(steps):
    ids = [set(h["verify_batches"][s][0]) for h in (h0, h1)]
    assert not ids[0] & ids[1]  # disjoint prompts: nothing gathered to one host
    assert ids[0] | ids[1] == set(ref["verify_batches"][s][0])
  calls = collections.Counter(h0["verifier_calls"]) + collections.Counter(h1["verifier_calls"])
  assert calls == collections.Counter(ref["verifier_calls"])  # every rollout verified once


def test_two_process_checkpoint_restores_on_another_mesh(runs):
  wait_all([runs["restore"]], timeout_s=300)
  d = runs["dir"]
  r = load(d / "restore.json")
  assert r["resumed"] and r["restored_step"] == 2
  assert r["mesh_shape"] == {"dcn": 1, "data": 2, "fsdp": 2, "tensor": 2}
  specs = " ".join(r["param_specs"].values())
  assert "tensor" in specs and "fsdp" in specs  # really resharded, not replicated
  restored = dict(np.load(d / "restore_restored.npz"))
  for k, v in runs["params"].items():
    np.testing.assert_array_equal(restored[k], v, err_msg=k)
  assert r["step"] == 3 and [h["step"] for h in r["history"]] == [3]
  assert np.isfinite(r["history"][0]["loss/epa"]) and r["history"][0]["policy/finite"] == 1.0


def test_checkpoint_of_another_model_config_is_rejected(runs, tmp_path):
  from mp_worker import numpy_params

  from fbos_jax import checkpoint as ckpt_lib
  from fbos_jax import sharding as sh
  from fbos_jax.rl.trainer import RLTrainer
  work = tmp_path / "other_model"
  shutil.copytree(runs["dir"] / "mp", work)
  from fbos_jax.testing.small import small_config
  c = small_config("configs/fbos.py:tiny", **{"model.num_layers": 2})
  tr = RLTrainer(c, str(work), mesh=sh.make_mesh({"data": 1}, devices=jax.devices()[:1]),
                 init_params=numpy_params(c))
  try:
    with pytest.raises(ckpt_lib.CheckpointMismatchError, match=r"model\.num_layers"):
      tr.maybe_restore(tr.init_state())
  finally:
    tr.close()


def test_mesh_that_does_not_fit_the_processes(bad_input_runs):
  wait_all(bad_input_runs["bad_mesh"], timeout_s=300)
  for i in range(2):
    errs = load(bad_input_runs["dir"] / f"b{i}.json")["errors"]
    assert errs["fixed_size"] and "ShardingError" in errs["fixed_size"]
    assert "multiply to 4, but there are 8 devices" in errs["fixed_size"]
    assert errs["batch_axes"] and "ProcessMeshError" in errs["batch_axes"]
    assert "do not divide over 2 processes" in errs["batch_axes"]


def test_unreachable_coordinator_and_missing_peers_time_out(bad_input_runs):
  import re

  from fbos_jax.distributed import INIT_TIMEOUT_EXIT_CODE
  worker, coordinator = bad_input_runs["lone_worker"], bad_input_runs["lone_coordinator"]
  rcs = wait_all([worker, coordinator], timeout_s=120, check=False)  # no hang
  worker_log, coord_log = tail(worker), tail(coordinator)
  # process 1: a DistributedInitError (a Python exception) after its 3 s timeout
  assert rcs[0] == 3, worker_log
  assert "unreachable after 3s" in worker_log, worker_log
  waited = float(re.search(r"DistributedInitError after ([0-9.]+)s", worker_log).group(1))
  assert 3 <= waited < 20, worker_log
  # process 0: JAX would abort (a C++ fatal error); the watchdog exits first, saying why
  assert rcs[1] == INIT_TIMEOUT_EXIT_CODE, coord_log
  assert "did not finish within 4s" in coord_log and "--num_processes" in coord_log, coord_log


@pytest.mark.slow  # default suite under 15 min (issue 35): .ci/run runs the slow set too
def test_engine_equals_static_in_two_processes(tmp_path):
  """2 processes x 4 devices, data=8: each process samples its own prompts (3 and 5;
  then 3 and none) with the static sampler and with the continuous engine: the
  same rows (greedy exactly; sampled up to flips each worker proves to be near-ties,
  fbos_jax.testing.flips), each process gets only its own, and both processes ran
  the same number of windows (lockstep)."""
  port = free_port()
  procs = [launch(["--mode=engine", f"--process_id={i}", "--num_processes=2",
                   f"--coordinator=127.0.0.1:{port}", "--timeout_s=90",
                   f"--out={tmp_path / f'e{i}.json'}"], tmp_path / f"e{i}.log")
           for i in range(2)]
  wait_all(procs, timeout_s=600)
  hosts = [load(tmp_path / f"e{i}.json") for i in range(2)]
  local_prompts = {"greedy": (3, 5), "sampled": (3, 5), "one_process_empty": (3, 0)}
  for h in hosts:
    for call in h["calls"]:
      name = call["name"]
      assert call["rows"] == 2 * local_prompts[name][h["process_index"]], (name, call["rows"])
      assert call["flip_error"] is None, (name, call["flip_error"])
      assert call["flips"] == 0 or name != "greedy", (name, call["flips"])
      print(f"process {h['process_index']} {name}: {call['flips']} proven near-tie flips")
  for c0, c1 in zip(hosts[0]["calls"], hosts[1]["calls"]):
    assert c0["stats"]["windows"] == c1["stats"]["windows"] > 0  # every window together
    assert c0["stats"]["prefills"] == c1["stats"]["prefills"]


def test_sampler_draws_are_keyed_by_global_sample():
  """What makes the processes' samples match one process's: sample j of global
  prompt i draws from fold_in(key_t, i*n + j), whatever the batch layout. The
  second host's call (its prompts, their global indices, other padding) gives
  the same rows as one call over all prompts; chunking changes nothing either."""
  from fbos_jax import buckets, sampling
  from fbos_jax.model import qwen
  from fbos_jax.testing.small import small_config
  cfg = qwen.ModelConfig.from_dict(small_config("configs/fbos.py:tiny").model)
  params = qwen.init_params(cfg, jax.random.key(0))
  rng = np.random.default_rng(0)
  prompts = [rng.integers(3, cfg.vocab_size, size=k) for k in (5, 3, 7, 4, 6)]
  kw = dict(max_new_tokens=5, temperature=1.0, prompt_buckets=(8,))
  fn = sampling.get_generate_fn(cfg, sampling.make_config(**kw), batch=4, prompt_len=8,
                                n_per_prompt=2)  # one program for every call below
  key = jax.random.key_data(jax.random.key(3))

  def run(rows, ids):  # a process's call: its prompts and their global indices
    toks, mask = buckets.left_pad(rows, 8, 0, rows=4)
    ids = np.asarray(list(ids) + [-1] * (4 - len(ids)), np.int32)
    with warnings.catch_warnings():  # the donated prompts cannot alias the n=2 outputs
      warnings.filterwarnings("ignore", message="Some donated buffers were not usable")
      out = fn(params, toks, mask, key, np.float32(1), np.float32(1),
               sampling.stop_id_array(()), ids)
    return {k: np.asarray(v)[:2 * len(rows)] for k, v in out.items()}

  whole = run(prompts[:4], range(4))
  host1 = run(prompts[2:4], [2, 3])  # host 1: global prompts 2, 3 (and 2 dummy rows)
  np.testing.assert_array_equal(host1["tokens"], whole["tokens"][4:8])
  np.testing.assert_allclose(host1["logprobs"], whole["logprobs"][4:8], atol=1e-6)
  assert (whole["tokens"][0::2] != whole["tokens"][1::2]).any()  # really sampled
  chunked = sampling.sample(params, cfg, prompts, key=key, n_per_prompt=2, batch_buckets=(4,),
                            **kw)  # chunks of 4 + 1 prompts
  np.testing.assert_array_equal(
      chunked.tokens, np.concatenate([whole["tokens"], run(prompts[4:], [4])["tokens"]]))


def test_distributed_helpers_in_one_process(monkeypatch):
  from fbos_jax import distributed
  assert distributed.agree_max(3, 5) == (3, 5)
  assert distributed.allgather_json({"a": 1}) == [{"a": 1}]
  assert distributed.mean_over_processes({"x": 1.0}, sum_keys=("x",)) == {"x": 1.0}
  state = {"grain": {"pos": 3}}
  assert distributed.per_process_state(state) is state  # 1 process: saved as is
  assert distributed.select_process_state(state) is state
  bundle = {"__per_process__": [{"pos": 1}, {"pos": 2}]}  # written by 2 processes
  assert distributed.select_process_state(bundle) is None  # restart the iterator
  assert distributed.select_process_state({"__per_process__": [{"pos": 7}]}) == {"pos": 7}
  distributed.check_mesh(None)  # a no-op in one process
  assert distributed.initialize() is False  # nothing to do for a single process
  # SLURM, one task per node: the process gets every GPU of its node
  for k, v in {"SLURM_JOB_ID": "7", "SLURM_NTASKS": "4", "SLURM_NTASKS_PER_NODE": "1",
               "CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7"}.items():
    monkeypatch.setenv(k, v)
  assert distributed._slurm_local_device_ids() == list(range(8))
  monkeypatch.setenv("SLURM_NTASKS_PER_NODE", "8")  # one per GPU: JAX's own pinning
  assert distributed._slurm_local_device_ids() is None
