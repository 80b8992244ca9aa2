"""A LoRA adapter as a source: push only the adapter's tensors (a few MB), or merge it into the base weights on the
trainer and push those (merged mode).

    trainer (PEFT-style model)                                              engine
    named_parameters() --LoraSource--> [manifest, A0, B0, A1, B1, ...] ====> AdapterVersions (torch_lora.py)
                                        adapter mode: the adapter's bytes     or vLLM (vllm_lora.py)
    named_parameters() --merged()----> [W + B@A * scaling, other weights] ==> any engine, as a full push
                                        merged mode: the model's bytes

Through WeightSync, ``source=AdapterOf(config)`` (adapter mode; the engines are TorchLoraEngine or
VllmEngine(lora=...): Note [adapter pushes through WeightSync] in raysync.engines.torch_lora) or
``source=MergedOf(config)`` (merged mode; ordinary engines). A push's report says which by its bytes: the
adapter's and its manifest's, or the model's.

Names. PEFT names a wrapped Linear's parameters ``<module>.base_layer.weight`` (the frozen base) and
``<module>.lora_A.<adapter>.weight`` / ``<module>.lora_B.<adapter>.weight``; its saved adapters drop the adapter
name (``<module>.lora_A.weight``). Both are recognised; on the wire every tensor has the saved form, which is
what vLLM's loader parses. Only Linear adapters are supported (no ``lora_embedding_*``, no DoRA magnitudes):
anything else LoRA-like is refused by name.

# Note [the adapter manifest]
# The adapter's config (rank, alpha, rslora, target modules, the modules in push order, the adapter's name) travels
# with every push as one more tensor, ``MANIFEST``: a uint8 tensor holding a msgpack map of plain values. It moves
# like any other tensor on every transport (and is covered by verify), and the receiver decodes it with msgpack
# only (strict map keys, bounded sizes, no ext types; nothing is unpickled) and checks it against the tensors that
# came with it (``LoraConfig.check``): a push whose manifest disagrees with its own tensors is refused. Its bytes
# are reported apart from the adapter's (``LoraSource.manifest_bytes``, ``adapter_bytes``).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgpack
import torch

from raysync.core.config import SyncConfig
from raysync.core.errors import LayoutError
from raysync.core.report import PushReport
from raysync.core.source import selected, wire_dtype
from raysync.core.wire import TensorSpec

if TYPE_CHECKING:
    from raysync.core.session import PushSender

MANIFEST = "raysync.lora.manifest"  # the manifest tensor's name (Note [the adapter manifest])
FORMAT = "raysync-lora/1"
MAX_MANIFEST_BYTES = 4 << 20
MAX_MODULES = 1 << 16
MAX_NAME = 1024

_PEFT = re.compile(r"^(?P<module>.+)\.lora_(?P<ab>[AB])(?:\.(?P<adapter>[^.]+))?\.weight$")
_UNSUPPORTED = ("lora_embedding_A", "lora_embedding_B", "lora_magnitude_vector")
_WRAPPED = "base_model.model."  # PEFT's prefix of the wrapped model's names


@dataclass(frozen=True)
class LoraConfig:
    """What an adapter is, besides its tensors: ``r`` (rank), ``alpha``, ``target_modules`` (module names or their
    last components, as PEFT's list form), ``use_rslora`` (scaling alpha / sqrt(r) instead of alpha / r)."""

    r: int
    alpha: float
    target_modules: tuple[str, ...]
    use_rslora: bool = False

    def __post_init__(self) -> None:
        if type(self.r) is not int or not 0 < self.r <= 1 << 16:
            raise LayoutError(f"LoRA rank r={self.r!r}: an int in [1, 65536]")
        if (
            isinstance(self.alpha, bool)
            or not isinstance(self.alpha, int | float)
            or not math.isfinite(self.alpha)
        ):
            raise LayoutError(f"LoRA alpha={self.alpha!r}: a finite number")
        targets = tuple(self.target_modules)
        if not targets or not all(isinstance(t, str) and 0 < len(t) <= MAX_NAME for t in targets):
            raise LayoutError(f"target_modules={self.target_modules!r}: a non-empty list of module names")
        object.__setattr__(self, "target_modules", targets)
        object.__setattr__(self, "alpha", float(self.alpha))
        if type(self.use_rslora) is not bool:
            raise LayoutError(f"use_rslora={self.use_rslora!r}: a bool")

    @property
    def scaling(self) -> float:
        """What B @ A is multiplied by (PEFT's ``scaling``)."""
        return self.alpha / math.sqrt(self.r) if self.use_rslora else self.alpha / self.r

    def targets(self, module: str) -> bool:
        return any(module == t or module.endswith("." + t) for t in self.target_modules)


@dataclass(frozen=True)
class Manifest:
    """The decoded manifest: the config, the adapter's name, the adapted modules in push order."""

    config: LoraConfig
    adapter: str
    modules: tuple[str, ...]

    def encode(self, device: torch.device | str = "cpu") -> torch.Tensor:
        c = self.config
        body = {
            "format": FORMAT,
            "r": c.r,
            "alpha": c.alpha,
            "use_rslora": c.use_rslora,
            "target_modules": list(c.target_modules),
            "adapter": self.adapter,
            "modules": list(self.modules),
        }
        raw = msgpack.packb(body, use_bin_type=True)
        return torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(device)

    @classmethod
    def decode(cls, data: torch.Tensor) -> Manifest:
        """From the manifest tensor as it landed (Note [the adapter manifest]); LayoutError if it is not one."""
        if data.dtype != torch.uint8 or data.dim() != 1 or data.numel() > MAX_MANIFEST_BYTES:
            raise LayoutError(f"{MANIFEST!r} is {data.dtype}{list(data.shape)}: a uint8 vector under 4 MiB")
        try:
            body = msgpack.unpackb(
                data.cpu().numpy().tobytes(),
                raw=False,
                strict_map_key=True,
                use_list=True,
                max_str_len=MAX_NAME,
                max_bin_len=0,
                max_ext_len=0,
                max_array_len=MAX_MODULES,
                max_map_len=16,
            )
        except Exception as e:
            raise LayoutError(f"{MANIFEST!r} is not a msgpack map: {type(e).__name__}: {e}") from e
        want = {"format", "r", "alpha", "use_rslora", "target_modules", "adapter", "modules"}
        if not isinstance(body, dict) or set(body) != want or body["format"] != FORMAT:
            got = sorted(body) if isinstance(body, dict) else type(body).__name__
            raise LayoutError(f"{MANIFEST!r}: expected the fields {sorted(want)} of {FORMAT}, got {got}")
        modules, targets = body["modules"], body["target_modules"]
        if not isinstance(modules, list) or not all(isinstance(m, str) and m for m in modules):
            raise LayoutError(f"{MANIFEST!r}: 'modules' is not a list of module names")
        if not isinstance(targets, list) or not isinstance(body["adapter"], str):
            raise LayoutError(f"{MANIFEST!r}: 'target_modules' must be a list, 'adapter' a string")
        config = LoraConfig(body["r"], body["alpha"], tuple(targets), body["use_rslora"])
        return cls(config, body["adapter"], tuple(modules))

    def check(self, shapes: dict[str, tuple[tuple[int, ...], tuple[int, ...]]]) -> None:
        """That the tensors that came with it are this adapter: ``shapes`` maps each module to (A's, B's shape)."""
        if tuple(shapes) != self.modules:
            raise LayoutError(
                f"the manifest lists {len(self.modules)} modules, the push carries {len(shapes)} "
                f"(only in the manifest: {sorted(set(self.modules) - set(shapes))[:3]}, only pushed: "
                f"{sorted(set(shapes) - set(self.modules))[:3]})"
            )
        for module, (a, b) in shapes.items():
            if len(a) != 2 or len(b) != 2 or a[0] != self.config.r or b[1] != self.config.r:
                raise LayoutError(
                    f"module {module!r}: lora_A {list(a)}, lora_B {list(b)}; rank {self.config.r} needs "
                    f"A [{self.config.r}, in] and B [out, {self.config.r}]"
                )
            if not self.config.targets(module):
                raise LayoutError(
                    f"module {module!r} is not one of target_modules {self.config.target_modules}"
                )


def adapter_name(module: str, ab: str) -> str:
    """The wire name of a module's A or B (PEFT's saved form)."""
    return f"{module}.lora_{ab}.weight"


def parse(name: str) -> tuple[str, str] | None:
    """(module, "A" | "B") for a LoRA tensor's name, in PEFT's live or saved form; None for any other tensor.
    A LoRA-like name raysync does not support raises LayoutError."""
    m = _PEFT.match(name)
    if m is None:
        if any(f".{u}" in name or name.startswith(u) for u in _UNSUPPORTED):
            raise LayoutError(f"{name!r}: only Linear LoRA adapters travel (no embedding adapters, no DoRA)")
        return None
    return m["module"], m["ab"]


def adapter_tensors(
    named_tensors: Iterable[tuple[str, torch.Tensor]], adapter: str | None = None
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """module -> (A, B) from ``named_tensors`` (every other tensor is ignored). ``adapter``: keep only that
    PEFT adapter's tensors (None: there must be one adapter)."""
    found: dict[str, dict[str, torch.Tensor]] = {}
    names: set[str] = set()
    for name, tensor in named_tensors:
        parsed = parse(name)
        if parsed is None:
            continue
        m = _PEFT.match(name)
        if adapter is not None and m["adapter"] not in (adapter, None):
            continue
        names.add(m["adapter"])
        found.setdefault(parsed[0], {})[parsed[1]] = tensor
    if adapter is None and len(names) > 1:
        raise LayoutError(f"the model holds several adapters {sorted(map(str, names))}: name the one to push")
    if not found:
        raise LayoutError("no LoRA tensors ('<module>.lora_A[.<adapter>].weight') among the tensors given")
    half = [m for m, ab in found.items() if set(ab) != {"A", "B"}]
    if half:
        raise LayoutError(f"modules with only one of lora_A / lora_B: {half[:3]}")
    return {m: (ab["A"], ab["B"]) for m, ab in found.items()}


class LoraSource:
    """The adapter of a PEFT-style model as a plain source: iterate it, or hand it to ``PushSender.push``. Built
    from ``model.named_parameters()`` (or any named set of A / B tensors; every other tensor is ignored) and its
    ``LoraConfig``; ``adapter``: which PEFT adapter, when the model holds several. Keeps the trainer's A / B
    tensors (the optimizer updates them in place), so every push sends the same objects."""

    def __init__(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], config: LoraConfig, adapter: str = "default"
    ):
        self.config, self.adapter = config, adapter
        self.modules = adapter_tensors(named_tensors, adapter)
        shapes = {m: (tuple(a.shape), tuple(b.shape)) for m, (a, b) in self.modules.items()}
        manifest = Manifest(config, adapter, tuple(self.modules))
        manifest.check(shapes)
        self.manifest = manifest.encode(next(iter(self.modules.values()))[0].device)

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        yield MANIFEST, self.manifest
        for module, (a, b) in self.modules.items():
            yield adapter_name(module, "A"), a
            yield adapter_name(module, "B"), b

    @property
    def manifest_bytes(self) -> int:
        return self.manifest.numel()

    def adapter_bytes(self, config: SyncConfig | None = None) -> int:
        """The adapter's bytes on the wire (in ``config``'s wire dtypes; as they are without a config)."""
        total = 0
        for name, t in self:
            if name == MANIFEST or (config is not None and not selected(name, config)):
                continue
            dtype = wire_dtype(name, t.dtype, config) if config is not None else t.dtype
            total += t.numel() * dtype.itemsize
        return total


@dataclass(frozen=True)
class LoraReport:
    """A LoRA push: which mode (``"adapter"``: only the adapter's tensors; ``"merged"``: the base weights with the
    adapter merged in, a full push), the bytes of the adapter (adapter mode) and the session's report."""

    mode: str
    push: PushReport
    adapter_bytes: int  # 0 in merged mode
    manifest_bytes: int

    def __str__(self) -> str:
        return f"lora {self.mode} push, adapter {self.adapter_bytes} B + manifest {self.manifest_bytes} B: {self.push}"


def push_adapter(sender: PushSender, source: LoraSource, version: int) -> LoraReport:
    """Adapter mode: push ``source`` (the adapter and its manifest) as ``version`` through any session."""
    report = sender.push(source, version)
    return LoraReport("adapter", report, source.adapter_bytes(sender.config), source.manifest_bytes)


# --- merged mode ------------------------------------------------------------------------------------------------
def base_name(name: str) -> str:
    """The name a tensor of the PEFT-wrapped model has in the plain model: ``base_model.model.`` dropped and
    ``<module>.base_layer.<p>`` -> ``<module>.<p>``."""
    name = name.removeprefix(_WRAPPED)
    return name.replace(".base_layer.", ".")


def merged_weight(weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scaling: float) -> torch.Tensor:
    """W + (B @ A) * scaling, in W's dtype: the delta in the adapter's dtype (float32 when the adapter is half
    precision on the CPU, where half matmuls are slow and inexact), cast to W's dtype, added in W's dtype."""
    compute = a.dtype
    if a.device.type == "cpu" and a.dtype in (torch.float16, torch.bfloat16):
        compute = torch.float32
    delta = (b.to(compute) @ a.to(compute)) * scaling
    return weight.detach() + delta.to(weight.dtype)


def merged(
    named_tensors: Iterable[tuple[str, torch.Tensor]], config: LoraConfig, adapter: str | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """Merged mode: every tensor of the plain model, in order, named as in the plain model; each adapted module's
    weight merged (``merged_weight``, a new tensor per push), the rest as they are. The adapter's own tensors do
    not travel. Push it as a full push: ``sender.push(merged(model.named_parameters(), config), version)``."""
    named = list(named_tensors)
    modules = {m.removeprefix(_WRAPPED): ab for m, ab in adapter_tensors(named, adapter).items()}
    done = set()
    for name, tensor in named:
        if parse(name) is not None:
            continue
        module, _, param = name.removeprefix(_WRAPPED).rpartition(".base_layer.")
        if module in modules and param == "weight":
            a, b = modules[module]
            done.add(module)
            yield base_name(name), merged_weight(tensor, a, b, config.scaling)
        else:
            yield base_name(name), tensor
    missing = set(modules) - done
    if missing:
        raise LayoutError(
            f"adapted modules without a '<module>.base_layer.weight' to merge into: {sorted(missing)[:3]}"
        )


def push_merged(
    sender: PushSender,
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    config: LoraConfig,
    version: int,
    adapter: str | None = None,
) -> LoraReport:
    """Merged mode through any session: a full push of the merged weights (``merged``)."""
    return LoraReport("merged", sender.push(merged(named_tensors, config, adapter), version), 0, 0)


# --- sources for WeightSync (``source=``) --------------------------------------------------------------------
_KEPT = "_raysync_lora_sources"  # on the trainer's actor: AdapterOf -> the LoraSource it gave last


@dataclass(frozen=True)
class AdapterOf:
    """WeightSync's ``source=`` for adapter mode: the adapter of ``actor.<attr>`` (a PEFT-style model) as a
    LoraSource. The same LoraSource (its manifest tensor too) is given again while the model's A / B tensors
    are the same objects, so the plan can read them in place (cuda_ipc direct mode) where it reads any source."""

    config: LoraConfig
    adapter: str = "default"
    attr: str = "model"

    @property
    def plan_note(self) -> str:
        """What the plan says of this source (raysync.ray.placement.report_source)."""
        return f"LoRA adapter mode: only the adapter {self.adapter!r} (r={self.config.r}) and its manifest travel"

    def __call__(self, actor: Any) -> LoraSource:
        fresh = LoraSource(getattr(actor, self.attr).named_parameters(), self.config, self.adapter)
        kept = actor.__dict__.setdefault(_KEPT, {}).get(self)
        if kept is not None and _same_tensors(kept.modules, fresh.modules):
            return kept
        actor.__dict__[_KEPT][self] = fresh
        return fresh


@dataclass(frozen=True)
class MergedOf:
    """WeightSync's ``source=`` for merged mode: ``merged`` of ``actor.<attr>``'s tensors (a full push of the
    plain model's weights, the adapter merged in); receivers are ordinary engines of the base model."""

    config: LoraConfig
    adapter: str | None = None
    attr: str = "model"

    @property
    def plan_note(self) -> str:
        """What the plan says of this source (raysync.ray.placement.report_source)."""
        return "LoRA merged mode: full pushes of the base weights with B @ A * scaling added"

    def __call__(self, actor: Any) -> Iterator[tuple[str, torch.Tensor]]:
        return merged(getattr(actor, self.attr).named_parameters(), self.config, self.adapter)


def _same_tensors(a: dict[str, tuple[torch.Tensor, ...]], b: dict[str, tuple[torch.Tensor, ...]]) -> bool:
    return a.keys() == b.keys() and all(x is y for m in a for x, y in zip(a[m], b[m], strict=True))


def specs_by_module(specs: Sequence[TensorSpec]) -> tuple[dict[str, tuple[int, int]], TensorSpec | None]:
    """A push's specs sorted out: module -> (index of A's spec, index of B's spec), and the manifest's spec.
    LayoutError for a tensor that is neither."""
    found: dict[str, dict[str, int]] = {}
    manifest = None
    for i, s in enumerate(specs):
        if s.name == MANIFEST:
            manifest = s
            continue
        parsed = parse(s.name)
        if parsed is None or _PEFT.match(s.name)["adapter"] is not None:
            raise LayoutError(f"{s.name!r} is not a LoRA tensor ('<module>.lora_A.weight' / 'lora_B.weight')")
        found.setdefault(parsed[0], {})[parsed[1]] = i
    half = [m for m, ab in found.items() if set(ab) != {"A", "B"}]
    if half:
        raise LayoutError(f"the push carries only one of lora_A / lora_B for {half[:3]}")
    return {m: (ab["A"], ab["B"]) for m, ab in found.items()}, manifest
