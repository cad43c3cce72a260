"""Export a run's checkpoint as a Hugging Face model directory, and check it.

``export_run`` writes the safetensors, ``config.json`` (keys we do not own, such
as ``max_position_embeddings`` and the eos/bos ids, kept from the source
checkpoint's ``config.json`` when the run came from one), the tokenizer files
and the source's ``generation_config.json``: a directory vLLM, SGLang and
``transformers.AutoModelForCausalLM`` load as is. ``check_greedy`` reloads it
with transformers and compares greedy generations with our sampler's.
"""

from __future__ import annotations

import os
import shutil

import jax

from fbos_jax import sampling
from fbos_jax import tokenizer as tok_lib
from fbos_jax.model import hf
from fbos_jax.rl import rollout
from fbos_jax.rl.run import with_checkpoint_model
from fbos_jax.rl.trainer import RLTrainer

GENERATION_CONFIG = "generation_config.json"


def export_run(config, workdir: str, out: str, *, step: int = -1, dtype: str = "",
               init_from_hf: str = "") -> tuple[list[str], int]:
  """Exports checkpoint ``step`` (-1 = latest) of ``workdir`` to ``out``.

  ``init_from_hf`` (or ``config.model.hf_path``): the source HF directory; the
  model fields are set from its ``config.json`` (``apply_hf_config``) and its
  ``config.json`` / ``generation_config.json`` keys are kept in the export.

  Returns:
    (files written, the checkpoint's step).
  """
  src = init_from_hf or config.model.get("hf_path", "")
  config = with_checkpoint_model(config, init_from_hf)
  tok_dir = tok_lib.resolve_tokenizer_path(config, workdir)  # a clear error before any work
  trainer = RLTrainer(config, workdir, log_metrics=False)
  try:
    state = trainer.restore_train_state(None if step < 0 else step)
    paths = hf.save_hf_checkpoint(state.params, trainer.model_cfg, out, dtype=dtype or None,
                                  base_config=hf.read_hf_config(src) if src else None)
    if jax.process_index() == 0:
      written = tok_lib.copy_tokenizer_files(tok_dir, out)
      if not written:  # so the directory serves as is
        written = list(trainer.env.tokenizer.save_pretrained(out))
      paths += written
      if src and os.path.isfile(os.path.join(src, GENERATION_CONFIG)):
        shutil.copyfile(os.path.join(src, GENERATION_CONFIG), os.path.join(out, GENERATION_CONFIG))
        paths.append(os.path.join(out, GENERATION_CONFIG))
    return paths, int(state.step)
  finally:
    trainer.close()


def check_greedy(config, workdir: str, out: str, num_prompts: int, *,
                 init_from_hf: str = "") -> list[bool]:
  """Greedy continuations of ``num_prompts`` held-out prompts: our sampler on the
  checkpoint vs transformers ``generate`` on the export, both in float32, stopped
  at the run's stop ids. Returns one equal/not flag per prompt (prints both)."""
  import torch
  import transformers
  config = with_checkpoint_model(config, init_from_hf)
  with config.unlocked():
    config.model.compute_dtype = "float32"
  trainer = RLTrainer(config, workdir, log_metrics=False)
  try:
    params = jax.tree.map(lambda a: a.astype("float32"), trainer.restore_train_state().params)
    examples = trainer.env.eval_examples()[:num_prompts]
    prompts = [rollout.prompt_ids(trainer.ctx, ex) for ex in examples]
    r = int(config.sampling.max_new_tokens)
    stops = trainer.env.stop_ids
    ours = sampling.sample(params, trainer.model_cfg, prompts, key=jax.random.key(0),
                           max_new_tokens=r, temperature=0.0, stop_token_ids=stops,
                           pad_id=trainer.env.pad_id)
    model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    flags_ = []
    for i, p in enumerate(prompts):
      with torch.no_grad():
        hf_out = model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                                max_new_tokens=r, do_sample=False, eos_token_id=list(stops),
                                pad_token_id=trainer.env.pad_id)
      theirs = hf_out[0, len(p):].tolist()
      mine = ours.tokens[i, :int(ours.lengths[i])].tolist()
      flags_.append(mine == theirs)
      print(f"prompt {i}: {'equal' if mine == theirs else 'DIFFERENT'} ({len(mine)} tokens)\n"
            f"  ours: {trainer.env.tokenizer.decode(mine)!r}\n"
            f"  HF:   {trainer.env.tokenizer.decode(theirs)!r}")
    return flags_
  finally:
    trainer.close()
