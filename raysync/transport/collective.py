"""Collective transport: a data plane that broadcasts every bucket from the sender to all its receivers over a
standalone torch process group (NCCL on GPUs, gloo on CPUs; "hccl" is accepted for Ascend but untested).

    rank 0 (sender)                      ranks 1..N (receivers)
    rendezvous store on host:port <---   join the store, then the group (rendezvous, bounded by a set-up limit)
    (raysync.transport.rendezvous: only holders of the session key get a byte in)
    control: one signed channel per receiver (control.Fanout), the push session's messages (raysync.core.session)
    bucket k: pack into buffer k % S, broadcast it   ->   broadcast into buffer k % S (posted S buckets ahead),
                                                          unpack into the sink, post bucket k + S there

The push itself (layout agreement, accept, verify, the report, versions, typed errors) is the one push session
that every plane runs on; this module is only the plane: how a packed bucket reaches every receiver (one
broadcast) and when a buffer is free again (its broadcast finished). A broadcast moves every rank together,
so the plane is ``all_or_none``: after accept the session sends a go (or an Abort for all when one refused).
Its two halves set up a rank of the group and are no session themselves: ``CollectiveSender`` (rank 0) and
``CollectiveReceiver`` (rank r) make the store, the control channels and the group, and their ``join`` hands
the group's plane to a plain ``PushSender`` / ``PushReceiver``, which they own and close before the group.

The group is the sync's own: it never touches a default process group that the trainer or vLLM use. The
store is raysync's own too (rendezvous.py, Note [who may talk to the rendezvous store]): torch's TCPStore
serves anyone who connects, and one local process writing garbage to it stalled every rank. It only bootstraps
the group; no control message goes through it.

# Note [no hangs in a collective]
# A collective only finishes when every rank takes part, so a rank that fails mid-push must not just stop:
# it sends its error to the sender (an Abort) and aborts the group (DataPlane.fail). With gloo the others'
# pending broadcasts then fail at once ("connection closed"); with NCCL they fail at their next bounded wait.
# Every wait is bounded by timeout_s, after which the waiting rank aborts the group itself. The sender, whose
# broadcast failed, reports the Abort a receiver sent rather than its own symptom. An aborted group is gone:
# the next push needs a new one (WeightSync reconnects broken pairs before the next push).
#
# Note [deltas over a broadcast]
# SyncConfig.delta (raysync.core.delta_push): only a delta bucket's used bytes cross. The sender broadcasts
# its header and table (a size both sides know from the bucket's chunks), then the bytes the header says
# follow; a receiver waits for the table, checks that size, then posts the rest. Both halves grow their
# buffers to the layout's encoding when it is placed / planned.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence

import torch
import torch.distributed as dist

from raysync.core.config import SyncConfig
from raysync.core.control import ReceiverChannel, SenderChannel
from raysync.core.delta import used_bytes
from raysync.core.delta_buffers import buffer_bytes, table_bytes
from raysync.core.errors import BadDelta, RaysyncError, SchemaError
from raysync.core.fanout import Fanout
from raysync.core.plan import Bucket, plan_buckets
from raysync.core.session import PushSender
from raysync.core.session_receiver import PushReceiver
from raysync.core.source import SourceTensor
from raysync.core.wire import Attached, DirectSources, Layout, RingInfo, SessionSecret
from raysync.transport.process_group import BroadcastGroup, Rendezvous, default_backend
from raysync.transport.rendezvous import StoreClient
from raysync.transport.rendezvous_server import StoreServer

logger = logging.getLogger(__name__)


def _buffers(config: SyncConfig, device: torch.device | None) -> list[torch.Tensor]:
    return [
        torch.empty(config.bucket_bytes, dtype=torch.uint8, device=device) for _ in range(config.num_buffers)
    ]


def _fit(buffers: list[torch.Tensor], layout: Layout) -> list[torch.Tensor]:
    """Buffers that hold the encoding of every bucket of ``layout`` (Note [deltas over a broadcast]): these,
    or new ones where they are too small (between pushes, when nothing is in flight)."""
    need = buffer_bytes(layout.tensors, layout.bucket_bytes, layout.align_bytes)
    if need <= buffers[0].numel():
        return buffers
    return [torch.empty(need, dtype=torch.uint8, device=b.device) for b in buffers]


class BroadcastPlane:
    """The sender's half (transport.base.DataPlane): bucket k is packed into buffer k % S and broadcast from
    there; the buffer is free again when that broadcast has finished (NCCL: a stream wait, no host wait)."""

    name = "collective"
    reads_in_place = False
    all_or_none = True

    def __init__(self, group: BroadcastGroup, buffers: list[torch.Tensor], delta: bool = False):
        self.transport, self.buffers, self.slots = group, buffers, len(buffers)
        self._delta = delta  # SyncConfig.delta: buffers fit each layout's encoding, encoded() is heard
        self._buckets: list[Bucket] = []
        self._used: dict[int, int] = {}  # delta buckets of this push: the bytes their encoding uses
        self._works: list[list] = [[] for _ in buffers]

    def describe(self) -> RingInfo:
        return RingInfo(self.name, self.slots, self.buffers[0].numel(), ())

    def attached(self, attached: Attached) -> None:
        pass

    def place(
        self, layout: Layout, sources: Sequence[SourceTensor]
    ) -> tuple[list[Bucket], DirectSources] | None:
        if self._delta:
            self.buffers = _fit(self.buffers, layout)
        return None

    def begin(self, push_id: int, buckets: list[Bucket]) -> None:
        self._buckets, self._used = buckets, {}

    def encoded(self, k: int, nbytes: int) -> None:
        """Bucket k of this push is a delta encoding of ``nbytes`` bytes: ``publish`` moves those only."""
        self._used[k] = nbytes

    def claim(self, k: int) -> torch.Tensor:
        if self.transport.pg is None:  # the first claim of a push (packed ahead): the receivers hear it
            raise RaysyncError("this collective group was aborted by an earlier failure; make a new one")
        slot = k % self.slots
        self.transport.wait(self._works[slot], f"broadcast bucket {k - self.slots}", block=False)
        self._works[slot] = []
        return self.buffers[slot]

    def bucket_view(self, k: int) -> torch.Tensor:
        return self.buffers[k % self.slots]

    def packed(self, k: int) -> None:
        pass  # NCCL orders the broadcast after the packing on the current stream

    def publish(self, k: int) -> None:
        slot, buffer = k % self.slots, self.buffers[k % self.slots]
        used, size = self._used.pop(k, None), self._buckets[k].nbytes
        if used is None:
            views = [buffer[:size]] if size else []
        else:  # Note [deltas over a broadcast]: the table, then what it says follows
            head = table_bytes(self._buckets[k])
            views = [buffer[:head]] + ([buffer[head:used]] if used > head else [])
        self._works[slot] = [w for v in views for w in self.transport.broadcast([v])]

    def wait_released(self) -> None:
        for k, works in enumerate(self._works):
            self.transport.wait(works, "finish", block=k == self.slots - 1)
        self._works = [[] for _ in self.buffers]

    def fail(self) -> None:
        self.transport.abort()  # Note [no hangs in a collective]

    def close(self) -> None:
        pass  # the group is the CollectiveSender's, which closes it after the session


class BroadcastReader:
    """The receiver's half (transport.base.PlaneReader): the broadcasts of the next S buckets are posted ahead
    into this rank's own buffers; bucket k + S is posted into buffer k % S once bucket k is unpacked."""

    name = "collective"
    all_or_none = True

    def __init__(self, group: BroadcastGroup, buffers: list[torch.Tensor], delta: bool = False):
        self.transport, self.buffers, self.slots = group, buffers, len(buffers)
        self._delta, self._encoded = delta, False  # SyncConfig.delta; this push's buckets are encoded
        self._buckets: list[Bucket] = []
        self._works: dict[int, list] = {}

    def attached(self) -> Attached:
        return Attached()

    def plan(self, layout: Layout) -> list[Bucket]:
        size = self.buffers[0].numel()
        if layout.bucket_bytes > size:
            raise SchemaError(
                f"the sender's bucket_bytes={layout.bucket_bytes} exceed this receiver's buffers "
                f"({size}); use one SyncConfig on both sides"
            )
        self._buckets = plan_buckets(layout.tensors, layout.bucket_bytes, layout.align_bytes)
        if self._delta:
            self.buffers = _fit(self.buffers, layout)
        return self._buckets

    def encoded(self, on: bool) -> None:
        """This push's buckets are delta encodings (the session tells it before the stream): each is read as
        its table, then the bytes the table says follow (Note [deltas over a broadcast])."""
        self._encoded = on

    def take_sources(self, sources: DirectSources, layout: Layout | None) -> list[Bucket]:
        raise SchemaError(f"storages for layout {sources.layout_id} do not fit a collective session")

    def check_start(self, push_id: int, layout_id: int) -> None:
        if self.transport.pg is None:
            raise RaysyncError("this collective group was aborted by an earlier failure; make a new one")

    def batches(self, buckets: int) -> Iterable[list[int]]:
        self._works = {}
        for k in range(min(1 if self._encoded else self.slots, buckets)):
            self._post(k)
        return ([k] for k in range(buckets))

    def _post(self, k: int) -> None:
        """Post bucket k's broadcast (an encoded push: its table's)."""
        size = table_bytes(self._buckets[k]) if self._encoded else self._buckets[k].nbytes
        buffer = self.buffers[k % self.slots]
        self._works[k] = self.transport.broadcast([buffer[:size]]) if size else []

    def read(self, batch: list[int], push_id: int) -> list[torch.Tensor]:
        (k,) = batch
        last, stage = k == len(self._buckets) - 1, f"broadcast bucket {k}/{len(self._buckets)}"
        if self._encoded:
            self._post_rest(k, stage)
        self.transport.wait(self._works.pop(k), stage, block=last)
        return [self.buffers[k % self.slots]]

    def _post_rest(self, k: int, stage: str) -> None:
        """An encoded bucket: wait for its table, post the broadcast of the bytes it says follow, then the
        next bucket's table (into the next buffer, free already; with one buffer, at release)."""
        buffer, head = self.buffers[k % self.slots], table_bytes(self._buckets[k])
        self.transport.wait(self._works.pop(k), f"{stage}: its table", block=True)
        used = used_bytes(buffer)
        if not head <= used <= buffer.numel():  # decode checks the rest against the table
            raise BadDelta(f"bucket {k}: {used} bytes after a {head}-byte table, buffer {buffer.numel()}")
        self._works[k] = self.transport.broadcast([buffer[head:used]]) if used > head else []
        if self.slots > 1 and k + 1 < len(self._buckets):
            self._post(k + 1)

    def release(self, batch: list[int], push_id: int) -> None:
        (k,) = batch
        if self._encoded:
            if self.slots == 1 and k + 1 < len(self._buckets):
                self._post(k + 1)
        elif k + self.slots < len(self._buckets):  # stream-ordered after the unpack of bucket k (NCCL)
            self._post(k + self.slots)

    def drain(self, timeout_s: float) -> None:
        if self.transport.device is not None:
            self.transport.poll_stream("drain")  # applied means visible: every copy is done

    def fail(self) -> None:
        self.transport.abort()

    def close(self) -> None:
        pass  # the group is the CollectiveReceiver's, which closes it after the session


