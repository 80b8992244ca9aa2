"""Staged pushes (issue 18) into real vLLM engines (the CPU build) through WeightSync: ``push(v, staged=True)``
lands in an ``LLM`` engine (between its generate calls) and in an ``AsyncLLM`` engine (while its requests run)
as host copies, both keep generating on the live version, ``flip()`` makes it live on both, ``discard()`` frees
the copies; an engine that refuses the stage makes neither flip (Note [staging in a vLLM worker] in
raysync.engines.vllm_staged). WeightSync's ``max_version_lag`` holds the requests of both kinds until the flip
(Note [requests and the staleness bound]). One engine of each kind serves the module, plus one that refuses;
the LLM engine's actor takes two calls at once (its requests through raysync's ``generate``)."""

from __future__ import annotations

import asyncio
import os
import tempfile
import threading
import types

import pytest
from vllm_cpu import EngineProcesses, require_vllm_cpu, stop, watch

ray = require_vllm_cpu()

from actors import Policy, VllmHost, greedy  # noqa: E402
from test_vllm import CFG, ONE_PROCESS, PROMPTS, TOKENS  # noqa: E402
from test_vllm_async import WAIT_S, AsyncHost  # noqa: E402

from raysync import WeightSync  # noqa: E402
from raysync.core.errors import NothingStaged, StageFailed  # noqa: E402
from raysync.engines.vllm import VllmEngine  # noqa: E402
from raysync.engines.vllm_server import ServerEngine  # noqa: E402
from raysync.ray import staged_endpoint as se  # noqa: E402
from raysync.tools.models import tiny_qwen2  # noqa: E402

pytestmark = pytest.mark.vllm


class SyncHost(VllmHost):
    """Its requests go through raysync's ``generate``: they and the driver's calls never overlap, also when the
    actor takes two calls at once."""

    def staged_bytes(self) -> int:
        """The host memory the engine's workers hold for staged pushes."""
        return sum(self.llm.collective_rpc("raysync_staged_bytes"))

    def generate(self, prompts: list[list[int]], tokens: int) -> list[list[int]]:
        return self.request(prompts, tokens, WAIT_S)[0]

    def request(self, prompts: list[list[int]], tokens: int, wait_s: float) -> tuple[list[list[int]], object]:
        """The greedy tokens of each prompt, and the version that made them (raysync.engines.vllm.generate)."""
        from vllm import SamplingParams

        from raysync.engines.vllm import generate

        params = SamplingParams(max_tokens=tokens, min_tokens=tokens, temperature=0.0)
        prompts = [{"prompt_token_ids": p} for p in prompts]
        done = generate(self.llm, prompts, params, wait_s=wait_s, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in done.output], done.version

    def request_refused(self, wait_s: float) -> str:
        try:
            self.request(PROMPTS[:1], 1, wait_s)
        except Exception as e:
            return f"{type(e).__name__}: {e}"
        return "admitted"

    def requests_in(self, count: int, timeout_s: float) -> None:
        """Until ``count`` requests are inside raysync's ``generate`` (begun, not ended)."""
        from raysync.ray.step_gate import gate_of

        gate = gate_of(self.llm)
        with gate.cond:
            assert gate.cond.wait_for(lambda: gate.loops >= count, timeout_s), "no request came"


class AsyncStagedHost(AsyncHost):
    async def staged_bytes(self) -> int:
        return sum(await self.llm.collective_rpc("raysync_staged_bytes"))

    async def requests_held(self, count: int, timeout_s: float) -> None:
        """Until ``count`` requests wait for a flip that max_version_lag needs."""
        from raysync.engines.vllm_async import gate_of

        gate = gate_of(self.llm)
        async with gate.bound_moved:
            await asyncio.wait_for(gate.bound_moved.wait_for(lambda: gate.held >= count), timeout_s)

    async def finished(self, version: object) -> int:
        """How many requests made by ``version`` have finished."""
        return sum(v == version for _, _, v, _ in self.done)

    async def release_when_served(self, trainer, requests: int, timeout_s: float) -> list:
        """Once a staged push lands in the engine's workers, wait for ``requests`` more requests to finish, then
        let the trainer's held push go (it cannot land before): the versions of those requests."""
        from raysync.engines.vllm_async import gate_of

        landing = gate_of(self.llm).landing
        try:
            await asyncio.wait_for(landing.wait(), timeout_s)
            n = len(self.done)
            async with self.changed:
                served = lambda: len(self.done) >= n + requests or self.errors  # noqa: E731
                await asyncio.wait_for(self.changed.wait_for(served), timeout_s)
            assert landing.is_set() and not self.errors, self.errors
            return [v for _, _, v, _ in self.done[n : n + requests]]
        finally:  # also when this failed: the push goes on, and the test fails on this call's error
            await trainer.release.remote()


