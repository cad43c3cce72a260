"""Reliability probes of the data pipeline (issue 14): each test is one thing a
hostile or unlucky user tried that used to give a wrong result without an error.
See docs/reliability.md for the table of probes."""

import json
import logging

import pytest

from fbos_jax import data
from fbos_jax import tasks
from fbos_jax.verifiers import base
from fbos_jax.verifiers import Verdict


def jsonl_config(path, **kw):
  cfg = data.default_data_config()
  cfg.update(dict(source="jsonl", path=str(path), verifier="math"))
  cfg.update(kw)
  return cfg


def write_records(path, records):
  with open(path, "w") as f:
    for r in records:
      f.write(json.dumps(r) + "\n")
  return str(path)


def all_examples(cfg, **kw):
  cfg = cfg.copy_and_resolve_references()
  cfg.update(dict(num_epochs=1, shuffle=False, drop_remainder=False))
  it = data.make_prompt_iterator(cfg, batch_size=7, process_index=0,
                                 process_count=1, **kw)
  return [ex for batch in it for ex in batch]


# ------------------------------------------------- item 1: held-out eval split


def test_file_eval_split_is_disjoint_from_training_and_deterministic(tmp_path):
  recs = [{"id": f"r{i}", "prompt": f"q{i}", "answer": str(i)} for i in range(400)]
  cfg = jsonl_config(write_records(tmp_path / "d.jsonl", recs))
  train = [e["id"] for e in all_examples(cfg)]
  cfg.split = "eval"
  evals = [e["id"] for e in all_examples(cfg)]
  assert evals, "the eval split of a file must not be empty"
  assert not set(train) & set(evals)  # was: the eval split WAS the training file
  assert sorted(train + evals) == sorted(r["id"] for r in recs)
  assert 0.02 * 400 <= len(evals) <= 0.10 * 400  # eval_fraction 0.05 by default
  # The split is by record id, not by position: reversing the file keeps it.
  write_records(tmp_path / "rev.jsonl", recs[::-1])
  cfg.path = str(tmp_path / "rev.jsonl")
  assert sorted(e["id"] for e in all_examples(cfg)) == sorted(evals)
  assert "0.05" in data.describe_eval_source(cfg)


def test_file_eval_split_without_ids_keeps_duplicate_prompts_on_one_side(tmp_path):
  recs = [{"prompt": f"q{i % 150}", "answer": str(i % 150)} for i in range(300)]
  cfg = jsonl_config(write_records(tmp_path / "d.jsonl", recs), eval_fraction=0.1)
  train = {e["prompt"] for e in all_examples(cfg)}
  cfg.split = "eval"
  evals = {e["prompt"] for e in all_examples(cfg)}
  assert evals and not train & evals


def test_eval_path_is_used_and_its_prompts_leave_the_training_stream(tmp_path):
  recs = [{"id": f"r{i}", "prompt": f"q{i}", "answer": str(i)} for i in range(40)]
  train_path = write_records(tmp_path / "train.jsonl", recs)
  eval_recs = [{"id": f"e{i}", "prompt": f"q{i}", "answer": str(i)} for i in range(5)]
  eval_path = write_records(tmp_path / "eval.jsonl", eval_recs)
  cfg = jsonl_config(train_path, eval_path=eval_path)
  train = all_examples(cfg)
  assert {e["prompt"] for e in train} == {f"q{i}" for i in range(5, 40)}
  cfg.split = "eval"
  assert [e["id"] for e in all_examples(cfg)] == [f"e{i}" for i in range(5)]
  assert "eval.jsonl" in data.describe_eval_source(cfg)


def test_eval_split_of_a_file_without_a_held_out_set_is_refused(tmp_path):
  path = write_records(tmp_path / "d.jsonl", [{"prompt": "q", "answer": "1"}] * 3)
  cfg = jsonl_config(path, eval_fraction=0.0, split="eval")
  with pytest.raises(ValueError, match="data.eval_fraction"):
    all_examples(cfg)
  cfg.split = "train"
  assert len(all_examples(cfg)) == 3  # no held-out set: training sees everything
  assert "no held-out" in data.describe_eval_source(cfg)


def test_procedural_eval_description():
  cfg = data.default_data_config()
  assert "disjoint" in data.describe_eval_source(cfg)


# ----------------------------------------- item 2: records without an answer


def test_record_without_answer_is_refused_for_math(tmp_path):
  path = write_records(tmp_path / "d.jsonl", [
      {"prompt": "1+1", "answer": "2"}, {"prompt": "2+2"},
      {"prompt": "3+3", "answer": None}, {"prompt": "4+4", "answer": "8"}])
  with pytest.raises(data.MalformedRecordError, match=r"d.jsonl:2: .*'answer'.*'math'"):
    all_examples(jsonl_config(path, eval_fraction=0.0))
  got = all_examples(jsonl_config(path, eval_fraction=0.0, on_malformed="skip"))
  assert [e["prompt"] for e in got] == ["1+1", "4+4"]


