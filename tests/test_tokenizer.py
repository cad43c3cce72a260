"""Tests for fbos_jax.tokenizer: the character tokenizer and loading."""

import os
import string

import pytest
from transformers import AutoTokenizer
from transformers import PreTrainedTokenizerFast

from fbos_jax import tokenizer as tk


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
  return tk.build_char_tokenizer(tmp_path_factory.mktemp("char_tok"))


def test_saved_as_hf_directory(tok_dir):
  files = set(os.listdir(tok_dir))
  assert {"tokenizer.json", "tokenizer_config.json",
          "special_tokens_map.json"} <= files


def test_autotokenizer_loads_fast_tokenizer_with_specials(tok_dir):
  tok = AutoTokenizer.from_pretrained(tok_dir, local_files_only=True)
  assert isinstance(tok, PreTrainedTokenizerFast)
  assert (tok.pad_token, tok.bos_token, tok.eos_token) == ("<pad>", "<bos>", "<eos>")
  assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 2)
  assert tok.chat_template is None  # templates take the plain-text path
  assert len(tok) == len(tk.char_vocab())


def test_roundtrip_printable_ascii_and_newline(tok_dir):
  tok = tk.load_tokenizer(tok_dir)
  text = "".join(chr(c) for c in range(32, 127)) + "\n12+45=57\n  sort 5291=1259"
  ids = tok.encode(text, add_special_tokens=False)
  assert len(ids) == len(text)  # one token per character
  assert tok.decode(ids) == text
  assert tk.UNK not in tok.convert_ids_to_tokens(ids)


def test_ef_brackets_are_single_tokens_kept_by_decode(tok_dir):
  tok = tk.load_tokenizer(tok_dir)
  ids = tok.encode("<EF>ok</EF>1+1=", add_special_tokens=False)
  assert ids[0] == 4 and ids[3] == 5 and len(ids) == 2 + 2 + 4
  assert tok.decode(ids, skip_special_tokens=True) == "<EF>ok</EF>1+1="
  # EOS and pad are dropped by skip_special_tokens.
  assert tok.decode(ids + [2, 0, 0], skip_special_tokens=True) == "<EF>ok</EF>1+1="


def test_unknown_characters_map_to_unk(tok_dir):
  tok = tk.load_tokenizer(tok_dir)
  ids = tok.encode("aé", add_special_tokens=False)
  assert ids[1] == tok.unk_token_id == 3


def test_extra_chars(tmp_path):
  tok = tk.load_tokenizer(tk.build_char_tokenizer(tmp_path, extra_chars="éλ"))
  assert tok.decode(tok.encode("éλa", add_special_tokens=False)) == "éλa"
  assert len(tok) == len(tk.char_vocab()) + 2


def test_vocab_covers_printable_without_control_chars():
  vocab = tk.char_vocab()
  for ch in string.ascii_letters + string.digits + string.punctuation + " \n":
    assert ch in vocab
  assert "\t" not in vocab


def test_load_missing_path_names_it(tmp_path):
  missing = tmp_path / "nope"
  with pytest.raises(FileNotFoundError, match="nope"):
    tk.load_tokenizer(missing)
  os.makedirs(missing)
  with pytest.raises(FileNotFoundError, match=str(missing)):
    tk.load_tokenizer(missing)  # exists but holds no tokenizer
