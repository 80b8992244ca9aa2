"""The ranks of a tensor-parallel torch engine as receivers (issue 16, item 4): each rank gets its shards.

    dims = megatron_dims(names)                       # name -> the dim it is split along (None: replicated)
    sender.push(rank_tensors(trainer_tensors, rank, world, dims), version)   # shard-only: one session per rank
    receiver.receive(into=dict(model.named_parameters()))                    # the rank's own tensors
    receiver.receive(load_fn=ShardLoader(params, rank=r, world=w, dims=dims))  # or: whole tensors, cut here

# Note [which bytes each engine rank receives]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Two ways to feed N ranks: shard-only (one session per rank pushes ``rank_tensors``: the sender packs each
# rank's 1/N, column blocks copied from strided views) or whole tensors (one ring read by the N ranks, a fan-out;
# each rank's ``ShardLoader`` copies its shard out of zero-copy views of the ring, Note [ring buffer views] in
# raysync.core.sink). Both move the same bytes into the ranks and pack the model once in total; shard-only
# measured 1.5-1.8x faster over shm (benchmarks/bench_tp_engine.py, docs/benchmarks.md, section 15; where the
# whole-tensor way loses, every rank waiting for the others' buckets or gathering sliced tensors whole, was not
# broken down). The rule:
#   - over a ring (measured over shm; the cuda_ipc ring and the collective not measured): shard-only, where the
#     engine's tensors are plain shards of the trainer's (a torch engine: ``dims``);
#   - in place (cuda_ipc direct: the ranks read the trainer's tensors on its GPU, nothing is packed): whole
#     tensors, each rank copying only its shard (``ShardLoader``); a column block cannot be read in place;
#   - vLLM engines: whole tensors always. A vLLM worker's ``load_weights`` cuts the checkpoint's tensors for its
#     rank itself (fused q/k/v, gate/up, padded vocabularies): raysync does not redo vLLM's sharding.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from raysync.core.errors import LayoutError
from raysync.core.wire import DTYPES, TensorSpec


def shard(t: torch.Tensor, rank: int, world: int, dim: int | None) -> torch.Tensor:
    """Rank ``rank``'s block of ``t`` split along ``dim`` (None: the rank holds all of it), as torch.chunk cuts."""
    return t if dim is None else t.chunk(world, dim)[rank]


class ShardLoader:
    """A ``load_fn`` for one engine rank: ``dims`` maps a tensor's name to the dim it is split along (a name
    missing from it, or mapped to None, is replicated). ``check`` refuses a push whose full shapes do not cut
    into this rank's tensors, before any byte moves."""

    def __init__(
        self, params: Mapping[str, torch.Tensor], *, rank: int, world: int, dims: Mapping[str, int | None]
    ):
        if not 0 <= rank < world:
            raise ValueError(f"rank {rank} is not one of {world} ranks")
        self.params, self.rank, self.world, self.dims = params, rank, world, dims
        self.copied_bytes = 0  # what this rank copied out of the ring in the last push

    def check(self, specs: Sequence[TensorSpec]) -> None:
        self.copied_bytes = 0
        for s in specs:
            mine = self.params.get(s.name)
            if mine is None:
                raise LayoutError(
                    f"rank {self.rank} of {self.world}: the push has {s.name!r}, this rank does not"
                )
            full = torch.empty(s.shape, dtype=DTYPES[s.dtype], device="meta")
            want = shard(full, self.rank, self.world, self.dims.get(s.name))
            if tuple(want.shape) != tuple(mine.shape) or want.dtype != mine.dtype:
                raise LayoutError(
                    f"rank {self.rank} of {self.world}: {s.name!r} arrives as {tuple(s.shape)} {want.dtype}, "
                    f"whose shard along dim {self.dims.get(s.name)} is {tuple(want.shape)}; this rank holds "
                    f"{tuple(mine.shape)} {mine.dtype}"
                )

    def __call__(self, items: list[tuple[str, torch.Tensor]]) -> None:
        for name, full in items:
            part = shard(full, self.rank, self.world, self.dims.get(name))
            self.params[name].copy_(part)
            self.copied_bytes += part.numel() * part.element_size()


def rank_tensors(
    tensors: Mapping[str, torch.Tensor], rank: int, world: int, dims: Mapping[str, int | None]
) -> list[tuple[str, torch.Tensor]]:
    """What the trainer pushes to rank ``rank`` shard-only: views of its shards, in the trainer's order."""
    return [(n, shard(t, rank, world, dims.get(n))) for n, t in tensors.items()]


def megatron_dims(names: Sequence[str]) -> dict[str, int | None]:
    """The usual split of a Llama/Qwen-style model across tensor-parallel ranks: column-parallel projections
    (q, k, v, gate, up) and the embeddings along dim 0, row-parallel ones (o, down) along dim 1, the rest
    (norms, biases of row-parallel layers) replicated."""
    dims: dict[str, int | None] = {}
    for n in names:
        if any(
            k in n for k in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "embed_tokens", "lm_head")
        ):
            dims[n] = 0
        elif any(k in n for k in ("o_proj", "down_proj")) and n.endswith("weight"):
            dims[n] = 1
        else:
            dims[n] = None
    return dims