class HeldPolicy(Policy):
    """A trainer whose pushes wait, after ``hold()``, until ``release()`` (its source waits): a staged push held
    in flight. Its actor takes two calls at once (a push, and the release)."""

    def __init__(self, seed: int):
        super().__init__(seed)
        self.go = threading.Event()
        self.go.set()

    def hold(self) -> None:
        self.go.clear()

    def release(self) -> None:
        self.go.set()


def held_source(actor: HeldPolicy):
    if not actor.go.wait(WAIT_S):
        raise TimeoutError(f"the push was held for more than {WAIT_S} s")
    return actor.model.named_parameters()


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> dict[str, str]:
    """The engines' checkpoint, and one of another layout (a larger vocabulary: no push of the trainers fits)."""
    paths = {}
    for name, vocab in (("tiny", 512), ("other-vocab", 640)):
        paths[name] = str(tmp_path_factory.mktemp(name))
        tiny_qwen2(seed=1, vocab=vocab).save_pretrained(paths[name])
    return paths


@pytest.fixture(scope="module")
def checkpoint() -> list[list[int]]:
    """What the engines generate from model_dirs["tiny"]: transformers' greedy tokens."""
    return greedy(tiny_qwen2(seed=1), PROMPTS, TOKENS)


@pytest.fixture(scope="module")
def hosts(ray_local, model_dirs):
    """{"sync": an LLM in one process, "async": an AsyncLLM in vLLM's processes, "other": an LLM of another
    layout, started when first asked for}; at the end nothing raysync made in their processes may be left."""
    started: dict[str, object] = {}
    processes = EngineProcesses()

    def get(kind: str):
        if kind not in started:
            if kind == "async":
                host = ray.remote(num_cpus=0.5)(AsyncStagedHost).remote(model_dirs["tiny"])
                where = host.__ray_call__.remote(lambda actor: (os.getpid(), tempfile.gettempdir()))
                processes.look(*ray.get(where, timeout=WAIT_S))
            else:
                which = "other-vocab" if kind == "other" else "tiny"
                concurrency = 2 if kind == "sync" else 1  # a request waits for a flip while the flip comes in
                host = ray.remote(num_cpus=0.5, max_concurrency=concurrency)(SyncHost)
                host = host.options(runtime_env=ONE_PROCESS).remote(model_dirs[which])
            started[kind] = host
        return started[kind]

    yield get
    if "async" in started:
        host = started.pop("async")
        watch(host, processes)
        ray.get(host.shutdown.remote(), timeout=WAIT_S)
        ray.kill(host)
    stop(list(started.values()), processes)


@pytest.fixture
def async_host(hosts, checkpoint):
    """The module's AsyncLLM engine, as if just started: vLLM's own reload loads its checkpoint again."""
    host = hosts("async")
    ray.get(host.reload_from_checkpoint.remote(), timeout=WAIT_S)
    assert ray.get(host.generate_now.remote(PROMPTS, TOKENS), timeout=WAIT_S) == [
        (t, None) for t in checkpoint
    ]
    return host


