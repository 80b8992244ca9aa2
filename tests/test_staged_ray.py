"""Staged pushes through WeightSync (issue 18): ``push(v, staged=True)``, ``flip()``, ``discard()`` on a real local
Ray, into engine actors that keep generating on their own thread (raysync.ray.staged_endpoint.engine_steps) or
in their Ray calls; over shm and over the collective (gloo)."""

from __future__ import annotations

import hashlib
import os
import signal
import threading

import pytest
import torch

ray = pytest.importorskip("ray")

from raysync import SyncConfig, WeightSync  # noqa: E402
from raysync.core.errors import FlipFailed, NothingStaged, StageFailed, StaleWeights  # noqa: E402
from raysync.ray.staged_endpoint import engine_steps  # noqa: E402

DIM, LAYERS = 128, 3
CFG = SyncConfig(bucket_bytes=32 << 10, num_buffers=2, timeout_s=10, progress=False, verify=True)
ACTOR = {"num_cpus": 0.25}


def make_model(version: int | None) -> torch.nn.Sequential:
    """The small model; ``version`` seeds its weights (None: the engine's own initial weights)."""
    g = torch.Generator().manual_seed(777 if version is None else version)
    model = torch.nn.Sequential(*[torch.nn.Linear(DIM, DIM) for _ in range(LAYERS)])
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    return model


