"""Staging memory in host memory (issue 18 item 1, raysync.core.staging_memory): ``staging_memory="host"`` stages a
push in (pinned, for a GPU) host memory and the flip copies it into the live weights; ``"auto"`` picks the
device when it has room; ``StagingInfo.memory`` says where and ``memory_why`` why."""

from __future__ import annotations

import pytest
import torch
from conftest import session_pair
from test_staged import CONFIG, _push, make_model, weights_digest

from raysync.core.staging_memory import StagingMemory
from raysync.core.wire import TensorSpec

SAME_MEMORY = "the destinations are in host memory: device and host staging are the same memory"


def host_digest(params: dict[str, torch.Tensor]) -> str:
    """weights_digest of a model whose ``params`` these are, read wherever they live (they stay there)."""
    model = torch.nn.Module()
    for i, t in enumerate(params.values()):
        model.register_parameter(f"p{i}", torch.nn.Parameter(t.detach().cpu(), requires_grad=False))
    return weights_digest(model)


def test_host_staging_is_bit_exact_after_each_flip_and_says_host(private_tmp, in_thread):
    model = make_model(None)
    params = dict(model.named_parameters())
    addresses = [p.data_ptr() for p in params.values()]
    with session_pair(CONFIG) as (sender, receiver):
        for version in (1, 2, 3):
            pushing = in_thread(_push, sender, version)
            receiver.receive(into=params, flip=False, staging_memory="host")
            pushing.result(timeout=30)
            assert receiver.version == (version - 1 or None) and receiver.staged_version == version
            assert weights_digest(model) == weights_digest(make_model(version - 1 or None))  # live untouched
            assert receiver.flip().version == version and receiver.version == version
            assert weights_digest(model) == weights_digest(make_model(version))
        info = receiver.staging
    assert [p.data_ptr() for p in params.values()] == addresses  # the flip wrote in place
    assert (info.memory, info.memory_why, info.mode) == ("host", SAME_MEMORY, "whole")
    assert info.push_bytes <= info.nbytes and info.devices == ((str(model[0].weight.device), info.nbytes),)


@pytest.mark.parametrize("staging_memory", ["auto", "device", "host"])
def test_host_destinations_stage_in_host_memory_whatever_staging_memory_says(
    private_tmp, in_thread, staging_memory
):
    model = make_model(None)
    with session_pair(CONFIG) as (sender, receiver):
        pushing = in_thread(_push, sender, 1)
        receiver.receive(into=dict(model.named_parameters()), flip=False, staging_memory=staging_memory)
        pushing.result(timeout=30)
        assert receiver.flip().version == 1 and weights_digest(model) == weights_digest(make_model(1))
        assert (receiver.staging.memory, receiver.staging.memory_why) == ("host", SAME_MEMORY)


