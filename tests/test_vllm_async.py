"""A real vLLM ``AsyncLLM`` (the CPU build) inside an async Ray actor, generating all the time, takes pushes
through WeightSync: no request fails, none sees two versions, and each says which version made it (Note [a push
into a generating engine] in raysync.engines.vllm_async). Its version follows raysync's sleep and wake and
vLLM's own reload (Note [sleep and wake of an AsyncLLM]). One engine serves the module's tests."""

from __future__ import annotations

import asyncio
import os
import tempfile

import pytest
from vllm_cpu import EngineProcesses, require_vllm_cpu

ray = require_vllm_cpu()

from actors import ENGINE_ARGS, Policy, greedy  # noqa: E402
from test_vllm import CFG, PROMPTS, TOKENS  # noqa: E402

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
        self.calls: list[tuple] = []  # what raysync asked of the engine, while record_calls is on
        self._recording = False

    async def start(self, prompts: list[list[int]], tokens: int, loops: int = 2) -> None:
        self.done, self.errors, self.stopping = [], [], False
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

    # --- one request at a time, sleep and wake, and what raysync asked of the engine ---------------------------
    async def generate_now(
        self, prompts: list[list[int]], tokens: int, wait_s: float = WAIT_S
    ) -> list[tuple]:
        """(tokens, version) of each prompt, one request after the other through raysync's ``generate``."""
        from vllm import SamplingParams

        from raysync.engines.vllm_async import generate

        params = SamplingParams(max_tokens=tokens, min_tokens=tokens, temperature=0.0)
        out = []
        for prompt in prompts:
            done = await generate(self.llm, {"prompt_token_ids": prompt}, params, wait_s=wait_s)
            out.append((list(done.output.outputs[0].token_ids), done.version))
        return out

    async def generate_refused(self, wait_s: float) -> str:
        """The error of a request through ``generate`` that may wait ``wait_s`` to be admitted."""
        try:
            await self.generate_now(PROMPTS[:1], 1, wait_s)
        except Exception as e:
            return f"{type(e).__name__}: {e}"
        return "admitted"

    async def sleep(self, level: int) -> None:
        from raysync.engines.vllm_async import sleep

        await sleep(self.llm, level)

    async def wake_up(self) -> None:
        from raysync.engines.vllm_async import wake_up

        await wake_up(self.llm)

    async def is_sleeping(self) -> bool:
        return await self.llm.is_sleeping()

    async def reload_from_checkpoint(self) -> None:
        """vLLM's own reload, outside raysync: the engine loads its starting checkpoint again."""
        await self.llm.collective_rpc("reload_weights")
        await self.llm.reset_prefix_cache()

    def record_calls(self) -> None:
        """From now on keep, in order, the engine's wake_up calls (their tags) and raysync's calls into its
        workers (their endpoint function): the real calls, made as before."""
        if self._recording:
            return
        self._recording = True
        llm, wake_up, collective_rpc = self.llm, self.llm.wake_up, self.llm.collective_rpc

        async def recorded_wake_up(tags=None):
            self.calls.append(("wake_up", tuple(tags or ())))
            return await wake_up(tags)

        async def recorded_collective_rpc(method, *args, **kwargs):
            if method == "raysync_call":
                self.calls.append(("raysync_call", kwargs["args"][0]))
            return await collective_rpc(method, *args, **kwargs)

        llm.wake_up, llm.collective_rpc = recorded_wake_up, recorded_collective_rpc

    def take_calls(self) -> list[tuple]:
        calls, self.calls = self.calls, []
        return calls


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("tiny-qwen2"))
    tiny_qwen2(seed=1).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def checkpoint() -> list[tuple[list[int], None]]:
    """What the engine generates from model_dir's weights, through ``generate_now``: transformers' greedy
    tokens, and no version."""
    return [(tokens, None) for tokens in greedy(tiny_qwen2(seed=1), PROMPTS, TOKENS)]


@pytest.fixture(scope="module")
def shared_host(ray_local, model_dir):
    """The module's AsyncHost actor; at the end it is shut down, and nothing raysync made in its processes may
    be left (vllm_cpu.EngineProcesses)."""
    host = ray.remote(num_cpus=0.5)(AsyncHost).remote(model_dir)
    processes = EngineProcesses()
    where = host.__ray_call__.remote(lambda actor: (os.getpid(), tempfile.gettempdir()))
    pid, temp_dir = ray.get(where, timeout=WAIT_S)
    processes.look(pid, temp_dir)  # the EngineCore runs under the actor's process
    yield host
    processes.look(pid, temp_dir)
    ray.get(host.shutdown.remote(), timeout=WAIT_S)
    ray.kill(host)
    processes.clean_up_and_check()


