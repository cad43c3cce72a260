"""HF checkpoint export after import: bit-for-bit tensors, loadable by transformers,
plus the importer's answers to bad input (named file, named tensor, no traceback soup);
then a real-shape Qwen3 (real vocabulary and tokenizer, bf16): logits and greedy decoding
against transformers, export, apply_hf_config and the launchers' --init_from_hf."""
import dataclasses
import importlib.util
import json
import os
import shutil
import struct

import jax
import ml_dtypes  # noqa: F401  (bfloat16 for safetensors' numpy reader)
import numpy as np
import pytest
import torch
import transformers
from safetensors import safe_open
from safetensors.numpy import save_file

from fbos_jax import sampling, templates
from fbos_jax import tokenizer as tk
from fbos_jax.model import (CheckpointError, load_hf_params, model_config_from_hf,
                            save_hf_checkpoint)
from fbos_jax.model import hf, qwen
from fbos_jax.testing import qwen_fixture as qf

TINY = dict(vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2)


def build_hf_model(model_type: str, seed: int = 0):
  """Random tiny model with every weight (norms, biases included) perturbed from init."""
  torch.manual_seed(seed)
  if model_type == "qwen3":
    model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(
        **TINY, head_dim=32, tie_word_embeddings=True, rope_theta=5000.0))
  else:
    model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
        **TINY, tie_word_embeddings=False))
  gen = torch.Generator().manual_seed(seed + 1)
  with torch.no_grad():
    for name, p in model.named_parameters():
      noise = torch.randn(p.shape, generator=gen)
      p.copy_(1.0 + 0.3 * noise if "norm" in name else 0.1 * noise)
  return model.eval()


def read_tensors(directory) -> dict:
  """name -> numpy array of every tensor in a checkpoint dir (any sharding)."""
  out = {}
  for f in sorted(os.listdir(directory)):
    if f.endswith(".safetensors"):
      with safe_open(os.path.join(directory, f), framework="numpy") as h:
        for k in h.keys():
          assert k not in out, f"{k} stored twice"
          out[k] = h.get_tensor(k)
  return out


def assert_bit_identical(a: dict, b: dict):
  assert sorted(a) == sorted(b)
  for k in a:
    assert a[k].dtype == b[k].dtype, k
    assert a[k].shape == b[k].shape, k
    assert a[k].tobytes() == b[k].tobytes(), f"{k} differs"


def torch_logits(model, tokens, mask):
  pos = np.maximum(np.cumsum(mask, -1) - 1, 0)
  with torch.no_grad():
    return model(input_ids=torch.tensor(tokens), attention_mask=torch.tensor(mask),
                 position_ids=torch.tensor(pos)).logits.float().numpy()


TOKENS = np.array([[0, 0, 0, 5, 17, 42], [3, 9, 27, 81, 100, 1]])
MASK = np.array([[0, 0, 0, 1, 1, 1], [1, 1, 1, 1, 1, 1]])


@pytest.fixture(scope="module")
def qwen3_f32(tmp_path_factory):
  """Qwen3, tied embeddings, float32, one model.safetensors."""
  model = build_hf_model("qwen3")
  path = tmp_path_factory.mktemp("q3_f32")
  model.save_pretrained(path)
  assert os.path.exists(path / "model.safetensors")
  return model, path


@pytest.fixture(scope="module")
def qwen2_bf16_sharded(tmp_path_factory):
  """Qwen2, untied, q/k/v biases, bfloat16, several shards + index."""
  model = build_hf_model("qwen2", seed=5).to(torch.bfloat16)
  path = tmp_path_factory.mktemp("q2_bf16")
  model.save_pretrained(path, max_shard_size="40KB")
  assert os.path.exists(path / "model.safetensors.index.json")
  return model, path


