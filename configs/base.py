"""Shared config pieces, as plain data (big_vision style).

Rule for algorithm files (grpo.py, gfpo.py, golf.py, fbos.py, fcp.py, sft.py):
an algorithm file starts from :func:`get_config_for` and sets ONLY the fields
that make its algorithm: which rounds run (``rl.round2``), how groups merge
(``rl.fap_*``, ``rl.epa_*``), the advantage estimator, GFPO masks, the loss
terms (``rl.terms``) and the prompt form (``rl.prompt``). Run sizes (model,
mesh, lengths, batch sizes, learning rates, steps) belong to the variant table
:data:`VARIANTS` below, so every algorithm runs the same model at the same size.
Flavors (``:tiny,decoupled``) are named changes on top, listed per file.

  python launch/train.py --config=configs/fbos.py:tiny --workdir=/tmp/fbos_tiny
  python launch/train.py --config=configs/fbos.py:qwen_8b --dry_run --topology=v5p:2x4x4

Every field can be overridden, e.g. ``--config.rl.group_size=16``. The
defaults the library owns are taken from it, so a default has one home: ``data``,
``templates``, the sharding rules, ``engine``, and the typed parts' sections
(``rl``, ``optim``, the sampler's ``sampling`` fields, ``model``'s attention
fields: ``fbos_jax/rl/config.py:section_defaults``, where each field is
explained). This file sets over them only the run sizes the library has no
default for and :data:`CHANGED_DEFAULTS` (each with its reason);
``tests/test_config_defaults.py`` fails on any other difference.
``fbos_jax/rl/config.py`` validates a config and turns it into the typed parts.
"""

import ml_collections as mlc

from fbos_jax import data as data_lib
from fbos_jax.engine import types as engine_types
from fbos_jax.rl import config as config_lib
from fbos_jax import sharding as sharding_lib
from fbos_jax import templates as templates_lib

# ------------------------------------------------------------------ the variant table
# Per variant: the model (field names of fbos_jax/model/qwen.py:ModelConfig; HF
# checkpoints overwrite the architecture from config.json with --init_from_hf;
# model.param_dtype is the trained master copy, float32 in every variant, and the
# forward pass runs in model.compute_dtype: a bfloat16 master rounds away most
# Adam steps at lr 1e-6, fbos_jax/rl/state.py:ComputeCopy),
# the mesh (sizes of dcn x data x fsdp x tensor; -1 takes the remaining devices)
# and the run sizes (dotted field -> value, applied over the defaults below).

_QWEN3_8B = dict(model_type="qwen3", vocab_size=151_936, hidden_size=4096,
                 intermediate_size=12_288, num_layers=36, num_heads=32, num_kv_heads=8,
                 head_dim=128, rope_theta=1_000_000.0, rms_norm_eps=1e-6, tie_embeddings=False,
                 param_dtype="float32", compute_dtype="bfloat16", remat="full")
_LARGE_RUN = {
    "data.source": "jsonl", "data.verifier": "math", "templates.style": "verbose",
    "templates.max_prompt_tokens": 4096, "optim.learning_rate": 1e-6,
    # one update program per pair of prompt buckets, not one per row bucket too: the
    # run compiles every program before step 1 (fbos_jax/compile_set.py), and each
    # is a whole-model program (--dry_run prints the count and the compile time)
    "rl.fixed_row_buckets": True,
}

_TINY_MODEL = dict(model_type="qwen3", vocab_size=128, hidden_size=128, intermediate_size=384,
                   num_layers=3, num_heads=4, num_kv_heads=2, head_dim=32,
                   rope_theta=10_000.0, rms_norm_eps=1e-6, tie_embeddings=True,
                   param_dtype="float32", compute_dtype="float32", remat="none")