def test_a_staged_push_lands_while_both_engines_generate_and_the_flip_makes_it_live_on_both(
    ray_local, no_leftovers, hosts, async_host, checkpoint
):
    """The LLM engine generates between the driver's calls, the AsyncLLM engine all the time (two request
    loops). Each staged push is held by its trainer until the AsyncLLM has served three requests while the
    push was landing in its workers (Note [a stage beside the engine's steps]): they ran on the live version.
    After the stage both engines still generate the live version's tokens, after the flip the new one's; a
    discard leaves the live version and frees the staged copies. Every request of the AsyncLLM says one
    version, and its tokens are transformers' on that version's weights."""
    llm = hosts("sync")
    trainer = ray.remote(num_cpus=0.25, max_concurrency=2)(HeldPolicy).remote(seed=11)
    expected = {None: checkpoint}
    ray.get(async_host.start.remote(PROMPTS, TOKENS), timeout=WAIT_S)
    engines = [VllmEngine(llm), VllmEngine(async_host)]
    with WeightSync([trainer], engines, CFG, source=held_source) as sync:
        ray.get(async_host.wait_for.remote(None, 2, WAIT_S), timeout=WAIT_S)
        live = None
        for version in (1, 2):
            ray.get(trainer.step.remote(version))
            expected[version] = ray.get(trainer.greedy.remote(PROMPTS, TOKENS))
            ray.get(trainer.hold.remote())
            served = async_host.release_when_served.remote(trainer, 3, WAIT_S)
            report = sync.push(version, staged=True)  # lands only after those three requests
            assert ray.get(served, timeout=WAIT_S) == [live] * 3
            assert report.staged and [p.bytes > 0 for p in report.pairs] == [True, True]
            assert sync.versions() == [live, live] and sync.staged_versions() == [version, version]
            held = ray.get([llm.staged_bytes.remote(), async_host.staged_bytes.remote()], timeout=WAIT_S)
            assert held == [p.bytes for p in report.pairs]  # host copies of the push's tensors
            staging = sync.staging()  # what each engine says it staged, and where
            assert [(r.mode, r.memory, r.nbytes) for r in staging] == [("whole", "host", b) for b in held]
            assert ray.get(llm.generate.remote(PROMPTS, TOKENS), timeout=WAIT_S) == expected[live]
            # at most two requests were running when the stage returned: a third one started after it
            after = ray.get(async_host.finished.remote(live), timeout=WAIT_S) + 3
            ray.get(async_host.wait_for.remote(live, after, WAIT_S), timeout=WAIT_S)

            flipped = sync.flip()
            assert flipped.version == version and min(flipped.stalls) > 0
            assert sync.versions() == [version, version] and sync.staged_versions() == [None, None]
            assert ray.get(llm.generate.remote(PROMPTS, TOKENS), timeout=WAIT_S) == expected[version]
            ray.get(async_host.wait_for.remote(version, 2 * len(PROMPTS), WAIT_S), timeout=WAIT_S)
            live = version

        ray.get(trainer.step.remote(3))
        sync.push(3, staged=True)
        assert sync.discard() == 3
        assert sync.versions() == [2, 2] and sync.staged_versions() == [None, None]
        assert ray.get([llm.staged_bytes.remote(), async_host.staged_bytes.remote()]) == [0, 0]
        assert ray.get(llm.generate.remote(PROMPTS, TOKENS), timeout=WAIT_S) == expected[2]
        with pytest.raises(NothingStaged):
            sync.flip()
    done, errors = ray.get(async_host.stop.remote(), timeout=WAIT_S)
    assert errors == [] and all(reason == "length" for _, _, _, reason in done)  # none aborted
    assert {v for _, _, v, _ in done} == {None, 1, 2}  # 3 was never live
    for prompt, tokens, version, _ in done:  # every token of it from that version's weights
        assert tokens == expected[version][prompt], (version, prompt)


