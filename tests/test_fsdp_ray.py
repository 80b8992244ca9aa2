"""WeightSync drives a sharded trainer: real FSDP2 (``fully_shard`` over gloo) with each trainer rank a Ray actor
holding the DTensorSource it made; the sending rank pushes, the other ranks follow, in the same round (Note
[every rank takes part in every push] in raysync.ray.trainer_group). And a lazy source that is not sharded."""

from __future__ import annotations

import dataclasses
import time

import pytest
import torch

ray = pytest.importorskip("ray")
pytest.importorskip("transformers")

from actors import Engine  # noqa: E402
from workers import die_instead_of_gathering, digest  # noqa: E402

from raysync import SyncConfig, SyncError, WeightSync  # noqa: E402
from raysync.ray.actors import ask  # noqa: E402
from raysync.ray.placement import PlanError  # noqa: E402
from raysync.tools.models import tiny_qwen2  # noqa: E402

# staged: a push that fails part-way leaves the engine's weights and version as they were. timeout_s: a
# follower waits at the start of a push while the sending rank opens its session (its first push) on a
# machine that may be busy with other tests
CFG = SyncConfig(bucket_bytes=64 << 10, timeout_s=10, progress=False, staged=True)
ACTOR = {"num_cpus": 0.25}


class FsdpRank:
    """One rank of an FSDP2 trainer, as a user would write it: the model sharded over gloo, an optimizer, and
    the DTensorSource made on every rank at the same point (``setup``, called on all ranks at once)."""

    def __init__(self, rank: int, world: int):
        self.rank, self.world = rank, world
        self.model = self.source = self.optimizer = self.store = None

    def setup(self, store: str, config: SyncConfig) -> None:
        """Idempotent per store: a call that Ray answered "unavailable" may have run (ask() asks again)."""
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        from raysync.sources import DTensorSource

        if store == self.store:
            return
        if dist.is_initialized():  # a rebuild after a rank was lost: a new group, a new source
            dist.destroy_process_group()
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=self.rank, world_size=self.world)
        mesh = init_device_mesh("cpu", (self.world,))  # gloo's mesh even where a GPU is visible
        model = tiny_qwen2(seed=0)
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        self.model, self.optimizer = model, torch.optim.SGD(model.parameters(), lr=0.05)
        self.source, self.store = DTensorSource(model.named_parameters(), config), store

    def step(self) -> dict[str, str]:
        """One optimizer step (every rank at once); the unsharded weights' digests (full_tensor: collective)."""
        loss = self.model(torch.arange(32).view(2, 16)).logits.float().pow(2).mean()
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad()
        return digest((n, p.full_tensor()) for n, p in self.model.named_parameters())

    def die_at_bucket(self, bucket: int) -> None:
        die_instead_of_gathering(bucket)

    def block(self, seconds: float) -> None:
        """Busy with something else (a long step): calls queue behind it."""
        time.sleep(seconds)


def rank_source(actor: FsdpRank):
    return actor.source


@pytest.fixture(scope="module")
def engines(ray_local) -> list:
    """Two engine actors for the module's tests (each test's WeightSync is new: it starts from no version)."""
    made = [ray.remote(**ACTOR)(Engine).remote() for _ in range(2)]
    yield made
    for actor in made:
        ray.kill(actor)


@pytest.fixture(scope="module")
def ranks(ray_local, tmp_path_factory) -> list:
    """Two FSDP2 ranks for the module's tests (Ray restarts a rank once); a test that breaks their group
    rebuilds it before it ends."""
    made = trainer_group(tmp_path_factory.mktemp("fsdp"), max_restarts=1)
    yield made
    for actor in made:
        ray.kill(actor)


def trainer_group(tmp_path, world: int = 2, **options) -> list:
    ranks = [ray.remote(**ACTOR, **options)(FsdpRank).remote(r, world) for r in range(world)]
    setup(ranks, tmp_path / "store")
    return ranks


def setup(ranks: list, store) -> None:
    """Every rank's setup at once (they make one group); a rank that Ray is restarting is asked again when it
    is back (raysync.ray.actors.ask, bounded)."""
    calls = {("sender", i): lambda r=r: r.setup.remote(str(store), CFG) for i, r in enumerate(ranks)}
    answers = ask(calls, "setup", 120, str)
    assert list(answers.values()) == [None] * len(ranks), answers


def step(ranks: list) -> dict[str, str]:
    digests = ray.get([r.step.remote() for r in ranks], timeout=60)
    assert all(d == digests[0] for d in digests)
    return digests[0]


