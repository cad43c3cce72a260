"""HF checkpoint export after import: bit-for-bit tensors, loadable by transformers,
plus the importer's answers to bad input (named file, named tensor, no traceback soup)."""
import json
import os
import shutil
import struct

import ml_dtypes  # noqa: F401  (bfloat16 for safetensors' numpy reader)
import numpy as np
import pytest
import torch
import transformers
from safetensors import safe_open
from safetensors.numpy import save_file

from fbos_jax.model import (CheckpointError, load_hf_params, model_config_from_hf,
                            save_hf_checkpoint)

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
