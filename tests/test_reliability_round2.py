"""Reliability probes, round two (issue 23): typed answers, empty prompts,
near-duplicate eval prompts, NaN weights in a Hugging Face checkpoint, a full disk
during an asynchronous checkpoint save, an unrepresentable reward range, and
libtpu's start-up noise on CPU runs. See docs/reliability.md."""
import errno
import json
import logging
import math
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import load

from fbos_jax import checkpoint as ckpt_lib
from fbos_jax import data
from fbos_jax.model import CheckpointError, load_hf_params, save_hf_checkpoint
from fbos_jax.model import qwen
from fbos_jax.rl import config as config_lib
from fbos_jax.verifiers import base
from fbos_jax.verifiers import Verdict

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def jsonl_config(path, **kw):
  cfg = data.default_data_config()
  cfg.update(dict(source="jsonl", path=str(path), verifier="math", eval_fraction=0.0,
                  num_epochs=1, shuffle=False, drop_remainder=False))
  cfg.update(kw)
  return cfg


def write_records(path, records):
  path.write_text("".join(json.dumps(r) + "\n" for r in records))
  return str(path)


def examples(cfg):
  it = data.make_prompt_iterator(cfg, batch_size=7, process_index=0, process_count=1)
  return [ex for batch in it for ex in batch]


# ------------------------------------------------------------- answers are strings


@base.register_verifier("round2_int_answers")
class IntAnswers:
  """Grades integer answers as integers: declares it accepts them."""

  required_fields = ("answer",)
  answer_types = (str, int)

  def __call__(self, example, response):
    return Verdict(float(response.strip() == str(example["answer"])), "")


@pytest.mark.parametrize("answer,kind", [(42, "int"), ([1, 2], "list"), ({"x": 1}, "dict"),
                                         (True, "bool"), (1.5, "float")])
def test_non_string_answer_is_refused_naming_file_line_and_field(tmp_path, answer, kind):
  path = write_records(tmp_path / "d.jsonl", [{"prompt": "q", "answer": "1"},
                                              {"prompt": "p", "answer": answer}])
  with pytest.raises(data.MalformedRecordError) as e:
    examples(jsonl_config(path))
  msg = str(e.value)
  assert f"{path}:2" in msg and "'answer'" in msg and f"is a {kind}" in msg
  assert "'math'" in msg and "answer_types" in msg


def test_answer_too_large_for_a_float_is_refused(tmp_path):
  path = tmp_path / "d.jsonl"
  path.write_text('{"prompt": "q", "answer": 1e400}\n')  # json.loads gives inf
  with pytest.raises(data.MalformedRecordError, match=r"d.jsonl:1: field 'answer' is the "
                     r"number inf"):
    examples(jsonl_config(path))


def test_string_answers_pass_unchanged_and_declared_types_are_accepted(tmp_path):
  path = write_records(tmp_path / "d.jsonl", [{"prompt": "q", "answer": "0042"}])
  assert [e["answer"] for e in examples(jsonl_config(path))] == ["0042"]
  path = write_records(tmp_path / "i.jsonl", [{"prompt": "q", "answer": 42},
                                              {"prompt": "p", "answer": "7"}])
  got = [e["answer"] for e in examples(jsonl_config(path, verifier="round2_int_answers"))]
  assert got == [42, "7"] and isinstance(got[0], int)  # passed through, not json.dumps'd
  assert base.answer_types("round2_int_answers") == (str, int)
  for bad in ([4, 2], True):  # a list, and a bool (not an int unless named)
    path = write_records(tmp_path / "b.jsonl", [{"prompt": "q", "answer": bad}])
    with pytest.raises(data.MalformedRecordError, match="b.jsonl:1.*'answer'"):
      examples(jsonl_config(path, verifier="round2_int_answers"))


# ---------------------------------------------------------------- empty prompts


@pytest.mark.parametrize("prompt", ["", "   \n\t"])
def test_empty_prompt_is_refused_at_load_with_file_line_and_id(tmp_path, prompt):
  path = write_records(tmp_path / "d.jsonl", [{"id": "a", "prompt": "q", "answer": "1"},
                                              {"id": "b7", "prompt": prompt, "answer": "1"}])
  with pytest.raises(data.MalformedRecordError) as e:
    examples(jsonl_config(path))
  msg = str(e.value)
  assert f"{path}:2" in msg and "'b7'" in msg and "'prompt' is empty" in msg
  # on_malformed=skip drops it (and counts it) instead
  assert [e["id"] for e in examples(jsonl_config(path, on_malformed="skip"))] == ["a"]


# ----------------------------------------------- near-duplicate eval prompts in training


