"""Hugging Face checkpoints, both ways, for the Qwen2 / Qwen3 decoder.

Import (:func:`load_hf_params`) reads a local directory holding ``config.json``
and either one ``model.safetensors`` or many shards listed in
``model.safetensors.index.json``. Every parameter is created directly in its
target sharding: for each addressable device we read only the slices of the HF
tensors that device owns (HF ``q_proj.weight [H*Dh, D]`` -> our
``q [L, D, H, Dh]``; the ``L`` axis comes from ``L`` separate HF tensors),
put them on that device and drop the host copy, so the host holds at most one
device shard at a time and no device ever holds the whole model.

Export (:func:`save_hf_checkpoint`) writes ``config.json`` plus safetensors
(sharded with an index when large) that ``transformers.AutoModelForCausalLM``
loads, so a trained policy can be served by vLLM or SGLang. Tensors are gathered
to the host one HF tensor (one layer of one weight) at a time and streamed to
disk; only process 0 writes.

Config (:func:`apply_hf_config`): sets every architecture field of a run config's
``model`` section from ``config.json`` (the file wins; dtypes, remat and the other
runtime choices stay the run's), so ``--config.model.hf_path`` / ``--init_from_hf``
never pair a checkpoint with a preset's RoPE base or norm epsilon.

Bad input (missing path, unreadable / truncated / corrupt safetensors, a
tensor missing, a shape that disagrees with ``config.json``, an unsupported
``model_type`` or feature) raises :class:`CheckpointError`, whose message names
the file and the tensor.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import json
import logging
import math
import os
import struct
import sys
from typing import Any, Optional, Union

import jax
import jax.numpy as jnp
import ml_dtypes  # noqa: F401  (registers bfloat16 & co. with numpy; safetensors needs it)
import numpy as np
from jax.sharding import NamedSharding, SingleDeviceSharding

from fbos_jax.model.qwen import (SUPPORTED_MODEL_TYPES, ModelConfig, Params, abstract_params,
                                 param_logical_axes)

log = logging.getLogger(__name__)

CONFIG_NAME = "config.json"
SINGLE_FILE_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
DEFAULT_MAX_SHARD_BYTES = 5_000_000_000  # HF's "5GB"

_ARCHITECTURES = {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
# The ModelConfig fields config.json defines (model_config_from_hf sets exactly these): the
# architecture. apply_hf_config copies them into a run config and load_hf_params checks a
# given ModelConfig against them; every other field (dtypes, remat, attention kernel, ...)
# is the run's choice.
HF_ARCH_FIELDS = ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_layers",
                  "num_heads", "num_kv_heads", "head_dim", "rope_theta", "rms_norm_eps",
                  "tie_embeddings")
# Tensors some real checkpoints carry that the model does not use.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)

# numpy dtype name -> safetensors dtype tag
_ST_DTYPES = {
    "float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16",
    "float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2",
    "int64": "I64", "int32": "I32", "int16": "I16", "int8": "I8", "uint8": "U8", "bool": "BOOL",
}


class CheckpointError(ValueError):
  """A checkpoint directory / file that we cannot read or write as asked."""


# ----------------------------------------------------------------------------- config


def _read_json(path: str, what: str) -> Any:
  if not os.path.isfile(path):
    raise CheckpointError(f"{what} not found: {path}")
  try:
    with open(path, "r", encoding="utf-8") as f:
      return json.load(f)
  except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
    raise CheckpointError(f"{path}: cannot parse {what}: {e}") from None


def _config_path(path: Union[str, os.PathLike]) -> str:
  path = os.fspath(path)
  if os.path.isdir(path):
    return os.path.join(path, CONFIG_NAME)
  if os.path.exists(path):
    return path
  parent = os.path.dirname(path) or "."
  if os.path.basename(path) == CONFIG_NAME and not os.path.isdir(parent):
    raise CheckpointError(f"checkpoint directory not found: {parent}")
  raise CheckpointError(f"checkpoint path not found: {path}")


def _rope_theta(src, d: dict) -> float:
  """RoPE's base from ``rope_parameters`` (transformers 5), ``rope_scaling`` or
  the top level (default 10000); scaled or partial RoPE raises."""
  rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
  if not isinstance(rope, dict):
    raise CheckpointError(f"{src}: rope_parameters must be an object, got {rope!r}.")
  if rope and not ("rope_type" in rope or "type" in rope or "rope_theta" in rope):
    raise CheckpointError(f"{src}: per-layer-type rope_parameters are not supported: {rope!r}.")
  rope_type = rope.get("rope_type", rope.get("type", "default"))
  if rope_type != "default":
    raise CheckpointError(f"{src}: rope_type={rope_type!r} is not supported (only 'default' RoPE).")
  theta = rope.get("rope_theta")
  if theta is None:
    theta = d.get("rope_theta", 10_000.0)
  prf = rope.get("partial_rotary_factor", d.get("partial_rotary_factor"))
  if prf not in (None, 1, 1.0):
    raise CheckpointError(f"{src}: partial_rotary_factor={prf} is not supported.")
  return theta


def _refuse_unsupported(src, d: dict, mt: str):
  """Features the decoder does not implement raise, named."""
  if d.get("use_sliding_window"):
    raise CheckpointError(f"{src}: use_sliding_window=true is not supported (full attention only).")
  if any(t != "full_attention" for t in (d.get("layer_types") or [])):
    raise CheckpointError(f"{src}: layer_types={d.get('layer_types')} is not supported "
                          "(full attention only).")
  if mt == "qwen3" and d.get("attention_bias"):
    raise CheckpointError(f"{src}: attention_bias=true is not supported for qwen3.")
  act = d.get("hidden_act", "silu")
  if act != "silu":
    raise CheckpointError(f"{src}: hidden_act={act!r} is not supported (SwiGLU with silu only).")


def model_config_from_hf(config_json: Union[dict, str, os.PathLike], **overrides) -> ModelConfig:
  """A :class:`ModelConfig` from a HF ``config.json`` (a dict, the file, or its directory).

  Follows transformers' reading of the file: ``head_dim`` defaults to 128 for
  ``qwen3`` (the ``Qwen3Config`` default) and to ``hidden_size // num_attention_heads``
  for ``qwen2``; ``rope_theta`` comes from ``rope_parameters`` (transformers 5),
  ``rope_scaling`` or the top level, default 10000. ``overrides`` set any
  :class:`ModelConfig` field (e.g. ``param_dtype="bfloat16"``, ``remat="dots"``).
  Features the decoder does not implement (sliding window, scaled RoPE, Qwen3
  attention biases, a non-SiLU activation) raise :class:`CheckpointError`.
  """
  if isinstance(config_json, dict):
    src, d = "config.json (dict)", config_json
  else:
    src = _config_path(config_json)
    d = _read_json(src, "config.json")
  if not isinstance(d, dict):
    raise CheckpointError(f"{src}: expected a JSON object, got {type(d).__name__}")
  mt = d.get("model_type")
  if mt not in SUPPORTED_MODEL_TYPES:
    raise CheckpointError(
        f"{src}: model_type={mt!r} is not supported; supported model types: "
        f"{', '.join(SUPPORTED_MODEL_TYPES)} (architectures {d.get('architectures')}).")

  def need(key):
    if key not in d:
      raise CheckpointError(f"{src}: required field {key!r} is missing (model_type={mt!r}).")
    v = d[key]
    if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
      raise CheckpointError(f"{src}: field {key!r} must be a positive integer, got {v!r}.")
    return v

  hidden, heads = need("hidden_size"), need("num_attention_heads")
  kv = d.get("num_key_value_heads") or heads
  if "head_dim" in d and d["head_dim"] is not None:
    head_dim = d["head_dim"]
  elif mt == "qwen3":
    head_dim = 128  # transformers.Qwen3Config default
  else:
    if hidden % heads:
      raise CheckpointError(f"{src}: hidden_size={hidden} is not divisible by "
                            f"num_attention_heads={heads} and head_dim is not given.")
    head_dim = hidden // heads

  theta = _rope_theta(src, d)
  _refuse_unsupported(src, d, mt)

  fields = dict(  # keys: HF_ARCH_FIELDS
      model_type=mt,
      vocab_size=need("vocab_size"),
      hidden_size=hidden,
      intermediate_size=need("intermediate_size"),
      num_layers=need("num_hidden_layers"),
      num_heads=heads,
      num_kv_heads=kv,
      head_dim=int(head_dim),
      rope_theta=float(theta),
      rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
      tie_embeddings=bool(d.get("tie_word_embeddings", False)),
  )
  names = {f.name for f in dataclasses.fields(ModelConfig)}
  unknown = sorted(set(overrides) - names)
  if unknown:
    raise TypeError(f"model_config_from_hf: unknown ModelConfig field(s) {unknown}; "
                    f"valid: {sorted(names)}")
  fields.update(overrides)
  try:
    return ModelConfig(**fields)
  except ValueError as e:
    raise CheckpointError(f"{src}: {e}") from None


def read_hf_config(path: Union[str, os.PathLike]) -> dict[str, Any]:
  """The ``config.json`` of a checkpoint directory (or the file itself) as a dict."""
  src = _config_path(path)
  d = _read_json(src, "config.json")
  if not isinstance(d, dict):
    raise CheckpointError(f"{src}: expected a JSON object, got {type(d).__name__}")
  return d


def checkpoint_dtype(path: Union[str, os.PathLike]) -> Optional[str]:
  """The dtype a checkpoint's ``config.json`` says its weights are stored in
  (``dtype``, transformers 5; ``torch_dtype``, 4.x), e.g. ``"bfloat16"``; None
  when it names none."""
  d = read_hf_config(path)
  name = d.get("dtype") or d.get("torch_dtype")
  return str(name) if name else None


def generation_stop_ids(path: Union[str, os.PathLike]) -> tuple[int, ...]:
  """The ids that end generation for the checkpoint at ``path``: ``eos_token_id`` (an int
  or a list) of its ``generation_config.json``, else of its ``config.json``; () if neither
  names one. (Qwen3 instruct: ``(151645, 151643)``, ``<|im_end|>`` and ``<|endoftext|>``;
  a run's ``config.sampling.stop_token_ids``.)"""
  path = os.fspath(path)
  for name in ("generation_config.json", CONFIG_NAME):
    f = os.path.join(path, name)
    if os.path.isfile(f):
      eos = _read_json(f, name).get("eos_token_id")
      if eos is not None:
        return tuple(int(i) for i in (eos if isinstance(eos, (list, tuple)) else [eos]))
  return ()


def hf_config_changes(model_config, path: Union[str, os.PathLike]) -> dict[str, tuple]:
  """``{field: (value in model_config, value in config.json)}`` for every architecture
  field (:data:`HF_ARCH_FIELDS`) on which ``model_config`` (a :class:`ModelConfig`, a
  run config's ``model`` section or a dict) disagrees with ``path``'s ``config.json``."""
  file_cfg = model_config_from_hf(path)
  get = (model_config.get if hasattr(model_config, "get") else
         lambda k, default=None: getattr(model_config, k, default))
  return {f: (get(f, None), getattr(file_cfg, f)) for f in HF_ARCH_FIELDS
          if get(f, None) != getattr(file_cfg, f)}


def apply_hf_config(config, path: Union[str, os.PathLike]):
  """A copy of run config ``config`` whose ``model`` section describes the checkpoint at ``path``.

  Every architecture field of :class:`ModelConfig` (:data:`HF_ARCH_FIELDS`: model
  type, sizes, heads, head_dim, ``rope_theta``, ``rms_norm_eps``, tied embeddings) is
  set from ``path/config.json`` (read by :func:`model_config_from_hf`); the file wins
  over the preset and over explicit ``--config.model.*`` values, because weights under
  any other architecture are a silently wrong model. The run's other fields
  (``param_dtype``, ``compute_dtype``, ``remat``, ...) are kept, and
  ``model.hf_path`` is set to ``path`` (so the tokenizer is looked for there unless
  ``model.tokenizer_path`` is set).
  Changed fields are logged (``model.rope_theta: 10000.0 -> 1000000.0 ...``).
  ``max_position_embeddings`` has no ModelConfig field; export reads it back from
  ``config.json`` (``launch/export_hf.py``).

  Args:
    config: an ``ml_collections.ConfigDict`` with a ``model`` section
      (``configs/base.py``); not modified.
    path: a HF checkpoint directory (or its ``config.json``).

  Returns:
    the updated copy (set even when ``config`` is locked).
  """
  path = os.fspath(path)
  changes = hf_config_changes(config.model, path)
  config = copy.deepcopy(config)
  with config.unlocked():
    for f, (_, new) in changes.items():
      config.model[f] = new
    config.model.hf_path = path
  if changes:
    log.info("model config from %s: %s", os.path.join(path, CONFIG_NAME) if os.path.isdir(path)
             else path, ", ".join(f"model.{f}: {old!r} -> {new!r}"
                                  for f, (old, new) in changes.items()))
  return config


# config.json keys we write only when the base config does not have them.
_SOFT_DEFAULTS = {"max_position_embeddings": 32768, "initializer_range": 0.02, "use_cache": True,
                  "attention_dropout": 0.0}


def hf_config_dict(cfg: ModelConfig, dtype: Any = None,
                   base_config: Optional[dict] = None) -> dict[str, Any]:
  """The ``config.json`` contents transformers (4.x and 5.x), vLLM and SGLang read.

  ``base_config`` (e.g. the source checkpoint's ``config.json``) supplies the keys
  we do not own (``eos_token_id``, ``bos_token_id``, ``max_position_embeddings``,
  ...); every field that defines the architecture, RoPE or the dtype is ours.
  """
  dt = jnp.dtype(dtype if dtype is not None else cfg.param_dtype).name
  d = {
      "architectures": [_ARCHITECTURES[cfg.model_type]],
      "model_type": cfg.model_type,
      "vocab_size": cfg.vocab_size,
      "hidden_size": cfg.hidden_size,
      "intermediate_size": cfg.intermediate_size,
      "num_hidden_layers": cfg.num_layers,
      "num_attention_heads": cfg.num_heads,
      "num_key_value_heads": cfg.num_kv_heads,
      "hidden_act": "silu",
      "rms_norm_eps": cfg.rms_norm_eps,
      "rope_theta": cfg.rope_theta,  # transformers 4.x / older vLLM
      "rope_scaling": None,
      "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},  # transformers 5
      "tie_word_embeddings": cfg.tie_embeddings,
      "use_sliding_window": False,
      "sliding_window": None,
      "max_window_layers": cfg.num_layers,
      "layer_types": ["full_attention"] * cfg.num_layers,
      "torch_dtype": dt,  # transformers 4.x
      "dtype": dt,  # transformers 5
  }
  if cfg.model_type == "qwen3":
    d["head_dim"] = cfg.head_dim
    d["attention_bias"] = False
  elif cfg.head_dim * cfg.num_heads != cfg.hidden_size:
    d["head_dim"] = cfg.head_dim  # Qwen2 reads it with getattr(config, "head_dim", ...)
  out = dict(base_config or {})
  out.pop("head_dim", None)
  out.pop("partial_rotary_factor", None)
  for k, v in _SOFT_DEFAULTS.items():
    out.setdefault(k, v)
  out.update(d)
  return out


# ----------------------------------------------------------------------------- name/layout map


@dataclasses.dataclass(frozen=True)
class _TensorMap:
  """How one of our params is laid out in HF tensors.

  The HF tensor (shape ``hf_shape``) is reshaped to the "intermediate" shape
  ``concat(groups)`` (each HF dim splits into the sizes of its group, e.g.
  ``H*Dh -> (H, Dh)``), then transposed so our per-layer dim ``j`` is
  intermediate dim ``perm[j]``. ``stacked`` params gain a leading layer axis,
  one HF tensor per layer (``hf_name`` has a ``{i}``).
  """
  path: tuple[str, ...]
  hf_name: str
  groups: tuple[tuple[int, ...], ...]
  perm: tuple[int, ...]
  stacked: bool

  @property
  def hf_shape(self) -> tuple[int, ...]:
    return tuple(math.prod(g) for g in self.groups)

  @property
  def inter_shape(self) -> tuple[int, ...]:
    return tuple(s for g in self.groups for s in g)

  @property
  def layer_shape(self) -> tuple[int, ...]:
    inter = self.inter_shape
    return tuple(inter[p] for p in self.perm)

  def names(self, num_layers: int) -> list[str]:
    if self.stacked:
      return [self.hf_name.format(i=i) for i in range(num_layers)]
    return [self.hf_name]

  def to_hf(self, x: np.ndarray) -> np.ndarray:
    """Our per-layer array -> the HF tensor (a contiguous copy)."""
    inv = np.argsort(self.perm)
    return np.ascontiguousarray(np.transpose(x, inv).reshape(self.hf_shape))


def tensor_maps(cfg: ModelConfig) -> list[_TensorMap]:
  """Every parameter of ``cfg`` with its HF tensor name(s) and layout."""
  D, H, K, Dh, F, V = (cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                       cfg.intermediate_size, cfg.vocab_size)
  lay = "model.layers.{i}."
  m = [
      _TensorMap(("embed",), "model.embed_tokens.weight", ((V,), (D,)), (0, 1), False),
      _TensorMap(("layers", "attn_norm"), lay + "input_layernorm.weight", ((D,),), (0,), True),
      _TensorMap(("layers", "q"), lay + "self_attn.q_proj.weight", ((H, Dh), (D,)), (2, 0, 1), True),
      _TensorMap(("layers", "k"), lay + "self_attn.k_proj.weight", ((K, Dh), (D,)), (2, 0, 1), True),
      _TensorMap(("layers", "v"), lay + "self_attn.v_proj.weight", ((K, Dh), (D,)), (2, 0, 1), True),
      _TensorMap(("layers", "o"), lay + "self_attn.o_proj.weight", ((D,), (H, Dh)), (1, 2, 0), True),
      _TensorMap(("layers", "mlp_norm"), lay + "post_attention_layernorm.weight", ((D,),), (0,),
                 True),
      _TensorMap(("layers", "gate"), lay + "mlp.gate_proj.weight", ((F,), (D,)), (1, 0), True),
      _TensorMap(("layers", "up"), lay + "mlp.up_proj.weight", ((F,), (D,)), (1, 0), True),
      _TensorMap(("layers", "down"), lay + "mlp.down_proj.weight", ((D,), (F,)), (1, 0), True),
  ]
  if cfg.qkv_bias:
    m += [
        _TensorMap(("layers", "q_bias"), lay + "self_attn.q_proj.bias", ((H, Dh),), (0, 1), True),
        _TensorMap(("layers", "k_bias"), lay + "self_attn.k_proj.bias", ((K, Dh),), (0, 1), True),
        _TensorMap(("layers", "v_bias"), lay + "self_attn.v_proj.bias", ((K, Dh),), (0, 1), True),
    ]
  if cfg.qk_norm:
    m += [
        _TensorMap(("layers", "q_norm"), lay + "self_attn.q_norm.weight", ((Dh,),), (0,), True),
        _TensorMap(("layers", "k_norm"), lay + "self_attn.k_norm.weight", ((Dh,),), (0,), True),
    ]
  m.append(_TensorMap(("final_norm",), "model.norm.weight", ((D,),), (0,), False))
  if not cfg.tie_embeddings:
    m.append(_TensorMap(("unembed",), "lm_head.weight", ((V,), (D,)), (1, 0), False))
  return m


def _get(tree, path):
  for k in path:
    tree = tree[k]
  return tree


def _set(tree, path, value):
  for k in path[:-1]:
    tree = tree.setdefault(k, {})
  tree[path[-1]] = value


# ----------------------------------------------------------------------------- safetensors reading


def _diagnose_safetensors(path: str, err: Exception, wanted: list[str]) -> str:
  """A readable reason why ``safe_open`` failed, naming the tensor(s) affected."""
  want = (f"; it should hold {wanted[0]!r}" + (f" and {len(wanted) - 1} more tensor(s)"
                                               if len(wanted) > 1 else "")) if wanted else ""
  try:
    size = os.path.getsize(path)
    with open(path, "rb") as f:
      raw = f.read(8)
      if len(raw) < 8:
        return f"{path}: not a safetensors file (only {size} bytes){want}"
      (n,) = struct.unpack("<Q", raw)
      if 8 + n > size:
        return (f"{path}: corrupt or truncated safetensors header (header claims {n} bytes, "
                f"the file has {size}){want}")
      try:
        header = json.loads(f.read(n))
      except (UnicodeDecodeError, json.JSONDecodeError) as e:
        return f"{path}: corrupt safetensors header (not valid JSON: {e}){want}"
    data = size - 8 - n
    tensors = {k: v for k, v in header.items() if k != "__metadata__" and isinstance(v, dict)}
    end = max((v.get("data_offsets", [0, 0])[1] for v in tensors.values()), default=0)
    if end > data:
      cut = sorted((k for k, v in tensors.items() if v.get("data_offsets", [0, 0])[1] > data),
                   key=lambda k: tensors[k]["data_offsets"][1], reverse=True)
      shown = ", ".join(repr(k) for k in cut[:4]) + (f" and {len(cut) - 4} more" if len(cut) > 4
                                                     else "")
      return (f"{path}: truncated safetensors file ({data} data bytes, header expects {end}); "
              f"tensor(s) cut off: {shown}")
  except OSError as e:
    return f"{path}: cannot read: {e}{want}"
  return f"{path}: invalid safetensors file ({err}){want}"


class _Reader:
  """Open safetensors files of one checkpoint directory and find tensors in them."""

  def __init__(self, directory: str):
    from safetensors import safe_open  # local: keeps `import fbos_jax` light
    self._safe_open = safe_open
    self.dir = directory
    index_path = os.path.join(directory, INDEX_NAME)
    single = os.path.join(directory, SINGLE_FILE_NAME)
    if os.path.isfile(index_path):
      idx = _read_json(index_path, "safetensors index")
      wm = idx.get("weight_map") if isinstance(idx, dict) else None
      if not isinstance(wm, dict) or not wm:
        raise CheckpointError(f"{index_path}: no 'weight_map' object in the index.")
      self.where = {k: os.path.join(directory, v) for k, v in wm.items()}
      self.source = index_path
    elif os.path.isfile(single):
      self.where = None  # every tensor in the one file
      self.files = [single]
      self.source = single
    else:
      found = sorted(f for f in os.listdir(directory) if f.endswith(".safetensors"))
      if len(found) != 1:
        raise CheckpointError(
            f"{directory}: no {SINGLE_FILE_NAME} or {INDEX_NAME}" +
            (f", and {len(found)} *.safetensors files ({', '.join(found[:4])}...) without an "
             "index" if found else " (no *.safetensors files at all)"))
      self.where = None
      self.files = [os.path.join(directory, found[0])]
      self.source = self.files[0]
    if self.where is not None:
      self.files = sorted(set(self.where.values()))
    self._handles: dict[str, Any] = {}
    self._keys: dict[str, set] = {}

  def open_all(self, wanted_by_file: dict[str, list[str]]):
    for path in self.files:
      wanted = wanted_by_file.get(path, [])
      if not os.path.isfile(path):
        raise CheckpointError(
            f"{path}: file listed in {self.source} is missing" +
            (f"; it should hold {wanted[0]!r}" if wanted else ""))
      try:
        h = self._safe_open(path, framework="numpy")
        keys = set(h.keys())
      except Exception as e:  # safetensors raises its own SafetensorError / OSError
        raise CheckpointError(_diagnose_safetensors(path, e, wanted)) from None
      self._handles[path] = h
      self._keys[path] = keys

  def file_of(self, name: str) -> Optional[str]:
    if self.where is not None:
      return self.where.get(name)
    return self.files[0]

  def all_names(self) -> dict[str, str]:
    return {k: p for p, ks in self._keys.items() for k in ks}

  def check(self, name: str, shape: tuple[int, ...], cfg_src: str, cfg_desc: str):
    path = self.file_of(name)
    if path is None or name not in self._keys.get(path, ()):
      where = (f"{path} (as listed in {self.source})" if path else
               f"{self.source}" + (" or any shard" if self.where is not None else ""))
      raise CheckpointError(f"missing tensor {name!r}: not found in {where}; {cfg_src} "
                            f"({cfg_desc}) requires it.")
    sl = self._handles[path].get_slice(name)
    got = tuple(int(s) for s in sl.get_shape())
    if got != shape:
      raise CheckpointError(
          f"{path}: tensor {name!r} has shape {list(got)}, but {cfg_src} ({cfg_desc}) implies "
          f"{list(shape)}.")
    dt = sl.get_dtype()
    if dt not in ("F64", "F32", "F16", "BF16"):
      raise CheckpointError(f"{path}: tensor {name!r} has dtype {dt}; expected a float type "
                            "(F32, BF16, F16 or F64).")

  def read(self, name: str, index: tuple[slice, ...]) -> np.ndarray:
    """The block ``index`` of tensor ``name``; raises ``CheckpointError`` naming
    the tensor when it holds a NaN or an infinity."""
    path = self.file_of(name)
    try:
      block = np.asarray(self._handles[path].get_slice(name)[index])
    except Exception as e:
      raise CheckpointError(f"{path}: cannot read tensor {name!r}: {e}") from None
    _check_finite(block, f"{path}: tensor {name!r}", index)
    return block

  def close(self):
    self._handles.clear()


def _check_finite(block: np.ndarray, what: str, index: tuple = (), note: str = "") -> None:
  """Raises ``CheckpointError`` when ``block`` (part ``index`` of a tensor)
  holds a NaN or an infinity: a model with one decodes garbage or crashes far
  from here (issue 23: ``OverflowError ... 'ids'`` in decode)."""
  finite = np.isfinite(block)
  if finite.all():
    return
  bad = np.argwhere(~finite)
  first = tuple(int(i) for i in bad[0])
  offset = tuple((s.start or 0) if isinstance(s, slice) else 0 for s in index)
  first = tuple(f + (offset[d] if d < len(offset) else 0) for d, f in enumerate(first))
  value = block[tuple(bad[0])]
  raise CheckpointError(
      f"{what} holds {len(bad)} non-finite value(s) (NaN or inf), the first {value!r} at "
      f"index {list(first)}{note}; the checkpoint is damaged or was saved from a diverged "
      "run, and a model with such a weight gives NaN logits. Use another checkpoint.")


def _ranges(index: tuple, shape: tuple[int, ...]) -> list[tuple[int, int]]:
  out = []
  for i, n in enumerate(shape):
    s = index[i] if i < len(index) else slice(None)
    start, stop, step = s.indices(n)
    if step != 1:
      raise CheckpointError(f"strided shard index {s} is not supported")
    out.append((start, stop))
  return out


def _read_layer_block(reader: _Reader, tm: _TensorMap, name: str,
                      our_ranges: list[tuple[int, int]]) -> np.ndarray:
  """Read just the part of HF tensor ``name`` that covers ``our_ranges`` (our per-layer dims)."""
  inter = [None] * len(tm.perm)
  for j, p in enumerate(tm.perm):
    inter[p] = our_ranges[j]
  hf_index, block_shape, post = [], [], []
  pos = 0
  for g in tm.groups:
    rs = inter[pos:pos + len(g)]
    stride = math.prod(g[1:])
    a0, a1 = rs[0]
    hf_index.append(slice(a0 * stride, a1 * stride))  # whole rows of the group's first dim
    block_shape += [a1 - a0, *g[1:]]
    post += [slice(None)] + [slice(r0, r1) for r0, r1 in rs[1:]]
    pos += len(g)
  block = reader.read(name, tuple(hf_index))
  block = block.reshape(block_shape)[tuple(post)]
  return np.transpose(block, tm.perm)


def _load_param(reader: _Reader, tm: _TensorMap, cfg: ModelConfig, sharding, dtype) -> jax.Array:
  layer_shape = tm.layer_shape
  shape = ((cfg.num_layers,) + layer_shape) if tm.stacked else layer_shape
  names = tm.names(cfg.num_layers)
  np_dtype = np.dtype(dtype)

  def read_block(index) -> np.ndarray:
    rng = _ranges(index, shape)
    out = np.empty([b - a for a, b in rng], np_dtype)
    cast = (f" (of the loaded shard, after the cast to {np_dtype.name}: the stored values "
            f"are finite but overflow {np_dtype.name}; load with a wider model.param_dtype)")
    if tm.stacked:  # one HF tensor per layer, written into place (no stacked copy)
      (l0, l1), rest = rng[0], rng[1:]
      for i in range(l0, l1):
        with np.errstate(over="ignore"):  # an overflow is reported just below
          out[i - l0] = _read_layer_block(reader, tm, names[i], rest)
        _check_finite(out[i - l0], f"{reader.file_of(names[i])}: tensor {names[i]!r}",
                      note=cast)
    else:
      with np.errstate(over="ignore"):
        out[...] = _read_layer_block(reader, tm, names[0], rng)
      _check_finite(out, f"{reader.file_of(names[0])}: tensor {names[0]!r}", note=cast)
    return out

  # Group devices by the (identical) slice they hold so each slice is read once, then
  # put it on those devices and let the host copy go before reading the next one.
  by_index: dict[tuple, list] = {}
  for dev, idx in sharding.addressable_devices_indices_map(shape).items():
    key = tuple((s.start, s.stop, s.step) for s in idx)
    by_index.setdefault(key, []).append((dev, idx))
  arrays = []
  for group in by_index.values():
    block = read_block(group[0][1])
    for dev, _ in group:
      arrays.append(jax.device_put(block, dev))
    jax.block_until_ready(arrays[-len(group):])
    del block
  return jax.make_array_from_single_device_arrays(shape, sharding, arrays)


def _describe(cfg: ModelConfig) -> str:
  return (f"model_type={cfg.model_type}, vocab_size={cfg.vocab_size}, "
          f"hidden_size={cfg.hidden_size}, intermediate_size={cfg.intermediate_size}, "
          f"num_hidden_layers={cfg.num_layers}, num_attention_heads={cfg.num_heads}, "
          f"num_key_value_heads={cfg.num_kv_heads}, head_dim={cfg.head_dim}")


def _agreeing_config(cfg_src: str, cfg: Optional[ModelConfig]) -> ModelConfig:
  """``cfg``, after checking its architecture fields against ``config.json``
  (``config.json``'s own config without ``cfg``)."""
  file_cfg = model_config_from_hf(cfg_src)
  if cfg is None:
    return file_cfg
  bad = [f for f in HF_ARCH_FIELDS if getattr(cfg, f) != getattr(file_cfg, f)]
  if bad:
    raise CheckpointError(
        f"{cfg_src} disagrees with the given ModelConfig on " +
        ", ".join(f"{f} (file {getattr(file_cfg, f)!r}, config {getattr(cfg, f)!r})"
                  for f in bad) +
        "; take the model fields from the checkpoint with "
        "fbos_jax.model.hf.apply_hf_config(config, path) (what --init_from_hf does).")
  return cfg


def _open_and_check(reader, maps, cfg: ModelConfig, cfg_src: str, path: str):
  """Open the files holding the tensors ``maps`` needs, check every tensor's
  shape, and warn about the tensors the model does not use."""
  wanted_by_file: dict[str, list[str]] = {}
  for tm in maps:
    for n in tm.names(cfg.num_layers):
      f = reader.file_of(n)
      if f is not None:
        wanted_by_file.setdefault(f, []).append(n)
  reader.open_all(wanted_by_file)
  desc = _describe(cfg)
  used = set()
  for tm in maps:
    for n in tm.names(cfg.num_layers):
      reader.check(n, tm.hf_shape, cfg_src, desc)
      used.add(n)
  extra = sorted(n for n in reader.all_names() if n not in used
                 and not n.endswith(_IGNORED_SUFFIXES)
                 and not (cfg.tie_embeddings and n == "lm_head.weight"))
  if extra:
    log.warning("%s: ignoring %d tensor(s) the %s model does not use: %s", path, len(extra),
                cfg.model_type, ", ".join(extra[:8]) + (" ..." if len(extra) > 8 else ""))


def load_hf_params(path: Union[str, os.PathLike], cfg: Optional[ModelConfig] = None, *,
                   mesh=None, rules=None, dtype: Any = None) -> tuple[Params, ModelConfig]:
  """Load a local HF Qwen2/Qwen3 checkpoint directory into our param pytree.

  Args:
    path: directory with ``config.json`` and ``model.safetensors`` (or shards +
      ``model.safetensors.index.json``).
    cfg: optional :class:`ModelConfig` (a run passes its own, e.g.
      ``RLTrainer.parts.model``, so the params come in its ``param_dtype``); its
      architecture fields (model type, sizes, ``tie_embeddings``, ``rope_theta``,
      ``rms_norm_eps``) must agree with ``config.json`` (see
      :func:`apply_hf_config`); dtypes and remat are taken from it. Default: read
      from ``config.json`` via :func:`model_config_from_hf`, with float32 params.
    mesh: a ``jax.sharding.Mesh``; each param is created directly with
      ``NamedSharding(mesh, spec)``, spec from the logical rules. Without a mesh,
      everything goes to the first device.
    rules: logical-axis -> mesh-axis rules (default ``sharding.DEFAULT_RULES``).
    dtype: storage dtype of the params (default ``cfg.param_dtype``; float32 without
      ``cfg``). The cast from the stored dtype happens on the host, one device
      shard at a time.

  Returns:
    ``(params, cfg)``, cfg with ``param_dtype`` set to the dtype used.
  """
  from fbos_jax import sharding as shd

  path = os.fspath(path)
  if not os.path.exists(path):
    raise CheckpointError(f"checkpoint directory not found: {path}")
  if not os.path.isdir(path):
    raise CheckpointError(f"checkpoint path is not a directory: {path}")
  cfg_src = os.path.join(path, CONFIG_NAME)
  cfg = _agreeing_config(cfg_src, cfg)
  dtype = jnp.dtype(dtype if dtype is not None else cfg.param_dtype)
  cfg = dataclasses.replace(cfg, param_dtype=dtype.name)
  reader = _Reader(path)
  maps = tensor_maps(cfg)
  _open_and_check(reader, maps, cfg, cfg_src, path)

  if mesh is not None:
    rules = shd.DEFAULT_RULES if rules is None else rules
    abstract = abstract_params(cfg)
    specs = shd.tree_specs(param_logical_axes(cfg), rules, abstract, mesh)
    spec_of = lambda p: NamedSharding(mesh, _get(specs, p))
  else:
    dev = jax.local_devices()[0]
    spec_of = lambda p: SingleDeviceSharding(dev)

  params: Params = {}
  try:
    for tm in maps:
      _set(params, tm.path, _load_param(reader, tm, cfg, spec_of(tm.path), dtype))
  finally:
    reader.close()
  return params, cfg


# ----------------------------------------------------------------------------- export


def _st_dtype(dt: np.dtype) -> str:
  try:
    return _ST_DTYPES[np.dtype(dt).name]
  except KeyError:
    raise CheckpointError(f"dtype {np.dtype(dt).name} cannot be stored in safetensors") from None


def _to_host(x: jax.Array) -> np.ndarray:
  """The full value of a (possibly sharded, possibly multi-host) array on this host."""
  if isinstance(x, jax.Array) and not x.is_fully_addressable:
    from jax.experimental import multihost_utils
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))
  return np.asarray(x)