def _control_endpoint(host: str) -> str:
    return f"tcp://[{host}]:*" if ":" in host else f"tcp://{host}:*"


class _GroupRank:
    """What both halves own, closed in this order: the push session ``join`` makes (else the control channels
    it would have taken), then the group."""

    config: SyncConfig
    _group: BroadcastGroup
    _control: Fanout | ReceiverChannel
    session: PushSender | PushReceiver | None

    def _join(self, timeout_s: float, plane: type, session: type) -> PushSender | PushReceiver:
        if self.session is not None:
            raise RaysyncError("this rank has joined its group already; a new group needs a new object")
        self._group.join(timeout_s)
        buffers = _buffers(self.config, self._group.device)
        self.session = session(
            self._control, self.config, plane=plane(self._group, buffers, delta=self.config.delta)
        )
        return self.session

    @property
    def group(self) -> object | None:
        """The torch process group (for benchmarks' floors); None before join and after an abort."""
        return self._group.pg

    @property
    def device(self) -> torch.device | None:
        """The GPU this rank's broadcasts run on (NCCL), None on gloo."""
        return self._group.device

    def _close_rank(self) -> None:
        try:
            if self.session is not None:
                self.session.close()  # its Close reaches the peers, then its channels go
            else:
                self._control.close()
        finally:
            self._group.close()