_TINY_RUN = {
    # "sort 4701=" -> "0147"; feedback names misplaced/missing items. Lists
    # of 4-10 digits: one shared skill with a held-out split of distinct
    # problems at every length. After the warm start the greedy answer is
    # right on 56-73% of them but a T=1 sample only on 26-33%, so most
    # groups have mixed rewards and RL has a policy to sharpen.
    "data.source": "procedural", "data.task": "sort",
    "data.difficulty": 4, "data.max_difficulty": 10,
    # the compact feedback wording ("extra: 9(9) 10(9); missing 2"): the prose
    # one spends ~47 characters per extra item, and whole FAPs in prose need
    # 416 tokens at the median step (FAPs of the warm-started model), which
    # would triple the update's cost (ECC at 512 prompt tokens)
    "data.verifier": "fbos_jax.verifiers.procedural:CompactProceduralVerifier",
    "sampling.max_new_tokens": 12,
    "sampling.prompt_buckets": (16, 32),
    # The FAP budget holds the longest FAP the task can produce, so none is cut
    # (fbos_jax/rl/fap_budget.py:longest_fap_tokens; tests/test_fbos_evidence.py):
    #   problem "sort " + 10 digits + "="                          16 chars
    #   response: 12 tokens of at most 5 chars (the token "</EF>")  60 chars
    #   compact feedback on a 60-char response (tasks.py bound)    572 chars
    #   FAP "{prompt}{response}|{feedback}|": 16 + 60 + 572 + 2 =  650 tokens
    # (character tokenizer: one token per character). With one-character
    # tokens the same sum is 16 + 12 + 140 + 2 = 170. Real FAPs after the warm
    # start: median ~41, 99th percentile ~118 tokens. The buckets keep the common
    # step at 128 (a FAP round samples and trains at its longest FAP's bucket);
    # 256 and 384 serve GOLF's aggregated prompts (all failed attempts of q).
    "sampling.fap_prompt_buckets": (128, 176, 256, 384, 656),
    "templates.max_prompt_tokens": 656,
    "sampling.batch_buckets": (8, 16, 64, 128),  # prompts per sampler call: few programs
    "verifier.workers": 2, "verifier.timeout_s": 5.0,
    "rl.prompts_per_step": 16, "rl.group_size": 8, "rl.round2_size": 8,
    "rl.epa_max_per_prompt": 8,
    "rl.fixed_row_buckets": True,  # compiles cost more than padded rows at this size
    # eta = 0 (synchronous, or split: bit for bit the same) on the static sampler;
    # rl.max_staleness > 0 on the continuous engine, whose rollout streams the steps
    # through one engine run (next-step prompts into the slots a step frees):
    # rollout/slot_util 0.89-0.96 on issue 31's command (4 rollout devices, eta 1)
    # where the static sampler, draining every batch, gave 0.59-0.72
    "sampling.engine": "auto",
    # with sampling.engine=continuous: a slot for every row of a round (P*n = P*m =
    # 128), nothing staged, and buckets that pad as the static sampler's do (on a
    # CPU a decode step costs in proportion to rows x positions): rows 16 / 64
    # (round 2 samples only the failed rollouts' FAPs, ~64) / 128 per batch shard,
    # those above the slots per shard cut to them (8 shards: 16; a 4-device rollout
    # mesh: 16 / 32); page tables of
    # 2 pages (round 1) and of the FAP buckets 128, 256 and 656 plus the 12 new
    # tokens (9, 17, 42 pages of 16); prefill chunks of those prompt buckets. 72
    # engine programs (114 with rl.stream_rounds) when written, before the 4 and 8
    # row buckets below (the synchronous engine run's whole compile set is now 82
    # programs), where powers of two give 268 (562), whose loaded kernels pass the
    # CPU's vm.max_map_count
    # (fbos_jax/compile_set.py:MapBudget); with one 128-row bucket and 8x steps
    # elsewhere (43 programs) round 2 took 5x the static sampler's time.
    # In the asynchronous loop (eta 1, the trainer the slower side) a step's rows
    # are fewer than the slots, so what wastes slot-steps is padding: a window at
    # the 32-row bucket with 20 rows on a shard. engine.min_fill runs a window at
    # the largest bucket its rows fill to 90% and lets the rest wait (a CPU step
    # costs in proportion to its rows); 4 and 8 give the tail small buckets.
    # rollout/slot_util on the issue-31 command (4 rollout devices, eta 1, 8 steps):
    # 0.34-0.37 before; 0.68-0.74 with the buckets cut to 32 and refills while the
    # stream is open; 0.90-0.95 with these (134 rollout engine programs, was 68).
    "engine.slots": 128, "engine.staged": 0, "engine.row_buckets": (4, 8, 16, 64, 128),
    "engine.min_fill": 0.9,
    "engine.page_buckets": (2, 9, 17, 42), "engine.prefill_chunk": 656,
    "engine.prefill_buckets": (16, 128, 256, 656), "engine.bucket_growth": 8,  # page copies
    # Adam's step (about lr per coordinate) must stay inside the small region
    # where the policy-gradient loss still falls: 3e-4 already lowered the reward.
    "optim.learning_rate": 1e-4, "optim.schedule": "cosine", "optim.warmup_steps": 5,
    "optim.weight_decay": 0.0,
    "train.steps": 100,  # the T=1 accuracy still climbs at 60 (README, "The tiny run")
    "train.eval_every": 10,
    "train.eval_prompts": 256,  # standard error of one greedy eval about 0.03
    "train.eval_k": 4,  # also pass@1 at temperature 1 (mean of 4) and pass@4
    "train.checkpoint_every": 10,
    "train.warm_start": "sft",
    "sft.steps": 100,  # partial competence: the model sorts short lists, not long ones
    "sft.batch_size": 64, "sft.learning_rate": 2e-3,
    "sft.fap_fraction": 0.25,  # the same warm start serves every algorithm
    # corrections from the model's own failures in the second half (sft.py):
    # one-character corruptions left round 2 fixing ~10% of real FAPs
    "sft.corrections": "self",
}

