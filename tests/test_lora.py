"""LoRA (issue 23): the adapter of a PEFT-style model pushed alone (raysync.sources.lora) into a torch engine that
holds several adapter versions (raysync.engines.torch_lora), and merged mode. The PEFT-style model is built by hand:
a Linear wrapped with A / B matrices, named as PEFT names them."""

from __future__ import annotations

import dataclasses

import msgpack
import pytest
import torch
from conftest import same_bits, session_pair

from raysync import LayoutError, SyncConfig
from raysync.core.errors import PushIncomplete, RaysyncError
from raysync.engines.torch_lora import AdapterVersions
from raysync.sources.lora import (
    MANIFEST,
    LoraConfig,
    LoraSource,
    Manifest,
    merged,
    merged_weight,
    parse,
    push_adapter,
    push_merged,
)

CFG = SyncConfig(bucket_bytes=4096, timeout_s=30, progress=False)
LORA = LoraConfig(r=4, alpha=8, target_modules=("q", "v"))


class Tiny(torch.nn.Module):
    """The base model: what the engine serves."""

    def __init__(self, vocab: int = 50, hidden: int = 32, layers: int = 2):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, hidden)
        self.layers = torch.nn.ModuleList(
            torch.nn.ModuleDict({"q": torch.nn.Linear(hidden, hidden), "v": torch.nn.Linear(hidden, hidden)})
            for _ in range(layers)
        )
        self.head = torch.nn.Linear(hidden, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for layer in self.layers:
            h = torch.tanh(layer["q"](h)) + layer["v"](h)
        return self.head(h)


class LoraLinear(torch.nn.Module):
    """A Linear wrapped as PEFT wraps it: base_layer, lora_A / lora_B per adapter name."""

    def __init__(self, base: torch.nn.Linear, r: int, scaling: float):
        super().__init__()
        self.base_layer = base
        self.lora_A = torch.nn.ModuleDict({"default": torch.nn.Linear(base.in_features, r, bias=False)})
        self.lora_B = torch.nn.ModuleDict({"default": torch.nn.Linear(r, base.out_features, bias=False)})
        torch.nn.init.zeros_(self.lora_B["default"].weight)  # as PEFT starts: the adapter is a no-op
        self.scaling = scaling

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base_layer(x) + self.lora_B["default"](self.lora_A["default"](x)) * self.scaling


class Peft(torch.nn.Module):
    """``base_model.model.<the base model's names>``, the adapted Linears wrapped, the base frozen."""

    def __init__(self, base: Tiny, config: LoraConfig):
        super().__init__()
        self.base_model = torch.nn.Module()
        self.base_model.model = base
        for p in base.parameters():
            p.requires_grad_(False)
        for layer in base.layers:
            for key in config.target_modules:
                layer[key] = LoraLinear(layer[key], config.r, config.scaling)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.base_model.model(tokens)


def models(seed: int = 0) -> tuple[Peft, Tiny]:
    """The trainer's PEFT-style model and the engine's base model, with the same base weights."""
    torch.manual_seed(seed)
    engine = Tiny()
    base = Tiny()
    base.load_state_dict(engine.state_dict())
    return Peft(base, LORA), engine


def train(model: Peft, steps: int, seed: int) -> None:
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.SGD(params, lr=0.5)
    gen = torch.Generator().manual_seed(seed)
    device = next(model.parameters()).device
    for _ in range(steps):
        tokens = torch.randint(0, 50, (4, 6), generator=gen).to(device)
        loss = torch.nn.functional.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()


def lora_params(model: Peft) -> list[torch.Tensor]:
    return [p for n, p in model.named_parameters() if ".lora_" in n]


TOKENS = torch.randint(0, 50, (3, 7), generator=torch.Generator().manual_seed(7))


# --- adapter mode -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("verify", [False, True])
def test_after_each_push_the_engine_with_the_adapter_computes_what_the_trainer_does(
    private_tmp, in_thread, verify
):
    trainer, base = models()
    engine = AdapterVersions(base)
    source = LoraSource(trainer.named_parameters(), LORA)
    adapter_bytes = sum(p.nbytes for p in lora_params(trainer))
    with session_pair(dataclasses.replace(CFG, verify=verify)) as (sender, receiver):
        for version in (1, 2, 3):
            train(trainer, steps=3, seed=version)
            got = in_thread(engine.receive, receiver)
            lora = push_adapter(sender, source, version)
            assert got.result(timeout=30).version == version == engine.latest
            with torch.no_grad(), engine.request() as request:
                assert request.version == version
                assert same_bits(request(TOKENS), trainer(TOKENS))
            assert lora.mode == "adapter" and lora.adapter_bytes == adapter_bytes
            assert lora.push.bytes == adapter_bytes + lora.manifest_bytes  # the adapter and its manifest only
            assert lora.push.tensors == len(lora_params(trainer)) + 1
            assert engine.versions() == {version: 0}
    with torch.no_grad():
        assert not same_bits(base(TOKENS), trainer(TOKENS))  # the base alone is not what the trainer computes


def adapter_engine(secret, config, rank, rendezvous, seed, pushes, out) -> None:
    """A rank of a broadcast group serving a torch engine with adapter versions: after each push, the engine's
    output with the latest adapter (bytes) to ``out``."""
    from raysync.transport.collective import CollectiveReceiver

    engine = AdapterVersions(models(seed)[1])
    group = CollectiveReceiver(secret, config, rank=rank, rendezvous=rendezvous)
    receiver = group.join()
    try:
        for _ in range(pushes):
            report = engine.receive(receiver)
            with torch.no_grad(), engine.request() as request:
                out.put((rank, report.version, request(TOKENS).numpy().tobytes()))
    finally:
        group.close()


def test_the_adapter_travels_over_the_collective_to_every_rank(spawn):
    """The adapter is a source like any other: a gloo broadcast group of one trainer and two engine processes."""
    from raysync import SessionSecret
    from raysync.transport.collective import CollectiveSender

    # the ranks start (spawn, import torch) while the first push waits for them: bounded, not meant to run out
    config = SyncConfig(bucket_bytes=4096, timeout_s=300, progress=False)
    trainer, _ = models(5)
    source = LoraSource(trainer.named_parameters(), LORA)
    secret = SessionSecret.generate()
    group = CollectiveSender(secret, config, host="127.0.0.1", num_receivers=2, backend="gloo")
    out = spawn.ctx.Queue()
    for rank in (1, 2):
        spawn(adapter_engine, secret, config, rank, group.rendezvous, 5, 2, out)
    try:
        sender = group.join()
        for version in (1, 2):
            train(trainer, steps=2, seed=version)
            lora = push_adapter(sender, source, version)
            assert lora.push.transport == "collective"
            assert lora.push.bytes == lora.adapter_bytes + lora.manifest_bytes
            with torch.no_grad():
                expected = trainer(TOKENS).numpy().tobytes()
            got = sorted(out.get(timeout=300) for _ in range(2))
            assert got == [(1, version, expected), (2, version, expected)]
    finally:
        group.close()


def test_a_request_started_on_version_k_finishes_on_k_while_k_plus_1_is_loaded(private_tmp, in_thread):
    trainer, base = models(1)
    engine = AdapterVersions(base)
    source = LoraSource(trainer.named_parameters(), LORA)
    with session_pair(CFG) as (sender, receiver):
        train(trainer, steps=3, seed=1)
        got = in_thread(engine.receive, receiver)
        sender.push(source, 1)
        assert got.result(timeout=30).version == 1
        expected_1 = trainer(TOKENS).detach()
        running = engine.request()  # a request on version 1: its first step
        assert same_bits(running(TOKENS), expected_1)
        train(trainer, steps=3, seed=2)
        got = in_thread(engine.receive, receiver)
        sender.push(source, 2)
        assert got.result(timeout=30).version == 2
        assert engine.versions() == {1: 1, 2: 0}  # both held, version 1 for the running request
        assert same_bits(running(TOKENS), expected_1)  # its next step: still version 1
        with engine.request() as new:
            assert new.version == 2 and same_bits(new(TOKENS), trainer(TOKENS).detach())
            assert not same_bits(new(TOKENS), expected_1)
        running.close()
        assert engine.versions() == {2: 0}  # version 1 dropped with its last request
        with pytest.raises(LookupError, match="version 1 is not held"):
            engine.request(1)
        with pytest.raises(RuntimeError, match="has finished"):
            running(TOKENS)
        running = engine.request()  # on version 2
        expected_2 = trainer(TOKENS).detach()
        train(trainer, steps=2, seed=3)
        got = in_thread(engine.receive, receiver)
        sender.push(source, 1)  # a version number used before: the latest is what was pushed last
        assert got.result(timeout=30).version == 1 == engine.latest
        assert engine.versions() == {1: 0, 2: 1}
        with engine.request() as new:
            assert new.version == 1 and same_bits(new(TOKENS), trainer(TOKENS).detach())
        assert same_bits(running(TOKENS), expected_2)
        running.close()
        assert engine.versions() == {1: 0}


def test_a_manifest_that_disagrees_with_its_tensors_installs_nothing(private_tmp, in_thread):
    trainer, base = models(2)
    engine = AdapterVersions(base)
    source = LoraSource(trainer.named_parameters(), LORA)
    with session_pair(CFG) as (sender, receiver):
        got = in_thread(engine.receive, receiver)
        sender.push(source, 1)
        assert got.result(timeout=30).version == 1
        lying = Manifest(
            LoraConfig(r=8, alpha=8, target_modules=("q", "v")), "default", tuple(source.modules)
        )
        forged = [(n, lying.encode() if n == MANIFEST else t) for n, t in source]
        got = in_thread(engine.receive, receiver)
        with pytest.raises(RaysyncError):
            sender.push(forged, 2)
        with pytest.raises(RaysyncError, match="rank 8"):
            got.result(timeout=30)
        assert engine.versions() == {1: 0} and receiver.version == 1


def test_an_adapter_the_engine_model_cannot_take_is_refused_before_a_byte_moves(private_tmp, in_thread):
    trainer, _ = models(3)
    engine = AdapterVersions(Tiny(hidden=16))  # another width: A's in_features do not fit
    source = LoraSource(trainer.named_parameters(), LORA)
    with session_pair(CFG) as (sender, receiver):
        got = in_thread(engine.receive, receiver)
        with pytest.raises(RaysyncError):
            sender.push(source, 1)
        with pytest.raises(PushIncomplete, match="in_features 16") as refused:
            got.result(timeout=30)
        assert refused.value.stage == "accept" and not refused.value.mixed
        assert engine.versions() == {} and receiver.version is None


def test_peft_names_live_and_saved_are_recognised_and_others_refused():
    assert parse("base_model.model.layers.0.q.lora_A.default.weight") == ("base_model.model.layers.0.q", "A")
    assert parse("base_model.model.layers.0.q.lora_B.weight") == ("base_model.model.layers.0.q", "B")
    assert parse("base_model.model.layers.0.q.base_layer.weight") is None
    with pytest.raises(LayoutError, match="embedding"):
        parse("base_model.model.embed.lora_embedding_A.default")
    trainer, _ = models()
    source = LoraSource(trainer.named_parameters(), LORA)
    assert [n for n, _ in source][:3] == [
        MANIFEST,
        "base_model.model.layers.0.q.lora_A.weight",
        "base_model.model.layers.0.q.lora_B.weight",
    ]
    with pytest.raises(LayoutError, match="rank 2 needs"):
        LoraSource(trainer.named_parameters(), LoraConfig(r=2, alpha=8, target_modules=("q", "v")))
    with pytest.raises(LayoutError, match="not one of target_modules"):
        LoraSource(trainer.named_parameters(), LoraConfig(r=4, alpha=8, target_modules=("q",)))


def test_a_push_that_is_not_an_adapter_is_refused_by_the_engine_before_a_byte_moves(private_tmp, in_thread):
    trainer, base = models(6)
    engine = AdapterVersions(base)
    source = LoraSource(trainer.named_parameters(), LORA)
    stray = [*source, ("layers.0.q.weight", base.layers[0]["q"].weight.detach())]  # a base weight among them
    headless = [(n, t) for n, t in source if n != MANIFEST]
    with session_pair(CFG) as (sender, receiver):
        for push, why in [(stray, "is not a LoRA tensor"), (headless, "carries its manifest")]:
            got = in_thread(engine.receive, receiver)
            with pytest.raises(RaysyncError):
                sender.push(push, 1)
            with pytest.raises(PushIncomplete, match=why) as refused:
                got.result(timeout=30)
            assert refused.value.stage == "accept" and engine.versions() == {}
        got = in_thread(engine.receive, receiver)
        assert sender.push(source, 1).version == 1 and got.result(timeout=30).version == 1
        got = in_thread(engine.receive, receiver)
        assert sender.push(source, 1).skipped  # the engine has version 1: nothing moves, nothing installed
        assert got.result(timeout=30).skipped and engine.versions() == {1: 0}


def test_the_adapter_bytes_follow_the_wire_dtype_and_one_adapter_of_several_is_named():
    trainer, _ = models()
    source = LoraSource(trainer.named_parameters(), LORA)
    fp32 = sum(p.nbytes for p in lora_params(trainer))
    assert source.adapter_bytes() == fp32
    assert source.adapter_bytes(dataclasses.replace(CFG, cast_dtype="bfloat16")) == fp32 // 2
    second = [(n.replace(".default.", ".other."), p) for n, p in trainer.named_parameters() if ".lora_" in n]
    both = [*trainer.named_parameters(), *second]
    pushed = [t for _, t in LoraSource(both, LORA)][1:]
    assert len(pushed) == 8 and all(a is b for a, b in zip(pushed, lora_params(trainer), strict=True))
    with pytest.raises(LayoutError, match="several adapters"):
        list(merged(both, LORA))
    with pytest.raises(LayoutError, match="only one of lora_A / lora_B"):
        LoraSource([(n, p) for n, p in trainer.named_parameters() if ".lora_B." not in n or ".1." in n], LORA)


@pytest.mark.parametrize(
    "raw",
    [
        b"\xc1",  # not msgpack
        msgpack.packb([1, 2]),  # not a map
        msgpack.packb({"format": "raysync-lora/1"}),  # fields missing
        msgpack.packb(msgpack.ExtType(1, b"x")),  # an ext type
        msgpack.packb({1: 2}),  # a non-string key
    ],
)
def test_manifest_decode_refuses_what_is_not_a_manifest(raw):
    with pytest.raises(LayoutError):
        Manifest.decode(torch.frombuffer(bytearray(raw), dtype=torch.uint8))


def test_manifest_round_trips():
    m = Manifest(LoraConfig(r=4, alpha=16, target_modules=("q_proj",), use_rslora=True), "a", ("x.q_proj",))
    assert Manifest.decode(m.encode()) == m and m.config.scaling == 8.0


# --- merged mode ---------------------------------------------------------------------------------------------------
def test_merged_mode_pushes_the_base_weights_with_the_adapter_merged_bit_for_bit(private_tmp, in_thread):
    trainer, base = models(4)
    train(trainer, steps=3, seed=4)
    dest = dict(base.named_parameters())
    with session_pair(CFG) as (sender, receiver), torch.no_grad():
        got = in_thread(receiver.receive, into=dest)
        lora = push_merged(sender, trainer.named_parameters(), LORA, 1)
        assert got.result(timeout=30).version == 1 and lora.mode == "merged"
        assert lora.push.tensors == len(dest)  # a full push: every parameter of the engine
        for layer, engine_layer in zip(trainer.base_model.model.layers, base.layers, strict=True):
            for key in LORA.target_modules:
                wrapped = layer[key]
                a, b = wrapped.lora_A["default"].weight, wrapped.lora_B["default"].weight
                by_hand = wrapped.base_layer.weight + (b @ a) * LORA.scaling  # a user's merge, in fp32
                assert same_bits(engine_layer[key].weight, by_hand)
        torch.testing.assert_close(base(TOKENS), trainer(TOKENS))  # merged = unmerged, up to rounding
    names = [n for n, _ in merged(trainer.named_parameters(), LORA)]
    assert names == [n for n, _ in base.named_parameters()]


def test_merged_weight_keeps_the_base_dtype():
    w = torch.randn(8, 6).to(torch.bfloat16)
    a, b = torch.randn(2, 6), torch.randn(8, 2)
    out = merged_weight(w, a, b, 0.5)
    assert out.dtype == torch.bfloat16
    assert same_bits(out, w + ((b @ a) * 0.5).to(torch.bfloat16))


# --- a transformers model with an adapter (tests/test_lora_vllm.py) -------------------------------------------------
PROMPTS = [list(range(3, 11)), [(7 * i) % 500 + 1 for i in range(40)]]
QWEN_LORA = LoraConfig(r=4, alpha=16, target_modules=("q_proj", "v_proj"))


def lora_qwen2(seed: int, config: LoraConfig = QWEN_LORA):
    """A tiny transformers Qwen2 with PEFT-style adapters on q_proj / v_proj (the trainer; the reference)."""
    from raysync.tools.models import tiny_qwen2

    model = tiny_qwen2(seed=seed)
    for p in model.parameters():
        p.requires_grad_(False)
    for layer in model.model.layers:
        for key in config.target_modules:
            setattr(layer.self_attn, key, LoraLinear(getattr(layer.self_attn, key), config.r, config.scaling))
    return model


def train_qwen2(model, steps: int, seed: int) -> None:
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=2.0)
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        ids = torch.randint(1, 512, (2, 12), generator=gen)
        loss = model(input_ids=ids, labels=ids).loss
        opt.zero_grad()
        loss.backward()
        opt.step()