def test_roundtrip_float32_single_file(qwen3_f32, tmp_path):
  model, src = qwen3_f32
  params, cfg = load_hf_params(src)
  base = json.loads((src / "config.json").read_text())
  base.update(eos_token_id=7, max_position_embeddings=4096, head_dim=999, rope_theta=1.0)
  written = save_hf_checkpoint(params, cfg, tmp_path / "out", base_config=base)
  assert sorted(os.path.basename(p) for p in written) == ["config.json", "model.safetensors"]
  assert_bit_identical(read_tensors(src), read_tensors(tmp_path / "out"))
  conf = json.loads((tmp_path / "out" / "config.json").read_text())
  assert conf["architectures"] == ["Qwen3ForCausalLM"] and conf["model_type"] == "qwen3"
  assert conf["tie_word_embeddings"] is True and conf["head_dim"] == 32
  # keys we don't own come from base_config; the architecture / RoPE ones are ours
  assert conf["eos_token_id"] == 7 and conf["max_position_embeddings"] == 4096
  assert conf["rope_theta"] == conf["rope_parameters"]["rope_theta"] == 5000.0
  # transformers loads the export and computes the same logits as the original.
  back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
  assert type(back).__name__ == "Qwen3ForCausalLM"
  assert back.config.rope_parameters["rope_theta"] == 5000.0
  np.testing.assert_array_equal(torch_logits(back, TOKENS, MASK),
                                torch_logits(model, TOKENS, MASK))
  # and we read our own export back to the same params
  params2, cfg2 = load_hf_params(tmp_path / "out")
  assert cfg2 == cfg
  for a, b in zip(*(map(np.asarray, __import__("jax").tree.leaves(p)) for p in (params, params2))):
    np.testing.assert_array_equal(a, b)


def test_roundtrip_bf16_sharded(qwen2_bf16_sharded, tmp_path):
  model, src = qwen2_bf16_sharded
  params, cfg = load_hf_params(src)  # bf16 -> float32 is exact
  assert params["layers"]["q"].dtype == np.float32 and "unembed" in params
  out = tmp_path / "out"
  written = save_hf_checkpoint(params, cfg, out, dtype="bfloat16", max_shard_bytes=40_000)
  assert len([p for p in written if p.endswith(".safetensors")]) > 1
  index = json.loads((out / "model.safetensors.index.json").read_text())
  assert set(index["weight_map"]) == set(read_tensors(src))
  for name, f in index["weight_map"].items():
    with safe_open(str(out / f), framework="numpy") as h:
      assert name in h.keys()
  assert_bit_identical(read_tensors(src), read_tensors(out))
  conf = json.loads((out / "config.json").read_text())
  assert conf["torch_dtype"] == conf["dtype"] == "bfloat16"
  back = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
  assert back.dtype == torch.bfloat16 and type(back).__name__ == "Qwen2ForCausalLM"
  # (compare loaded-vs-loaded: `model.to(bfloat16)` also rounds its RoPE inv_freq buffer,
  # which a freshly loaded model keeps in float32.)
  orig = transformers.AutoModelForCausalLM.from_pretrained(src).eval()
  np.testing.assert_array_equal(torch_logits(back, TOKENS, MASK),
                                torch_logits(orig, TOKENS, MASK))
  # Keeping bf16 storage on import also round-trips, and re-saving into the same
  # directory as one file replaces the old shards (no stale index left behind).
  params16, cfg16 = load_hf_params(src, dtype="bfloat16")
  assert params16["embed"].dtype.name == "bfloat16" and cfg16.param_dtype == "bfloat16"
  save_hf_checkpoint(params16, cfg16, out)
  assert sorted(os.listdir(out)) == ["config.json", "model.safetensors"]
  assert_bit_identical(read_tensors(src), read_tensors(out))


# ----------------------------------------------------------------------------- config reading


