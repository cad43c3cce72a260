"""Tests for fbos_jax.templates: FAP, aggregated (GOLF) and FCP prompts."""

import random

import pytest

from fbos_jax import templates as T
from fbos_jax import tokenizer as tk

CHAT = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n"
        "{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}")


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
  return tk.load_tokenizer(tk.build_char_tokenizer(
      tmp_path_factory.mktemp("tok")))


@pytest.fixture(scope="module")
def chat_tok(tmp_path_factory):
  t = tk.load_tokenizer(tk.build_char_tokenizer(tmp_path_factory.mktemp("ct")))
  t.chat_template = CHAT
  return t


def builder(tok, **overrides):
  cfg = T.default_template_config()
  cfg.update(overrides)
  return T.PromptBuilder(tok, cfg)


def test_compact_fap_text_and_ids(tok):
  p = builder(tok).fap("12+45=", "56", "digit 1 from the right is wrong")
  assert p.text == "12+45=56|digit 1 from the right is wrong|"
  assert p.token_ids == tok.encode(p.text, add_special_tokens=False)
  assert not p.truncated


def test_verbose_fap_holds_all_parts(tok):
  p = builder(tok, style="verbose", max_prompt_tokens=1000).fap(
      "What is 2+2?", "5", "the value is wrong")
  assert p.text.startswith("What is 2+2?\n")
  assert "previous attempt at this problem:\n5\n" in p.text
  assert "Feedback on that attempt:\nthe value is wrong\n" in p.text


def test_custom_fap_template_from_config(tok):
  p = builder(tok, fap="Q:{prompt} A:{response} F:{feedback} A:").fap(
      "1+1=", "3", "wrong")
  assert p.text == "Q:1+1= A:3 F:wrong A:"


def test_fcp_prompt(tok):
  p = builder(tok).fcp("12+45=", "correct")
  assert p.text == "<EF>correct</EF>12+45="
  assert p.token_ids[0] == tok.convert_tokens_to_ids("<EF>")


def test_plain_text_path_vs_chat_template(tok, chat_tok):
  assert T.render_prompt(tok, "1+1=") == tok.encode("1+1=", add_special_tokens=False)
  ids = T.render_prompt(chat_tok, "1+1=")
  assert chat_tok.decode(ids) == "<user>1+1=\n<assistant>"
  ids = T.render_prompt(chat_tok, "1+1=", system_prompt="be brief")
  assert chat_tok.decode(ids) == "<system>be brief\n<user>1+1=\n<assistant>"
  p = builder(chat_tok).fap("1+1=", "3", "wrong")
  assert chat_tok.decode(p.token_ids) == "<user>1+1=3|wrong|\n<assistant>"
  assert builder(tok, add_bos=True).plain("1+1=").token_ids[0] == tok.bos_token_id


def test_aggregated_shortest_first_numbered_and_deduped(tok):
  atts = [T.Attempt("1234", "digits 1 and 2 are wrong", 0.0),
          T.Attempt("5", "too short", 0.0),
          T.Attempt("56", "digit 1 wrong", 0.5),
          T.Attempt("5", "too short (dup)", 0.0)]
  p = builder(tok, style="verbose", max_prompt_tokens=2000).aggregated("12+45=", atts)
  assert p.num_attempts == 3
  i1 = p.text.index("Attempt 1 (score 0):\n5\nFeedback: too short\n")
  i2 = p.text.index("Attempt 2 (score 0.5):\n56\nFeedback: digit 1 wrong\n")
  i3 = p.text.index("Attempt 3 (score 0):\n1234\n")
  assert i1 < i2 < i3
  assert "dup" not in p.text
  assert p.text.startswith("Problem:\n12+45=\n")
  assert "do not mention the attempts" in p.text
  compact = builder(tok).aggregated("12+45=", atts)
  assert compact.text == "12+45=5|too short|56|digit 1 wrong|1234|digits 1 and 2 are wrong|"


def test_aggregated_greedy_budget_skips_what_does_not_fit(tok):
  atts = [T.Attempt("1", "a" * 30, 0.0), T.Attempt("22", "b", 0.0),
          T.Attempt("333", "c", 0.0)]
  # Shortest response first is "1" but its block (34 tokens) does not fit in
  # 6 (prompt) + 14; "22|b|" and "333|c|" do.
  p = builder(tok, max_prompt_tokens=20).aggregated("12+45=", atts)
  assert p.text == "12+45=22|b|333|c|"
  assert p.num_attempts == 2 and len(p.token_ids) <= 20


def test_aggregated_cuts_the_shortest_attempt_when_none_fits(tok):
  atts = [T.Attempt("9" * 40, "wrong digits", 0.0),
          T.Attempt("8" * 50, "wrong", 0.0)]
  p = builder(tok, max_prompt_tokens=30).aggregated("12+45=", atts)
  assert p.num_attempts == 1 and p.truncated
  # Budget 30 = 6 (problem) + 14 ("|wrong digits|") + 10 for the response:
  # "middle" keeps 4 head + 3 tail tokens around "...".
  assert p.text == "12+45=9999...999|wrong digits|"
  assert len(p.token_ids) == 30


