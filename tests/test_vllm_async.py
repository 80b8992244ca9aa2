"""A real vLLM ``AsyncLLM`` (the CPU build) inside an async Ray actor, generating all the time, takes pushes
through WeightSync: no request fails, none sees two versions, and each says which version made it (Note [a push
into a generating engine] in raysync.engines.vllm_async)."""

from __future__ import annotations

import asyncio
import os

import pytest
from vllm_cpu import require_vllm_cpu

ray = require_vllm_cpu()

from actors import ENGINE_ARGS, Policy, greedy  # noqa: E402
from test_vllm import CFG, PROMPTS, TOKENS, vllm_segments  # noqa: E402

from raysync import WeightSync  # noqa: E402
from raysync.engines.vllm import VllmEngine  # noqa: E402
from raysync.tools.models import tiny_qwen2  # noqa: E402

pytestmark = pytest.mark.vllm

WAIT_S = 300  # a bound on each wait of the driver for the engine (a loaded 2-core machine)


class AsyncHost:
    """A user's async rollout actor: an AsyncLLM made in ``__init__`` (run in the actor's event loop), and
    request loops that generate through raysync's ``generate`` until stopped, keeping every finished request."""

    def __init__(self, model_dir: str):
        from vllm import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        args = AsyncEngineArgs(
            model_dir, worker_extension_cls="raysync.engines.vllm.WorkerExtension", **ENGINE_ARGS
        )
        self.llm = AsyncLLM.from_engine_args(args)
        self.done: list[tuple[int, list[int], object, str]] = []  # (prompt, tokens, version, finish reason)
        self.errors: list[str] = []
        self.tasks: list[asyncio.Task] = []
        self.stopping = False
        self.changed = asyncio.Condition()

    async def start(self, prompts: list[list[int]], tokens: int, loops: int = 2) -> None:
        self.tasks = [asyncio.create_task(self._requests(prompts, tokens, k)) for k in range(loops)]

    async def _requests(self, prompts: list[list[int]], tokens: int, first: int) -> None:
        from vllm import SamplingParams

        from raysync.engines.vllm_async import generate

        params = SamplingParams(max_tokens=tokens, min_tokens=tokens, temperature=0.0)
        k = first
        while not self.stopping:
            which = k % len(prompts)
            try:
                done = await generate(self.llm, {"prompt_token_ids": prompts[which]}, params)
                finished = done.output.outputs[0]
                self.done.append((which, list(finished.token_ids), done.version, finished.finish_reason))
            except Exception as e:
                self.errors.append(f"{type(e).__name__}: {e}")
            async with self.changed:
                self.changed.notify_all()
            k += 1

    async def wait_for(self, version: object, count: int, timeout_s: float) -> None:
        """Until ``count`` requests made by ``version`` have finished (or any request failed)."""

        def seen() -> bool:
            return bool(self.errors) or sum(v == version for _, _, v, _ in self.done) >= count

        async with self.changed:
            await asyncio.wait_for(self.changed.wait_for(seen), timeout_s)

    async def stop(self) -> tuple[list, list[str]]:
        self.stopping = True
        await asyncio.wait_for(asyncio.gather(*self.tasks), WAIT_S)
        return self.done, self.errors

    async def shutdown(self) -> None:
        self.llm.shutdown(timeout=60)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("tiny-qwen2"))
    tiny_qwen2(seed=1).save_pretrained(path)
    return path


@pytest.fixture
def async_host(model_dir):
    """An AsyncHost actor; at the end it is shut down and the shared memory vLLM made for it must be gone."""
    host = ray.remote(num_cpus=0.5)(AsyncHost).remote(model_dir)
    ours = vllm_segments(host)  # the EngineCore's, under the actor's process
    yield host
    ours |= vllm_segments(host)
    ray.get(host.shutdown.remote(), timeout=WAIT_S)
    ray.kill(host)
    left = sorted(n for n in ours if os.path.exists(os.path.join("/dev/shm", n)))
    for name in left:
        os.unlink(os.path.join("/dev/shm", name))
    assert not left, f"vLLM left {left} in /dev/shm"


def test_an_async_engine_generating_all_the_time_takes_three_pushes(ray_local, async_host, no_leftovers):
    host = async_host
    trainer = ray.remote(num_cpus=0.25)(Policy).remote(seed=11)
    expected = {None: greedy(tiny_qwen2(seed=1), PROMPTS, TOKENS)}  # the engine's checkpoint: no version
    ray.get(host.start.remote(PROMPTS, TOKENS), timeout=WAIT_S)
    with WeightSync([trainer], [VllmEngine(host)], CFG) as sync:
        ray.get(host.wait_for.remote(None, 2, WAIT_S), timeout=WAIT_S)
        for version in (1, 2, 3):
            ray.get(trainer.step.remote(version))
            expected[version] = ray.get(trainer.greedy.remote(PROMPTS, TOKENS))
            report = sync.push(version)  # the request loops keep going meanwhile
            assert report.pairs[0].bytes > 0
            ray.get(host.wait_for.remote(version, 2 * len(PROMPTS), WAIT_S), timeout=WAIT_S)
        assert sync.versions() == [3]
    done, errors = ray.get(host.stop.remote(), timeout=WAIT_S)
    assert errors == []
    assert all(reason == "length" for _, _, _, reason in done)  # none aborted by a push
    by_version = {v: [(p, t) for p, t, w, _ in done if w == v] for v in expected}
    assert sum(map(len, by_version.values())) == len(done)  # each request says one version of these
    for version, requests in by_version.items():
        assert requests, f"no request finished on version {version}"
        for prompt, tokens in requests:  # every token of it from that version's weights
            assert tokens == expected[version][prompt], (version, prompt)