_TINY_CHAIN_RUN = {
    # "7*8 -9 +4 +3 =" -> "56,47,51,54": four operations, left to right, each result
    # in 0..99 written with two digits. Always four, so result k sits at a fixed
    # distance from operation k (a tiny model learns to find its operands quickly);
    # what it gets wrong is the arithmetic.
    "data.task": "chain", "data.difficulty": 4, "data.max_difficulty": 4,
    # the compact wording: the results as they should start, up to the first wrong
    # one ("12,47,__,__"), the slots in the places of the results they speak of
    "data.verifier": "fbos_jax.verifiers.procedural:CompactProceduralVerifier",
    "data.require_hidden_answer": True,  # refuse at start a feedback that names it
    "sampling.max_new_tokens": 12,  # 4 results of 2 digits, 3 commas, EOS
    "sampling.prompt_buckets": (16,),  # 14 characters
    # the longest FAP (fbos_jax/rl/fap_budget.py:longest_fap_tokens): problem 14 + response
    # 12 x 5 = 60 (the token "</EF>") + feedback 59 (nothing of the response is
    # echoed) + 2 = 135 tokens; 87 with one-character tokens. Real FAPs: ~40. 256 and
    # 384 serve GOLF's aggregated prompts: up to 8 failed attempts of ~30 tokens each.
    "sampling.fap_prompt_buckets": (64, 96, 136, 256, 384),
    "templates.max_prompt_tokens": 384,
    # The problem comes last in a FAP (and in GOLF's aggregated prompt), right before
    # the answer as in q, so the answer's results keep their distance to the
    # operations; the attempt and the feedback come before it.
    "templates.fap": "{response}|{feedback}|{prompt}",
    "templates.aggregated_footer": "{prompt}",
    # The warm start (fbos_jax/rl/sft.py, sft.stages): demonstrations with a quarter
    # of corrections (a task-made failure, fbos_jax/tasks.py:_corrupt_chain, and
    # its feedback -> the solution), until the model finds its operands and gets
    # about two results in three right; then a stage of mostly corrections of its
    # own failures, at a lower learning rate, so it reads the feedback it will get.
    # RL at 1e-5, not the sort task's 1e-4 (issue 33): binary rewards, half the groups
    # all-equal and 128 rollouts a step make the gradient mostly noise, and Adam moves
    # every weight by about the rate whatever the signal; at 1e-4 every arm first fell
    # from greedy 0.41 to ~0.25 and spent its budget climbing back. The check that no
    # arm falls > 0.03 in its first 2,000 rollouts: docs/results/verdict_rule.md.
    "optim.learning_rate": 1e-5,
    "sft.steps": 800,  # the stages' total (validate checks it equals their sum)
    "sft.stages": (
        {"name": "demos", "steps": 700, "learning_rate": 3e-3, "warmup_steps": 20,
         "fap_fraction": 0.25, "corrections": "corrupt"},
        {"name": "own_failures", "steps": 100, "learning_rate": 3e-4, "warmup_steps": 10,
         "fap_fraction": 0.75, "corrections": "self", "self_corrections_from": 0.0,
         "self_samples": 2},
    ),
}

