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


# ----------------------------------------------------------------------------- a run's tokenizer


def run_config(**model):
  import ml_collections
  return ml_collections.ConfigDict({"model": dict({"hf_path": "", "tokenizer_path": ""}, **model)})


def test_resolve_prefers_tokenizer_path_then_hf_path(tok_dir, tmp_path):
  hf_dir = tmp_path / "ckpt"
  tk.copy_tokenizer_files(tok_dir, hf_dir)
  assert tk.resolve_tokenizer_path(run_config(hf_path=str(hf_dir)), tmp_path / "wd") == str(hf_dir)
  assert tk.resolve_tokenizer_path(run_config(hf_path=str(hf_dir), tokenizer_path=tok_dir),
                                   tmp_path / "wd") == tok_dir
  assert not (tmp_path / "wd").exists()  # nothing built when a tokenizer is given


def test_resolve_builds_the_char_tokenizer_in_the_workdir(tmp_path):
  path = tk.resolve_tokenizer_path(run_config(), tmp_path)
  assert path == str(tmp_path / "tokenizer") and tk.is_tokenizer_dir(path)
  with pytest.raises(FileNotFoundError, match="--config.model.tokenizer_path"):
    tk.resolve_tokenizer_path(run_config(), tmp_path / "other", build_char=False)


def test_checkpoint_without_tokenizer_says_where_it_looked(tmp_path):
  ckpt = tmp_path / "ckpt"
  os.makedirs(ckpt)
  (ckpt / "config.json").write_text("{}")
  with pytest.raises(FileNotFoundError) as e:
    tk.resolve_tokenizer_path(run_config(hf_path=str(ckpt)), tmp_path / "wd")
  msg = str(e.value)
  assert str(ckpt) in msg and "tokenizer.json" in msg and "tokenizer_config.json" in msg
  assert "--config.model.tokenizer_path" in msg and "--init_from_hf" in msg
  with pytest.raises(FileNotFoundError, match=r"model\.tokenizer_path=.*nope.*"
                     r"--config\.model\.tokenizer_path"):
    tk.resolve_tokenizer_path(run_config(tokenizer_path=str(tmp_path / "nope")), tmp_path)
  with pytest.raises(FileNotFoundError, match="--config.model.tokenizer_path"):
    tk.load_tokenizer(ckpt)


def test_copy_tokenizer_files_is_verbatim(tok_dir, tmp_path):
  written = tk.copy_tokenizer_files(tok_dir, tmp_path / "out")
  assert sorted(os.path.basename(p) for p in written) == sorted(os.listdir(tok_dir))
  for p in written:
    assert open(p, "rb").read() == open(os.path.join(tok_dir, os.path.basename(p)), "rb").read()
  assert tk.copy_tokenizer_files(tmp_path / "out" / "nothing_here", tmp_path / "o2") == []


def test_compat_vocab_must_fit_the_model(tok_dir):
  tok = tk.load_tokenizer(tok_dir)
  n = len(tok)
  tk.check_tokenizer_compat(tok, vocab_size=n, template_style="compact")
  with pytest.raises(ValueError, match=rf"{n} tokens but model\.vocab_size={n - 1}") as e:
    tk.check_tokenizer_compat(tok, vocab_size=n - 1, template_style="compact",
                              tokenizer_path=tok_dir)
  assert tok_dir in str(e.value)


def test_compat_chat_template_against_prompt_style(tok_dir):
  plain = tk.load_tokenizer(tok_dir)  # the char tokenizer has no chat template
  with pytest.raises(ValueError, match=r"templates\.style='verbose'.*has none"):
    tk.check_tokenizer_compat(plain, vocab_size=1000, template_style="verbose")
  chat = tk.load_tokenizer(tok_dir)
  chat.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
  with pytest.raises(ValueError, match=r"templates\.style='compact'.*has a chat template"):
    tk.check_tokenizer_compat(chat, vocab_size=1000, template_style="compact")
  tk.check_tokenizer_compat(chat, vocab_size=1000, template_style="verbose")