def test_near_duplicate_eval_prompts_leave_training_with_a_counted_warning(tmp_path, caplog):
  recs = [{"id": f"r{i}", "prompt": f"Problem {i}: what is {i}+{i}?", "answer": str(2 * i)}
          for i in range(10)]
  recs += [{"id": "case", "prompt": "PROBLEM 1: WHAT IS 1+1?", "answer": "2"},
           {"id": "space", "prompt": "  Problem 2:  what is 2+2?\n", "answer": "4"},
           {"id": "tab", "prompt": "problem 3:\twhat is 3+3? ", "answer": "6"}]
  train_path = write_records(tmp_path / "train.jsonl", recs)
  eval_path = write_records(tmp_path / "eval.jsonl", [
      {"id": f"e{i}", "prompt": f"Problem {i}: what is {i}+{i}?", "answer": str(2 * i)}
      for i in (1, 2, 3)])
  with caplog.at_level(logging.WARNING):
    train = examples(jsonl_config(train_path, eval_path=eval_path))
  ids = {e["id"] for e in train}
  assert ids == {f"r{i}" for i in (0, 4, 5, 6, 7, 8, 9)}, ids
  warned = [r.getMessage() for r in caplog.records if "held-out prompt" in r.getMessage()]
  assert warned and "removed 6 training record(s)" in warned[0]
  assert "3 identical, 3 equal up to case and whitespace" in warned[0]
  assert f"{train_path}:11" in warned[0]  # names where the near-duplicates are
  # A data state saved before near-duplicates were removed (same config, the stream of an
  # older loader) no longer fits the stream: the resume is refused, naming why.
  cfg = jsonl_config(train_path, eval_path=eval_path)
  it = data.make_prompt_iterator(cfg, batch_size=2, process_index=0, process_count=1)
  old = it.get_state()
  assert old["fields"].pop("eval_near_duplicates_removed") == 3
  old["fingerprint"] = data._fingerprint(cfg, 0, 1, 2)  # what the older loader wrote
  with pytest.raises(ValueError, match=r"eval_near_duplicates_removed: saved None, now 3"):
    it.set_state(old)
  it.set_state(it.get_state())  # its own state restores


# ------------------------------------------------------ NaN / inf weights in an HF checkpoint


def _tiny_checkpoint(path):
  cfg = qwen.ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2,
                         num_heads=4, num_kv_heads=2, head_dim=8)
  params = qwen.init_params(cfg, jax.random.key(0))
  save_hf_checkpoint(params, cfg, path)
  return cfg


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_non_finite_hf_weight_is_refused_at_load_naming_the_tensor(tmp_path, bad):
  from safetensors.numpy import load_file, save_file
  _tiny_checkpoint(tmp_path)
  f = str(tmp_path / "model.safetensors")
  tensors = load_file(f)
  name = "model.layers.1.mlp.down_proj.weight"
  t = tensors[name].copy()
  t[3, 5] = bad
  tensors[name] = t
  save_file(tensors, f, metadata={"format": "pt"})
  with pytest.raises(CheckpointError) as e:
    load_hf_params(tmp_path)
  msg = str(e.value)
  assert repr(name) in msg and f in msg and "[3, 5]" in msg and "non-finite" in msg


def test_weight_that_overflows_the_param_dtype_is_refused(tmp_path):
  from safetensors.numpy import load_file, save_file
  _tiny_checkpoint(tmp_path)
  f = str(tmp_path / "model.safetensors")
  tensors = load_file(f)
  tensors["model.norm.weight"] = tensors["model.norm.weight"].copy()
  tensors["model.norm.weight"][0] = 1e6  # finite in float32, inf in float16
  save_file(tensors, f, metadata={"format": "pt"})
  load_hf_params(tmp_path)  # float32: fine
  with pytest.raises(CheckpointError, match=r"'model.norm.weight'.*float16"):
    load_hf_params(tmp_path, dtype=jnp.float16)


# -------------------------------------------------- a failed asynchronous checkpoint save

_FULL_DISK = r"""
import errno, sys, time
import jax.numpy as jnp
from fbos_jax import checkpoint as ck
from orbax.checkpoint._src.serialization import serialization as ser

async def full_disk(*args, **kwargs):
  raise OSError(errno.ENOSPC, "No space left on device")

c = ck.Checkpointer(sys.argv[1], save_every=1, keep=3)
state = {"w": jnp.ones((8,))}
c.save(1, state, {}, {"x": 1})
c.wait()
ser.async_serialize_from_host = full_disk  # the disk fills up during the next save
c.save(2, state, {}, {"x": 1})
for step in range(3, 200):  # the trainer checks every step
  time.sleep(0.05)
  c.check_errors()
print("the run went on")
"""


def test_failed_async_save_stops_the_run_with_the_cause_last(tmp_path):
  script = tmp_path / "full_disk.py"
  script.write_text(_FULL_DISK)
  out = subprocess.run([sys.executable, str(script), str(tmp_path / "ckpt")], cwd=ROOT,
                       capture_output=True, text=True, timeout=600,
                       env=dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.path.join(
                           ROOT, "kernels")])))
  assert out.returncode != 0 and "the run went on" not in out.stdout
  last = out.stderr.strip().splitlines()[-1]
  assert last.startswith("fbos_jax.checkpoint.CheckpointSaveError: checkpoint save of step 2")
  assert last.endswith("OSError: [Errno 28] No space left on device"), last
  assert "last complete checkpoint is step 1" in last