def test_model_config_from_hf_fields(tmp_path):
  base = dict(TINY, model_type="qwen2")
  cfg = model_config_from_hf(base)
  assert cfg.head_dim == 16 and cfg.num_layers == 2 and cfg.rope_theta == 10000.0
  assert cfg.tie_embeddings is False
  cfg = model_config_from_hf(dict(base, rope_theta=1e6, tie_word_embeddings=True,
                                  rms_norm_eps=1e-5), param_dtype="bfloat16", remat="full")
  assert (cfg.rope_theta, cfg.tie_embeddings, cfg.rms_norm_eps) == (1e6, True, 1e-5)
  assert (cfg.param_dtype, cfg.remat) == ("bfloat16", "full")
  cfg = model_config_from_hf(dict(base, model_type="qwen3", head_dim=8,
                                  rope_parameters={"rope_type": "default", "rope_theta": 7.0}))
  assert (cfg.head_dim, cfg.rope_theta, cfg.qk_norm) == (8, 7.0, True)
  (tmp_path / "config.json").write_text(json.dumps(dict(base, rope_scaling={
      "rope_type": "yarn", "factor": 4.0})))
  with pytest.raises(CheckpointError, match=r"config\.json.*yarn"):
    model_config_from_hf(tmp_path)
  with pytest.raises(TypeError, match="no_such_field"):
    model_config_from_hf(base, no_such_field=1)


# ----------------------------------------------------------------------------- bad input


def assert_clean(err: BaseException):
  """A message first, no chained traceback soup."""
  assert err.__cause__ is None
  assert err.__context__ is None or err.__suppress_context__


@pytest.fixture
def broken(qwen3_f32, tmp_path):
  """A fresh copy of the good single-file checkpoint to break."""
  _, src = qwen3_f32
  dst = tmp_path / "ckpt"
  shutil.copytree(src, dst)
  return dst


def test_missing_directory(tmp_path):
  missing = tmp_path / "no" / "such" / "ckpt"
  with pytest.raises(CheckpointError, match="not found") as e:
    load_hf_params(missing)
  assert str(missing) in str(e.value)
  assert_clean(e.value)
  with pytest.raises(CheckpointError, match="not found") as e:
    model_config_from_hf(missing)
  assert str(missing) in str(e.value)


def test_missing_config_json(broken):
  os.remove(broken / "config.json")
  with pytest.raises(CheckpointError, match="config.json") as e:
    load_hf_params(broken)
  assert str(broken / "config.json") in str(e.value)


def test_unknown_model_type(broken):
  conf = json.loads((broken / "config.json").read_text())
  conf["model_type"] = "llama"
  (broken / "config.json").write_text(json.dumps(conf))
  with pytest.raises(CheckpointError) as e:
    load_hf_params(broken)
  msg = str(e.value)
  assert str(broken / "config.json") in msg and "'llama'" in msg
  assert "qwen2" in msg and "qwen3" in msg
  assert_clean(e.value)


def test_truncated_file(broken):
  f = broken / "model.safetensors"
  data = f.read_bytes()
  f.write_bytes(data[:-1000])
  with pytest.raises(CheckpointError, match="truncated") as e:
    load_hf_params(broken)
  msg = str(e.value)
  assert str(f) in msg
  # the tensor stored last in the file is the one cut off
  (n,) = struct.unpack("<Q", data[:8])
  header = json.loads(data[8:8 + n])
  last = max((k for k in header if k != "__metadata__"),
             key=lambda k: header[k]["data_offsets"][1])
  assert repr(last) in msg
  assert_clean(e.value)


def test_corrupted_header(broken):
  f = broken / "model.safetensors"
  data = bytearray(f.read_bytes())
  data[8:16] = b"\x00garbag"[:8].ljust(8, b"!")
  f.write_bytes(bytes(data))
  with pytest.raises(CheckpointError, match="header") as e:
    load_hf_params(broken)
  msg = str(e.value)
  assert str(f) in msg and "'model.embed_tokens.weight'" in msg
  assert_clean(e.value)


def test_corrupted_shard_names_its_tensor(qwen2_bf16_sharded, tmp_path):
  _, src = qwen2_bf16_sharded
  dst = tmp_path / "ckpt"
  shutil.copytree(src, dst)
  index = json.loads((dst / "model.safetensors.index.json").read_text())
  victim = index["weight_map"]["model.norm.weight"]
  (dst / victim).write_bytes(b"\x07")  # not even a header
  with pytest.raises(CheckpointError) as e:
    load_hf_params(dst)
  msg = str(e.value)
  assert str(dst / victim) in msg
  assert any(repr(k) in msg for k, v in index["weight_map"].items() if v == victim)
  assert_clean(e.value)


