"""Lazy sources (raysync.core.source.Source): the layout from metadata, the bytes made bucket by bucket.

lazy.py: LazySource, tensors made when their bucket is packed, from a manifest (a meta-device model, a
checkpoint's index). The sharded one, in the order of the data flow: params.py (what each rank holds: Shard(d),
Replicate, declared shards) and mapping.py (NameMap: the engine's names and shapes) -> dtensor.py (DTensorSource:
FSDP2 / tensor-parallel parameters, one per trainer rank) -> gather_plan.py (pure: which bytes each rank gathers for each bucket) ->
walk.py (the all-gathers of one push on every rank, bounded: Note [every rank walks the same buckets]).
lora.py: LoraSource, a LoRA adapter's A/B tensors and its manifest (push only the adapter), and merged mode
(merged / push_merged: the adapter folded into the base weights, pushed as a full push); AdapterOf / MergedOf,
the two modes as WeightSync's ``source=``.
"""

from raysync.sources.dtensor import DTensorSource
from raysync.sources.lazy import LazySource
from raysync.sources.lora import (
    AdapterOf,
    LoraConfig,
    LoraReport,
    LoraSource,
    MergedOf,
    merged,
    push_adapter,
    push_merged,
)
from raysync.sources.mapping import Fuse, NameMap, Rename, Split, Transpose

__all__ = [
    "AdapterOf",
    "DTensorSource",
    "Fuse",
    "LazySource",
    "LoraConfig",
    "LoraReport",
    "LoraSource",
    "MergedOf",
    "NameMap",
    "Rename",
    "Split",
    "Transpose",
    "merged",
    "push_adapter",
    "push_merged",
]
