"""A tensor-parallel engine's ranks as receivers (issue 16, item 4; Note [which bytes each engine rank receives]):
whole tensors on one ring read by both ranks, each keeping exactly its shard, or shard-only sessions."""

from __future__ import annotations

import pytest
import torch

from raysync import PushIncomplete, RemoteError, SessionSecret, SyncConfig, WeightReceiver, WeightSender
from raysync.engines.torch_tp import ShardLoader, megatron_dims, rank_tensors, shard

CFG = SyncConfig(bucket_bytes=8192, num_buffers=2, timeout_s=30, progress=False, transport="shm")


def trainer_weights(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    shapes = {
        "model.embed_tokens.weight": (64, 16),
        "model.layers.0.self_attn.q_proj.weight": (32, 16),
        "model.layers.0.self_attn.q_proj.bias": (32,),
        "model.layers.0.self_attn.o_proj.weight": (16, 32),
        "model.layers.0.mlp.down_proj.weight": (16, 48),  # 1.5 KB rows: column blocks cross buckets
        "model.layers.0.input_layernorm.weight": (16,),
    }
    return {n: torch.randn(s, generator=g).to(torch.bfloat16) for n, s in shapes.items()}


def rank_params(rank: int, world: int) -> dict[str, torch.Tensor]:
    full = trainer_weights(0)
    dims = megatron_dims(list(full))
    return {n: torch.zeros_like(shard(t, rank, world, dims[n])).contiguous() for n, t in full.items()}


def test_two_ranks_read_one_ring_and_each_keeps_exactly_its_shard(in_thread):
    names = list(trainer_weights(0))
    dims = megatron_dims(names)
    assert [dims[n] for n in names] == [0, 0, 0, 1, 1, None]
    secret = SessionSecret.generate()
    params = [rank_params(r, 2) for r in (0, 1)]
    loaders = [ShardLoader(params[r], rank=r, world=2, dims=dims) for r in (0, 1)]
    with WeightSender(secret, CFG, receivers=2) as sender:
        receivers = [WeightReceiver(e, secret, CFG) for e in sender.endpoints]
        try:
            for step in (1, 2):
                w = trainer_weights(step)
                got = [in_thread(r.receive, load_fn=f) for r, f in zip(receivers, loaders, strict=True)]
                report = sender.push(w.items(), step)
                assert [g.result(timeout=30).version for g in got] == [step, step]
                assert sender.packed_buckets == report.buckets  # one pack serves both ranks
                for r in (0, 1):
                    for n, t in w.items():
                        assert torch.equal(params[r][n], shard(t, r, 2, dims[n])), (r, n)
                full_bytes = sum(t.numel() * t.element_size() for t in w.values())
                replicated = w["model.layers.0.input_layernorm.weight"].numel() * 2
                assert [f.copied_bytes for f in loaders] == [(full_bytes - replicated) // 2 + replicated] * 2
        finally:
            for r in receivers:
                r.close()


def test_a_rank_whose_tensors_do_not_cut_from_the_push_refuses_it_before_any_byte(in_thread):
    dims = megatron_dims(list(trainer_weights(0)))
    secret = SessionSecret.generate()
    params = [rank_params(r, 2) for r in (0, 1)]
    params[1]["model.layers.0.self_attn.o_proj.weight"] = torch.zeros(
        8, 32, dtype=torch.bfloat16
    )  # wrong dim
    loaders = [ShardLoader(params[r], rank=r, world=2, dims=dims) for r in (0, 1)]
    with WeightSender(secret, CFG, receivers=2) as sender:
        receivers = [WeightReceiver(e, secret, CFG) for e in sender.endpoints]
        try:
            got = [in_thread(r.receive, load_fn=f) for r, f in zip(receivers, loaders, strict=True)]
            with pytest.raises(RemoteError, match=r"rank 1 of 2: 'model.layers.0.self_attn.o_proj.weight'"):
                sender.push(trainer_weights(1).items(), 1)
            errors = [g.exception(timeout=30) for g in got]
            assert all(isinstance(e, PushIncomplete) for e in errors), errors
            assert all(not t.any() for p in params for t in p.values())  # nothing written on either rank
        finally:
            for r in receivers:
                r.close()


def test_shard_only_sessions_give_each_rank_its_shards_and_pack_only_those(in_thread):
    w = trainer_weights(3)
    dims = megatron_dims(list(w))
    for rank in (0, 1):
        secret = SessionSecret.generate()
        mine = rank_params(rank, 2)
        with WeightSender(secret, CFG) as sender, WeightReceiver(sender.endpoint, secret, CFG) as receiver:
            got = in_thread(receiver.receive, into=mine)
            report = sender.push(rank_tensors(w, rank, 2, dims), 3)
            assert got.result(timeout=30).version == 3
        assert all(torch.equal(mine[n], shard(t, rank, 2, dims[n])) for n, t in w.items())
        assert report.bytes == sum(t.numel() * t.element_size() for t in mine.values())  # only this rank's