def test_a_stage_refused_by_one_of_two_engines_flips_neither(
    ray_local, no_leftovers, hosts, async_host, checkpoint
):
    """The other engine's model has another vocabulary: it refuses the push when it is accepted. The AsyncLLM
    engine, which staged it while generating, drops it; neither flips, both keep serving their checkpoints."""
    other = hosts("other")
    trainer = ray.remote(num_cpus=0.25)(Policy).remote(seed=12)
    ray.get(trainer.step.remote(1))
    other_tokens = ray.get(other.generate.remote(PROMPTS, TOKENS), timeout=WAIT_S)
    ray.get(async_host.start.remote(PROMPTS, TOKENS), timeout=WAIT_S)
    with WeightSync([trainer], [VllmEngine(async_host), VllmEngine(other)], CFG) as sync:
        with pytest.raises(StageFailed) as failed:
            sync.push(1, staged=True)
        failures = failed.value.failures
        assert not [f for f in failures if f.endpoint.startswith("receiver #0")], failures
        [refused] = [f for f in failures if f.endpoint.startswith("receiver #1")]
        assert refused.stage.startswith("stage"), refused
        assert "embed_tokens" in refused.error and "nothing flips" in str(failed.value), refused
        assert sync.versions() == [None, None] and sync.staged_versions() == [None, None]
        assert ray.get([async_host.staged_bytes.remote(), other.staged_bytes.remote()]) == [0, 0]
        with pytest.raises(NothingStaged, match="the last staged push failed"):
            sync.flip()
        ray.get(async_host.wait_for.remote(None, 2 * len(PROMPTS), WAIT_S), timeout=WAIT_S)
        assert ray.get(other.generate.remote(PROMPTS, TOKENS), timeout=WAIT_S) == other_tokens
    done, errors = ray.get(async_host.stop.remote(), timeout=WAIT_S)
    assert errors == [] and {v for _, _, v, _ in done} == {None}
    assert all(tokens == checkpoint[prompt] for prompt, tokens, _, _ in done)


def test_max_version_lag_holds_the_requests_of_both_engines_until_the_flip(
    ray_local, no_leftovers, hosts, async_host
):
    """max_version_lag=0: once version 11 is staged, a request of the LLM engine and one of the AsyncLLM engine
    wait for the flip instead of starting on the live weights; after it they run on 11 and say so. With 12
    staged and never flipped, a request that may wait 1 s raises StaleWeights naming the WeightSync and the
    stage; after the discard, requests run on 11 again."""
    llm = hosts("sync")
    trainer = ray.remote(num_cpus=0.25)(Policy).remote(seed=13)
    ray.get(trainer.step.remote(11))
    v11 = ray.get(trainer.greedy.remote(PROMPTS, TOKENS))
    with WeightSync([trainer], [VllmEngine(llm), VllmEngine(async_host)], CFG, max_version_lag=0) as sync:
        sync.push(11, staged=True)
        requests = [
            llm.request.remote(PROMPTS, TOKENS, WAIT_S),
            async_host.generate_now.remote(PROMPTS, TOKENS),
        ]
        ray.get(
            [llm.requests_in.remote(1, WAIT_S), async_host.requests_held.remote(1, WAIT_S)], timeout=WAIT_S
        )
        held = ray.wait(requests, num_returns=2, timeout=0)[0]
        assert held == []  # neither can start on the live weights
        assert sync.flip().version == 11
        answers = ray.get(requests, timeout=WAIT_S)
        assert answers == [(v11, 11), [(tokens, 11) for tokens in v11]]

        ray.get(trainer.step.remote(12))
        sync.push(12, staged=True)
        refused = ray.get([llm.request_refused.remote(1.0), async_host.generate_refused.remote(1.0)])
        for error in refused:
            assert error.startswith("StaleWeights: the live weights are version 11, version 12"), error
            assert f"WeightSync {sync._sync_id} (its flip())" in error and "max_version_lag=0" in error, error
            assert "at stage 'generate: waiting for the flip" in error, error
        assert sync.discard() == 12 and sync.versions() == [11, 11]
        assert ray.get(llm.request.remote(PROMPTS, TOKENS, WAIT_S), timeout=WAIT_S) == (v11, 11)
        assert ray.get(async_host.generate_now.remote(PROMPTS[:1], TOKENS), timeout=WAIT_S) == [(v11[0], 11)]


def test_the_openai_server_refuses_a_staged_push_before_a_byte_moves(ray_local):
    """ServerEngine answers the check that precedes a WeightSync's staged push (receiver_stageable) with its
    refusal, naming the server, without a call to it (the driver turns a refusal there into StageFailed before
    a byte moves); the staged calls after that check are refused outright."""
    server = ServerEngine("http://127.0.0.1:9", "00" * 32)
    answer = ray.get(server.call(se.receiver_stageable, {0: ("s",), 1: ("s",)}), timeout=WAIT_S)
    assert set(answer) == {0, 1}, answer
    for reason in answer.values():
        assert "vLLM's OpenAI server at http://127.0.0.1:9" in reason and "push it live" in reason, reason
    with pytest.raises(ValueError, match="receiver_stage cannot run in a vLLM server"):
        server.call(se.receiver_stage, {0: ("s", 1, None)})


