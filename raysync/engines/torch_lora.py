"""A plain torch engine's LoRA adapters (issue 23): each push of an adapter (raysync.sources.lora) lands as a new
adapter version in tensors of its own; several versions are held at once, each reference-counted by the requests
running on it.

    receiver.receive(load_fn=AdapterLoad) --finish--> AdapterVersions.install(version)
                                                          |  versions: {3: 2 requests, 4: 0 (the latest)}
    engine.request() -> Lease(version 4) ---forward hooks on the target Linears--> base(x) + B(A(x)) * scaling

# Note [adapter versions and requests]
# A request takes a lease on the latest version when it starts and runs every step on that version, whatever is
# pushed meanwhile: a push never writes into a version's tensors, it makes new ones (the adapter is small). A
# version that is no longer the latest is dropped when its last lease is released; the latest is always held.
# ``versions()`` says which versions are held and how many requests each serves. A push that fails (or whose
# manifest disagrees with its tensors) installs nothing: the versions held stay as they were.

Through WeightSync, the engine's actor is a receiver through ``TorchLoraEngine(actor, attr="adapters")``:

    WeightSync([trainer], [TorchLoraEngine(engine)], source=AdapterOf(lora_config))

# Note [adapter pushes through WeightSync]
# An engine that serves adapters is reached through an engine adapter (TorchLoraEngine here, VllmEngine(lora=...)
# in raysync.engines.vllm): WeightSync's endpoint functions (raysync.ray.endpoint) run in the engine's process on
# an AdapterEndpoint, not on the actor (or vLLM worker) itself. The sessions of adapter pushes and the version
# they hold are the AdapterEndpoint's: apart from the actor's own, whose version is that of its base weights, which
# an adapter push does not change (Note [versions never lie]). The driver's sink is replaced by the engine's own
# load function (AdapterLoad; in vLLM, TensorsLoad); when a receive has completed, what it landed is installed as
# that push's version, and from then on new requests get it. ``WeightSync.versions()`` says each engine's latest
# adapter version; the engine's ``versions()`` says every version it holds and the requests on each.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from raysync.core.errors import LayoutError
from raysync.core.report import PushReport
from raysync.core.wire import TensorSpec
from raysync.sources.lora import MANIFEST, Manifest, specs_by_module

_WRAPPED = "base_model.model."


@dataclass(frozen=True)
class Adapter:
    """One adapter version, in the engine's own tensors: module (the engine's name) -> (A, B)."""

    version: int
    manifest: Manifest
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.weights.values())


class AdapterLoad:
    """The load function of one adapter push (``receive(load_fn=...)``): ``check`` refuses a push that does not
    fit the engine's model before a byte moves, each call keeps a copy of what it is given (Note [ring buffer
    views]), ``finish`` checks the manifest against the tensors. Installs nothing: ``AdapterVersions.receive``
    does, once the push completed."""

    def __init__(self, engine: AdapterVersions):
        self._engine = engine
        self._specs: dict[str, tuple[int, int]] = {}
        self._kept: dict[str, torch.Tensor] = {}
        self.manifest: Manifest | None = None

    def check(self, specs: Sequence[TensorSpec]) -> None:
        modules, manifest = specs_by_module(specs)
        if manifest is None:
            raise LayoutError(f"an adapter push carries its manifest {MANIFEST!r}; this one does not")
        for module, (a, b) in modules.items():
            self._engine.check_module(module, specs[a].shape, specs[b].shape)
        self._specs, self._kept = modules, {}

    def __call__(self, batch: list[tuple[str, torch.Tensor]]) -> None:
        for name, tensor in batch:
            self._kept[name] = tensor.to(self._engine.device, copy=True)

    def finish(self) -> None:
        self.manifest = Manifest.decode(self._kept.pop(MANIFEST))
        shapes = {m: (tuple(self._a(m).shape), tuple(self._b(m).shape)) for m in self._specs}
        self.manifest.check(shapes)

    def adapter(self, version: int) -> Adapter:
        weights = {self._engine.module_name(m): (self._a(m), self._b(m)) for m in self._specs}
        return Adapter(version, self.manifest, weights)

    def _a(self, module: str) -> torch.Tensor:
        return self._kept[f"{module}.lora_A.weight"]

    def _b(self, module: str) -> torch.Tensor:
        return self._kept[f"{module}.lora_B.weight"]


class Lease:
    """One request's hold on one adapter version (Note [adapter versions and requests]): call it like the model;
    ``close`` (or the end of a ``with``) when the request is done."""

    def __init__(self, engine: AdapterVersions, adapter: Adapter):
        self._engine, self.adapter, self.closed = engine, adapter, False

    @property
    def version(self) -> int:
        return self.adapter.version

    def __call__(self, *args, **kwargs):
        if self.closed:
            raise RuntimeError(f"the request on adapter version {self.version} has finished")
        return self._engine.run(self.adapter, *args, **kwargs)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self._engine.release(self.adapter)

    def __enter__(self) -> Lease:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AdapterVersions:
    """A torch model served with LoRA adapter versions (Note [adapter versions and requests]). ``model`` is the
    plain base model (no adapter wrappers); the adapter's modules are found in it by name (PEFT's
    ``base_model.model.`` prefix dropped) and must be ``nn.Linear``. Requests may run from several threads."""

    def __init__(self, model: torch.nn.Module, device: torch.device | str | None = None):
        self.model = model
        first = next(model.parameters(), None)
        self.device = (
            torch.device(device) if device is not None else (first.device if first is not None else "cpu")
        )
        self._held = HeldVersions()  # the Adapters, counted by requests
        self._local = threading.local()  # the adapter of the request running on this thread
        self._hooks: dict[str, object] = {}  # module -> its forward hook's handle

    # --- pushes -----------------------------------------------------------------------------------------------
    def receive(self, receiver, wait_s: float | None = None) -> PushReport:
        """Serve one adapter push on ``receiver`` (a PushReceiver) and install it as a new version."""
        load = AdapterLoad(self)
        report = receiver.receive(load_fn=load, wait_s=wait_s)
        if not report.skipped:
            self.install(load.adapter(report.version))
        return report

    def install(self, adapter: Adapter) -> None:
        """Make ``adapter`` the latest version (the one new requests get); the previous latest is dropped unless
        requests still use it."""
        for module in adapter.weights:
            self._hook(module)
        self._held.install(adapter.version, adapter)

    def check_module(self, module: str, a_shape: tuple[int, ...], b_shape: tuple[int, ...]) -> None:
        name = self.module_name(module)
        linear = dict(self.model.named_modules()).get(name)
        if not isinstance(linear, torch.nn.Linear):
            raise LayoutError(f"adapter module {module!r}: the engine's model has no Linear {name!r}")
        if len(a_shape) != 2 or len(b_shape) != 2 or a_shape[1] != linear.in_features:
            raise LayoutError(
                f"{module!r}: lora_A {list(a_shape)} does not fit in_features {linear.in_features}"
            )
        if b_shape[0] != linear.out_features or b_shape[1] != a_shape[0]:
            raise LayoutError(
                f"{module!r}: lora_B {list(b_shape)} does not fit out_features {linear.out_features} and "
                f"rank {a_shape[0]}"
            )

    @staticmethod
    def module_name(module: str) -> str:
        return module.removeprefix(_WRAPPED)

    # --- requests ---------------------------------------------------------------------------------------------
    def request(self, version: int | None = None) -> Lease:
        """A lease on ``version`` (default: the latest) for one request."""
        return Lease(self, self._held.acquire(version))

    def release(self, adapter: Adapter) -> None:
        self._held.release(adapter)

    def versions(self) -> dict[int, int]:
        """The adapter versions held -> how many requests run on each (the latest is held with none)."""
        return self._held.versions()

    @property
    def latest(self) -> int | None:
        return self._held.latest

    def run(self, adapter: Adapter, *args, **kwargs):
        """The model's forward with ``adapter`` on every module it adapts (this thread only)."""
        previous, self._local.adapter = getattr(self._local, "adapter", None), adapter
        try:
            return self.model(*args, **kwargs)
        finally:
            self._local.adapter = previous

    def close(self) -> None:
        for handle in self._hooks.values():
            handle.remove()
        self._hooks = {}

    def _hook(self, name: str) -> None:
        if name in self._hooks:
            return
        module = dict(self.model.named_modules())[name]

        def add_delta(mod, inputs, output, name=name):
            adapter = getattr(self._local, "adapter", None)
            weights = adapter.weights.get(name) if adapter is not None else None
            if weights is None:
                return output
            a, b = weights
            return output + F.linear(F.linear(inputs[0], a), b) * adapter.manifest.config.scaling

        self._hooks[name] = module.register_forward_hook(add_delta)