@functools.partial(jax.jit, static_argnums=2)
def _take_layer(x, i, dtype):
  return jax.lax.dynamic_index_in_dim(x, i, 0, keepdims=False).astype(dtype)


def _write_shard(path: str, entries: list, fetch) -> None:
  """Stream one safetensors file: header from shapes, then each tensor as it is fetched."""
  header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
  off = 0
  for name, shape, dt, nbytes in entries:
    header[name] = {"dtype": _st_dtype(dt), "shape": list(shape), "data_offsets": [off, off + nbytes]}
    off += nbytes
  hb = json.dumps(header, separators=(",", ":")).encode("utf-8")
  hb += b" " * (-len(hb) % 8)  # data starts 8-byte aligned, like the reference writer
  tmp = path + ".tmp"
  with open(tmp, "wb") as f:
    f.write(struct.pack("<Q", len(hb)))
    f.write(hb)
    for name, shape, dt, nbytes in entries:
      arr = fetch(name)
      if arr is not None:
        if arr.shape != tuple(shape) or arr.dtype != dt or arr.nbytes != nbytes:
          raise CheckpointError(f"{path}: internal error writing {name!r}: got "
                                f"{arr.shape} {arr.dtype}, planned {tuple(shape)} {dt}")
        f.write(np.ascontiguousarray(arr).reshape(-1).view(np.uint8).data)
  os.replace(tmp, path)