def weights_digest(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


class Trainer:
    def __init__(self):
        self.model = make_model(0)

    def step(self, version: int) -> str:
        """Version ``version``'s weights, written in place (what an optimizer step does); their digest."""
        with torch.no_grad():
            for p, q in zip(self.model.parameters(), make_model(version).parameters(), strict=True):
                p.copy_(q)
        return weights_digest(self.model)

    def nudge(self, version: int) -> str:
        """A change of one element: what a delta push moves little of."""
        with torch.no_grad():
            self.model[0].bias[0] += version
        return weights_digest(self.model)


class LoopEngine:
    """A torch engine generating on its own thread: before each step, the boundary engine_steps yields (flips
    happen there, and only there); each step records the version it was told, and its weights' digest when it
    started and when it ended. A StaleWeights at a boundary is recorded, and the loop tries again."""

    def __init__(self):
        self.model = make_model(None)
        self.steps: list[tuple[object, str, str]] = []
        self.stale: list[str] = []
        self.broken = False
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def digest(self) -> str:
        return weights_digest(self.model)

    def destinations(self) -> dict[str, torch.Tensor]:
        """The sink: the model's parameters; once broken, one of them has a shape no push fits."""
        live = dict(self.model.named_parameters())
        if self.broken:
            live["0.bias"] = torch.empty(DIM + 1)
        return live

    def load(self, batch: list[tuple[str, torch.Tensor]]) -> None:
        """A load function (``load_weights``-style) over the same parameters."""
        params = dict(self.model.named_parameters())
        with torch.no_grad():
            for name, t in batch:
                params[name].copy_(t)

    def break_staging(self) -> None:
        self.broken = True

    def start(self, wait_s: float = 60.0) -> None:
        self._thread = threading.Thread(target=self._loop, args=(wait_s,), daemon=True)
        self._thread.start()

    def _loop(self, wait_s: float) -> None:
        x = torch.randn(8, DIM, generator=torch.Generator().manual_seed(1))
        with engine_steps(self, wait_s) as boundary:
            while not self._stop.is_set():
                try:
                    version = boundary()
                except StaleWeights as e:
                    with self._cond:
                        self.stale.append(f"{type(e).__name__}|{e.peer}|{e.stage}|{e}")
                        self._cond.notify_all()
                    continue
                before = weights_digest(self.model)
                with torch.no_grad():
                    self.model(x)
                with self._cond:
                    self.steps.append((version, before, weights_digest(self.model)))
                    self._cond.notify_all()

    def wait_steps(self, more: int, timeout_s: float = 60.0) -> list:
        """Block until ``more`` further steps ran; those steps."""
        with self._cond:
            n = len(self.steps)
            assert self._cond.wait_for(lambda: len(self.steps) >= n + more, timeout_s), "the engine stopped"
            return self.steps[n:]

    def wait_stale(self, timeout_s: float = 60.0) -> tuple[str, int]:
        """Block until a boundary raised StaleWeights; it, and how many steps had run then."""
        with self._cond:
            assert self._cond.wait_for(lambda: self.stale, timeout_s), "no StaleWeights"
            return self.stale[-1], len(self.steps)

    def stop(self) -> tuple[list, list[str]]:
        self._stop.set()
        self._thread.join(timeout=60)
        assert not self._thread.is_alive()
        return self.steps, self.stale

    def die(self) -> None:
        os.kill(os.getpid(), signal.SIGKILL)


def sink(actor: LoopEngine) -> dict[str, torch.Tensor]:
    return actor.destinations()


def loader(actor: LoopEngine):
    return actor.load


def _actors(made: list, engines: int, **engine_options) -> tuple:
    trainer = ray.remote(**ACTOR)(Trainer).remote()
    out = [ray.remote(**ACTOR, **engine_options)(LoopEngine).remote() for _ in range(engines)]
    made += [trainer, *out]
    return trainer, out


def _check_steps(steps: list, digests: dict) -> list:
    """Every step computed on one pushed version's weights, the one it was told; the versions it was told."""
    assert [s for s in steps if s[1] != s[2]] == []  # no flip inside a step
    assert [s for s in steps if digests.get(s[0]) != s[1]] == []  # the version told names the weights
    return [s[0] for s in steps]


@pytest.mark.parametrize("transport", ["shm", "collective"])
def test_an_engine_generates_through_three_staged_pushes_on_exactly_one_version_per_step(
    ray_local, no_leftovers, made, transport
):
    """Engine #0 generates on its own thread; engine #1 is a plain actor (a flip runs in WeightSync's call).
    While each version is staged the engines keep running the live one; the flip lands between two steps."""
    trainer, engines = _actors(made, 2)
    digests = {None: ray.get(engines[0].digest.remote())}
    with WeightSync([trainer], engines, CFG, sink=sink, transport=transport) as sync:
        assert {p.transport for p in sync.plan} == {transport}
        ray.get(engines[0].start.remote())
        for version in (1, 2, 3):
            digests[version] = ray.get(trainer.step.remote(version))
            report = sync.push(version, staged=True)
            assert report.staged and report.version == version and "staged (not applied" in str(report)
            assert sync.versions() == [version - 1 or None] * 2 and sync.staged_versions() == [version] * 2
            meanwhile = ray.get(engines[0].wait_steps.remote(2))  # still generating, on the live version
            assert {s[0] for s in meanwhile} == {version - 1 or None}
            flipped = sync.flip()
            assert flipped.version == version and len(flipped.stalls) == 2 and min(flipped.stalls) > 0
            assert sync.versions() == [version] * 2 and sync.staged_versions() == [None, None]
            assert {s[0] for s in ray.get(engines[0].wait_steps.remote(2))} == {version}
            assert ray.get(engines[1].digest.remote()) == digests[version]
        steps, stale = ray.get(engines[0].stop.remote())
    versions = _check_steps(steps, digests)
    assert [v or 0 for v in versions] == sorted(v or 0 for v in versions)
    assert set(versions) == {None, 1, 2, 3} and stale == []


def test_a_stage_failing_on_one_of_two_engines_flips_neither(ray_local, no_leftovers, made):
    trainer, engines = _actors(made, 2)
    digests = {}
    with WeightSync([trainer], engines, CFG, sink=sink) as sync:
        digests[1] = ray.get(trainer.step.remote(1))
        sync.push(1, staged=True)
        sync.flip()
        ray.get([e.start.remote() for e in engines])
        ray.get(engines[1].break_staging.remote())
        digests[2] = ray.get(trainer.step.remote(2))
        with pytest.raises(StageFailed) as failed:
            sync.push(2, staged=True)
        named = [f for f in failed.value.failures if f.endpoint.startswith("receiver #1")]
        assert named and named[0].stage.startswith("stage") and "0.bias" in named[0].error
        assert "nothing flips" in str(failed.value)
        assert sync.versions() == [1, 1] and sync.staged_versions() == [None, None]  # #0 discarded its stage
        with pytest.raises(NothingStaged, match="the last staged push failed"):
            sync.flip()
        after = [ray.get(e.wait_steps.remote(2)) for e in engines]  # both keep serving version 1
        assert all({(s[0], s[1]) for s in steps} == {(1, digests[1])} for steps in after)
        for e in engines:
            steps, _ = ray.get(e.stop.remote())
            _check_steps(steps, digests)


def test_a_flip_is_refused_everywhere_when_an_engine_lost_its_staged_version(ray_local, no_leftovers, made):
    """Engine #1 is killed and restarted by Ray between the staged push and the flip: the flip's check finds its
    staged version gone, no engine flips, #0 discards; the next push reconnects #1 and lands everywhere."""
    trainer, engines = _actors(made, 2, max_restarts=1)
    with WeightSync([trainer], engines, CFG, sink=sink) as sync:
        one = ray.get(trainer.step.remote(1))
        sync.push(1, staged=True)
        sync.flip()
        ray.get(trainer.step.remote(2))
        sync.push(2, staged=True)
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(engines[1].die.remote())
        with pytest.raises(FlipFailed) as failed:
            sync.flip()
        assert failed.value.flipped == () and "no receiver flipped" in str(failed.value)
        [f] = failed.value.failures
        assert f.endpoint.startswith("receiver #1") and f.stage.startswith("flip") and "gone" in f.error
        assert sync.versions() == [1, None] and sync.staged_versions() == [None, None]
        assert ray.get(engines[0].digest.remote()) == one
        three = ray.get(trainer.step.remote(3))
        sync.push(3, staged=True)
        assert sync.flip().version == 3 and sync.versions() == [3, 3]
        assert ray.get([e.digest.remote() for e in engines]) == [three, three]


def test_max_version_lag_holds_the_engine_at_its_step_boundary_until_the_flip(ray_local, no_leftovers, made):
    """max_version_lag=1: with version 2 staged the engine keeps generating on 1; version 3 staged (replacing 2,
    never flipped) is two ahead, so the engine stops at its boundary (StaleWeights after its wait, naming the
    WeightSync) and its next step runs on 3, after the flip."""
    trainer, [engine] = _actors(made, 1)
    digests = {}
    with WeightSync([trainer], [engine], CFG, sink=sink, max_version_lag=1) as sync:
        digests[1] = ray.get(trainer.step.remote(1))
        sync.push(1, staged=True)
        sync.flip()
        ray.get(engine.start.remote(1.0))
        digests[2] = ray.get(trainer.step.remote(2))
        sync.push(2, staged=True)
        assert {s[0] for s in ray.get(engine.wait_steps.remote(2))} == {1}  # one behind: within the bound
        digests[3] = ray.get(trainer.step.remote(3))
        sync.push(3, staged=True)  # replaces staged version 2
        assert sync.staged_versions() == [3]
        stale, held = ray.get(engine.wait_stale.remote())
        assert stale.startswith(f"StaleWeights|WeightSync {sync._sync_id}")
        assert "step boundary: waiting for the flip" in stale and "max_version_lag=1" in stale
        assert sync.flip().version == 3
        ray.get(engine.wait_steps.remote(2))
        steps, _ = ray.get(engine.stop.remote())
    versions = _check_steps(steps, digests)
    assert set(versions[held:]) == {3} and 2 not in versions


def test_full_passes_through_a_live_push_drops_the_staged_version_and_a_load_function_cannot_stage(
    ray_local, no_leftovers, made
):
    config = (
        SyncConfig(  # every push that can be a delta is one (the time rule would measure a full push first)
            bucket_bytes=32 << 10,
            num_buffers=2,
            timeout_s=10,
            progress=False,
            delta=True,
            delta_by_time=False,
        )
    )
    total = sum(p.nbytes for p in make_model(0).parameters())
    trainer, [engine] = _actors(made, 1)
    with WeightSync([trainer], [engine], config, sink=sink) as sync:
        ray.get(trainer.step.remote(1))
        sync.push(1)
        ray.get(trainer.nudge.remote(2))
        assert sync.push(2).bytes < total // 10  # a delta: one element changed
        three = ray.get(trainer.nudge.remote(3))
        assert sync.push(3, full=True).bytes == total
        assert ray.get(engine.digest.remote()) == three
        ray.get(trainer.nudge.remote(4))
        sync.push(4, staged=True)
        five = ray.get(trainer.nudge.remote(5))
        sync.push(5)  # live: staged version 4 is dropped (flipped later, it would go back in time)
        assert sync.staged_versions() == [None] and sync.versions() == [5]
        with pytest.raises(NothingStaged, match="nothing staged"):
            sync.flip()
        assert ray.get(engine.digest.remote()) == five
        ray.get(trainer.nudge.remote(6))
        sync.push(6, staged=True)
        assert sync.discard() == 6 and sync.staged_versions() == [None] and sync.versions() == [5]
        assert ray.get(engine.digest.remote()) == five
    with WeightSync([trainer], [engine], config, sink=loader) as sync:  # nothing to flip into: refused
        with pytest.raises(StageFailed, match="receiver #0.*load function"):
            sync.push(7, staged=True)
        seven = ray.get(trainer.nudge.remote(7))
        sync.push(7)  # applied live, through the load function
        assert sync.versions() == [7] and ray.get(engine.digest.remote()) == seven


def test_a_staged_push_reports_where_each_engine_staged_it_and_staging_memory_passes_through(
    ray_local, no_leftovers, made
):
    """CPU engines stage in host memory whatever staging_memory asks (their device memory is host memory): each
    engine's StagingReport says so and why, its bytes the push's (whole staging); the plan says the choice once
    made. An unknown staging_memory is refused before any actor is asked anything (here: one that is dead)."""
    total = sum(p.nbytes for p in make_model(0).parameters())
    trainer, engines = _actors(made, 2)
    with WeightSync([trainer], engines, CFG, sink=sink) as sync:
        assert sync.staging() == [None, None] and sync.plan.staging == {}
        assert "staging (staging_memory='auto'): chosen at the first staged push" in str(sync.plan)
        one = ray.get(trainer.step.remote(1))
        report = sync.push(1, staged=True)
        assert [p.bytes for p in report.pairs] == [total, total]
        staging = sync.staging()
        for s in staging:
            assert (s.mode, s.memory, s.asked, s.groups) == ("whole", "host", "auto", 1)
            assert s.nbytes == s.push_bytes == total and "staging for the whole push" in s.why
            assert "device and host staging are the same memory" in s.memory_why
        assert sync.plan.staging == dict(enumerate(staging))
        text = str(sync.plan)
        assert all(f"receiver #{j}: whole, host memory, {total} bytes" in text for j in (0, 1))
        assert text.splitlines()[-1].startswith("push rounds: ")  # the staging comes before it
        assert sync.flip().version == 1 and sync.staging() == staging  # the memory is kept for the next push
        assert ray.get([e.digest.remote() for e in engines]) == [one, one]
    with WeightSync([trainer], engines[:1], CFG, sink=sink, staging_memory="device") as sync:
        assert "staging (staging_memory='device'): chosen at the first staged push" in str(sync.plan)
        two = ray.get(trainer.step.remote(2))
        sync.push(2, staged=True)
        [s] = sync.staging()
        assert (s.asked, s.memory, s.nbytes) == ("device", "host", total)
        assert "device and host staging are the same memory" in s.memory_why
        assert sync.flip().version == 2 and ray.get(engines[0].digest.remote()) == two
    ray.kill(engines[1])
    with pytest.raises(ValueError, match="staging_memory='gpu': one of 'auto', 'device', 'host'"):
        WeightSync([trainer], engines[1:], CFG, sink=sink, staging_memory="gpu")
