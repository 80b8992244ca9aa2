"""LoRA adapters through WeightSync (issue 23), on the CPU: a trainer actor with a PEFT-style model (built by hand in
tests/test_lora.py: PEFT is no dependency) pushes its adapter to plain torch engine actors that hold adapter versions
(raysync.engines.torch_lora.TorchLoraEngine), over shared memory and over the collective (gloo); merged mode pushes
the base weights with the adapter merged in to an ordinary engine actor."""

from __future__ import annotations

import pytest
import torch
from conftest import same_bits
from test_lora import LORA, TOKENS, Tiny, lora_params, models, train

from raysync import SyncConfig, SyncError, WeightSync
from raysync.engines.torch_lora import AdapterVersions, TorchLoraEngine
from raysync.sources.lora import AdapterOf, LoraSource, MergedOf

ray = pytest.importorskip("ray")

CFG = SyncConfig(bucket_bytes=4096, timeout_s=60, progress=False)  # the adapter spans several buckets


class LoraTrainer:
    """A user's trainer actor: a PEFT-style model (``model``) whose adapter it trains."""

    def __init__(self, seed: int = 0, device: str = "cpu"):
        self.reset(seed, device)

    def reset(self, seed: int, device: str = "cpu") -> None:
        self.model = models(seed)[0].to(device)
        self.tokens = TOKENS.to(device)

    def train(self, steps: int, seed: int) -> None:
        train(self.model, steps, seed)

    def forward(self) -> torch.Tensor:
        with torch.no_grad():
            return self.model(self.tokens).cpu()

    def lora_tensors(self) -> dict[str, torch.Tensor]:
        return {n: p.detach().cpu() for n, p in self.model.named_parameters() if ".lora_" in n}

    def merged(self) -> dict[str, torch.Tensor]:
        """What merged mode pushes, made here as a user would merge: W + B @ A * scaling per adapted Linear."""
        out = {}
        for name, p in self.model.base_model.model.named_parameters():
            module, _, param = name.rpartition(".base_layer.")
            if param != "weight":
                out[name.replace(".base_layer.", ".")] = p.detach().clone()
                continue
            wrapped = self.model.base_model.model.get_submodule(module)
            a, b = wrapped.lora_A["default"].weight, wrapped.lora_B["default"].weight
            out[f"{module}.weight"] = (p + (b @ a) * LORA.scaling).detach()
        return {n: t for n, t in out.items() if ".lora_" not in n}

    def adapter_bytes(self) -> tuple[int, int]:
        source = LoraSource(self.model.named_parameters(), LORA)
        return source.adapter_bytes(), source.manifest_bytes


class LoraServer:
    """A user's engine actor: the base model, served with the adapter versions pushed to it (``adapters``)."""

    def __init__(self, seed: int = 0, device: str = "cpu"):
        self.reset(seed, device=device)

    def reset(self, seed: int, hidden: int = 32, device: str = "cpu") -> None:
        """A fresh engine: the base model of ``seed`` (another ``hidden`` width: another model), no adapter."""
        self.model = (models(seed)[1] if hidden == 32 else Tiny(hidden=hidden)).to(device)
        self.adapters = AdapterVersions(self.model)
        self.running, self.tokens = None, TOKENS.to(device)

    def forward(self) -> tuple[int, torch.Tensor]:
        """A whole request on the latest version: its version and output."""
        with torch.no_grad(), self.adapters.request() as request:
            return request.version, request(self.tokens).cpu()

    def start(self) -> tuple[int, torch.Tensor]:
        """A request's first step, on the latest version; the request stays open."""
        self.running = self.adapters.request()
        with torch.no_grad():
            return self.running.version, self.running(self.tokens).cpu()

    def step(self) -> tuple[int, torch.Tensor]:
        """The open request's next step."""
        with torch.no_grad():
            return self.running.version, self.running(self.tokens).cpu()

    def lora_tensors(self) -> dict[str, torch.Tensor]:
        """The latest version's A / B, named as the trainer names them."""
        with self.adapters.request() as request:
            weights = request.adapter.weights
        out = {}
        for module, (a, b) in weights.items():
            wrapped = f"base_model.model.{module}"
            out[f"{wrapped}.lora_A.default.weight"], out[f"{wrapped}.lora_B.default.weight"] = (
                a.cpu(),
                b.cpu(),
            )
        return out

    def finish(self) -> None:
        self.running.close()

    def versions(self) -> dict[int, int]:
        return self.adapters.versions()

    def base(self) -> dict[str, torch.Tensor]:
        return {n: p.detach().clone() for n, p in self.model.named_parameters()}


@pytest.fixture(scope="module")
def cast(ray_local):
    """One trainer and two engine actors for the module (an actor's start costs seconds here); each test resets
    them."""
    trainer = ray.remote(num_cpus=0.25)(LoraTrainer).remote()
    servers = [ray.remote(num_cpus=0.25)(LoraServer).remote() for _ in range(2)]
    yield trainer, servers
    for actor in (trainer, *servers):
        ray.kill(actor)


def actors(cast, seed: int, hidden: tuple[int, ...] = (32, 32)):
    """The cast reset: the trainer's model and the engines' base models of ``seed``."""
    trainer, servers = cast
    ray.get(
        [trainer.reset.remote(seed)] + [s.reset.remote(seed, h) for s, h in zip(servers, hidden, strict=True)]
    )
    return trainer, servers