VARIANTS = {
    # A ~0.4M-parameter Qwen3 that trains on a 2-core CPU in minutes; its vocab
    # covers the character tokenizer built by fbos_jax/tokenizer.py.
    "tiny": dict(model=_TINY_MODEL, mesh=dict(dcn=1, data=-1, fsdp=1, tensor=1), run=_TINY_RUN),
    # The regime where feedback should matter (issue 16): the same model and warm
    # start recipe on longer lists, 11-16 digits, so that after the warm start many
    # groups have no correct sample (plain GRPO then learns nothing from them).
    "tiny_hard": dict(
        model=_TINY_MODEL, mesh=dict(dcn=1, data=-1, fsdp=1, tensor=1),
        run=dict(_TINY_RUN, **{
            "data.difficulty": 11, "data.max_difficulty": 16,
            "sampling.max_new_tokens": 18,  # 16 items + EOS, one spare
            # the static sampler also at rl.max_staleness > 0: its FAPs (up to 960 tokens, 62
            # pages) pass tiny's engine page buckets
            "sampling.engine": "static",
            "sampling.prompt_buckets": (32,),
            # the longest FAP (as for tiny): problem 22 + response 18 x 5 = 90 + compact
            # feedback on it 842 + 2 = 956 tokens; 236 with one-character tokens
            "sampling.fap_prompt_buckets": (128, 256, 384, 512, 960),
            "templates.max_prompt_tokens": 960,
        })),
    # Where feedback should pay (issue 24): chained arithmetic with the intermediate
    # results written out ("7*8-9+4=" -> "56,47,51"); the verifier names the first
    # wrong value and its correct value, never the final answer (fbos_jax/tasks.py,
    # family "chain"). Same model; a two-stage warm start whose second stage is
    # mostly corrections of the model's own failures (sft.stages).
    "tiny_chain": dict(model=_TINY_MODEL, mesh=dict(dcn=1, data=-1, fsdp=1, tensor=1),
                       run=dict(_TINY_RUN, **_TINY_CHAIN_RUN)),
    # Qwen/Qwen3-0.6B on a v5e-8 (16 GiB chips): FSDP over the 8 chips.
    "qwen3_0_6b": dict(
        model=dict(model_type="qwen3", vocab_size=151_936, hidden_size=1024,
                   intermediate_size=3072, num_layers=28, num_heads=16, num_kv_heads=8,
                   head_dim=128, rope_theta=1_000_000.0, rms_norm_eps=1e-6,
                   tie_embeddings=True, param_dtype="float32", compute_dtype="bfloat16",
                   remat="dots_no_batch"),
        mesh=dict(dcn=1, data=1, fsdp=-1, tensor=1),
        run=dict(_LARGE_RUN, **{
            # the fewest micro-batches at which the update fits on 8 v5e chips (16 GiB):
            # --dry_run --topology=v5e:2x4 --fit_micro_batches (32: 16.0 GiB, too much)
            "rl.micro_batches": 64,
            # 16 prompts per sampler call: round 1 (x 8 samples, 2,560 cache slots) at
            # 32 prompts or more needs more than a v5e's HBM (--dry_run --topology=v5e:2x4)
            "sampling.batch_buckets": (4, 8, 16),
            # the continuous engine at its default knobs (64 slots + 64 staged): its largest
            # program, round 2's prefill into a 7.47 GiB page pool, peaks at 8.27 GiB (52%)
            # (--dry_run --topology=v5e:2x4)
            "sampling.engine": "continuous",
            "engine.bucket_growth": 0,  # one bucket per engine dimension (as qwen_8b)
        })),
    # Qwen/Qwen3-8B (untied embeddings, 8,190,735,360 parameters) on a v5p pod
    # slice: FSDP over the slice, 4-way tensor parallel inside a host.
    "qwen_8b": dict(
        model=_QWEN3_8B, mesh=dict(dcn=1, data=1, fsdp=-1, tensor=4),
        run=dict(_LARGE_RUN, **{
            "rl.micro_batches": 2,  # the fewest that fit on v5p:2x4x4: 75.2 GiB (1: does not compile; --fit_micro_batches)
            # the engine with a slot for every row of a round (P*n = P*m = 512), so nothing
            # is staged; round 2's prefill (10.1 GiB pool) peaks at 15.1 GiB (16%)
            # (--dry_run --topology=v5p:2x4x4; roofline: step >= 25.1 s vs 27.9 s static)
            "sampling.engine": "continuous",
            "engine.slots": 512, "engine.staged": 0,
            # one bucket per engine dimension (rows, page-table width, prefill chunk):
            # a memory-bound TPU decode step costs about the same at any row count and
            # the Pallas kernel reads only the pages in use, so padding is nearly free,
            # and the compile set is a few dozen programs, not hundreds (--dry_run)
            "engine.bucket_growth": 0,
            # split for the asynchronous loop (rl.rollout_devices=16 of 32: 4 whole hosts
            # per side): the rollout mesh's axes (the engine needs its batch shards to
            # divide over the side's 4 hosts)
            "rl.rollout_mesh.tensor": 2,
            # round 2 samples P*m = 512 FAP rows; all at once they need more than a
            # v5p's HBM, so the sampler takes them in chunks of 256 prompts
            "sampling.batch_buckets": (8, 16, 32, 64, 128, 256),
        })),
    # The same with reasoning-length responses: 1,024-token prompts, 8,192 new
    # tokens; a FAP holds q + a whole response + feedback, so its budget is q + R + 1k.
    "qwen_8b_long": dict(
        model=_QWEN3_8B, mesh=dict(dcn=1, data=1, fsdp=-1, tensor=4),
        run=dict(_LARGE_RUN, **{
            "sampling.max_new_tokens": 8192,
            "sampling.prompt_buckets": (256, 512, 1024),
            "sampling.fap_prompt_buckets": (2048, 4096, 8192, 10_240),
            "templates.max_prompt_tokens": 10_240,
            "sampling.batch_buckets": (8, 16, 32, 64, 128),
            # the update on real tokens (fbos_jax/rl/packing.py): sequences end to end in
            # rows of the padded row length, micro-batches of 147,456 tokens per batch
            # shard (the padded run's 8 micro-batches: 16 EPA / 8 ECC rows), each batch at
            # the most micro-batches its rows fill (rl.fixed_row_buckets: 12 update
            # programs) and the empty ones skipped. Peak 72.5 GiB (76%); modelled update
            # 48.6 s packed vs 95.6 s padded, step >= 109 s vs 156 s, under the assumed
            # response lengths (--dry_run --topology=v5p:2x4x4)
            "rl.micro_batch_tokens": 147_456, "rl.micro_batches": 1,
            # the engine with a slot for every row of a round (P*n = P*m = 512), so nothing
            # is staged; round 2's prefill (40.5 GiB pool of 10,240 + 8,192-token rows) peaks
            # at 48.4 GiB (50%) with the float32 master's state beside it (--dry_run
            # --topology=v5p:2x4x4; roofline: continuous rounds 60.6 s vs 198 s static)
            "sampling.engine": "continuous",
            "engine.slots": 512, "engine.staged": 0,
            # one bucket per engine dimension (rows, page-table width, prefill chunk):
            # a memory-bound TPU decode step costs about the same at any row count and
            # the Pallas kernel reads only the pages in use, so padding is nearly free,
            # and the compile set is a few dozen programs, not hundreds (--dry_run)
            "engine.bucket_growth": 0,
            "rl.rollout_mesh.tensor": 2,  # as qwen_8b's (split: 4 whole hosts per side)
        })),
    # The real-user path at CPU size: a Qwen3 checkpoint directory (the real-shape
    # fixture of fbos_jax/testing/qwen_fixture.py, or any --init_from_hf=DIR: its
    # config.json sets the architecture), its BPE tokenizer and chat template, the
    # arithmetic word problems with math-verify, verbose FAPs, bf16, a short SFT
    # warm start on the gold solutions, 3 FBOS steps.
    "qwen3_smoke": dict(
        model=dict(model_type="qwen3", vocab_size=151_936, hidden_size=256, intermediate_size=768,
                   num_layers=2, num_heads=16, num_kv_heads=8, head_dim=128,
                   rope_theta=1_000_000.0, rms_norm_eps=1e-6, tie_embeddings=True,
                   param_dtype="float32", compute_dtype="bfloat16", remat="none"),
        mesh=dict(dcn=1, data=-1, fsdp=1, tensor=1),
        run={
            "data.source": "jsonl", "data.verifier": "math",
            "data.path": "fbos_jax/datasets/arith_word/train.jsonl",
            "data.eval_path": "fbos_jax/datasets/arith_word/test.jsonl",
            "data.solution_field": "solution",  # worked solutions ending in #### n or \\boxed{n}
            "templates.style": "verbose",
            "templates.system_prompt": "Solve the problem. Put the final answer in \\boxed{}.",
            "templates.max_prompt_tokens": 512,
            "sampling.max_new_tokens": 64,
            "sampling.prompt_buckets": (128,),
            "sampling.fap_prompt_buckets": (256, 512),
            "sampling.batch_buckets": (4, 8, 16),
            "rl.prompts_per_step": 4, "rl.group_size": 4, "rl.round2_size": 4,
            "rl.epa_max_per_prompt": 4,
            "rl.fixed_row_buckets": True,  # a small compile set (fbos_jax/compile_set.py)
            "optim.learning_rate": 1e-5, "optim.warmup_steps": 0,
            "train.steps": 3, "train.eval_every": 3, "train.eval_prompts": 8,
            "train.checkpoint_every": 3,
            "train.warm_start": "sft", "sft.steps": 4, "sft.batch_size": 8,
            "sft.learning_rate": 1e-4, "sft.warmup_steps": 1, "sft.fap_fraction": 0.25,
        }),
    # Qwen3-8B on 8xH100 nodes: tensor parallel inside the node (NVLink), data
    # parallel across nodes (dcn). The continuous engine with the Pallas GPU decode
    # kernel (engine.attention=auto on GPU: fbos_kernels.paged_decode_gpu reads the
    # pages in place; the XLA path would gather every slot's pages into a dense cache
    # per window), a slot for every row of a round as qwen_8b: compiled deviceless for
    # h100:2x8, round 2's prefill peaks at 47.6 GiB (60%) and its window at 35.4 GiB,
    # the update at 51.6 GiB (65%) (--dry_run --topology=h100:2x8; fits at <= 75%).
    "qwen_8b_h100": dict(
        model=_QWEN3_8B, mesh=dict(dcn=-1, data=1, fsdp=1, tensor=8),
        run=dict(_LARGE_RUN, **{
            "sampling.engine": "continuous",
            "engine.slots": 512, "engine.staged": 0,
            "engine.bucket_growth": 0,  # one bucket per engine dimension, as qwen_8b
            "rl.micro_batches": 32,
            # round 2's 512 FAP rows in calls of at most 256 prompts: all 512 at once
            # compiled to 52.7 GiB with a bf16 master, and the float32 master and Adam's
            # moments held beside it (12.3 GB per GPU) would pass 75% of an H100. An
            # estimate: not yet compiled (--dry_run --topology=h100:2x8)
            "sampling.batch_buckets": (8, 16, 32, 64, 128, 256),
        })),
}