def test_shape_mismatch_between_config_and_tensors(broken):
  conf = json.loads((broken / "config.json").read_text())
  conf["intermediate_size"] = 128  # tensors were saved with 96
  (broken / "config.json").write_text(json.dumps(conf))
  with pytest.raises(CheckpointError) as e:
    load_hf_params(broken)
  msg = str(e.value)
  assert str(broken / "model.safetensors") in msg
  assert "'model.layers.0.mlp.gate_proj.weight'" in msg
  assert "[96, 64]" in msg and "[128, 64]" in msg and "config.json" in msg
  assert_clean(e.value)


def test_missing_tensor(broken):
  f = broken / "model.safetensors"
  tensors = read_tensors(broken)
  del tensors["model.layers.1.self_attn.k_norm.weight"]
  save_file(tensors, str(f), metadata={"format": "pt"})
  with pytest.raises(CheckpointError, match="missing tensor") as e:
    load_hf_params(broken)
  msg = str(e.value)
  assert "'model.layers.1.self_attn.k_norm.weight'" in msg and str(f) in msg
  assert_clean(e.value)


def test_index_points_to_missing_shard(qwen2_bf16_sharded, tmp_path):
  _, src = qwen2_bf16_sharded
  dst = tmp_path / "ckpt"
  shutil.copytree(src, dst)
  index = json.loads((dst / "model.safetensors.index.json").read_text())
  victim = index["weight_map"]["lm_head.weight"]
  os.remove(dst / victim)
  with pytest.raises(CheckpointError, match="missing") as e:
    load_hf_params(dst)
  assert str(dst / victim) in str(e.value)


def test_given_config_must_agree_with_file(qwen3_f32):
  import dataclasses
  _, src = qwen3_f32
  cfg = model_config_from_hf(src)
  with pytest.raises(CheckpointError, match="num_layers"):
    load_hf_params(src, dataclasses.replace(cfg, num_layers=3))


# ----------------------------------------------------------------------------- real shape
# A random Qwen3 with the real vocabulary (151,936), real head sizes (head_dim 128, 16 query /
# 8 KV heads, like Qwen3-0.6B), 2 layers of width 256, stored in bfloat16 with the real BPE
# tokenizer and a hub-style config.json (fbos_jax/testing/qwen_fixture.py); prompts are
# math questions rendered through its chat template.

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QWEN_PROMPTS = ["What is 2 + 3?",
                "Mia has 17 apples. Mia gets 6 more apples. How many apples does Mia have now?",
                r"Compute $\frac{1}{2} + \frac{1}{3}$ and put the result in \boxed{}.",
                "小明有 12 个苹果，吃了 5 个。还剩几个？"]
STOP_IDS = (151645, 151643)  # <|im_end|>, <|endoftext|> (generation_config.json)


def load_config(spec):
  """configs/NAME.py:ARG -> ConfigDict (as absl's config_flags would)."""
  path, _, arg = spec.partition(":")
  mod_spec = importlib.util.spec_from_file_location("cfg_" + os.path.basename(path)[:-3],
                                                    os.path.join(ROOT, path))
  mod = importlib.util.module_from_spec(mod_spec)
  mod_spec.loader.exec_module(mod)
  return mod.get_config(arg)


def left_pad(rows, pad_id):
  t = max(map(len, rows))
  toks = np.full((len(rows), t), pad_id, np.int64)
  mask = np.zeros((len(rows), t), np.int64)
  for i, r in enumerate(rows):
    toks[i, t - len(r):] = r
    mask[i, t - len(r):] = 1
  return toks, mask


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory):
  return qf.shared_qwen3_checkpoint(tmp_path_factory.getbasetemp())


@pytest.fixture(scope="module")
def qwen3_prompts(qwen3_dir):
  tok = tk.load_tokenizer(qwen3_dir)
  return [templates.render_prompt(tok, p) for p in QWEN_PROMPTS]


@pytest.fixture(scope="module")
def qwen3_torch_f32(qwen3_dir):
  return transformers.AutoModelForCausalLM.from_pretrained(qwen3_dir, dtype=torch.float32).eval()


