"""Export a run's checkpoint as a Hugging Face model directory, and check it.

``export_run`` writes the safetensors, ``config.json`` (keys we do not own, such
as ``max_position_embeddings`` and the eos/bos ids, kept from the source
checkpoint's ``config.json`` when the run came from one), the tokenizer files
and the source's ``generation_config.json``: a directory vLLM, SGLang and
``transformers.AutoModelForCausalLM`` load as is. ``check_greedy`` reloads it
with transformers and compares greedy generations with our sampler's. Both
read only the params of the checkpoint (``fbos_jax.rl.state.restore_params``).
"""

from __future__ import annotations

import dataclasses
import os
import shutil

import jax

from fbos_jax import data as data_lib
from fbos_jax import tokenizer as tok_lib
from fbos_jax.model import hf
from fbos_jax.rl import config as config_lib
from fbos_jax.rl import state as state_lib
from fbos_jax.rl.context import RolloutContext
from fbos_jax.rl.state import restore_params

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
  config = config_lib.with_checkpoint_model(config, init_from_hf)
  tok_dir = tok_lib.resolve_tokenizer_path(config, workdir)  # a clear error before any work
  params, restored = restore_params(config, workdir, step=step)
  model_cfg = config_lib.build_parts(config).model
  paths = hf.save_hf_checkpoint(params, model_cfg, out, dtype=dtype or None,
                                base_config=hf.read_hf_config(src) if src else None)
  if jax.process_index() == 0:
    written = tok_lib.copy_tokenizer_files(tok_dir, out)
    if not written:  # so the directory serves as is
      written = list(tok_lib.load_tokenizer(tok_dir).save_pretrained(out))
    paths += written
    if src and os.path.isfile(os.path.join(src, GENERATION_CONFIG)):
      shutil.copyfile(os.path.join(src, GENERATION_CONFIG), os.path.join(out, GENERATION_CONFIG))
      paths.append(os.path.join(out, GENERATION_CONFIG))
  return paths, restored


def check_greedy(config, workdir: str, out: str, num_prompts: int, *,
                 init_from_hf: str = "") -> list[bool]:
  """Greedy continuations of ``num_prompts`` held-out prompts: our sampler on the
  checkpoint vs transformers ``generate`` on the export, both in float32, stopped
  at the run's stop ids. Returns one equal/not flag per prompt (prints both)."""
  import torch
  import transformers
  config = config_lib.with_checkpoint_model(config, init_from_hf)
  with config.unlocked():
    config.model.compute_dtype = "float32"
  ctx = RolloutContext.build(config, workdir, with_pool=False, check_budget=False)
  params, _ = restore_params(config, workdir)
  params = jax.tree.map(lambda a: a.astype("float32"), params)
  examples = data_lib.held_out_examples(config.data, num_prompts, tokenizer=ctx.tokenizer,
                                        templates_config=config.templates)[:num_prompts]
  prompts = [ctx.prompt_ids(ex) for ex in examples]
  greedy = dataclasses.replace(ctx.parts.sampling.eval, temperature=0.0)
  ours = ctx.sample(params, prompts, 1, state_lib.stream_key(  # greedy: the key is unused
      state_lib.root_rng(ctx.parts.seed), "eval", 0), greedy)
  model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
  flags_ = []
  for i, p in enumerate(prompts):
    with torch.no_grad():
      hf_out = model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                              max_new_tokens=greedy.max_new_tokens, do_sample=False,
                              eos_token_id=list(ctx.stop_ids), pad_token_id=ctx.pad_id)
    theirs = hf_out[0, len(p):].tolist()
    mine = ours.tokens[i, :int(ours.lengths[i])].tolist()
    flags_.append(mine == theirs)
    print(f"prompt {i}: {'equal' if mine == theirs else 'DIFFERENT'} ({len(mine)} tokens)\n"
          f"  ours: {ctx.tokenizer.decode(mine)!r}\n"
          f"  HF:   {ctx.tokenizer.decode(theirs)!r}")
  return flags_
