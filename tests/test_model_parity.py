"""Logit parity of our Qwen2/Qwen3 decoder against transformers, in float32.

Random tiny HF models are built with torch (nothing is downloaded), every norm
weight and bias is perturbed away from its init so a norm / bias mistake cannot
hide, the models are saved and imported through ``load_hf_params``.
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from fbos_jax.model import forward, init_cache, load_hf_params
from fbos_jax.model import logits as model_logits
from fbos_jax.model import apply as model_apply

TINY = dict(vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2)


def build_hf_model(model_type: str, seed: int = 0, **overrides):
  """A random tiny Qwen2/Qwen3ForCausalLM (float32) with every weight perturbed."""
  torch.manual_seed(seed)
  if model_type == "qwen3":  # tied embeddings, head_dim != hidden/heads, q/k norms
    kw = dict(TINY, head_dim=32, tie_word_embeddings=True, rope_theta=5000.0, rms_norm_eps=1e-5)
    kw.update(overrides)
    model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**kw))
  else:  # untied embeddings, q/k/v biases
    kw = dict(TINY, tie_word_embeddings=False, rope_theta=20000.0, rms_norm_eps=1e-6)
    kw.update(overrides)
    model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**kw))
  gen = torch.Generator().manual_seed(seed + 1)
  with torch.no_grad():
    for name, p in model.named_parameters():
      noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
      if "norm" in name:
        p.copy_(1.0 + 0.3 * noise)  # RMSNorm / q_norm / k_norm weights away from 1
      elif name.endswith("bias"):
        p.copy_(0.2 * noise)
      else:
        p.copy_(0.1 * noise)
  return model.float().eval()


def left_padded_batch(vocab: int, lengths, seed: int = 0):
  rng = np.random.default_rng(seed)
  t = max(lengths)
  tokens = rng.integers(0, vocab, size=(len(lengths), t)).astype(np.int32)
  mask = np.zeros((len(lengths), t), np.int32)
  for i, n in enumerate(lengths):
    mask[i, t - n:] = 1
  tokens = np.where(mask == 1, tokens, 0)  # pad id 0 (any id works: masked out)
  return tokens, mask


def hf_logits(model, tokens, mask):
  pos = np.maximum(np.cumsum(mask, -1) - 1, 0)
  with torch.no_grad():
    out = model(input_ids=torch.tensor(tokens, dtype=torch.long),
                attention_mask=torch.tensor(mask, dtype=torch.long),
                position_ids=torch.tensor(pos, dtype=torch.long))
  return out.logits.float().numpy()


# A left-padded prompt batch of unequal lengths plus a continuation: the parity test
# scores prompt + continuation in one forward, the KV-cache test prefills the prompt
# and decodes the continuation token by token against the same reference.
PROMPT_LENGTHS = [7, 2, 5, 4]
N_NEW = 4


@pytest.fixture(scope="module", params=["qwen3", "qwen2"])
def case(request, tmp_path_factory):
  model_type = request.param
  model = build_hf_model(model_type)
  path = tmp_path_factory.mktemp(f"hf_{model_type}")
  model.save_pretrained(path)
  params, cfg = load_hf_params(path)
  prompt, pmask = left_padded_batch(cfg.vocab_size, PROMPT_LENGTHS, seed=1)
  cont = np.random.default_rng(2).integers(0, cfg.vocab_size, (len(PROMPT_LENGTHS), N_NEW))
  seq = np.concatenate([prompt, cont.astype(np.int32)], axis=1)
  smask = np.concatenate([pmask, np.ones_like(cont, dtype=np.int32)], axis=1)
  ours = np.asarray(jax.jit(model_apply, static_argnums=3)(params, seq, smask, cfg))
  return dict(model_type=model_type, model=model, path=path, params=params, cfg=cfg,
              prompt=prompt, pmask=pmask, seq=seq, smask=smask, ours=ours)


def test_config_matches_hf(case):
  model_type, c, cfg = case["model_type"], case["model"].config, case["cfg"]
  assert cfg.model_type == model_type
  assert cfg.tie_embeddings == (model_type == "qwen3")
  assert ("unembed" in case["params"]) == (model_type == "qwen2")
  assert (cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size, cfg.num_layers) == (
      c.vocab_size, c.hidden_size, c.intermediate_size, c.num_hidden_layers)
  assert (cfg.num_heads, cfg.num_kv_heads) == (c.num_attention_heads, c.num_key_value_heads)
  assert cfg.head_dim == (32 if model_type == "qwen3" else 16)
  assert cfg.rope_theta == (5000.0 if model_type == "qwen3" else 20000.0)
  assert cfg.rms_norm_eps == c.rms_norm_eps
  assert cfg.param_dtype == "float32"


def test_logit_parity_left_padded(case):
  """Our logits == transformers' (max abs < 1e-4) at every non-pad position."""
  model, seq, smask, ours = case["model"], case["seq"], case["smask"], case["ours"]
  ref = hf_logits(model, seq, smask)
  real = smask.astype(bool)
  assert ref[real].std() > 0.3, "logits too small for the test to mean anything"
  err = np.abs(ours - ref)[real].max()
  assert err < 1e-4, f"{case['model_type']}: max abs logit error {err}"
  # Left padding must not change a row's logits: the shortest row alone, unpadded.
  n = int(smask[1].sum())
  alone = hf_logits(model, seq[1:2, -n:], smask[1:2, -n:])
  np.testing.assert_allclose(ours[1, -n:], alone[0], atol=1e-4, rtol=0)


def test_kv_cache_prefill_decode_matches_full_forward(case):
  """Prefill + token-by-token decode via the KV cache == one full forward (causal)."""
  params, cfg, prompt, pmask = case["params"], case["cfg"], case["prompt"], case["pmask"]
  seq, full = case["seq"], case["ours"]
  b, t = prompt.shape

  @functools.partial(jax.jit, static_argnums=5)
  def step(params, tok, pos, cache, kv_mask, cfg, idx):
    hidden, cache = forward(params, tok, jnp.ones_like(tok), cfg, positions=pos, cache=cache,
                            cache_index=idx, kv_mask=kv_mask)
    return model_logits(params, hidden, cfg), cache

  cache = init_cache(cfg, b, t + N_NEW)
  kv_mask = np.concatenate([pmask, np.zeros((b, N_NEW), np.int32)], axis=1)
  pos = np.maximum(np.cumsum(pmask, -1) - 1, 0).astype(np.int32)
  logits, cache = step(params, prompt, pos, cache, kv_mask, cfg, jnp.int32(0))
  real = pmask.astype(bool)
  np.testing.assert_allclose(np.asarray(logits)[real], full[:, :t][real], atol=1e-5, rtol=0)

  next_pos = pmask.sum(-1).astype(np.int32)
  for j in range(N_NEW):
    kv_mask[:, t + j] = 1
    logits, cache = step(params, seq[:, t + j:t + j + 1], (next_pos + j)[:, None], cache,
                         kv_mask, cfg, jnp.int32(t + j))
    np.testing.assert_allclose(np.asarray(logits)[:, 0], full[:, t + j], atol=1e-5, rtol=0,
                               err_msg=f"{case['model_type']}: decode step {j}")