def test_qwen3_fixture_looks_like_a_download(qwen3_dir, qwen3_prompts):
  conf = json.loads(open(os.path.join(qwen3_dir, "config.json")).read())
  assert (conf["vocab_size"], conf["head_dim"], conf["num_attention_heads"],
          conf["num_key_value_heads"]) == (151_936, 128, 16, 8)
  assert conf["rope_theta"] == 1e6 and conf["max_position_embeddings"] == 40_960
  assert conf["torch_dtype"] == "bfloat16" and conf["tie_word_embeddings"] is True
  gen = json.loads(open(os.path.join(qwen3_dir, "generation_config.json")).read())
  assert gen["eos_token_id"] == list(STOP_IDS) and hf.generation_stop_ids(qwen3_dir) == STOP_IDS
  cfg = model_config_from_hf(qwen3_dir)
  assert (cfg.vocab_size, cfg.head_dim, cfg.rope_theta, cfg.num_layers) == (151_936, 128, 1e6, 2)
  with safe_open(os.path.join(qwen3_dir, "model.safetensors"), framework="numpy") as h:
    assert h.get_slice("model.embed_tokens.weight").get_dtype() == "BF16"
  assert [p[:1] for p in qwen3_prompts] == [[151644]] * 4  # <|im_start|>, real BPE inside
  assert max(map(max, qwen3_prompts)) < 151_936 and len(set(map(len, qwen3_prompts))) == 4


def test_qwen3_bf16_load_and_f32_logits_vs_transformers(qwen3_dir, qwen3_prompts,
                                                         qwen3_torch_f32):
  file_cfg = model_config_from_hf(qwen3_dir)
  cfg16 = dataclasses.replace(file_cfg, param_dtype="bfloat16", compute_dtype="bfloat16")
  params16, cfg16 = load_hf_params(qwen3_dir, cfg16)
  assert {x.dtype.name for x in jax.tree.leaves(params16)} == {"bfloat16"}
  assert cfg16.param_dtype == "bfloat16"
  params32, cfg32 = load_hf_params(qwen3_dir)
  assert {x.dtype.name for x in jax.tree.leaves(params32)} == {"float32"}
  for a, b in zip(jax.tree.leaves(params16), jax.tree.leaves(params32)):  # stored bf16: exact
    np.testing.assert_array_equal(np.asarray(a).astype(np.float32), np.asarray(b))

  toks, mask = left_pad(qwen3_prompts, 151643)
  m = mask.astype(bool)
  ref = torch_logits(qwen3_torch_f32, toks, mask)
  ours = np.asarray(jax.jit(qwen.apply, static_argnums=3)(params32, toks, mask, cfg32))
  # float32: roundoff only (measured ~1e-4 on logits of std ~16: 256-wide sums, 151,936 rows)
  np.testing.assert_allclose(ours[m], ref[m], atol=1e-3, rtol=0)
  assert np.all(ours[m].argmax(-1) == ref[m].argmax(-1))


@pytest.mark.slow  # 11-25 s here: bf16 matmuls on CPU (ours and torch's), one more compile
def test_qwen3_bf16_logits_within_transformers_bf16_error(qwen3_dir, qwen3_prompts,
                                                          qwen3_torch_f32):
  """Our bfloat16 model (bf16 params and compute) against the float32 reference is no
  further off than transformers' own bfloat16 model (same stored weights)."""
  cfg16 = dataclasses.replace(model_config_from_hf(qwen3_dir), param_dtype="bfloat16",
                              compute_dtype="bfloat16")
  params16, cfg16 = load_hf_params(qwen3_dir, cfg16)
  toks, mask = left_pad(qwen3_prompts, 151643)
  m = mask.astype(bool)
  ref = torch_logits(qwen3_torch_f32, toks, mask)
  hf16 = transformers.AutoModelForCausalLM.from_pretrained(qwen3_dir).eval()
  assert hf16.dtype == torch.bfloat16
  err_hf = np.abs(torch_logits(hf16, toks, mask) - ref)[m]
  ours16 = np.asarray(jax.jit(qwen.apply, static_argnums=3)(params16, toks, mask, cfg16))
  assert ours16.dtype == np.float32  # logits come out in float32 from bf16 compute
  err = np.abs(ours16 - ref)[m]
  assert err.max() <= 1.5 * err_hf.max() and err.mean() <= 1.5 * err_hf.mean(), (
      err.max(), err_hf.max(), err.mean(), err_hf.mean())
  assert np.mean(ours16[m].argmax(-1) == ref[m].argmax(-1)) >= 0.95