def _export_plan(leaves: dict, maps, cfg: ModelConfig, out_dt, max_shard_bytes: int):
  """Every HF tensor with its shape and dtype, in HF's usual order, split into
  files of at most ``max_shard_bytes``: (plan, files), each entry
  ``(name, shape, dtype, nbytes, tensor map, layer)``."""
  plan = []
  for tm in maps:
    x = leaves[tm.path]
    want = ((cfg.num_layers,) + tm.layer_shape) if tm.stacked else tm.layer_shape
    if tuple(x.shape) != want:
      raise CheckpointError(f"save_hf_checkpoint: param {'/'.join(tm.path)} has shape "
                            f"{tuple(x.shape)}, but the config ({_describe(cfg)}) implies {want}.")
    dt = np.dtype(out_dt if out_dt is not None else x.dtype)
    nbytes = math.prod(tm.hf_shape) * dt.itemsize
    for i, n in enumerate(tm.names(cfg.num_layers)):
      plan.append((n, tm.hf_shape, dt, nbytes, tm, i if tm.stacked else None))
  order = {"model.embed_tokens.weight": (-1, ""), "model.norm.weight": (1 << 30, ""),
           "lm_head.weight": (1 << 31, "")}
  plan.sort(key=lambda e: order.get(e[0], (e[5] if e[5] is not None else 0, e[0])))
  files: list[list] = [[]]
  size = 0
  for e in plan:
    if files[-1] and size + e[3] > max_shard_bytes:
      files.append([])
      size = 0
    files[-1].append(e)
    size += e[3]
  return plan, files