class CollectiveSender(_GroupRank):
    """The collective's sending half: rank 0 of a broadcast group. It hosts the store and binds one control
    channel per receiver; ``join`` makes the group and hands its plane to a plain push session.

        group = CollectiveSender(secret, config, host=ip, num_receivers=R)
        # hand group.rendezvous and the secret to the receivers; every rank joins at the same time:
        sender = group.join()  # a PushSender on this group's BroadcastPlane
        sender.push(named_tensors, version)  # as often as needed
        group.close()  # the session, then the group, then the store
    """

    name = "collective"

    @classmethod
    def is_available(cls) -> bool:
        return dist.is_available()

    def __init__(
        self,
        secret: SessionSecret,
        config: SyncConfig,
        *,
        host: str,
        num_receivers: int,
        backend: str | None = None,
    ):
        self.config = config
        self._server = StoreServer(secret, host, config.max_frame_bytes)  # refuses every-interface hosts
        channels: list[SenderChannel] = []
        try:
            store = StoreClient(
                secret,
                host,
                self._server.port,
                timeout_s=config.timeout_s,
                max_value_bytes=config.max_frame_bytes,
            )
            for rank in range(1, num_receivers + 1):
                channels.append(
                    SenderChannel(
                        secret,
                        endpoint=_control_endpoint(host),
                        allow_any_interface=False,
                        timeout_s=config.timeout_s,
                        max_frame_bytes=config.max_frame_bytes,
                        label=f"rank {rank}",
                    )
                )
        except BaseException:
            for c in channels:
                c.close()
            self._server.close()
            raise
        self.rendezvous = Rendezvous(
            host,
            self._server.port,
            num_receivers + 1,
            backend or default_backend(),
            tuple(c.endpoint for c in channels),
        )
        self._group = BroadcastGroup(config, 0, self.rendezvous, store)
        self._control = Fanout(channels)
        self.session: PushSender | None = None  # made by join

    def join(self, timeout_s: float = 300.0) -> PushSender:
        """Returns the push session once every rank of the group has joined (all must call it at the same
        time); the session is this object's, closed by ``close``."""
        return self._join(timeout_s, BroadcastPlane, PushSender)

    def close(self) -> None:
        """The session, then the group, then the store that made it."""
        try:
            self._close_rank()
        finally:
            self._server.close()