def test_qwen3_export_keeps_source_config_and_reloads(qwen3_dir, qwen3_prompts, tmp_path):
  cfg16 = dataclasses.replace(model_config_from_hf(qwen3_dir), param_dtype="bfloat16")
  params16, cfg16 = load_hf_params(qwen3_dir, cfg16)
  out = tmp_path / "export"
  save_hf_checkpoint(params16, cfg16, out, base_config=hf.read_hf_config(qwen3_dir))
  assert_bit_identical(read_tensors(qwen3_dir), read_tensors(out))
  conf = json.loads((out / "config.json").read_text())
  assert conf["max_position_embeddings"] == 40_960  # from the source, not the 32768 default
  assert (conf["eos_token_id"], conf["bos_token_id"]) == (151645, 151643)
  assert conf["torch_dtype"] == conf["dtype"] == "bfloat16" and conf["rope_theta"] == 1e6
  back = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
  orig = transformers.AutoModelForCausalLM.from_pretrained(qwen3_dir, dtype=torch.float32).eval()
  assert back.config.max_position_embeddings == 40_960
  toks, mask = left_pad(qwen3_prompts, 151643)
  np.testing.assert_array_equal(torch_logits(back, toks, mask), torch_logits(orig, toks, mask))


def test_apply_hf_config_sets_architecture_keeps_runtime(qwen3_dir, caplog):
  config = load_config("configs/fbos.py:tiny")  # rope_theta 1e4, vocab 128, head_dim 32, ...
  config.model.param_dtype, config.model.compute_dtype = "bfloat16", "bfloat16"
  config.model.remat = "full"
  config.model.rms_norm_eps = 1e-5  # an explicit value that disagrees with the file
  config.lock()
  with caplog.at_level("INFO", logger="fbos_jax.model.hf"):
    new = hf.apply_hf_config(config, qwen3_dir)
  file_cfg = model_config_from_hf(qwen3_dir)
  for f in hf.HF_ARCH_FIELDS:  # the file wins for every architecture field
    assert new.model[f] == getattr(file_cfg, f), f
  assert (new.model.rope_theta, new.model.rms_norm_eps, new.model.vocab_size) == (
      1e6, 1e-6, 151_936)
  assert (new.model.param_dtype, new.model.compute_dtype, new.model.remat) == (
      "bfloat16", "bfloat16", "full")
  assert new.model.hf_path == qwen3_dir
  assert config.model.rope_theta == 10_000.0 and config.model.hf_path == ""  # a copy
  assert "model.rope_theta: 10000.0 -> 1000000.0" in caplog.text
  assert "model.rms_norm_eps: 1e-05 -> 1e-06" in caplog.text
  assert hf.hf_config_changes(new.model, qwen3_dir) == {}
  # the Qwen3-0.6B preset differs from the fixture in its sizes only
  q06 = load_config("configs/fbos.py:qwen3_0_6b")
  assert set(hf.hf_config_changes(q06.model, qwen3_dir)) == {
      "hidden_size", "intermediate_size", "num_layers"}

  # loading with the run's own ModelConfig gives params in the run's param_dtype ...
  run_cfg = qwen.ModelConfig.from_dict(new.model)
  params, cfg = load_hf_params(qwen3_dir, run_cfg)
  assert {x.dtype.name for x in jax.tree.leaves(params)} == {"bfloat16"} and cfg == run_cfg
  # ... and a config that kept the preset's RoPE base is refused, not silently used
  with pytest.raises(CheckpointError, match=r"rope_theta \(file 1000000\.0, config 10000\.0\)"
                     r".*apply_hf_config"):
    load_hf_params(qwen3_dir, dataclasses.replace(run_cfg, rope_theta=10_000.0))