# qwen_8b_long on AReaL's split (docs/async.md, "The qwen_8b_long split"): 16 of the 32
# chips (4 whole hosts) roll out, 16 train, at most one version stale. The rollout mesh
# is chosen for decode (planning/async_split.py:split_model): data 4 x tensor 4, so a
# chip reads a quarter of the weights per decode step and gathers none (fsdp 8 x tensor 2
# reads twice as much and gathers 7.2 GB a step); its 4 batch shards are the side's 4
# hosts. Slots: the most whose pages fit the side beside its params copies (the model
# says 468 of the round's 512 rows; the rest wait for a free slot).
VARIANTS["qwen_8b_long_async"] = dict(
    VARIANTS["qwen_8b_long"],
    run=dict(VARIANTS["qwen_8b_long"]["run"], **{
        "rl.rollout_devices": 16, "rl.max_staleness": 1,
        "rl.rollout_mesh.data": 4, "rl.rollout_mesh.fsdp": 1, "rl.rollout_mesh.tensor": 4,
        "engine.slots": 468,
    }))

# Flavors every algorithm file accepts (``:tiny,decoupled``).
COMMON_FLAVORS = ("decoupled",)

# Variants whose algorithm files keep the rollouts per step equal (an algorithm
# with a second round or a larger group samples half the prompts).
EQUAL_ROLLOUT_VARIANTS = ("tiny", "tiny_hard", "tiny_chain")