def test_a_real_peft_models_adapter_lands_in_a_torch_engine_that_then_computes_what_peft_does(
    private_tmp, in_thread
):
    """With PEFT installed (it is no dependency: skipped without it), its own names and its own LoRA forward."""
    peft = pytest.importorskip("peft")
    from raysync.tools.models import tiny_qwen2

    wrapped = peft.get_peft_model(
        tiny_qwen2(seed=3), peft.LoraConfig(r=4, lora_alpha=16, target_modules=["q_proj", "v_proj"])
    )
    config = wrapped.peft_config["default"]
    lora = LoraConfig(
        r=config.r, alpha=config.lora_alpha, target_modules=tuple(sorted(config.target_modules))
    )
    engine = AdapterVersions(tiny_qwen2(seed=3))
    ids = torch.randint(1, 512, (2, 9), generator=torch.Generator().manual_seed(3))
    with session_pair(CFG) as (sender, receiver):
        for version in (1, 2):
            train_qwen2(wrapped, steps=2, seed=version)
            got = in_thread(engine.receive, receiver)
            pushed = push_adapter(sender, LoraSource(wrapped.named_parameters(), lora), version)
            assert got.result(timeout=30).version == version
            assert pushed.push.tensors == 1 + 2 * 2 * len(wrapped.base_model.model.model.layers)
            with torch.no_grad(), engine.request() as request:
                expected = wrapped(input_ids=ids).logits
                assert same_bits(request(input_ids=ids).logits, expected)
                assert not torch.allclose(engine.model(input_ids=ids).logits, expected)  # the adapter counts