class CollectiveReceiver(_GroupRank):
    """The collective's receiving half: rank ``rank`` (>= 1) of a broadcast group. It connects to the
    sender's control channel; ``join`` makes the group and hands its plane to a plain push session, whose
    ``receive`` serves one push, like a WeightReceiver's. ``close`` closes the session, then the group."""

    name = "collective"

    def __init__(self, secret: SessionSecret, config: SyncConfig, *, rank: int, rendezvous: Rendezvous):
        if not 1 <= rank <= len(rendezvous.control):
            raise ValueError(f"rank {rank}: the group has receiver ranks 1..{len(rendezvous.control)}")
        self.config = config
        store = StoreClient(
            secret,
            rendezvous.host,
            rendezvous.port,
            timeout_s=config.timeout_s,
            max_value_bytes=config.max_frame_bytes,
        )
        self._group = BroadcastGroup(config, rank, rendezvous, store)
        try:
            self._control = ReceiverChannel(
                secret,
                endpoint=rendezvous.control[rank - 1],
                timeout_s=config.timeout_s,
                max_frame_bytes=config.max_frame_bytes,
            )
        except BaseException:
            self._group.close()
            raise
        self.session: PushReceiver | None = None  # made by join

    def join(self, timeout_s: float = 300.0) -> PushReceiver:
        """Returns the push session once every rank of the group has joined (all must call it at the same
        time); the session is this object's, closed by ``close``."""
        return self._join(timeout_s, BroadcastReader, PushReceiver)

    def close(self) -> None:
        self._close_rank()