@pytest.mark.parametrize("transport", ["shm", "collective"])
def test_each_push_through_weightsync_serves_the_trainers_adapter_and_moves_only_its_bytes(cast, transport):
    """Two engines; after each push every engine's output with the adapter is the trainer's, bit for bit; a push
    moves the adapter's bytes and its manifest, nothing else; versions() names the adapter version."""
    trainer, servers = actors(cast, seed=1)
    adapter, manifest = ray.get(trainer.adapter_bytes.remote())
    engines = [TorchLoraEngine(s) for s in servers]
    with WeightSync([trainer], engines, CFG, source=AdapterOf(LORA), transport=transport) as sync:
        assert [p.transport for p in sync.plan] == [transport] * 2, str(sync.plan)
        assert all("LoRA adapter mode" in p.how for p in sync.plan), str(sync.plan)  # the plan says the mode
        for version in (1, 2, 3):
            ray.get(trainer.train.remote(steps=2, seed=version))
            report = sync.push(version)
            assert [p.bytes for p in report.pairs] == [adapter + manifest] * 2
            expected = ray.get(trainer.forward.remote())
            for server in servers:
                got_version, got = ray.get(server.forward.remote())
                assert got_version == version and same_bits(got, expected)
                assert ray.get(server.versions.remote()) == {version: 0}
            assert sync.versions() == [version, version]
        assert sync.push(3).bytes == 0  # the engines hold version 3: nothing moves, nothing is installed
        assert ray.get([s.versions.remote() for s in servers]) == [{3: 0}] * 2
    # the adapter went to the engines' AdapterVersions, never into their base weights
    base = ray.get(servers[0].base.remote())
    assert all(same_bits(base[n], p) for n, p in models(1)[1].named_parameters())


def test_a_request_started_on_version_k_finishes_on_k_while_k_plus_1_is_pushed(cast):
    trainer, [server, _] = actors(cast, seed=2)
    with WeightSync([trainer], [TorchLoraEngine(server)], CFG, source=AdapterOf(LORA)) as sync:
        ray.get(trainer.train.remote(steps=2, seed=1))
        sync.push(1)
        on_1 = ray.get(trainer.forward.remote())
        assert ray.get(server.start.remote())[0] == 1
        ray.get(trainer.train.remote(steps=2, seed=2))
        sync.push(2)  # while the request on version 1 runs
        assert ray.get(server.versions.remote()) == {1: 1, 2: 0}
        version, out = ray.get(server.step.remote())
        assert version == 1 and same_bits(out, on_1)  # its next step: still version 1
        version, out = ray.get(server.forward.remote())
        assert version == 2 and same_bits(out, ray.get(trainer.forward.remote())) and not same_bits(out, on_1)
        ray.get(server.finish.remote())
        assert ray.get(server.versions.remote()) == {2: 0}  # version 1 dropped with its last request
        assert sync.versions() == [2]


def test_an_adapter_the_engine_cannot_take_is_refused_and_the_engine_serves_what_it_held(cast):
    trainer, [server, narrow] = actors(
        cast, seed=3, hidden=(32, 16)
    )  # another width: A's in_features do not fit
    engines = [TorchLoraEngine(server), TorchLoraEngine(narrow)]
    with WeightSync([trainer], engines, CFG, source=AdapterOf(LORA)) as sync:
        with pytest.raises(SyncError, match="in_features 16") as failed:
            sync.push(1)
        assert {f.stage for f in failed.value.failures} == {"accept"} and not failed.value.mixed
        assert sync.versions() == [1, None]
        assert ray.get([server.versions.remote(), narrow.versions.remote()]) == [{1: 0}, {}]


def test_the_adapter_source_gives_the_same_tensors_at_every_call_so_the_plan_may_read_them_in_place():
    """What cuda_ipc's direct mode needs of a source (Note [direct or ring] in raysync.ray.placement), asked as
    the plan asks every sender (report_source); a plain object stands in for the trainer's actor."""
    from raysync.ray.placement import report_source

    trainer, source = type("Actor", (), {})(), AdapterOf(LORA)
    trainer.model = models(5)[0]
    first = source(trainer)
    assert source(trainer) is first  # its manifest tensor too
    report = report_source(trainer, source, CFG)
    assert report.stable and report.push_bytes == first.adapter_bytes() + first.manifest_bytes
    trainer.model = models(6)[0]  # another model: a source of its own tensors
    second = [t for _, t in source(trainer)][1:]
    assert all(a is b for a, b in zip(second, lora_params(trainer.model), strict=True))


def test_merged_mode_through_weightsync_writes_the_merged_weights_into_an_ordinary_engine(cast):
    """Merged mode is a full push of the plain model's weights: the engine is an ordinary actor, its model's
    parameters written in place; they equal the trainer's base weights with B @ A * scaling added."""
    trainer, [server, _] = actors(cast, seed=4)
    ray.get(trainer.train.remote(steps=3, seed=4))
    expected = ray.get(trainer.merged.remote())
    with WeightSync([trainer], [server], CFG, source=MergedOf(LORA)) as sync:
        assert "LoRA merged mode" in sync.plan[0].how, str(sync.plan)
        report = sync.push(1)
        assert report.bytes == sum(
            t.nbytes for t in expected.values()
        )  # the model's bytes, not the adapter's
        got = ray.get(server.base.remote())
        assert got.keys() == expected.keys() and all(same_bits(got[n], t) for n, t in expected.items())
        assert not same_bits(got["layers.0.q.weight"], models(4)[1].layers[0]["q"].weight)
        assert sync.versions() == [1]