@pytest.fixture
def async_host(shared_host, checkpoint):
    """The module's engine, as if just started: vLLM's own reload loads its checkpoint again (no version)."""
    ray.get(shared_host.reload_from_checkpoint.remote(), timeout=WAIT_S)
    assert ray.get(shared_host.generate_now.remote(PROMPTS, TOKENS), timeout=WAIT_S) == checkpoint
    return shared_host


def test_an_async_engine_generating_all_the_time_takes_three_pushes(
    ray_local, async_host, checkpoint, no_leftovers
):
    host = async_host
    trainer = ray.remote(num_cpus=0.25)(Policy).remote(seed=11)
    expected = {None: [tokens for tokens, _ in checkpoint]}  # the engine's checkpoint: no version
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


def test_an_async_engine_keeps_the_version_rules_across_sleep_wake_and_vllms_reload(
    ray_local, async_host, checkpoint, no_leftovers
):
    """Note [sleep and wake of an AsyncLLM], through the real engine: vLLM's CPU build keeps the weights through
    a sleep (its workers ignore sleep and wake_up) but its engine core sleeps for real: the scheduler is paused
    and is_sleeping() says so until the KV cache is woken. So what is seen through it: the versions, the gate,
    the order of the wake-ups around a push, vLLM's reload."""
    host = async_host
    trainer = ray.remote(num_cpus=0.25)(Policy).remote(seed=13)
    ray.get(host.record_calls.remote())
    with WeightSync([trainer], [VllmEngine(host)], CFG) as sync:
        ray.get(trainer.step.remote(1))
        v1 = [(tokens, 1) for tokens in ray.get(trainer.greedy.remote(PROMPTS, TOKENS))]
        ray.get(host.take_calls.remote())
        assert sync.push(1).pairs[0].bytes > 0
        pushed = ray.get(host.take_calls.remote())
        assert ("raysync_call", "receiver_receive") in pushed
        assert not [c for c in pushed if c[0] == "wake_up"], pushed  # an awake engine is not woken
        assert ray.get(host.generate_now.remote(PROMPTS, TOKENS), timeout=WAIT_S) == v1

        ray.get(host.sleep.remote(1), timeout=WAIT_S)  # level 1: the same weights come back
        assert ray.get(host.is_sleeping.remote()) and sync.versions() == [1]
        refused = ray.get(host.generate_refused.remote(1.0), timeout=WAIT_S)  # held at the gate, not queued
        assert "PeerTimeout" in refused and "generate: wait for the push" in refused, refused
        ray.get(host.take_calls.remote())
        ray.get(host.wake_up.remote(), timeout=WAIT_S)
        assert ray.get(host.take_calls.remote()) == [("wake_up", ("weights",)), ("wake_up", ("kv_cache",))]
        assert not ray.get(host.is_sleeping.remote())
        assert sync.versions() == [1] and sync.push(1).pairs[0].bytes == 0  # kept: skipped
        assert ray.get(host.generate_now.remote(PROMPTS, TOKENS), timeout=WAIT_S) == v1

        ray.get(host.sleep.remote(2), timeout=WAIT_S)  # level 2: the weights are gone, so is the version
        assert ray.get(host.is_sleeping.remote()) and sync.versions() == [None]
        ray.get(host.take_calls.remote())
        assert sync.push(1).pairs[0].bytes > 0  # into the sleeping engine: applied, not skipped
        order = [
            c for c in ray.get(host.take_calls.remote()) if c[0] == "wake_up" or c[1] == "receiver_receive"
        ]
        assert order == [
            ("wake_up", ("weights",)),
            ("raysync_call", "receiver_receive"),
            ("wake_up", ("kv_cache",)),
        ], order
        assert not ray.get(host.is_sleeping.remote()) and sync.versions() == [1]
        assert ray.get(host.generate_now.remote(PROMPTS, TOKENS), timeout=WAIT_S) == v1  # the gate is open

        # vLLM's reload_weights, outside raysync
        ray.get(host.reload_from_checkpoint.remote(), timeout=WAIT_S)
        assert sync.versions() == [None]
        assert ray.get(host.generate_now.remote(PROMPTS, TOKENS), timeout=WAIT_S) == checkpoint
        assert sync.push(1).pairs[0].bytes > 0  # the same version again: applied
        assert ray.get(host.generate_now.remote(PROMPTS, TOKENS), timeout=WAIT_S) == v1


def test_sleep_refuses_to_keep_requests_across_it():
    from raysync.engines.vllm_async import sleep

    with pytest.raises(ValueError, match="'keep'"):
        asyncio.run(sleep(object(), 1, mode="keep"))  # refused before the engine is touched