def test_qwen3_greedy_generation_matches_transformers(qwen3_dir, qwen3_prompts, qwen3_torch_f32):
  """Our jitted sampler (greedy, float32, left-padded batch of 4) against transformers
  `generate` (greedy, float32, one prompt at a time), token for token."""
  new = 12
  params, cfg = load_hf_params(qwen3_dir)
  out = sampling.sample(params, cfg, qwen3_prompts, key=jax.random.PRNGKey(0), max_new_tokens=new,
                        temperature=0.0, stop_token_ids=STOP_IDS, pad_id=151643,
                        prompt_buckets=(32,), batch_buckets=(4,))
  ours = [out.tokens[i, :out.lengths[i]].tolist() for i in range(4)]
  theirs = []
  for r in qwen3_prompts:
    ids = torch.tensor([r])
    with torch.no_grad():
      o = qwen3_torch_f32.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                   max_new_tokens=new, eos_token_id=list(STOP_IDS),
                                   pad_token_id=151643)
    theirs.append(o[0, len(r):].tolist())
  assert ours == theirs
  # not vacuous: the continuations differ between prompts and are not one repeated token
  assert len({tuple(o) for o in ours}) == 4 and max(len(set(o)) for o in ours) > 3


@pytest.mark.slow  # 45 s - 3.5 min here: a trainer, an orbax checkpoint, two launcher processes
def test_launchers_with_init_from_hf(qwen3_dir, tmp_path):
  """A run started from the (bf16) HF checkpoint, its float32 master filled from it, is
  exported and evaluated by launch/export_hf.py and launch/eval.py given only
  --init_from_hf (no model fields retyped): the export is in the source's dtype and
  holds the source's weights bit for bit, keeps its
  max_position_embeddings and generation config, and ships its tokenizer."""
  import subprocess
  import sys

  from fbos_jax import sharding as sh
  from fbos_jax.datasets import arith_word
  from fbos_jax.rl.trainer import RLTrainer
  overrides = {"data.path": arith_word.TRAIN_PATH, "data.eval_path": arith_word.TEST_PATH,
               "rl.prompts_per_step": 8, "train.eval_prompts": 8, "sampling.max_new_tokens": 8}
  config = hf.apply_hf_config(load_config("configs/fbos.py:qwen3_0_6b"), qwen3_dir)
  with config.unlocked():
    for k, v in overrides.items():
      section, field = k.split(".")
      config[section][field] = v
  assert config.model.param_dtype == "float32"
  workdir = str(tmp_path / "run")
  trainer = RLTrainer(config, workdir, log_metrics=False)
  params, _ = load_hf_params(qwen3_dir, trainer.parts.model, mesh=trainer.mesh,
                             rules=sh.rules_dict(config.mesh.rules))
  assert {x.dtype.name for x in jax.tree.leaves(params)} == {"float32"}
  trainer.save(trainer.init_state(params), force=True)
  trainer.close()

  flags = ["--config=configs/fbos.py:qwen3_0_6b", f"--init_from_hf={qwen3_dir}",
           f"--workdir={workdir}"] + [f"--config.{k}={v}" for k, v in overrides.items()]
  out = tmp_path / "export"
  run = lambda script, *extra: subprocess.run(
      [sys.executable, os.path.join(ROOT, "launch", script), *flags, *extra], cwd=ROOT,
      capture_output=True, text=True, timeout=600)
  res = run("export_hf.py", f"--out={out}")
  assert res.returncode == 0, res.stderr[-3000:]
  assert_bit_identical(read_tensors(qwen3_dir), read_tensors(out))
  conf = json.loads((out / "config.json").read_text())
  assert conf["max_position_embeddings"] == 40_960 and conf["torch_dtype"] == "bfloat16"
  for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
    assert (out / name).read_bytes() == open(os.path.join(qwen3_dir, name), "rb").read(), name
  assert len(transformers.AutoTokenizer.from_pretrained(out)) == 151_669
  transformers.AutoModelForCausalLM.from_pretrained(out)

  res = run("eval.py")
  assert res.returncode == 0, res.stderr[-3000:]
  result = json.loads(res.stdout[res.stdout.index("{"):])
  assert result["step"] == 0 and 0.0 <= result["eval/accuracy"] <= 1.0