def test_an_unknown_staging_memory_is_refused_before_the_push_starts(private_tmp):
    model = make_model(None)
    with session_pair(CONFIG) as (_, receiver):
        with pytest.raises(ValueError, match="staging_memory='gpu': one of auto, device, host"):
            receiver.receive(into=dict(model.named_parameters()), flip=False, staging_memory="gpu")
        assert receiver.version is None and receiver.staging is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_host_staging_for_a_gpu_engine_is_pinned_takes_no_gpu_memory_and_flips_bit_exact(
    private_tmp, in_thread
):
    model = make_model(None).cuda()
    params = dict(model.named_parameters())
    addresses = [p.data_ptr() for p in params.values()]
    push_bytes = sum(p.nbytes for p in params.values())
    with session_pair(CONFIG) as (sender, receiver):
        for version in (1, 2):
            torch.cuda.synchronize()
            allocated = torch.cuda.memory_allocated()
            pushing = in_thread(_push, sender, version)  # CPU tensors over shm into pinned host staging
            receiver.receive(into=params, flip=False, staging_memory="host")
            pushing.result(timeout=60)
            assert torch.cuda.memory_allocated() - allocated < push_bytes  # staged off the GPU
            assert host_digest(params) == weights_digest(make_model(version - 1 or None))  # live untouched
            assert receiver.flip().version == version
            assert torch.cuda.current_stream().query()  # complete when it returns: no copy still queued
            assert host_digest(params) == weights_digest(make_model(version))
        buffers = list(receiver._staging.memory.buffers.values())  # the staging memory itself
        assert len(buffers) == 1 and buffers[0].device.type == "cpu" and buffers[0].is_pinned()
        info = receiver.staging
    assert not buffers[0].is_pinned()  # unlocked when the session closed
    assert [p.data_ptr() for p in params.values()] == addresses
    assert (info.memory, info.memory_why) == ("host", "staging_memory='host'")
    assert info.devices == (("cuda:0", info.nbytes),) and push_bytes <= info.nbytes


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_auto_stages_on_the_gpu_when_it_has_room_and_in_pinned_host_memory_when_not():
    dest = {f"w{i}": torch.zeros(256, 256, device="cuda") for i in range(4)}
    specs = tuple(TensorSpec(n, "float32", tuple(t.shape)) for n, t in dest.items())
    _, total = torch.cuda.mem_get_info()
    roomy = StagingMemory(dest, None, staging_memory="auto", margin_bytes=0)
    roomy.prepare(specs)
    assert roomy.info.memory == "device" and "fit" in roomy.info.memory_why
    assert roomy.buffers[torch.device("cuda", 0)].is_cuda
    full = StagingMemory(dest, None, staging_memory="auto", margin_bytes=total)  # no room left
    full.prepare(specs)
    assert full.info.memory == "host" and "do not fit" in full.info.memory_why
    buffer = full.buffers[torch.device("cuda", 0)]
    assert buffer.device.type == "cpu" and buffer.is_pinned() and buffer.numel() == full.info.nbytes
    assert full.pinned == {torch.device("cuda", 0)}  # page-locked as it is (exactly nbytes), until dropped
    for i, name in enumerate(dest):  # the flip's copies: pinned host -> the live tensors on the GPU
        full.views[name].fill_(i + 1)
    for copies in full.flips:
        copies.run()
    torch.cuda.synchronize()
    assert [bool((t == i + 1).all()) for i, t in enumerate(dest.values())] == [True] * len(dest)
    roomy.close()
    full.close()
    assert not full.pinned and not buffer.is_pinned()  # unlocked when dropped


class _Live:
    """What holds the live weights' version (a receiver, in a session)."""

    version = 0


def test_a_bounded_flip_after_a_dropped_version_waits_for_the_next_push_without_holding_the_lock(in_thread):
    """A new layout drops a version that waited for its flip; a flip bounded by max_version_lag then waits
    (it does not spin holding the staging's lock): the next push's begin goes through, and the flip applies it
    once it landed. With no next push, the wait ends in StaleWeights after wait_s."""
    from raysync.core.errors import StaleWeights
    from raysync.core.staging import Staging

    dest = {"a": torch.zeros(4), "b": torch.zeros(8)}
    specs = {n: TensorSpec(n, "float32", tuple(t.shape)) for n, t in dest.items()}
    live = _Live()
    staging = Staging(StagingMemory(dest, None), live, timeout_s=30, peer="trainer")
    staging.make_sink((specs["a"],), graphs=False)
    staging.begin(1)
    staging.landed(1)
    staging.make_sink((specs["a"], specs["b"]), graphs=False)  # a new layout: version 1 is dropped
    waited = in_thread(staging.flip, max_version_lag=0, wait_s=0.2)  # on a thread: a spin fails, not hangs
    with pytest.raises(StaleWeights):
        waited.result(timeout=30)
    flipped = in_thread(staging.flip, max_version_lag=0, wait_s=30)
    staging.begin(2)  # would block for good behind a spinning flip
    staging.landed(2)
    report = flipped.result(timeout=30)
    assert report.staged_version == 2 and live.version == 2