def test_failed_async_save_raises_at_the_next_call(tmp_path, monkeypatch):
  from orbax.checkpoint._src.serialization import serialization as ser

  async def full_disk(*args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device")

  c = ckpt_lib.Checkpointer(str(tmp_path / "ckpt"), save_every=1, keep=3)
  state = {"w": jnp.ones((8,))}
  monkeypatch.setattr(ser, "async_serialize_from_host", full_disk)
  c.save(1, state, {}, {"x": 1})  # returns at once; the write fails in the background
  with pytest.raises(ckpt_lib.CheckpointSaveError, match=r"step 1 .*No space left") as e:
    c.save(2, state, {}, {"x": 1})  # at the latest: the next call
  assert isinstance(e.value.__cause__, OSError)
  with pytest.raises(ckpt_lib.CheckpointSaveError):  # and it stays raised
    c.check_errors()


# ------------------------------------------------------------ reward range past float32


def test_reward_range_past_float32_is_refused_naming_the_field_and_rule():
  c = load("configs/fbos.py:tiny")
  c.verifier.reward_range = (-1e40, 1e40)
  with pytest.raises(ValueError) as e:
    config_lib.validate(c)
  msg = str(e.value)
  assert "verifier.reward_range=(-1e+40, 1e+40)" in msg and "|bound| < 3e+38" in msg
  assert "must be finite" not in msg  # the old, false reason


def test_reward_range_whose_spread_overflows_the_advantages_is_refused():
  """The real rule: a step's N rewards' squared deviations must sum below float32's
  largest value, else the advantages' variance is inf and every advantage is 0."""
  import fbos_kernels as K
  c = load("configs/fbos.py:tiny")
  n = c.rl.prompts_per_step * c.rl.group_size * 2
  limit = math.sqrt(4 * 3.4028234663852886e38 / n)
  for spread, ok in ((0.9 * limit, True), (1.1 * limit, False)):
    r = np.array([-spread / 2, spread / 2] * (n // 2), np.float32)[None]
    adv = np.asarray(K.batch_std_advantages(jnp.asarray(r), jnp.ones(r.shape, bool)))
    assert (np.abs(adv).max() > 0.5) == ok  # past the limit: silently all 0
    c.verifier.reward_range = (-spread / 2, spread / 2)
    if ok:
      config_lib.validate(c)
    else:
      with pytest.raises(ValueError, match=rf"verifier.reward_range=.*N={n} rewards"):
        config_lib.validate(c)
  with pytest.raises(ValueError, match=r"reward_range.*\|bound\| < 3e\+38"):
    base.VerifierPool(lambda e, r: Verdict(1.0, ""), reward_range=(-1e39, 1.0))


# ------------------------------------------------------------- libtpu noise on CPU runs


def _launcher_env():
  env = {k: v for k, v in os.environ.items()
         if not k.startswith(("JAX_PLATFORM", "TPU_", "ALLOW_MULTIPLE_LIBTPU"))}
  env["PYTHONPATH"] = ROOT
  return env


def test_launchers_choose_the_cpu_quietly_without_an_accelerator():
  import glob
  if any(glob.glob(p) for p in ("/dev/accel*", "/dev/vfio/[0-9]*", "/dev/nvidia[0-9]*",
                                 "/dev/kfd")):
    pytest.skip("this machine has an accelerator")
  code = ("from fbos_jax import cli; import jax; jax.devices(); "
          "print(jax.default_backend(), jax.config.jax_platforms)")
  out = subprocess.run([sys.executable, "-c", code], cwd=os.path.join(ROOT, "launch"),
                       capture_output=True, text=True, timeout=300, env=_launcher_env())
  assert out.returncode == 0, out.stderr
  assert out.stdout.split() == ["cpu", "cpu"]
  for noise in ("TPU", "libtpu", "host bounds", "INVALID_ARGUMENT"):
    assert noise not in out.stderr, out.stderr


def test_launchers_leave_real_accelerators_and_explicit_choices_alone(monkeypatch):
  from fbos_jax import cli as _common
  monkeypatch.setattr(_common, "accelerator_attached", lambda: True)
  env = {}
  assert not _common.choose_cpu_platform_without_accelerator(env) and env == {}
  monkeypatch.setattr(_common, "accelerator_attached", lambda: False)
  for chosen in ({"JAX_PLATFORMS": "tpu"}, {"JAX_FORCE_TPU_INIT": "1"}):
    env = dict(chosen)
    assert not _common.choose_cpu_platform_without_accelerator(env) and env == chosen
  env = {}
  assert _common.choose_cpu_platform_without_accelerator(env)
  assert env == {"JAX_PLATFORMS": "cpu"}