def test_the_drivers_calls_move_the_bound_as_the_workers_answer_them():
    """Note [requests and the staleness bound]: a stage announces its version; a stage that failed or only
    staged leaves the announce standing; a flip settles it with the version the workers say is live, a stage
    skipped (live already) with its version; workers that disagree settle it as MIXED (no version: still
    stale); a close forgets it."""
    from raysync.core.report import PushReport
    from raysync.core.version import MIXED
    from raysync.engines import vllm_staged as staged
    from raysync.ray.results import EndpointResult, RemoteFailure, StagedState
    from raysync.ray.step_gate import StepGate

    gate, stage = StepGate(), {"0": ["s", 3, 0], "1": ["s", 3, 0]}
    staged.after_call(gate, "receiver_connect", ["s", {"timeout_s": 1}], {0: None, 1: None}, connected=2)
    assert gate.stale() is None
    assert staged.before_call(gate, "receiver_stage", stage) and gate.stale() == ("s", 2, 3, 0)
    report = PushReport(3, "shm", 10, 1, 1, 0.1)
    failed = EndpointResult(failure=RemoteFailure("stage", "ValueError: no", ""), version=2)
    assert not staged.after_call(
        gate, "receiver_stage", stage, {0: EndpointResult(report, version=2), 1: failed}
    )
    assert gate.stale() == ("s", 2, 3, 0)  # staged, or failed: the driver flips or discards
    assert staged.after_call(gate, "receiver_flip", {"0": ["s", 3, 5.0]}, {0: StagedState(3, None)})
    assert gate.stale() is None
    staged.before_call(gate, "receiver_stage", stage)
    skipped = EndpointResult(PushReport(3, "shm", 0, 0, 0, 0.0, skipped=True), version=3)
    assert staged.after_call(gate, "receiver_stage", stage, {0: skipped, 1: skipped}) and gate.stale() is None
    staged.before_call(gate, "receiver_stage", {"0": ["s", 4, 0]})
    staged.after_call(gate, "receiver_discard", ["s"], {0: StagedState(3, None), 1: StagedState(2, None)})
    assert gate.syncs["s"].live == MIXED and gate.stale() is None  # nothing announced waits
    staged.before_call(gate, "receiver_stage", {"0": ["s", 5, 3]})
    assert gate.stale() == ("s", MIXED, 5, 3)  # a mix is no version: no lag makes it fresh
    assert staged.after_call(gate, "close", ["s"], {}) and gate.stale() is None and gate.syncs == {}


def test_calls_into_a_worker_wait_for_a_stage_landing_on_its_thread(monkeypatch):
    """Note [a stage beside the engine's steps]: the stage's answer comes once it landed; a call that changes
    the worker's sessions waits for it, bounded (StagingError naming the call)."""
    from raysync.core.errors import StagingError
    from raysync.engines import vllm_staged as staged

    worker = types.SimpleNamespace(rank=0)
    go = threading.Event()
    staged.begin(worker, lambda: {"0": "staged"} if go.wait(WAIT_S) else {"0": "never released"})
    with pytest.raises(RuntimeError, match="one at a time"):
        staged.begin(worker, dict)
    assert staged.wait(worker, 0.01) is None  # still landing
    monkeypatch.setattr(staged, "SETTLE_S", 0.05)
    with pytest.raises(StagingError, match="receiver_connect waited 0.05 s for a staged push still landing"):
        staged.settle(worker, "receiver_connect")
    monkeypatch.setattr(staged, "SETTLE_S", WAIT_S)
    go.set()
    staged.settle(worker, "receiver_connect")  # returns once it landed
    assert staged.wait(worker, WAIT_S) == {"0": "staged"}
    with pytest.raises(RuntimeError, match="receiving no staged push"):
        staged.wait(worker, 0)