def _prepare_out_dir(out_dir: str):
  """Create the export directory and remove stale shards (they would shadow or
  mix with the new ones)."""
  if sys.byteorder != "little":
    raise CheckpointError("save_hf_checkpoint: big-endian hosts are not supported")
  try:
    os.makedirs(out_dir, exist_ok=True)
  except OSError as e:
    raise CheckpointError(f"cannot create checkpoint directory {out_dir}: {e}") from None
  for f in os.listdir(out_dir):
    if (f.startswith("model") and f.endswith(".safetensors")) or f == INDEX_NAME:
      os.remove(os.path.join(out_dir, f))


def _write_index_and_config(out_dir, plan, files, names, cfg, out_dt, leaves, base_config):
  """The shard index (more than one file) and ``config.json``; their paths."""
  written = []
  if len(files) > 1:
    index = {"metadata": {"total_size": int(sum(e[3] for e in plan))},
             "weight_map": {e[0]: fname for fname, entries in zip(names, files)
                            for e in entries}}
    p = os.path.join(out_dir, INDEX_NAME)
    with open(p, "w", encoding="utf-8") as f:
      json.dump(index, f, indent=2, sort_keys=True)
    written.append(p)
  dts = {e[2].name for e in plan}
  conf = hf_config_dict(cfg, dtype=out_dt if out_dt is not None else
                        (dts.pop() if len(dts) == 1 else leaves[("embed",)].dtype),
                        base_config=base_config)
  p = os.path.join(out_dir, CONFIG_NAME)
  with open(p, "w", encoding="utf-8") as f:
    json.dump(conf, f, indent=2, sort_keys=True)
  written.append(p)
  return written