def test_required_fields_follow_the_verifier(tmp_path):
  path = write_records(tmp_path / "d.jsonl", [{"prompt": "write code"}])
  with pytest.raises(data.MalformedRecordError, match=r"d.jsonl:1: .*'tests'.*'code'"):
    all_examples(jsonl_config(path, eval_fraction=0.0, verifier="code"))
  # IFEval needs no reference answer: the record is fine.
  ok = all_examples(jsonl_config(path, eval_fraction=0.0, verifier="ifeval"))
  assert [e["prompt"] for e in ok] == ["write code"]


# -------------------------------------------- item 3: which verifier runs

CALLS = []


def recording_verifier(example, response):
  CALLS.append((example["id"], response))
  return Verdict(0.25, "custom verifier")


def test_configured_verifier_wins_for_procedural_data():
  cfg = data.default_data_config()
  cfg.verifier = f"{__name__}:recording_verifier"
  batch = next(data.make_prompt_iterator(cfg, batch_size=3, process_index=0,
                                         process_count=1))
  verify = base.make_verifier(cfg)
  CALLS.clear()
  verdicts = [verify(ex, "x") for ex in batch]
  assert [v.reward for v in verdicts] == [0.25] * 3
  assert [c[0] for c in CALLS] == [ex["id"] for ex in batch]
  # Also for an example that still names "procedural" itself.
  CALLS.clear()
  assert verify(tasks.make_example("arithmetic", 0), "x").reward == 0.25
  assert len(CALLS) == 1


def test_verifier_column_conflicting_with_the_config_is_reported(tmp_path):
  path = write_records(tmp_path / "d.jsonl", [
      {"prompt": "p1", "answer": "1", "verifier": "math"},
      {"prompt": "p2", "answer": "2", "verifier": "ifeval"}])
  with pytest.raises(data.VerifierConflictError,
                     match=r"d.jsonl:2: .*'ifeval'.*data.verifier='math'"):
    all_examples(jsonl_config(path, eval_fraction=0.0))
  # data.verifier="auto": the column decides, per example.
  got = all_examples(jsonl_config(path, eval_fraction=0.0, verifier="auto"))
  assert [e["verifier"] for e in got] == ["math", "ifeval"]


def test_auto_verifier_needs_a_column_for_files(tmp_path):
  path = write_records(tmp_path / "d.jsonl", [{"prompt": "p1", "answer": "1"}])
  with pytest.raises(data.MalformedRecordError, match=r"d.jsonl:1: .*data.verifier"):
    all_examples(jsonl_config(path, eval_fraction=0.0, verifier="auto"))


# ------------------- weaker points: mismatch names fields, locations logged


def test_iterator_state_mismatch_names_the_fields(tmp_path):
  path = write_records(tmp_path / "d.jsonl",
                       [{"prompt": f"q{i}", "answer": "1"} for i in range(20)])
  cfg = jsonl_config(path)
  it = data.make_prompt_iterator(cfg, batch_size=4, process_index=0, process_count=1)
  next(it)
  other = data.make_prompt_iterator(cfg, batch_size=2, process_index=0,
                                    process_count=1, seed=99)
  with pytest.raises(ValueError) as e:
    other.set_state(it.get_state())
  msg = str(e.value)
  assert "shuffle_seed: saved 0, now 99" in msg
  assert "batch_size: saved 4, now 2" in msg


def test_over_long_error_names_file_and_line(tmp_path):
  path = write_records(tmp_path / "d.jsonl", [
      {"id": "a", "prompt": "xx", "answer": "1"},
      {"id": "b", "prompt": "x" * 50, "answer": "1"}])
  cfg = jsonl_config(path, eval_fraction=0.0, max_prompt_chars=10, over_long="error")
  with pytest.raises(ValueError, match=r"d.jsonl:2 \(id 'b'\).*data.max_prompt_chars=10"):
    all_examples(cfg)


def test_skipped_and_filtered_records_are_logged_with_locations(tmp_path, caplog):
  path = tmp_path / "d.jsonl"
  lines = [json.dumps({"prompt": f"q{i}", "answer": "1"}) for i in range(1, 11)]
  lines[3] = '{"prompt": "broken",'  # line 4
  lines[6] = json.dumps({"prompt": "y" * 40, "answer": "1"})  # line 7: over-long
  path.write_text("\n".join(lines) + "\n")
  cfg = jsonl_config(path, eval_fraction=0.0, on_malformed="skip",
                     max_prompt_chars=10)
  with caplog.at_level(logging.WARNING):
    got = all_examples(cfg)
  assert len(got) == 8
  text = "\n".join(r.getMessage() for r in caplog.records)
  assert "skipped 1 malformed record" in text and "d.jsonl:4" in text
  assert "over-long" in text and "d.jsonl:7" in text
  assert data.locate(got[0]).startswith(f"{path}:1")