# The library defaults (the typed parts' dataclasses, fbos_jax/rl/config.py:section_defaults)
# that the project's configs change, each with its reason; tests/test_config_defaults.py
# fails on any other difference between configs/base.py and the typed parts.
CHANGED_DEFAULTS = {
    # the response budget of the large variants (qwen3_0_6b, qwen_8b, qwen_8b_h100); the
    # sampler's own default is 256
    "sampling.max_new_tokens": 512,
    # round-1 prompt buckets of those variants (the sampler's: 64 ... 4096)
    "sampling.prompt_buckets": (256, 512, 1024, 2048),
}


def defaults(variant: str) -> mlc.ConfigDict:
  """Every field with its ALGORITHMS.md default (the FBOS-RL knobs off)."""
  v = VARIANTS[variant]
  c = mlc.ConfigDict()
  c.variant = variant
  c.algo = "grpo"  # a label for logs and plots; behaviour comes from the fields below
  c.seed = 0

  # the variant's architecture, and the attention fields of fbos_jax/model/qwen.py:ModelConfig
  # (auto: dense for short sequences, Pallas splash on TPU, blocked elsewhere)
  c.model = mlc.ConfigDict(dict(config_lib.section_defaults("model"), **v["model"]))
  c.model.hf_path = ""  # a local HF checkpoint dir; empty = random init (tiny) / must set (large)
  c.model.tokenizer_path = ""  # empty = the HF dir, or the char tokenizer built in the workdir

  c.mesh = mlc.ConfigDict(dict(v["mesh"]))
  c.mesh.rules = [[name, list(t) if isinstance(t, tuple) else t]
                  for name, t in sharding_lib.DEFAULT_RULES]  # logical axis -> mesh axes
  c.mesh.num_devices = 0  # >0: plan for this many (abstract) devices in --dry_run

  # data and templates: the library's sections, whose defaults live there (one home)
  c.data = data_lib.default_data_config()
  c.templates = templates_lib.default_template_config()

  # the sampler's fields: the defaults of fbos_jax/sampling.py:SamplingConfig
  c.sampling = mlc.ConfigDict(config_lib.section_defaults("sampling"))
  c.sampling.fap_prompt_buckets = (512, 1024, 2048, 4096)  # round-2 (feedback) prompts
  c.sampling.eval_temperature = 0.0  # greedy held-out evaluation (pass@1)
  # sampling.stop_token_ids: ids that end a response besides the tokenizer's EOS; () +
  # --init_from_hf = the checkpoint's generation_config eos ids (Qwen3: <|im_end|>, <|endoftext|>)
  # static: one jitted loop per batch, to its longest row | continuous: the engine
  # (fbos_jax/engine: slots, paged KV, decode windows that refill finished slots)
  c.sampling.engine = "static"

  # the continuous engine's knobs (fbos_jax/engine/types.py:EngineConfig holds the
  # defaults and their meaning); used when sampling.engine=continuous
  c.engine = mlc.ConfigDict(engine_types.engine_config_defaults())

  c.verifier = mlc.ConfigDict()
  # (which verifier: data.verifier, a registry name or "pkg.module:attr")
  c.verifier.timeout_s = 10.0
  c.verifier.workers = 4
  c.verifier.backend = "thread"  # thread | process (a process can be killed when it hangs)
  c.verifier.reward_range = (-10.0, 10.0)  # rewards outside are error verdicts
  c.verifier.max_abandoned_threads = 16  # hung thread calls tolerated before switching to process
  c.verifier.success_threshold = 1.0  # reward >= this counts as solved
  # stop the run when every verifier call of this many steps in a row failed (0 = never)
  c.verifier.max_failed_steps = 3

  # rl and optim: the defaults of the typed parts (fbos_jax/rl/config.py: RolloutSpec,
  # LossConfig, UpdateConfig, AsyncConfig, OptimConfig, where each field is explained)
  c.rl = mlc.ConfigDict(config_lib.section_defaults("rl"))
  c.rl.prompts_per_step = 64  # P (no library default: a run size)
  c.rl.group_size = 8  # n: round-1 rollouts per prompt (no library default)
  # The objective: named terms, each a batch the rollout builds (fbos_jax/rl/batch_kinds.py),
  # a loss of the kernels' registry (fbos_kernels.POLICY_LOSSES) and a weight; weight 0 = off.
  #   epa: round-1 rollouts on q (+ feedback-guided ones pulled back, off-policy)
  #   ecc: round-2 rollouts on their FAPs (on-policy)
  #   fcp: round-1 rollouts re-conditioned on their own feedback, <EF>c</EF>q
  # loss: policy_gradient (PPO clip; f(u) on off-policy rows) | decoupled (AReaL,
  # for stale rollouts) | mle (maximum likelihood)
  c.rl.terms.epa.weight = 1.0  # GRPO's objective unless an algorithm file says otherwise
  # asynchronous RL (AReaL's system; fbos_jax/rl/sources.py, docs/async.md): rl.rollout_devices,
  # rl.max_staleness, ... (AsyncConfig); stale rollouts pair with the decoupled loss (the
  # `decoupled` flavor). rl.rollout_mesh: the rollout mesh's axes when split (0 = as mesh.*):
  # e.g. tensor=2 gives a 16-chip rollout of 4 whole hosts (4 chips each) 8 batch shards

  c.optim = mlc.ConfigDict(config_lib.section_defaults("optim"))
  c.optim.learning_rate = 1e-6  # no library default: the large variants' rate
  # True: train a master (model.param_dtype) of fewer than float32's bits as is. A
  # bfloat16 master keeps 8 significant bits, so an Adam step of about lr rounds away
  # on every weight above ~256 x lr (at lr 1e-6, ~98% of N(0, 0.02) weights); refused
  # at build unless this is set (update/param_change_frac shows what a step changed)
  c.optim.allow_low_precision_params = False

  # the defaults the project's configs change (CHANGED_DEFAULTS, above)
  for dotted, value in CHANGED_DEFAULTS.items():
    set_field(c, dotted, value)

  c.train = mlc.ConfigDict()
  c.train.steps = 200
  c.train.log_every = 1
  c.train.eval_every = 20
  c.train.eval_prompts = 128
  c.train.eval_k = 1  # pass@k with k samples per prompt at eval temperature
  c.train.checkpoint_every = 20
  c.train.keep_checkpoints = 3
  c.train.warm_start = ""  # "" | "sft" (train configs/sft.py first, cached in the workdir)
  c.train.progress = True
  # compile every program the run can call before step 1 (fbos_jax/compile_set.py;
  # a compile after it is counted in compile/after_start and warned about)
  c.train.compile_at_start = True
  # >0: every this many steps, the feedback-reading probe on the step's prompts
  # (fbos_jax/rl/probe.py: log p(gold | FAP) vs log p(gold | q), fix vs resample rates and
  # the controls, logged as probe/*); it samples ~4x the failed rollouts again
  c.train.probe_every = 0

  c.export = mlc.ConfigDict()
  # the dtype launch/export_hf.py writes: "" = the source checkpoint's (config.json's
  # dtype / torch_dtype of model.hf_path or --init_from_hf), bfloat16 without one; the
  # run's float32 master is rounded to it once, at export
  c.export.dtype = ""

  c.sft = mlc.ConfigDict()
  c.sft.steps = 0
  c.sft.batch_size = 64
  c.sft.learning_rate = 1e-3
  c.sft.warmup_steps = 20
  c.sft.schedule = "cosine"  # cosine (to 0.1 x lr) | constant
  c.sft.fap_fraction = 0.0  # share of correction demos on FAPs (teaches the FAP format)
  # where a correction's wrong attempt comes from: corrupt (one changed character
  # of the solution) | self (the model's own failed samples, fbos_jax/rl/sft.py)
  c.sft.corrections = "corrupt"
  c.sft.self_corrections_from = 0.5  # self: share of sft.steps before own samples are used
  c.sft.self_samples = 4  # self: samples per correction example to find a failure
  c.sft.conditional = False  # FCP offline stage: train on <EF>c</EF>q -> o (c = feedback)
  # A recipe of stages run in order, each a dict of sft.* fields over the ones above
  # (e.g. its own steps, learning_rate, fap_fraction, corrections), each from the
  # previous stage's params with a fresh optimizer; every stage is cached, so a
  # stopped warm start resumes at the first stage not done (fbos_jax/rl/sft.py).
  # () = one stage: the fields above. With stages, sft.steps is their total, and a
  # --config.sft.X override of a field a stage sets is refused (the stage ignores it).
  c.sft.stages = ()
  return c


