"""How big the buffers that carry delta encodings must be (raysync.core.delta.capacity): a ring made for a delta
session holds the largest bucket's encoding; a plane that moves only the bytes used sends a bucket's header and
table first (raysync.transport.collective)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from raysync.core import delta
from raysync.core.config import SyncConfig
from raysync.core.delta_reference import chunk_sizes
from raysync.core.plan import Bucket, align_up, plan_buckets
from raysync.core.wire import TensorSpec


def table_bytes(bucket: Bucket) -> int:
    """Where bucket k's first payload starts in its encoding: the header and table, padded (what a plane that
    moves only the bytes used sends first: the header says how many follow)."""
    return align_up(delta.HEADER_BYTES + delta.ROW_BYTES * len(bucket.chunks), delta.PAYLOAD_ALIGN)


def buffer_bytes(specs: Sequence[TensorSpec], bucket_bytes: int, align_bytes: int) -> int:
    """The buffer size that holds the encoding of every bucket of this layout (at least ``bucket_bytes``)."""
    if not specs:
        return bucket_bytes
    buckets = plan_buckets(specs, bucket_bytes, align_bytes)
    need = max(delta.capacity(chunk_sizes(b, specs)) for b in buckets)
    return max(bucket_bytes, align_up(need, align_bytes))


def ring_config(config: SyncConfig, specs: Sequence[TensorSpec]) -> SyncConfig:
    """The config a delta session's ring is made with: buffers that hold the largest bucket's encoding."""
    if not config.delta or not specs:
        return config
    need = buffer_bytes(specs, config.bucket_bytes, config.align_bytes)
    return dataclasses.replace(config, bucket_bytes=need)
