"""The receiver's side of the data: check the destinations, unpack each bucket, reassemble sliced tensors.

Two kinds of destination, chosen by the caller of ``WeightReceiver.receive``:

* ``into``: a dict name -> tensor (e.g. ``dict(model.named_parameters())``). Every chunk is one byte copy
  straight into its destination; a tensor sliced over several buckets is reassembled in place.
* ``load_fn``: called once per bucket with a list of (name, tensor), the contract of vLLM's
  ``model.load_weights``. Whole tensors are zero-copy views of the ring buffer; a sliced tensor is gathered
  into one staging tensor of its own size and handed over in the bucket that completes it. Two optional
  methods of the load function: ``check(specs)`` is called when a push is accepted, before any byte moves, with
  the push's TensorSpecs (raise LayoutError to refuse the push: nothing is touched); ``finish()`` is called once
  after the last bucket of a complete push, before the version counts as applied (a staging loader: it keeps
  each bucket and applies the whole push at its end, see raysync.engines.vllm).

A staged push (``receive(flip=False)``) lands in a Staging's memory through ``StagingSink``
(raysync.core.staging_sink, made by raysync.core.staging) and reaches the destinations only at the engine's
``flip()``.

Which pushes are atomic (Note [versions never lie] in raysync.core.version): ``into`` with ``SyncConfig.staged``,
and a load function with ``finish`` — a staging loader's contract is that a ``finish`` that fails has put the
old weights back, or raises ``WeightsMixed``. Every other push writes the destinations as its buckets land
(``Sink.in_place``): one that fails part-way leaves them a mix, and the receiver says so.

# Note [ring buffer views]
# The views given to ``load_fn`` point into a ring buffer that the sender overwrites as soon as the call
# returns. A load function must copy what it keeps (``param.copy_(t)``, as every weight loader does).
#
# Note [staging tensors on the host]
# A sliced tensor is gathered into a staging tensor of its own size. On the host, a fresh tensor is new memory
# whose pages fault in at the first write (a 272 MB embedding: ~68k faults at every push), so the staging
# tensors are kept for the next push of the same layout (the sliced tensors' bytes, once per receiver); the
# GPU's caching allocator reuses its blocks by itself. Like a ring view, a staging tensor is reused after the
# load function returns: it must copy what it keeps.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch

from raysync.core import delta, delta_decode_kernels, digest, grouped_copy
from raysync.core.copies import CopyList
from raysync.core.delta import delta_applies
from raysync.core.delta_workspace import reserve_copy_in, side_stream
from raysync.core.errors import LayoutError, WeightsMixed
from raysync.core.plan import Bucket, Chunk
from raysync.core.version import Version
from raysync.core.wire import DTYPES, PushStart, TensorSpec

LoadFn = Callable[[list[tuple[str, torch.Tensor]]], object]


class Sink:
    """Unpacks buckets of one push for one destination; tracks which tensors are complete."""

    in_place = True  # every write reaches the destinations: a push that fails part-way leaves them mixed
    takes_delta = False  # can decode a delta push in place (raysync.core.delta): into= tensors, not staged

    def __init__(self, specs: Sequence[TensorSpec]):
        self.specs = specs
        self.done: set[int] = set()
        self._devices: set[torch.device] = set()
        self.verify = False  # set by the receiver for a push that asks for digests
        self.delta_base: int | None = None  # set by the receiver for a delta push: the version it holds
        self.moved = self.moved_full = 0  # bytes of the buffers a delta push decoded; of them, FULL payloads

    def offered(self, start: PushStart, held: Version) -> bool:
        """A push starts here, holding version ``held``: False when it offers a delta this sink cannot take
        (raysync.core.delta: only in place, on top of exactly its base version), which asks for a full push."""
        takes = start.delta and self.takes_delta and delta_applies(held, start.base_version)
        self.delta_base = start.base_version if takes else None  # the sender's go may still say full
        return takes or not start.delta

    def undelivered(self) -> list[str]:
        return [s.name for i, s in enumerate(self.specs) if i not in self.done]

    def write(self, bucket: Bucket, buffer: torch.Tensor) -> None:
        self.write_all([(bucket, buffer)])

    def write_all(self, parts: Sequence[tuple[Bucket, torch.Tensor]]) -> None:
        """Unpack several buckets at once (direct mode: every storage of the sender, one bucket each)."""
        raise NotImplementedError

    def commit(self) -> None:
        """Every bucket has landed: apply what was staged (nothing for most sinks). Raises WeightsMixed when
        it failed after touching the destinations."""

    def digests(self) -> list[int]:
        """Each tensor's digest of the bytes that landed (raysync.core.digest), in layout order."""
        raise NotImplementedError

    def _sync(self, buffer: torch.Tensor) -> None:
        """Host -> device copies were issued non-blocking: finish them before the host buffer is reused.
        Device -> device copies need nothing: they are ordered on the stream before any reuse."""
        if buffer.device.type == "cpu":
            for device in self._devices:
                torch.cuda.current_stream(device).synchronize()


