"""The layout agreement, both halves: what a session's sender and receivers agree on before a push can start.

    sender (SenderLayout)                                  receiver (ReceiverLayout)
    select the tensors (kept while they stay the same)
    Layout when names, dtypes or shapes change       -->   check it, plan it as the plane moves it
    what the plane places (direct: the storages)     -->   map them, plan from them
    the Packer's copies, made once per set of tensors      the sink for the destinations, made once per
                                                           layout (checked ahead, while waiting for a push)

A layout the receiver refuses is answered at the next PushStart (accept), never by a hang: the sender sends
its Layout and goes on to PushStart without waiting.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence

import torch

from raysync.core.config import SyncConfig
from raysync.core.control import ReceiverChannel
from raysync.core.errors import LayoutError, RaysyncError, RemoteError, SchemaError, SessionClosed
from raysync.core.plan import Bucket, plan_buckets, total_bytes
from raysync.core.sink import LoadFn, Sink, Sinks
from raysync.core.source import Packer, Source, SourcePacker, SourceTensor, select
from raysync.core.wire import Abort, BucketReady, Checked, Close, DirectSources, Layout, PushStart

logger = logging.getLogger(__name__)


class SenderLayout:
    """The sender's half: the selected tensors, the Layout sent, the buckets, and what every push replays
    (the Packer's copies into the plane's buffers; none when the plane reads the source in place)."""

    def __init__(self, config: SyncConfig):
        self.config = config
        self.layout: Layout | None = None
        self.nbytes = 0  # of the layout's tensors
        self.buckets: list[Bucket] = []
        self.packer: Packer | SourcePacker | None = None
        self.lazy: Source | None = None  # the lazy source self.packer packs from
        self.placed = 0  # counts the placements: what every push replays, made once per set of tensors
        self.is_placed = False  # for the current tensors (select clears it when they change)
        self._sources: list[SourceTensor] = []
        self._key: tuple | None = None
        self._named: list[tuple[str, torch.Tensor]] = []  # what the last push was given

    @property
    def sources(self) -> list[SourceTensor]:
        """The tensors selected for the current layout (none for a lazy source)."""
        return self._sources

    def select(self, named: list[tuple[str, torch.Tensor]]) -> list[SourceTensor]:
        """source.select(), skipped while the trainer pushes the same tensors (updated in place)."""
        key = tuple((n, t.data_ptr(), t.dtype, t.shape, t.stride(), t.device) for n, t in named)
        if key != self._key:
            self._sources, self._key = select(named, self.config), key
            self.is_placed, self.packer = False, None
        self._named = named
        return self._sources

    def same_objects(self, named: list[tuple[str, torch.Tensor]]) -> bool:
        """The same names and tensor objects as last push: likely (not surely) the same tensors."""
        last = self._named
        if len(named) != len(last):
            return False
        return all(a[0] == b[0] and a[1] is b[1] for a, b in zip(named, last, strict=True))

    def agree(self, sources: Sequence[SourceTensor], plane: object, channel: object) -> None:
        """Send the Layout when the tensors' names, dtypes or shapes change; make what every push replays when
        the tensors themselves change: the Packer's copies, or what the plane places (a direct plane: the
        exported storages and its own plan, checked before anything is sent)."""
        if self.is_placed:  # made for these very tensors (select clears it when they change)
            return
        cfg = self.config
        specs = tuple(s.spec for s in sources)
        new = self.layout is None or self.layout.tensors != specs
        layout = self.layout
        if new:
            layout_id = self.layout.layout_id + 1 if self.layout else 1
            layout = Layout(layout_id, cfg.bucket_bytes, cfg.align_bytes, specs)
        placed = plane.place(layout, sources)
        if new:
            self.layout, self.nbytes = layout, total_bytes(specs)
            self.buckets = plan_buckets(specs, cfg.bucket_bytes, cfg.align_bytes)
            channel.send(layout, "layout")
        if placed is not None:
            self.buckets, message = placed
            channel.send(message, "layout: the trainer's storages")
        buffers = plane.buffers
        self.packer = Packer(self.buckets, sources, buffers, cfg.cuda_graphs) if buffers else None
        self.placed, self.is_placed, self.lazy = self.placed + 1, True, None

    def agree_source(self, source: Source, plane: object, channel: object) -> None:
        """The same agreement for a lazy source: its Layout from its metadata (``source.specs``), sent when it
        changed; its packer made once per layout and source. A plain push after it selects and places anew."""
        cfg = self.config
        if plane.reads_in_place:
            raise LayoutError(
                f"the {plane.name} plane reads whole tensors in place; a lazy source ({type(source).__name__}) "
                f"has none: use a ring (SyncConfig(direct=False))"
            )
        specs = tuple(source.specs(cfg))
        if self.layout is None or self.layout.tensors != specs:
            layout_id = self.layout.layout_id + 1 if self.layout else 1
            layout = Layout(layout_id, cfg.bucket_bytes, cfg.align_bytes, specs)
            self.layout, self.nbytes = layout, total_bytes(specs)
            self.buckets = plan_buckets(specs, cfg.bucket_bytes, cfg.align_bytes)
            channel.send(layout, "layout")
            self.lazy = None
        if self.lazy is not source:
            self.packer, self.lazy = source.packer(cfg, self.buckets, plane.buffers), source
        self.is_placed, self._key = False, None


class ReceiverLayout:
    """The receiver's half: the Layout taken (or the reason it was refused), its buckets as the plane moves
    them, and the sinks made for it."""

    def __init__(self, config: SyncConfig):
        self.config = config
        self.layout: Layout | None = None
        self.buckets: list[Bucket] = []
        self.error: RaysyncError | None = None  # a Layout we refused; answered at the next PushStart
        self._sinks = Sinks(config.staged, config.cuda_graphs)
        self._made = 1  # counts the Sinks made: a sink checked ahead is used only from the current one
        self._last_push_id = 0  # the last push started (or aborted by the sender before it started)

    @property
    def names(self) -> list[str]:
        return [s.name for s in self.layout.tensors] if self.layout else []

    def next_push(self, channel: ReceiverChannel, plane: object, wait_s: float | None) -> PushStart:
        """Wait for the next PushStart, taking a new Layout (or storages) on the way; skip leftovers of failed
        pushes; an Abort of a push not started yet is the sender's failure before it (its source raised)."""
        stage = "waiting for a push"
        while True:
            msg = channel.recv(stage, wait_s)
            if isinstance(msg, Layout):
                self.take_layout(msg, plane)
            elif isinstance(msg, DirectSources):
                self.take_sources(msg, plane)
            elif isinstance(msg, PushStart):
                self._last_push_id = msg.push_id
                return msg
            elif isinstance(msg, Close):
                raise SessionClosed(f"{channel.peer} closed the session")
            elif isinstance(msg, Abort) and msg.push_id > self._last_push_id:
                self._last_push_id = msg.push_id
                raise RemoteError(channel.peer, msg.stage, msg.message, msg.traceback)
            elif isinstance(msg, (BucketReady, Abort, Checked)):  # Checked: of a push refused here
                logger.debug("skipping %s left over from push %d", type(msg).__name__, msg.push_id)
            else:
                raise SchemaError(f"{channel.peer} sent {type(msg).__name__} while no push was running")

    def take_layout(self, layout: Layout, plane: object) -> None:
        """Plan the layout as the plane moves it; a refusal is answered at the next PushStart."""
        try:
            buckets = plane.plan(layout)
        except SchemaError as e:
            self.layout, self.buckets, self.error = None, [], e
            return
        self.layout, self.buckets, self.error = layout, buckets, None

    def take_sources(self, sources: DirectSources, plane: object) -> None:
        """A plane that reads the sender's storages in place maps them (once per set of tensors) and plans from
        them; a refusal is answered at the next PushStart, like a refused layout."""
        self.drop_sinks()  # their copies read the old mappings: drop them first
        self.buckets = []
        try:
            buckets = plane.take_sources(sources, self.layout)
        except Exception as e:
            self.error = (
                e
                if isinstance(e, RaysyncError)
                else LayoutError(f"cannot map the sender's storages: {type(e).__name__}: {e}")
            )
            return
        self.buckets, self.error = buckets, None

    def check_ahead(self, into: Mapping[str, torch.Tensor] | None, load_fn: LoadFn | None) -> tuple | None:
        """Check the destinations against the current layout before the push starts (the engine waits then,
        while accept is on every push's critical path). Used only if nothing changed by the time the push
        starts; any error is left for accept to raise and report."""
        if self.layout is None or self.error is not None:
            return None
        try:
            sink = self._sinks.make(self.layout.layout_id, self.layout.tensors, into, load_fn)
        except Exception:  # accept makes it again, and tells the sender what failed
            return None
        return self.layout.layout_id, self._made, sink  # no reference to the Sinks: see drop_sinks

    def sink_for(
        self,
        start: PushStart,
        into: Mapping[str, torch.Tensor] | None,
        load_fn: LoadFn | None,
        ahead: tuple | None,
    ) -> Sink:
        """The sink for push ``start``: the layout it names must be the one taken, the destinations must fit
        it (checked ahead when nothing changed since). Raises the reason otherwise."""
        if self.error is not None:
            raise self.error
        if self.layout is None or start.layout_id != self.layout.layout_id:
            raise SchemaError(f"push {start.push_id} names layout {start.layout_id}, which was never sent")
        if ahead is not None and ahead[:2] == (self.layout.layout_id, self._made):
            return ahead[2]  # checked while waiting, and nothing changed since
        return self._sinks.make(self.layout.layout_id, self.layout.tensors, into, load_fn)

    def drop_sinks(self) -> None:
        """The cached sinks hold views of the ring (or of the sender's mapped storages) and keep that memory
        mapped: they go before the ring does, and nothing else may keep them (an exception's frames can)."""
        self._sinks = Sinks(self.config.staged, self.config.cuda_graphs)
        self._made += 1