def test_two_fsdp2_ranks_as_ray_actors_push_bit_exact_through_weightsync(ranks, engines, no_leftovers):
    """Rank 0 sends (the engine is on its node), rank 1 follows: after each of two pushes, an optimizer step
    before each, the engine's weights equal the trainer's unsharded ones bit for bit; the same version again is
    skipped by every rank."""
    engine = engines[0]
    with WeightSync(ranks, [engine], CFG, source=rank_source) as sync:
        assert [(p.sender, p.receiver, p.transport) for p in sync.plan] == [(0, 0, "shm")]
        assert "sharded: trainer rank 0 of 2 sends, ranks 1 follow" in str(sync.plan)
        for version in (1, 2):
            expected = step(ranks)
            report = sync.push(version)
            assert ray.get(engine.digest.remote()) == expected, f"version {version} is not bit-exact"
            assert report.bytes > 0
        assert sync.versions() == [2]
        assert sync.push(2).pairs[0].bytes == 0  # skipped: the engine has it; rank 1 heard it too
        expected = step(ranks)
        sync.push(3)
        assert ray.get(engine.digest.remote()) == expected and sync.versions() == [3]


def test_a_rank_serving_two_engines_pushes_once_and_a_group_cut_short_is_refused(ranks, engines):
    """Rank 0 serves both engines: one broadcast group (one walk a push), bit-exact on both; forcing a ring per
    engine is a PlanError that says why; handing WeightSync one rank of two is a PlanError too."""
    with pytest.raises(PlanError, match="one broadcast group"):
        WeightSync(ranks, engines, CFG, source=rank_source, transport="shm")
    with pytest.raises(PlanError, match="every rank of one group must be a sender"):
        WeightSync(ranks[:1], engines, CFG, source=rank_source)
    with pytest.raises(PlanError, match="shard_sources splits whole tensors"):
        WeightSync(ranks, engines, CFG, source=rank_source, shard_sources=True)
    with WeightSync(ranks, engines, CFG, source=rank_source) as sync:
        assert [(p.sender, p.transport) for p in sync.plan] == [(0, "collective")] * 2
        assert "walks once per push" in str(sync.plan)
        expected = step(ranks)
        sync.push(1)
        assert ray.get([e.digest.remote() for e in engines]) == [expected, expected]
        assert sync.versions() == [1, 1]


def test_two_sending_ranks_walk_together_each_to_its_engine(ranks, engines):
    """pairs= gives each rank an engine: both ranks send in the same walk (no follower), bit-exact on both."""
    with WeightSync(ranks, engines, CFG, source=rank_source, pairs=[(0, 0), (1, 1)]) as sync:
        assert "ranks none follow" in str(sync.plan)
        for version in (1, 2):
            expected = step(ranks)
            sync.push(version)
            assert ray.get([e.digest.remote() for e in engines]) == [expected, expected]
        assert sync.versions() == [2, 2]


def test_a_staged_push_of_a_sharded_trainer_flips_bit_exact(ranks, engines):
    """push(staged=True) runs every rank's part too: the engine keeps version 1 live until flip()."""
    engine = engines[0]
    with WeightSync(ranks, [engine], CFG, source=rank_source) as sync:
        first = step(ranks)
        sync.push(1)
        second = step(ranks)
        assert sync.push(2, staged=True).staged
        assert sync.versions() == [1] and ray.get(engine.digest.remote()) == first
        sync.flip()
        assert sync.versions() == [2] and ray.get(engine.digest.remote()) == second


@pytest.mark.parametrize("rounds", ["graph", "loop"])
def test_followers_take_part_when_the_rounds_run_in_a_graph_or_loops(ranks, engines, rounds):
    """The sending rank and the engine in a compiled graph (or push loops), the follower through its ordinary
    call: the same push, bit-exact."""
    with WeightSync(ranks, engines[1:], CFG, source=rank_source, push_rounds=rounds) as sync:
        assert "ordinary Ray call per endpoint" not in str(sync.plan).splitlines()[-1]
        for version in (1, 2):
            expected = step(ranks)
            sync.push(version)
            assert ray.get(engines[1].digest.remote()) == expected
        assert sync.versions() == [2]


def test_a_rank_that_never_joins_is_named_within_timeout_s(ranks, engines, tmp_path):
    """Rank 1 is busy elsewhere when the push comes: rank 0 names it (PeerTimeout at the start of the push) and
    the driver names it too, within timeout_s of the push; the engine keeps its version. Once the user rebuilt
    the group, the next push goes through."""
    engine = engines[0]
    with WeightSync(ranks, [engine], CFG, source=rank_source) as sync:
        step(ranks)
        sync.push(1)
        good = ray.get(engine.digest.remote())
        busy = ranks[1].block.remote(2 * CFG.timeout_s)
        began = time.monotonic()
        with pytest.raises(SyncError) as raised:
            sync.push(2)
        seconds = time.monotonic() - began
        failures = {f.endpoint.split(" (")[0]: f for f in raised.value.failures}
        sending, following = failures["sender #0"], failures["sender #1"]
        assert "PeerTimeout" in sending.error and "trainer rank 1 of 2" in sending.error, failures
        assert sending.stage == "the start of the push of version 2", sending
        assert "PeerTimeout" in following.error and following.stage == "following the push", following
        # bounded by timeout_s (the walk's census on rank 0, the engine's own wait), not by push_timeout_s
        # (an hour): the rest is Ray's answers and the machine's load
        assert seconds <= 1.5 * CFG.timeout_s, seconds
        assert sync.versions() == [1] and ray.get(engine.digest.remote()) == good
        ray.get(busy)
        setup(ranks, tmp_path / "store")  # the group failed a gather: the user makes a new one, new sources
        expected = step(ranks)
        sync.push(3)
        assert ray.get(engine.digest.remote()) == expected and sync.versions() == [3]