def set_field(c: mlc.ConfigDict, dotted: str, value):
  """Set ``c.a.b = value`` from ``"a.b"``: the one dotted setter (configs, tests,
  ``launch/compare.py --set``). A field that does not exist raises, naming it;
  a string value for a non-string field is parsed as ``--config.a.b=...`` would
  parse it (bool, int, float, tuple of numbers)."""
  *path, last = dotted.split(".")
  node = c
  for i, p in enumerate(path):
    if p not in node:
      raise KeyError(f"config field {'.'.join(path[:i + 1])!r} does not exist "
                     f"(setting {dotted!r})")
    node = node[p]
  if last not in node:
    raise KeyError(f"config field {dotted!r} does not exist")
  node[last] = _parsed(node[last], value, dotted)


def _parsed(current, value, dotted: str):
  """``value`` in the type of the field's ``current`` value, when given as text."""
  if not isinstance(value, str) or isinstance(current, str) or current is None:
    return value
  try:
    if isinstance(current, bool):
      if value.lower() not in ("1", "0", "true", "false"):
        raise ValueError(value)
      return value.lower() in ("1", "true")
    if isinstance(current, (int, float)):
      return type(current)(float(value) if isinstance(current, int) and "e" in value.lower()
                           else value)
    if isinstance(current, (tuple, list)):
      items = [x.strip() for x in value.strip("()[] ").split(",") if x.strip()]
      return tuple(float(x) if any(ch in x for ch in ".eE") else int(x) for x in items)
  except ValueError:
    raise ValueError(f"{dotted}={value!r}: expected a {type(current).__name__} like "
                     f"{current!r}") from None
  return value