class IntoTensors(Sink):
    """``staged``: every byte lands in a copy of the destinations first (allocated once, kept while the
    destinations stay) and is copied into them by ``finish``, after the last bucket: a push that fails
    part-way leaves the destinations as they were, never half old and half new. Costs one more copy of the
    weights in memory and one more copy per push."""

    def __init__(
        self,
        specs: Sequence[TensorSpec],
        dest: Mapping[str, torch.Tensor],
        staged: bool = False,
        graphs: bool = True,
        deltas: bool = True,
    ):
        super().__init__(specs)
        final = [byte_view(spec, dest) for spec in specs]  # checks everything before any byte moves
        self._bytes = [torch.empty_like(t) for t in final] if staged else final
        self.in_place = not staged
        self.takes_delta = deltas and not staged
        self._graphs = graphs  # raysync.core.copies: lists on one GPU replayed from a CUDA graph
        self._apply = CopyList(list(zip(final, self._bytes, strict=True)), graphs) if staged else None
        self._copies: dict[tuple, tuple[CopyList, list[torch.Tensor], frozenset[int]]] = {}
        self._devices = {t.device for t in self._bytes if t.device.type == "cuda"}
        self._unsettled: list = []  # delta buckets checked on the device: settled before digests and commit
        for device in self._devices:  # the copies' kernel compiled now, not in the first push
            if grouped_copy.available(device):
                grouped_copy.warm(device)
        if self.takes_delta:  # Note [fused delta kernels]: compiled now, not in the first delta push
            for device in self._devices:
                sizes = {min(s.itemsize, 8) for s, t in zip(specs, final, strict=True) if t.device == device}
                delta_decode_kernels.warm(device, sizes)
                side_stream("copy in", device)  # Note [the first delta push's one-time work]

    def reset(self) -> None:
        self.done, self.delta_base, self.moved, self.moved_full = set(), None, 0, 0
        self._unsettled.clear()

    def write_all(self, parts: Sequence[tuple[Bucket, torch.Tensor]]) -> None:
        if self.delta_base is not None:
            self._decode_all(parts)
            return
        key = tuple((bucket.index, buffer.data_ptr()) for bucket, buffer in parts)
        made = self._copies.get(key)
        if made is None:  # made once per buckets and buffers, replayed every push (raysync.core.copies)
            pairs = [
                (self.target(c), buffer[c.bucket_offset : c.bucket_offset + c.nbytes])
                for bucket, buffer in parts
                for c in bucket.chunks
            ]
            copies = CopyList([(d, s) for d, s in pairs if d.numel()], self._graphs)
            hosts = [buffer for _, buffer in parts if buffer.device.type == "cpu"][-1:]
            finished = frozenset(c.index for bucket, _ in parts for c in bucket.chunks if c.last)
            made = self._copies[key] = (copies, hosts, finished)
        copies, hosts, finished = made
        copies.run()
        for buffer in hosts:  # host -> device copies: done before the host buffer is reused
            self._sync(buffer)
        self.done.update(finished)  # what ``landed`` says of each bucket, for all of them at once

    def _decode_all(self, parts: Sequence[tuple[Bucket, torch.Tensor]]) -> None:
        """A delta push: each bucket decoded in place into the destinations (everything in a bucket is checked
        before its first write: BadDelta, BaseMismatch)."""
        for bucket, buffer in parts:
            devices = {self._bytes[c.index].device for c in bucket.chunks}
            # one device: the bytes cross while the views are made (decode copies them itself otherwise)
            if len(devices) == 1 and buffer.device.type == "cpu":  # room for two whole buckets in flight
                reserve_copy_in(next(iter(devices)), 2 * buffer.numel())
            moved = delta.copy_in(buffer, devices.pop()) if len(devices) == 1 else None
            try:
                dests = []
                for c in bucket.chunks:
                    width = min(self.specs[c.index].itemsize, 8)
                    dests.append(self.target(c).view(delta.WORDS[width]))
                code = delta.decode(
                    buffer,
                    dests,
                    held_version=self.delta_base,
                    unsettled=self._unsettled,
                    tag=bucket,
                    moved=moved,
                )
            finally:
                if moved is not None:  # no copy reads the ring buffer once it is released (decode waited)
                    moved[1].synchronize()
            self.moved, self.moved_full = self.moved + code.nbytes, self.moved_full + code.sent_as_full
            self.landed(bucket)

    def digests(self) -> list[int]:
        self._settle()
        return digest.combine([[digest.partial(t, 0)] for t in self._bytes])  # staged: checked before applied

    def commit(self) -> None:
        self._settle()
        if self._apply is None:
            return
        try:
            self._apply.run()
            for device in self._devices:
                torch.cuda.current_stream(device).synchronize()  # applied means in place
        except Exception as e:  # some destinations may hold the new bytes already
            raise WeightsMixed(f"applying the staged push failed part-way: {type(e).__name__}: {e}") from e

    def _settle(self) -> None:
        """The delta buckets checked on the device (raysync.core.delta.settle): BadDelta for one the kernels
        refused to write, which names it, and whose tensors count as undelivered."""
        try:
            delta.settle(self._unsettled)
        except delta.BadDelta as e:
            bucket = getattr(e, "tag", None)
            if bucket is None:
                raise
            self.done -= {c.index for c in bucket.chunks}
            raise delta.BadDelta(f"bucket {bucket.index}: {e}") from e

    def target(self, chunk: Chunk) -> torch.Tensor:
        """The destination bytes of ``chunk`` (a staged sink's: its copy of the destinations)."""
        return self._bytes[chunk.index][chunk.src_offset : chunk.src_offset + chunk.nbytes]

    def landed(self, bucket: Bucket) -> None:
        self.done.update(c.index for c in bucket.chunks if c.last)