def test_a_rank_killed_mid_push_is_named_and_the_engine_keeps_its_version(
    ranks, engines, no_leftovers, tmp_path
):
    """Rank 1 is SIGKILLed where it would join the all-gather of bucket 2: the driver's SyncError names it
    (Ray's death of sender #1, and rank 0's walk naming trainer rank 1 at bucket 2) within timeout_s; the
    engine keeps version 1, weights untouched. The next push fails at once, saying the group is broken; once
    Ray restarted rank 1 and the user rebuilt the group, a push goes through, bit-exact."""
    engine = engines[0]
    with WeightSync(ranks, [engine], CFG, source=rank_source) as sync:
        good = step(ranks)
        sync.push(1)
        step(ranks)
        ray.get(ranks[1].die_at_bucket.remote(2))
        began = time.monotonic()
        with pytest.raises(SyncError) as raised:
            sync.push(2)
        seconds = time.monotonic() - began
        failures = {f.endpoint.split(" (")[0]: f for f in raised.value.failures}
        assert "Actor" in failures["sender #1"].error, failures
        lost = failures["sender #0"]
        assert "trainer rank 1 of 2" in lost.error and "all-gather of bucket 2" in lost.stage, lost
        assert seconds <= CFG.timeout_s + 2, seconds
        assert sync.versions() == [1] and ray.get(engine.digest.remote()) == good
        with pytest.raises(SyncError, match="make a new source"):
            sync.push(2)
        assert sync.versions() == [1]
        setup(ranks, tmp_path / "store-2")  # rank 1 is back (Ray restarted it): a new group, new sources
        expected = step(ranks)
        sync.push(3)
        assert ray.get(engine.digest.remote()) == expected and sync.versions() == [3]


@pytest.mark.slow
def test_four_fsdp2_ranks_push_bit_exact_and_a_killed_rank_is_named(engines, tmp_path):
    """Four ranks: rank 0 sends, ranks 1-3 follow, bit-exact; rank 2 SIGKILLed where it would join the gather
    of bucket 2: the driver's SyncError names it, through Ray and through rank 0's walk; the engine keeps
    version 1."""
    ranks, engine = trainer_group(tmp_path, world=4), engines[0]
    try:
        with WeightSync(ranks, [engine], CFG, source=rank_source) as sync:
            assert "sharded: trainer rank 0 of 4 sends, ranks 1, 2, 3 follow" in str(sync.plan)
            good = step(ranks)
            sync.push(1)
            assert ray.get(engine.digest.remote()) == good
            step(ranks)
            ray.get(ranks[2].die_at_bucket.remote(2))
            with pytest.raises(SyncError) as raised:
                sync.push(2)
            failures = {f.endpoint.split(" (")[0]: f for f in raised.value.failures}
            assert "Actor" in failures["sender #2"].error, failures
            assert "trainer rank 2 of 4" in failures["sender #0"].error, failures
            assert sync.versions() == [1] and ray.get(engine.digest.remote()) == good
    finally:
        for actor in ranks:
            ray.kill(actor)


class LazyTrainer(Engine):
    """A trainer whose source is a manifest plus a load function (raysync.sources.LazySource)."""


def lazy_source(actor: LazyTrainer):
    from raysync.sources import LazySource

    params = dict(actor.model.named_parameters())
    return LazySource.from_module(actor.model, load=lambda name: params[name].detach().clone())


def test_a_lazy_source_that_is_not_sharded_through_weightsync(ray_local, engines, no_leftovers):
    """A LazySource (tensors made as their buckets are packed) to two engines, over a ring each: bit-exact."""
    trainer = ray.remote(**ACTOR)(LazyTrainer).remote(seed=5)
    config = dataclasses.replace(CFG, staged=False)
    try:
        with WeightSync([trainer], engines, config, source=lazy_source) as sync:
            assert [p.transport for p in sync.plan] == ["shm", "shm"]
            expected = ray.get(trainer.digest.remote())
            report = sync.push(1)
            assert ray.get([e.digest.remote() for e in engines]) == [expected, expected]
            model_bytes = sum(p.numel() * p.element_size() for p in tiny_qwen2(seed=0).parameters())
            assert report.bytes == 2 * model_bytes and sync.versions() == [1, 1]
    finally:
        ray.kill(trainer)