def get_config_for(arg: str, flavors: tuple = ()) -> tuple[mlc.ConfigDict, tuple]:
  """``'tiny'`` or ``'tiny,drgrpo'`` -> (the variant's config, the flavors asked for).

  Unknown variants and flavors raise, naming what is known. The common flavor
  ``decoupled`` (AReaL's objective for stale rollouts) is applied here."""
  parts = [p for p in (arg or "tiny").split(",") if p]
  variant, extra = parts[0], tuple(parts[1:])
  if variant not in VARIANTS:
    raise ValueError(f"Unknown config variant {variant!r}; choose one of {sorted(VARIANTS)} "
                     "(e.g. --config=configs/fbos.py:tiny).")
  known = tuple(flavors) + COMMON_FLAVORS
  bad = [e for e in extra if e not in known]
  if bad:
    raise ValueError(f"Unknown config flavor(s) {bad}; this file knows {list(known)} "
                     f"(e.g. :{variant},{known[0]}).")
  c = defaults(variant)
  for dotted, value in VARIANTS[variant]["run"].items():
    set_field(c, dotted, value)
  return c, extra


def apply_common_flavors(c: mlc.ConfigDict, flavors: tuple) -> mlc.ConfigDict:
  """Flavors shared by every algorithm: call last, after the algorithm's fields."""
  if "decoupled" in flavors:  # AReaL: pi_prox recomputed each step; pair with rl.max_staleness
    for term in c.rl.terms.values():
      if term.loss == "policy_gradient":
        term.loss = "decoupled"
  return c
