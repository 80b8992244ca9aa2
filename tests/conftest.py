from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor

import pytest
import torch

from raysync import SessionSecret, SyncConfig, WeightReceiver, WeightSender


def raysync_shm_entries() -> set[str]:
    return {n for n in os.listdir("/dev/shm") if n.startswith("raysync-")}


@pytest.fixture
def private_tmp(monkeypatch) -> Iterator[str]:
    """A temp dir of its own for this test (children inherit TMPDIR); asserts raysync left nothing in it or in
    /dev/shm. Short, because unix socket paths (ours, Ray's) are limited to 107 bytes."""
    d = tempfile.mkdtemp(prefix="rs", dir="/tmp")
    monkeypatch.setenv("TMPDIR", str(d))
    monkeypatch.setattr(tempfile, "tempdir", str(d))
    shm_before = raysync_shm_entries()
    yield str(d)
    left = [p for p in os.listdir(d) if p.startswith("raysync-")]
    shutil.rmtree(d, ignore_errors=True)
    assert left == []
    assert raysync_shm_entries() - shm_before == set()


@contextlib.contextmanager
def session_pair(config: SyncConfig) -> Iterator[tuple[WeightSender, WeightReceiver]]:
    """A sender and a receiver in this process (drive them from two threads)."""
    secret = SessionSecret.generate()
    with WeightSender(secret, config) as sender, WeightReceiver(sender.endpoint, secret, config) as receiver:
        yield sender, receiver


@pytest.fixture
def in_thread() -> Iterator[Callable[..., Future]]:
    pool = ThreadPoolExecutor(max_workers=2)
    yield lambda fn, *a, **kw: pool.submit(fn, *a, **kw)
    pool.shutdown(wait=True)


@pytest.fixture
def spawn() -> Iterator[Callable[..., mp.Process]]:
    """Start ``fn(*args)`` in a spawned process; every process still alive at the end is killed."""
    ctx = mp.get_context("spawn")
    procs: list[mp.Process] = []

    def start(fn: Callable, *args: object) -> mp.Process:
        p = ctx.Process(target=fn, args=args, daemon=True)
        p.start()
        procs.append(p)
        return p

    start.ctx = ctx  # type: ignore[attr-defined]
    yield start
    for p in procs:
        if p.is_alive():
            p.kill()
        p.join(timeout=10)


def random_tensor(dtype: torch.dtype, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    """Random bits of any dtype (via raw bytes, so fp8, bool and complex work alike)."""
    itemsize = dtype.itemsize
    n = int(torch.Size(shape).numel()) * itemsize
    raw = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen)
    if dtype == torch.bool:
        raw = raw % 2
    return raw.view(dtype).reshape(shape)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(
        a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8)
    )


def _local_ray(**resources: object) -> Iterator[None]:
    ray = pytest.importorskip("ray")
    here = os.path.dirname(os.path.abspath(__file__))
    path = os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH")) if p)
    ray.init(include_dashboard=False, logging_level="warning", runtime_env={"env_vars": {"PYTHONPATH": path}},
             **resources)  # fmt: skip
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def ray_local() -> Iterator[None]:
    """A local Ray for this module; the test helpers (tests/) are importable in its workers."""
    yield from _local_ray(num_cpus=2)


@pytest.fixture(scope="module")
def ray_gpu() -> Iterator[None]:
    """A local Ray with this machine's GPUs."""
    yield from _local_ray(num_cpus=4, num_gpus=torch.cuda.device_count())


@pytest.fixture
def no_leftovers() -> Iterator[None]:
    """Nothing raysync makes may stay in /dev/shm or the temp dir once the test is over."""
    tmp = tempfile.gettempdir()
    before = raysync_shm_entries(), {p for p in os.listdir(tmp) if p.startswith("raysync-")}
    yield
    after = raysync_shm_entries(), {p for p in os.listdir(tmp) if p.startswith("raysync-")}
    assert after[0] - before[0] == set() and after[1] - before[1] == set()
