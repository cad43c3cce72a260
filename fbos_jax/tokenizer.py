"""Tokenizers: a character-level tokenizer for the tiny CPU configs, and loading.

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
"""

from __future__ import annotations

import json
import os
from typing import Any

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
EF_OPEN, EF_CLOSE = "<EF>", "</EF>"
SPECIAL_TOKENS = (PAD, BOS, EOS, UNK)
ADDED_TOKENS = (EF_OPEN, EF_CLOSE)
BASE_CHARS = "\n" + "".join(chr(c) for c in range(32, 127))


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
  if not os.path.isdir(path) or not (
      os.path.exists(os.path.join(path, "tokenizer.json"))
      or os.path.exists(os.path.join(path, "tokenizer_config.json"))
  ):
    raise FileNotFoundError(
        f"no tokenizer at {path!r}: expected a directory with tokenizer.json or "
        "tokenizer_config.json (build one with "
        "fbos_jax.tokenizer.build_char_tokenizer)"
    )
  from transformers import AutoTokenizer

  tok = AutoTokenizer.from_pretrained(path, local_files_only=True, **kwargs)
  if tok.pad_token is None and tok.eos_token is not None:
    tok.pad_token = tok.eos_token
  return tok