class HeldVersions:
    """The adapter versions an engine holds, each counted by the requests running on it (Note [adapter versions
    and requests]): ``install`` makes a value the latest, ``acquire`` / ``release`` count a request in and out of
    the value it runs on. Each returns the values it dropped, for an engine that must free them itself (vLLM).
    Counted per value, so a version number pushed again while requests run on its earlier value keeps both."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._held: list[list] = []  # [version, value, requests], oldest first; the last is the latest

    @property
    def latest(self) -> int | None:
        return self._held[-1][0] if self._held else None

    def install(self, version: int, value: object) -> list[object]:
        """``value`` is the latest now, whatever its version's number (the receiver applied it)."""
        with self._lock:
            self._held.append([version, value, 0])
            return self._drop_unused()

    def acquire(self, version: int | None = None) -> object:
        """The value of ``version`` (default: the latest; the newest of that number), counted for one more
        request."""
        with self._lock:
            entry = next((e for e in reversed(self._held) if version is None or e[0] == version), None)
            if entry is None:
                raise LookupError(f"adapter version {version} is not held (held: {sorted(self._versions())})")
            entry[2] += 1
            return entry[1]

    def release(self, value: object) -> list[object]:
        with self._lock:
            entry = next((e for e in self._held if e[1] is value), None)
            if entry is None or entry[2] <= 0:
                raise LookupError("no request holds this adapter version")
            entry[2] -= 1
            return self._drop_unused()

    def versions(self) -> dict[int, int]:
        with self._lock:
            return dict(sorted(self._versions().items()))

    def _versions(self) -> dict[int, int]:
        out: dict[int, int] = {}
        for version, _, requests in self._held:
            out[version] = out.get(version, 0) + requests
        return out

    def _drop_unused(self) -> list[object]:
        dropped = [e[1] for e in self._held[:-1] if e[2] == 0]
        self._held = [e for e in self._held[:-1] if e[2] > 0] + self._held[-1:]
        return dropped