def save_hf_checkpoint(params: Params, cfg: ModelConfig, out_dir: Union[str, os.PathLike], *,
                       dtype: Any = None, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
                       base_config: Optional[dict] = None) -> list[str]:
  """Write ``params`` as a HF checkpoint directory transformers / vLLM / SGLang load.

  Args:
    params: our param pytree (any sharding; multi-host arrays are all-gathered
      one HF tensor at a time, so every process must call this).
    cfg: the model config.
    out_dir: created if missing; old ``model*.safetensors`` / index files in it
      are replaced.
    dtype: storage dtype of the tensors (default: each param's own dtype); the
      cast happens on device before the transfer.
    max_shard_bytes: files are split at this size; more than one file gets a
      ``model.safetensors.index.json``.
    base_config: a ``config.json`` dict (e.g. the source checkpoint's) whose keys
      we do not own are kept (``eos_token_id``, ``bos_token_id``,
      ``max_position_embeddings``, ...); architecture / RoPE / dtype fields are
      always written from ``cfg``.

  Returns:
    the paths of the files written (on process 0; ``[]`` elsewhere).
  """
  out_dir = os.fspath(out_dir)
  writer = jax.process_index() == 0
  maps = tensor_maps(cfg)
  try:
    leaves = {tm.path: _get(params, tm.path) for tm in maps}
  except (KeyError, TypeError) as e:
    raise CheckpointError(f"save_hf_checkpoint: params have no entry {e} required by the "
                          f"{cfg.model_type} config ({_describe(cfg)})") from None
  out_dt = None if dtype is None else jnp.dtype(dtype)

  plan, files = _export_plan(leaves, maps, cfg, out_dt, max_shard_bytes)
  n_files = len(files)
  names = ([SINGLE_FILE_NAME] if n_files == 1 else
           [f"model-{i + 1:05d}-of-{n_files:05d}.safetensors" for i in range(n_files)])

  by_name = {e[0]: e for e in plan}

  def fetch(name):
    _, _, dt, _, tm, layer = by_name[name]
    x = leaves[tm.path]
    if layer is not None:  # one compile per (shape, dtype, sharding), not per layer
      x = _take_layer(x, jnp.int32(layer), dt)
    elif x.dtype != dt:
      x = x.astype(dt)
    host = _to_host(x)  # collective on multi-host: every process runs it
    return tm.to_hf(host) if writer else None

  if writer:
    _prepare_out_dir(out_dir)
  written = []
  for fname, entries in zip(names, files):
    p = os.path.join(out_dir, fname)
    # Wider dtypes first (stable), so every tensor starts aligned to its item size even
    # when a file mixes dtypes (like the reference writer). Same order on every process:
    # the fetches are collectives on multi-host.
    ent = sorted(((e[0], e[1], e[2], e[3]) for e in entries), key=lambda e: -e[2].itemsize)
    if writer:
      _write_shard(p, ent, fetch)
      written.append(p)
    else:
      for e in ent:
        fetch(e[0])
  if writer:
    written += _write_index_and_config(out_dir, plan, files, names, cfg, out_dt, leaves,
                                       base_config)
  return written
