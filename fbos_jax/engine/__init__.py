"""The continuous-batching engine: slots, a paged KV cache, jitted decode windows
and a host scheduler that refills slots between windows (issue 22).

Behind the static sampler's contract (:func:`fbos_jax.sampling.sample`)::

    out = engine.sample(params, cfg, prompts, key=key, n_per_prompt=8, config=scfg,
                        engine_config=EngineConfig(slots=64), mesh=mesh, rules=rules)

returns the same :class:`~fbos_jax.sampling.SampleOutput`: sample j of global
prompt i draws step t from ``fold_in(fold_in(key, t), i * n + j)`` whatever slot
or window it ran in, so greedy tokens equal the static sampler's, sampled tokens
too except where a float difference flips a draw, and the log-probs are the
same temperature-scaled, full-vocabulary ones (teacher forcing reproduces them).
It draws, agrees on prompt rows and stops as the static sampler does, through the
public functions of :mod:`fbos_jax.sampling.shared`. This package moves into
``fbos_jax/sampling/`` once the work on its runner (the async issue) has landed.

Streaming (rounds that feed each other while the engine runs)::

    feed = ListFeed([Request(prompt, n=8, key=k, sid_base=i * 8, tag=i), ...], closed=False)
    stats = engine.run(params, cfg, feed, on_row, config=scfg, engine_config=ecfg)

``feed.poll()`` is called between windows; ``on_row(FinishedRow)`` gets each row
as it stops (it may ``feed.submit`` new requests, each with its own key and
stream ids); the run ends once ``feed.finished()`` and every row is done.

Pieces: :mod:`.types` (config, requests, stats), :mod:`.pages` (host free lists),
:mod:`.programs` (the jitted prefill and decode window over the page pool),
:mod:`.runner` (admission, windows, multi-process lockstep); the programs as
abstract (fn, args) for compiled plans are :mod:`fbos_jax.planning.engine`.
"""

from fbos_jax.engine.pages import PageAllocator
from fbos_jax.engine.runner import Engine, PoolLayout, pool_layout, run, sample
from fbos_jax.engine.types import (EngineConfig, EngineError, EngineStats, Feed, FinishedRow,
                                   ListFeed, ParamsSource, Request, is_params_source)

__all__ = ["Engine", "EngineConfig", "EngineError", "EngineStats", "Feed", "FinishedRow",
           "ListFeed", "PageAllocator", "ParamsSource", "PoolLayout", "Request", "is_params_source",
           "pool_layout", "run", "sample"]