class IntoLoadFn(Sink):
    def __init__(self, specs: Sequence[TensorSpec], load_fn: LoadFn, spare: dict | None = None):
        super().__init__(specs)
        self._load_fn = load_fn
        self.in_place = not callable(getattr(load_fn, "finish", None))  # a staging loader applies in finish
        _check_with(load_fn, specs)
        self._staging: dict[int, torch.Tensor] = {}
        self._spare = {} if spare is None else spare  # Note [staging tensors on the host]
        self._parts: dict[int, list[torch.Tensor]] = {}  # digests of the bytes handed over, per tensor

    def write_all(self, parts: Sequence[tuple[Bucket, torch.Tensor]]) -> None:
        """One call of the load function for all of ``parts`` (a load function has a cost per call)."""
        batch = [item for bucket, buffer in parts for item in self._complete(bucket, buffer)]
        if batch:
            self._load_fn(batch)  # Note [ring buffer views]
        for bucket, _ in parts:
            self.done.update(c.index for c in bucket.chunks if c.last)

    def _complete(self, bucket: Bucket, buffer: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        """The tensors ``bucket`` completes: views of ``buffer``, or a sliced tensor's staging tensor."""
        batch: list[tuple[str, torch.Tensor]] = []
        for c in bucket.chunks:
            region = buffer[c.bucket_offset : c.bucket_offset + c.nbytes]
            if self.verify:
                self._parts.setdefault(c.index, []).append(digest.partial(region, c.src_offset))
            if c.whole:
                batch.append(self._typed(c, region))
                continue
            if c.src_offset == 0:
                self._staging[c.index] = self._staging_for(c.index, buffer.device)
            staging = self._staging[c.index]
            staging[c.src_offset : c.src_offset + c.nbytes].copy_(region)
            if c.last:
                batch.append(self._typed(c, self._staging.pop(c.index)))
        return batch

    def _staging_for(self, index: int, device: torch.device) -> torch.Tensor:
        nbytes = self.specs[index].nbytes
        t = self._spare.get(index)
        if t is None or t.numel() != nbytes or t.device != device:
            t = torch.empty(nbytes, dtype=torch.uint8, device=device)
            if device.type == "cpu":
                self._spare[index] = t
        return t

    def digests(self) -> list[int]:
        return digest.combine([self._parts.get(i, []) for i in range(len(self.specs))])

    def commit(self) -> None:
        finish = getattr(self._load_fn, "finish", None)
        if finish is not None:
            finish()

    def _typed(self, chunk: Chunk, data: torch.Tensor) -> tuple[str, torch.Tensor]:
        spec = self.specs[chunk.index]
        return spec.name, data.view(DTYPES[spec.dtype]).reshape(spec.shape)


class Sinks:
    """Makes each push's sink. Checking 339 destinations and making their byte views costs milliseconds of
    Python, so the checked views are kept while the layout and the destination tensors stay the same."""

    def __init__(self, staged: bool = False, graphs: bool = True) -> None:
        self._staged, self._graphs = staged, graphs
        self._key: tuple | None = None
        self._into: IntoTensors | None = None
        self._spare: tuple[int, dict] = (-1, {})  # (layout id, host staging tensors by tensor index)

    def make(
        self,
        layout_id: int,
        specs: Sequence[TensorSpec],
        into: Mapping[str, torch.Tensor] | None,
        load_fn: LoadFn | None,
    ) -> Sink:
        if into is None:
            if self._spare[0] != layout_id:
                self._spare = (layout_id, {})
            return IntoLoadFn(specs, load_fn, self._spare[1])
        make_sink = getattr(into, "make_sink", None)  # a Staging's (raysync.core.staging): staged already
        try:
            ptrs = tuple((t.data_ptr(), t.dtype, t.shape) for t in (into[s.name] for s in specs))
            key = (layout_id, id(into) if make_sink else None, ptrs)  # the sink keeps ``into`` alive
        except KeyError:
            key = None  # IntoTensors names the missing destination
        if key is None or key != self._key or self._into is None:
            # the old sink (its views of the staging memory) goes before the new one is made, and so does its
            # key: destinations refused now free their memory, and new ones may get the same addresses
            self._into, self._key = None, None
            if make_sink is not None:
                self._into = make_sink(specs, self._graphs)
            else:
                self._into = IntoTensors(specs, into, self._staged, self._graphs)
            self._key = key
        else:
            self._into.reset()
        return self._into


def _check_with(load_fn: LoadFn, specs: Sequence[TensorSpec]) -> None:
    """The load function's own check of a push (its ``check(specs)``, if it has one), before any byte moves;
    whatever it raises refuses the push."""
    check = getattr(load_fn, "check", None)
    if not callable(check):
        return
    try:
        check(specs)
    except LayoutError:
        raise
    except Exception as e:
        raise LayoutError(f"the load function refused the push: {type(e).__name__}: {e}") from e


def byte_view(spec: TensorSpec, dest: Mapping[str, torch.Tensor]) -> torch.Tensor:
    t = dest.get(spec.name)
    if t is None:
        close = [n for n in dest if n.rsplit(".", 1)[-1] == spec.name.rsplit(".", 1)[-1]][:3]
        raise LayoutError(
            f"tensor {spec.name!r} has no destination on the receiver ({len(dest)} destinations; similar: {close}); "
            f"exclude it on the sender (SyncConfig.exclude) or add it to the destinations"
        )
    if tuple(t.shape) != spec.shape or t.dtype != DTYPES[spec.dtype]:
        raise LayoutError(
            f"tensor {spec.name!r}: sender has {spec.dtype}{list(spec.shape)}, destination is "
            f"{str(t.dtype).removeprefix('torch.')}{list(t.shape)}; set SyncConfig.cast_dtype on the sender to match"
        )
    if not t.is_contiguous():
        raise LayoutError(f"destination {spec.name!r} is not contiguous; pass a contiguous tensor")
    return t.detach().reshape(-1).view(torch.uint8)
