"""Tokenizers: a character-level tokenizer for the tiny CPU configs, finding and
loading a run's tokenizer, and checking that it fits the model and the prompt style.

The character tokenizer is a real Hugging Face tokenizer (``tokenizer.json`` +
``tokenizer_config.json`` + ``special_tokens_map.json``), so everything else in
the stack treats it exactly like a Qwen tokenizer:
``transformers.AutoTokenizer.from_pretrained(dir)`` returns a
``PreTrainedTokenizerFast`` with ``pad``/``bos``/``eos`` set.

Vocabulary (ids are stable; tests rely on the order):
  0 ``<pad>``, 1 ``<bos>``, 2 ``<eos>``, 3 ``<unk>`` (special tokens),
  4 ``<EF>``, 5 ``</EF>`` (FCP feedback brackets; ordinary added tokens so that
  ``decode(skip_special_tokens=True)`` keeps them),
  then ``"\\n"``, the printable ASCII characters ``" "`` .. ``"~"`` and
  ``extra_chars``. Any other character encodes to ``<unk>``.

No chat template is set on the character tokenizer, so ``templates.render_prompt``
takes its plain-text path for it. Nothing here touches the network.

A run's tokenizer (:func:`resolve_tokenizer_path`): ``model.tokenizer_path`` if set,
else the checkpoint directory ``model.hf_path`` (``--init_from_hf``), else the
character tokenizer built in the workdir. :func:`check_tokenizer_compat` then rejects
a tokenizer larger than the model's vocabulary and a chat tokenizer paired with the
plain-text prompt style (or the reverse).
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Any

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
EF_OPEN, EF_CLOSE = "<EF>", "</EF>"
SPECIAL_TOKENS = (PAD, BOS, EOS, UNK)
ADDED_TOKENS = (EF_OPEN, EF_CLOSE)
BASE_CHARS = "\n" + "".join(chr(c) for c in range(32, 127))

TOKENIZER_PATH_FLAG = "--config.model.tokenizer_path"
# Files that make a directory a tokenizer (either is enough for AutoTokenizer).
TOKENIZER_MARKERS = ("tokenizer.json", "tokenizer_config.json")
# Everything a HF tokenizer directory may hold; copied verbatim by copy_tokenizer_files.
TOKENIZER_FILE_NAMES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                        "added_tokens.json", "vocab.json", "merges.txt", "tokenizer.model",
                        "chat_template.jinja", "chat_template.json")
# templates.style values whose prompts are written for a chat template, and the
# plain-text one (the character tokenizer's format).
CHAT_TEMPLATE_STYLES = ("verbose",)
PLAIN_TEMPLATE_STYLES = ("compact",)


def char_vocab(extra_chars: str = "") -> dict[str, int]:
  """Returns the token -> id map of the character tokenizer (see module doc)."""
  tokens = list(SPECIAL_TOKENS) + list(ADDED_TOKENS)
  for ch in BASE_CHARS + extra_chars:
    if ch not in tokens:
      tokens.append(ch)
  return {t: i for i, t in enumerate(tokens)}


def build_char_tokenizer(out_dir: str | os.PathLike, extra_chars: str = "") -> str:
  """Builds the character-level tokenizer and saves it as an HF tokenizer dir.

  Args:
    out_dir: directory to write (created if missing).
    extra_chars: characters to add to the vocabulary after printable ASCII.

  Returns:
    ``out_dir`` as a string; pass it to ``load_tokenizer``.
  """
  from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
  from transformers import PreTrainedTokenizerFast

  vocab = char_vocab(extra_chars)
  tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
  # Every character is its own pre-token ("[\s\S]" also matches newlines).
  tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
  tok.decoder = decoders.Fuse()  # join characters without spaces
  tok.add_special_tokens(list(SPECIAL_TOKENS))
  tok.add_tokens(list(ADDED_TOKENS))
  fast = PreTrainedTokenizerFast(
      tokenizer_object=tok,
      pad_token=PAD,
      bos_token=BOS,
      eos_token=EOS,
      unk_token=UNK,
      clean_up_tokenization_spaces=False,
      model_max_length=1 << 30,
  )
  os.makedirs(out_dir, exist_ok=True)
  fast.save_pretrained(str(out_dir))
  # transformers 5 no longer writes this file; older loaders still read it.
  with open(os.path.join(out_dir, "special_tokens_map.json"), "w") as f:
    json.dump({"pad_token": PAD, "bos_token": BOS, "eos_token": EOS,
               "unk_token": UNK}, f, indent=2)
  return str(out_dir)


def load_tokenizer(path: str | os.PathLike, **kwargs: Any):
  """Loads a local HF tokenizer directory (never downloads).

  Args:
    path: a directory holding ``tokenizer.json`` / ``tokenizer_config.json``
      (e.g. from ``build_char_tokenizer`` or a Qwen checkpoint).
    **kwargs: passed to ``AutoTokenizer.from_pretrained``.

  Returns:
    A ``transformers.PreTrainedTokenizerBase``. If it has no pad token, the EOS
    token is used as pad (Qwen base checkpoints ship without one sometimes).

  Raises:
    FileNotFoundError: naming ``path`` when it is not a tokenizer directory.
  """
  path = os.fspath(path)
  if not is_tokenizer_dir(path):
    raise FileNotFoundError(
        f"no tokenizer at {path!r}: expected a directory with tokenizer.json or "
        f"tokenizer_config.json; set {TOKENIZER_PATH_FLAG}=DIR to a tokenizer directory "
        "(e.g. the original model download) or build one with "
        "fbos_jax.tokenizer.build_char_tokenizer"
    )
  from transformers import AutoTokenizer

  tok = AutoTokenizer.from_pretrained(path, local_files_only=True, **kwargs)
  if tok.pad_token is None and tok.eos_token is not None:
    tok.pad_token = tok.eos_token
  return tok


def is_tokenizer_dir(path: str | os.PathLike) -> bool:
  """Whether ``path`` is a directory holding ``tokenizer.json`` or ``tokenizer_config.json``."""
  path = os.fspath(path)
  return os.path.isdir(path) and any(
      os.path.isfile(os.path.join(path, f)) for f in TOKENIZER_MARKERS)


def resolve_tokenizer_path(config, workdir: str | os.PathLike, *,
                           build_char: bool = True) -> str:
  """The tokenizer directory of a run, or an error that says where it looked.

  In order: ``config.model.tokenizer_path`` when set; else the checkpoint directory
  ``config.model.hf_path`` (``--init_from_hf``); else ``WORKDIR/tokenizer``, the
  character tokenizer (built there when missing and ``build_char``).

  Raises:
    FileNotFoundError: ``model.tokenizer_path`` or the HF checkpoint directory holds
      no tokenizer; the message names the directory, the files looked for and the
      flag that sets the tokenizer (``--config.model.tokenizer_path``).
  """
  m = config.model
  looked_for = " or ".join(TOKENIZER_MARKERS)
  tok_path = m.get("tokenizer_path", "") or ""
  if tok_path:
    if not is_tokenizer_dir(tok_path):
      raise FileNotFoundError(
          f"model.tokenizer_path={tok_path!r} is not a tokenizer directory (looked for "
          f"{looked_for} in it); set {TOKENIZER_PATH_FLAG}=DIR to a directory that has them.")
    return os.fspath(tok_path)
  hf_path = m.get("hf_path", "") or ""
  if hf_path:
    if not is_tokenizer_dir(hf_path):
      raise FileNotFoundError(
          f"no tokenizer in the checkpoint directory {hf_path!r} (model.hf_path / "
          f"--init_from_hf): looked for {looked_for} in it. Copy the tokenizer files of "
          f"the model it came from there, or set {TOKENIZER_PATH_FLAG}=DIR to that "
          "tokenizer's directory (e.g. the original download).")
    return os.fspath(hf_path)
  path = os.path.join(os.fspath(workdir), "tokenizer")
  if not os.path.exists(os.path.join(path, "tokenizer.json")):
    if not build_char:
      raise FileNotFoundError(
          f"no tokenizer at {path!r} (the character tokenizer of this workdir) and neither "
          f"model.tokenizer_path nor model.hf_path is set; set {TOKENIZER_PATH_FLAG}=DIR.")
    build_char_tokenizer(path)
  return path


def check_tokenizer_compat(tokenizer, *, vocab_size: int, template_style: str,
                           tokenizer_path: str = "") -> None:
  """Rejects a tokenizer that does not fit the model or the prompt template style.

  Args:
    tokenizer: a loaded HF tokenizer.
    vocab_size: ``config.model.vocab_size`` (rows of the embedding).
    template_style: ``config.templates.style``.
    tokenizer_path: where it was loaded from (for the message).

  Raises:
    ValueError: ``len(tokenizer) > vocab_size`` (ids without an embedding row), a
      tokenizer with a chat template under the plain-text style ``"compact"``, or
      one without a chat template under a chat style (``"verbose"``).
  """
  where = f" ({tokenizer_path})" if tokenizer_path else ""
  n = len(tokenizer)
  if n > int(vocab_size):
    raise ValueError(
        f"the tokenizer{where} has {n} tokens but model.vocab_size={vocab_size}: ids "
        f">= {vocab_size} have no embedding row. Use the model's own tokenizer "
        f"({TOKENIZER_PATH_FLAG}) or take the model from its checkpoint (--init_from_hf).")
  chat = bool(getattr(tokenizer, "chat_template", None))
  if chat and template_style in PLAIN_TEMPLATE_STYLES:
    raise ValueError(
        f"templates.style={template_style!r} is the plain-text prompt format of the "
        f"character tokenizer, but the tokenizer{where} has a chat template, so every "
        "prompt would be wrapped in a chat turn the format was not written for; use "
        "--config.templates.style=verbose with a chat model.")
  if not chat and template_style in CHAT_TEMPLATE_STYLES:
    raise ValueError(
        f"templates.style={template_style!r} writes prompts for a chat template, but the "
        f"tokenizer{where} has none (no chat_template in its tokenizer_config.json), so "
        "prompts would go to the model as bare text; use a tokenizer with a chat "
        "template, or --config.templates.style=compact for a plain-text model.")


def copy_tokenizer_files(src_dir: str | os.PathLike, out_dir: str | os.PathLike) -> list[str]:
  """Copies the tokenizer files of ``src_dir`` (:data:`TOKENIZER_FILE_NAMES`) verbatim.

  Returns:
    the paths written (empty when ``src_dir`` holds none of them).
  """
  written = []
  os.makedirs(out_dir, exist_ok=True)
  for name in TOKENIZER_FILE_NAMES:
    src = os.path.join(os.fspath(src_dir), name)
    if os.path.isfile(src):
      dst = os.path.join(os.fspath(out_dir), name)
      shutil.copyfile(src, dst)
      written.append(dst)
  return written