def test_truncation_policies(tok):
  resp = "0123456789" * 5
  kw = dict(max_prompt_tokens=40)
  assert builder(tok, **kw).fap("12+45=", resp, "digit 1 wrong").text == (
      "12+45=01234567...23456789|digit 1 wrong|")
  assert builder(tok, truncation="left", **kw).fap(
      "12+45=", resp, "digit 1 wrong").text == "12+45=...4567890123456789|digit 1 wrong|"
  assert builder(tok, truncation="right", **kw).fap(
      "12+45=", resp, "digit 1 wrong").text == "12+45=0123456789012345...|digit 1 wrong|"
  with pytest.raises(T.PromptTooLongError):
    builder(tok, truncation="error", **kw).fap("12+45=", resp, "digit 1 wrong")
  # Feedback is cut (from its end) only once the response is gone.
  p = builder(tok, **kw).fap("12+45=", resp, "x" * 60)
  assert p.text.startswith("12+45=...|xxx") and p.text.endswith("...|")


def test_problem_is_never_cut(tok):
  with pytest.raises(T.PromptTooLongError):
    builder(tok, max_prompt_tokens=10).fap("9" * 12 + "=", "1", "f")
  with pytest.raises(T.PromptTooLongError):
    builder(tok, max_prompt_tokens=10).plain("9" * 12 + "=")
  with pytest.raises(T.PromptTooLongError):
    builder(tok, max_prompt_tokens=10).fcp("9" * 12 + "=", "good")


@pytest.mark.parametrize("use_chat", [False, True])
@pytest.mark.parametrize("style", ["compact", "verbose"])
@pytest.mark.parametrize("truncation", ["middle", "left", "right"])
def test_every_template_round_trips_within_budget(tok, chat_tok, use_chat, style,
                                                  truncation):
  t = chat_tok if use_chat else tok
  rng = random.Random(f"{use_chat}{style}{truncation}")
  alphabet = "0123456789abcdef +-=|\n"
  rand = lambda lo, hi: "".join(rng.choice(alphabet) for _ in range(rng.randint(lo, hi)))
  overhead = 400 if style == "verbose" else 30
  for _ in range(25):
    budget = overhead + rng.randint(10, 120)
    b = builder(t, style=style, truncation=truncation, max_prompt_tokens=budget)
    q = rand(1, 10) + "="
    prompts = [b.plain(q), b.fap(q, rand(0, 200), rand(0, 200)),
               b.fcp(q, rand(0, 200)),
               b.aggregated(q, [T.Attempt(rand(0, 80), rand(0, 80), rng.random())
                                for _ in range(rng.randint(0, 6))])]
    for p in prompts:
      assert len(p.token_ids) <= budget
      # Lossless round trip: ids decode to exactly the rendered text.
      rendered = T.render_text(t, p.text)
      assert t.decode(p.token_ids) == rendered
      assert t.encode(rendered, add_special_tokens=False) == p.token_ids
      assert q in p.text  # the problem is always there, uncut


def test_bad_config_values(tok):
  with pytest.raises(ValueError):
    builder(tok, style="nope")
  with pytest.raises(ValueError):
    builder(tok, truncation="nope")


@pytest.mark.parametrize("use_chat", [False, True])
@pytest.mark.parametrize("style", ["compact", "verbose"])
def test_longest_tokens_is_the_length_of_the_longest_pieces(tok, chat_tok, use_chat, style):
  """The budget bound of each prompt kind (character tokenizer: exact) equals the
  rendered prompt of pieces that long, and a budget of that size cuts nothing."""
  t = chat_tok if use_chat else tok
  q, o, f = "7" * 13 + "=", "8" * 21, "x" * 37
  need = {k: builder(t, style=style).longest_tokens(k, prompt_chars=len(q), response_chars=len(o),
                                                     feedback_chars=len(f))
          for k in ("fap", "aggregated", "fcp")}
  b = builder(t, style=style, max_prompt_tokens=max(need.values()))
  built = {"fap": b.fap(q, o, f), "fcp": b.fcp(q, f),
           "aggregated": b.aggregated(q, [T.Attempt(o, f, -0.333333)])}
  for kind, p in built.items():
    assert not p.truncated
    assert len(p.token_ids) == need[kind], kind
  # one token less and the longest FAP is cut
  short = builder(t, style=style, max_prompt_tokens=need["fap"] - 1)
  assert short.fap(q, o, f).truncated
  with pytest.raises(ValueError, match="prompt kind"):
    b.longest_tokens("nope", prompt_chars=1, response_chars=1, feedback_chars=1)
