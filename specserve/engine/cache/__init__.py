"""Per-layer cache specs and their managers (vLLM v1's idea, made small).

Each layer of a model declares what it keeps between steps (:mod:`.specs`): full-attention K/V
that grows with the context, sliding-window K/V that keeps only the last ``window`` tokens, or a
recurrent state of fixed size. Layers of one kind form a group; a manager per group
(:mod:`.managers`) does allocation (with lookahead slots for drafts), prefix-cache hits, rollback
to the accepted count and freeing; the :class:`~.coordinator.CacheCoordinator` puts them behind
one interface for the scheduler and the model runner.
"""

from specserve.engine.cache.coordinator import CacheCoordinator, SequenceCache
from specserve.engine.cache.managers import (FullAttentionManager, RecurrentStateManager, RecurrentTable,
                                             SlidingWindowManager)
from specserve.engine.cache.specs import (CacheSpec, FullAttentionSpec, RecurrentStateSpec, SlidingWindowSpec,
                                          layer_cache_specs)

__all__ = ["CacheCoordinator", "CacheSpec", "FullAttentionManager", "FullAttentionSpec", "RecurrentStateManager",
           "RecurrentStateSpec", "RecurrentTable", "SequenceCache", "SlidingWindowManager", "SlidingWindowSpec",
           "layer_cache_specs"]
