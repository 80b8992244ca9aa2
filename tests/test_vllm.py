"""Real vLLM engines (the CPU build) inside Ray actors receive a trainer's weights through WeightSync and then
generate what transformers generates with those weights."""

from __future__ import annotations

import os

import pytest

ray = pytest.importorskip("ray")
pytest.importorskip("vllm")
pytest.importorskip("transformers")

from actors import Policy, VllmHost  # noqa: E402

from raysync import SyncConfig, WeightSync  # noqa: E402
from raysync.models import tiny_qwen2  # noqa: E402
from raysync.vllm import VllmEngine  # noqa: E402

pytestmark = pytest.mark.vllm

CFG = SyncConfig(bucket_bytes=64 << 10, timeout_s=30, progress=False)  # the embedding spans 4 buckets
PROMPTS = [list(range(3, 11)), [(7 * i) % 500 + 1 for i in range(80)]]  # the second fills 2 cache blocks
TOKENS = 8
ONE_PROCESS = {"env_vars": {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    """The engines' starting checkpoint: another random init than the trainer's."""
    path = str(tmp_path_factory.mktemp("tiny-qwen2"))
    tiny_qwen2(seed=1).save_pretrained(path)
    return path


@pytest.fixture
def vllm_segments_cleaned():
    """vLLM's own shared memory (psm_*) must be gone once its engines are shut down."""
    before = set(os.listdir("/dev/shm"))
    yield
    left = {n for n in set(os.listdir("/dev/shm")) - before if n.startswith("psm_")}
    for name in left:  # leave the machine clean for the next test, then fail
        os.unlink(os.path.join("/dev/shm", name))
    assert not left, f"vLLM left {sorted(left)} in /dev/shm"


def engine(model_dir: str, runtime_env: dict | None = None):
    return ray.remote(num_cpus=0.5)(VllmHost).options(runtime_env=runtime_env).remote(model_dir)


@pytest.mark.parametrize("transport", ["shm", "collective"])
def test_one_engine_generates_with_the_pushed_weights(
    transport, ray_local, model_dir, no_leftovers, vllm_segments_cleaned
):
    trainer = ray.remote(num_cpus=0.25)(Policy).remote()
    host = engine(model_dir, ONE_PROCESS)
    try:
        with WeightSync([trainer], [VllmEngine(host)], CFG, transport=transport) as sync:
            assert [p.transport for p in sync.plan] == [transport]  # collective: a gloo group beside vLLM's
            before = ray.get(host.generate.remote(PROMPTS, TOKENS))
            assert ray.get(host.weight_version.remote()) is None
            for version in (1, 2):  # the second push goes through the CPU reload path again
                ray.get(trainer.step.remote(version))
                expected = ray.get(trainer.greedy.remote(PROMPTS, TOKENS))
                report = sync.push(version)
                assert report.pairs[0].bytes > 0
                got = ray.get(host.generate.remote(PROMPTS, TOKENS))  # the long prompt is in the prefix cache
                assert got == expected, f"version {version}"
                assert got != before
                before = got
            assert ray.get(host.weight_version.remote()) == 2 and sync.versions() == [2]
            assert sync.push(2).pairs[0].bytes == 0  # the same version again: nothing moves
    finally:
        ray.get(host.shutdown.remote())
        ray.kill(host)


def test_two_engines_one_in_vllms_multiprocess_layout(
    ray_local, model_dir, no_leftovers, vllm_segments_cleaned
):
    trainer = ray.remote(num_cpus=0.25)(Policy).remote(seed=5)
    hosts = [engine(model_dir, ONE_PROCESS), engine(model_dir)]  # the second: EngineCore + worker processes
    try:
        with WeightSync([trainer], [VllmEngine(h) for h in hosts], CFG) as sync:
            assert len(sync.plan) == 2
            host_pids = ray.get([h.__ray_call__.remote(lambda a: os.getpid()) for h in hosts])
            plan = str(sync.plan)
            assert f"pid {host_pids[0]}" in plan  # one process: the worker runs in the actor
            assert f"pid {host_pids[1]}" not in plan  # multiprocess: the worker is vLLM's own process
            ray.get(trainer.step.remote(1))
            expected = ray.get(trainer.greedy.remote(PROMPTS, TOKENS))
            sync.push(1)
            assert ray.get([h.generate.remote(PROMPTS, TOKENS) for h in hosts]) == [expected, expected]
            assert sync.versions() == [1, 1]
    finally:
        ray.get([h.shutdown.remote() for h in hosts])
        for h in hosts:
            ray.kill(h)


def test_a_tensor_parallel_engine_is_one_receiver_per_worker(
    ray_local, model_dir, no_leftovers, vllm_segments_cleaned
):
    trainer = ray.remote(num_cpus=0.25)(Policy).remote(seed=7)
    bind = {"env_vars": {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}}  # one core per worker (one NUMA node here)
    host = (
        ray.remote(num_cpus=0.5)(VllmHost).options(runtime_env=bind).remote(model_dir, tensor_parallel_size=2)
    )
    try:
        with WeightSync([trainer], [VllmEngine(host)], CFG) as sync:
            assert [(p.sender, p.receiver) for p in sync.plan] == [
                (0, 0),
                (0, 1),
            ]  # each worker loads its shard
            ray.get(trainer.step.remote(1))
            expected = ray.get(trainer.greedy.remote(PROMPTS, TOKENS))
            report = sync.push(1)
            assert [p.receiver for p in report.pairs] == [0, 1]
            assert ray.get(host.generate.remote(PROMPTS, TOKENS)) == expected
            assert sync.versions() == [1, 1] and ray.get(host.weight_version.remote()) == 1
    finally:
        ray.get(host.shutdown.remote())
        ray.kill(host)