# --- through WeightSync (Note [adapter pushes through WeightSync]) -------------------------------------------------
_ENDPOINTS = "_raysync_adapter_endpoints"  # on the engine's actor: its attribute's name -> AdapterEndpoint


class AdapterEndpoint:
    """What the endpoint functions take for "the actor" in an engine that serves adapters: its sessions of adapter
    pushes live here. ``engine``: the AdapterVersions (or the vLLM worker); ``make_load(engine)``: the load
    function of one push."""

    def __init__(self, engine: Any, make_load: Callable[[Any], Any]):
        self.engine, self._make_load = engine, make_load
        self.load: Any = None  # the load function of the last receive

    def sink(self) -> Any:
        self.load = self._make_load(self.engine)
        return self.load


def adapter_sink(endpoint: AdapterEndpoint) -> Any:
    """The sink that replaces the driver's: the engine's own load function."""
    return endpoint.sink()


def with_adapter_sink(args: Sequence[Any]) -> tuple:
    """An endpoint function's arguments with the driver's sink (its one callable) replaced by ``adapter_sink``."""
    return tuple(adapter_sink if callable(a) and not isinstance(a, type) else a for a in args)


def endpoint_of(actor: Any, attr: str, engine: Any, make_load: Callable[[Any], Any]) -> AdapterEndpoint:
    """The AdapterEndpoint of ``actor.<attr>``, made on first use."""
    endpoints = actor.__dict__.setdefault(_ENDPOINTS, {})
    if attr not in endpoints or endpoints[attr].engine is not engine:
        endpoints[attr] = AdapterEndpoint(engine, make_load)
    return endpoints[attr]


@dataclass(frozen=True)
class TorchLoraEngine:
    """A torch engine actor serving adapter versions (``actor.<attr>``, an AdapterVersions), for WeightSync's
    ``receivers``; the senders' ``source`` gives the adapter (raysync.sources.lora.AdapterOf). One receiver."""

    actor: Any
    attr: str = "adapters"

    def call(self, fn: Callable, args: tuple | dict[int, tuple] = ()) -> Any:
        """Like ActorEndpoint.call (raysync.ray.endpoint): a Ray ObjectRef of {slot: result}."""
        by_slot = args if isinstance(args, dict) else {0: args}
        return self.actor.__ray_call__.remote(_on_adapters, self.attr, fn, by_slot)


def _on_adapters(actor: Any, attr: str, fn: Callable, args: dict[int, tuple]) -> dict[int, Any]:
    """Runs in the engine's actor: ``fn`` on the AdapterEndpoint; a receive that completed is installed."""
    from raysync.ray import endpoint as ep

    engine = getattr(actor, attr, None)
    if not isinstance(engine, AdapterVersions):
        raise TypeError(
            f"{type(actor).__name__}.{attr} is not an AdapterVersions; pass TorchLoraEngine(actor, attr=...)"
        )
    endpoint = endpoint_of(actor, attr, engine, AdapterLoad)
    out = {}
    for slot, a in args.items():
        if fn is ep.where and not a:  # where the engine's tensors are, not only the GPUs its process sees
            a = (None, lambda e: e.engine.model.named_parameters())
        out[slot] = result = fn(endpoint, *with_adapter_sink(a))
        if fn is ep.receiver_receive and result.ok and not result.report.skipped:
            engine.install(endpoint.load.adapter(result.report.version))
    return out
