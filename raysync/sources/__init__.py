"""Sources of a sharded trainer: lazy sources (raysync.core.source.Source) whose ranks all take part in a push.

Read in the order of the data flow: dtensor.py (DTensorSource: FSDP2 / DTensor parameters, what a trainer rank
makes) -> gather_plan.py (pure: which bytes each rank gathers for each bucket) -> walk.py (the all-gathers of
one push on every rank, bounded: Note [every rank walks the same buckets]).
"""

from raysync.sources.dtensor import DTensorSource

__all__ = ["DTensorSource"]
