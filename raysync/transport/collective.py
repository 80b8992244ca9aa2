"""Collective transport: one sender broadcasts every bucket to all its receivers over a standalone torch
process group (NCCL on GPUs, gloo on CPUs; "hccl" is accepted for Ascend but untested).

    rank 0 (sender)                      ranks 1..N (receivers)
    rendezvous store on host:port <---   join the store, then the group (rendezvous, bounded by a set-up limit)
    (raysync.transport.rendezvous: only holders of the session key get a byte in)
    signed frames in the store:          layout/<id>, <push>/start  ->  <push>/accept/<rank>
                                         <push>/go (Accept = stream, Abort = nobody streams)
    per bucket: one broadcast per chunk, grouped into one launch; chunks are read from the trainer's tensors
    and land in the destination tensors in place where they can, else they pass through the bucket's buffer
    finish: one all-reduce (MIN) of an ok flag; a rank that failed first leaves its reason in <push>/done/<rank>

The group is the sync's own: it never touches a default process group that the trainer or vLLM use. The
store is raysync's own too (rendezvous.py, Note [who may talk to the rendezvous store]): torch's TCPStore
serves anyone who connects, and one local process writing garbage to it stalled every rank. Every control
value in the store is also a signed raysync frame (wire.py), checked like anything else off a socket; each
rank signs with its own derived key. The sender deletes a push's keys at the start of the next one, so the
store stays small however many pushes a group serves.

# Note [no hangs in a collective]
# A collective only finishes when every rank takes part, so a rank that fails mid-push must not just stop:
# it writes its error to the store and aborts the group. With gloo the others' pending broadcasts then fail
# at once ("connection closed"); with NCCL they fail at their next bounded wait. Every wait is bounded by
# timeout_s, after which the waiting rank aborts the group itself. An aborted group is gone: the next push needs a new
# one (WeightSync reconnects broken pairs before the next push).
"""

from __future__ import annotations

import datetime
import logging
import time
import traceback
from collections.abc import Generator, Iterable, Iterator, Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist

from raysync.config import SyncConfig
from raysync.errors import PeerTimeout, PushIncomplete, RaysyncError, RemoteError, WeightsMixed
from raysync.plan import plan_buckets, total_bytes
from raysync.report import PushReport
from raysync.sink import IntoTensors, LoadFn, Sink, Sinks
from raysync.source import direct_bytes, select, write_chunk
from raysync.transport.rendezvous import StoreClient
from raysync.transport.rendezvous_server import StoreServer
from raysync.version import MIXED, Version
from raysync.wire import Abort, Accept, FrameCodec, Layout, Message, PushStart, SessionSecret

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Rendezvous:
    """What a receiver needs to join: plain values, handed out by the coordinator."""

    host: str
    port: int
    world_size: int
    backend: str  # "gloo" | "nccl" | "hccl"


def default_backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


class _Group:
    """The store, the process group and the signed frames of one rank."""

    def __init__(
        self, secret: SessionSecret, config: SyncConfig, rank: int, rdv: Rendezvous, store: StoreClient
    ):
        self.rank, self.rdv, self.config, self.store = rank, rdv, config, store
        self.timeout = datetime.timedelta(seconds=config.timeout_s)
        self.device = torch.device("cuda", torch.cuda.current_device()) if rdv.backend == "nccl" else None
        self._secret = secret
        self._codecs: dict[str, FrameCodec] = {}
        self.pg = None

    def join(self, timeout_s: float) -> None:
        """Create the process group: blocks until every rank has joined (at most ``timeout_s``: ranks may take
        a while to start, so this is the set-up limit, not the per-stage ``SyncConfig.timeout_s``)."""
        self.store.set_timeout(datetime.timedelta(seconds=timeout_s))
        try:
            self._create(datetime.timedelta(seconds=timeout_s))
        except Exception as e:
            raise PeerTimeout(f"the other ranks of the {self.rdv.backend} group", "join", timeout_s) from e
        finally:
            self.store.set_timeout(self.timeout)

    def _create(self, rendezvous_timeout: datetime.timedelta) -> None:
        backend = self.rdv.backend
        if backend == "gloo":  # gloo connects every pair at creation: give it the set-up limit
            opts = dist.ProcessGroupGloo._Options()
            opts._timeout = rendezvous_timeout
            opts._devices = [dist.ProcessGroupGloo.create_device(hostname=self.rdv.host)]
            self.pg = dist.ProcessGroupGloo(self.store, self.rank, self.rdv.world_size, opts)
        elif backend == "nccl":
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = self.timeout
            self.pg = dist.ProcessGroupNCCL(self.store, self.rank, self.rdv.world_size, opts)
        elif backend == "hccl":  # pragma: no cover - Ascend, untested here
            import torch_npu  # noqa: F401

            self.pg = torch.distributed.ProcessGroupHCCL(
                self.store, self.rank, self.rdv.world_size, self.timeout
            )
        else:
            raise ValueError(f"unknown collective backend {backend!r} (gloo, nccl, hccl)")

    # --- signed frames in the store ------------------------------------------------------------------------------
    # Each (writer rank, stream) signs with its own derived key and numbers its frames, so a frame can be
    # neither forged nor moved to another key of the store: see wire.FrameCodec.
    def _signer(self, stream: str) -> FrameCodec:
        role = f"rank{self.rank}/{stream}"
        if role not in self._codecs:
            self._codecs[role] = FrameCodec(self._secret, role, "-", self.config.max_frame_bytes)
        return self._codecs[role]

    def _verifier(self, writer: int, stream: str) -> FrameCodec:
        role = f"rank{writer}/{stream}"
        if "?" + role not in self._codecs:
            self._codecs["?" + role] = FrameCodec(self._secret, "-", role, self.config.max_frame_bytes)
        return self._codecs["?" + role]

    def put(self, key: str, msg: Message, stream: str) -> None:
        self.store.set(key, self._signer(stream).encode(msg))

    def take(self, key: str, writer: int, stream: str, stage: str, timeout_s: float | None = None) -> Message:
        """Wait for ``key`` (written by rank ``writer`` on ``stream``); check its signature and schema."""
        wait = self.config.timeout_s if timeout_s is None else timeout_s
        try:
            frame = self.store.wait_get(key, wait)
        except PeerTimeout:  # the key never came, or the store's host (rank 0) is gone
            raise PeerTimeout(f"rank {writer} of the {self.rdv.backend} group", stage, wait) from None
        return self._verifier(writer, stream).decode(frame)

    def forget(self, keys: list[str]) -> None:
        """Delete keys nobody reads any more (not answered: costs a push no round trip)."""
        self.store.delete_keys(keys)

    # --- collectives ---------------------------------------------------------------------------------------------
    def broadcast(self, views: list[torch.Tensor]) -> list:
        """Broadcast every view (rank 0's bytes into everyone's), as one NCCL group launch where it can."""
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        opts.timeout = self.timeout
        if self.rdv.backend != "nccl" or len(views) < 2:
            return [self.pg.broadcast([v], opts) for v in views]
        self.pg._start_coalescing()
        for v in views:
            self.pg.broadcast([v], opts)
        return [self.pg._end_coalescing()]

    def agree(self, ok: bool, stage: str) -> bool:
        """True if every rank says ok: one tiny all-reduce (MIN) over the group, far cheaper than a round trip
        through the store. Bounded by timeout_s like every other wait."""
        flag = torch.tensor([int(ok)], dtype=torch.int32, device=self.device)
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.MIN
        opts.timeout = self.timeout
        self.wait([self.pg.allreduce([flag], opts)], stage)
        return bool(flag.item())

    def wait(self, works: list, stage: str, block: bool = True) -> None:
        """Wait for broadcasts, bounded by timeout_s. NCCL: the current stream waits for them (no host wait,
        so packing and unpacking keep the GPU busy), and ``block`` then polls that stream's progress from the
        host: torch's own bounded wait sleeps a millisecond between polls, which a push pays at every stage."""
        if self.rdv.backend == "nccl":
            for work in works:
                work.wait()
            if block:
                self._poll_stream(stage)
            return
        for work in works:
            try:
                ok = work.wait(self.timeout)
            except Exception as e:
                self.abort()
                why = f"{stage}: {str(e).splitlines()[0]}"
                raise PeerTimeout("a rank of the group", why, self.config.timeout_s) from e
            if ok is False:
                self.abort()
                raise PeerTimeout("a rank of the group", stage, self.config.timeout_s)

    def _poll_stream(self, stage: str) -> None:
        done = torch.cuda.Event()
        done.record()
        started = time.monotonic()
        while not done.query():
            waited = time.monotonic() - started
            if waited > self.config.timeout_s:
                self.abort()
                raise PeerTimeout("a rank of the group", stage, self.config.timeout_s)
            time.sleep(0 if waited < 1e-3 else 5e-5)  # spin briefly, then poll every ~50 us

    def abort(self) -> None:
        """Note [no hangs in a collective]."""
        if self.pg is not None:
            try:
                self.pg.abort()
            except Exception:  # already broken
                pass
            self.pg = None

    def close(self) -> None:
        self.abort()
        self.store.close()


def _buffers(config: SyncConfig, device: torch.device | None) -> list[torch.Tensor]:
    return [
        torch.empty(config.bucket_bytes, dtype=torch.uint8, device=device) for _ in range(config.num_buffers)
    ]


class CollectiveSender:
    """Rank 0 of a broadcast group: hosts the store, plans and packs, broadcasts every bucket.

    Make it, hand ``rendezvous`` and the secret to the receivers, then call ``join()`` here and on every
    receiver at the same time (it returns when all ranks are in), then ``push`` as often as needed."""

    name = "collective"

    @classmethod
    def is_available(cls) -> bool:
        return dist.is_available()

    def __init__(self, secret: SessionSecret, config: SyncConfig, *, host: str, num_receivers: int,
                 backend: str | None = None):  # fmt: skip
        self.config = config
        self._server = StoreServer(secret, host, config.max_frame_bytes)  # refuses every-interface hosts
        try:
            store = StoreClient(secret, host, self._server.port, timeout_s=config.timeout_s,
                                max_value_bytes=config.max_frame_bytes)  # fmt: skip
        except BaseException:
            self._server.close()
            raise
        self.rendezvous = Rendezvous(host, self._server.port, num_receivers + 1, backend or default_backend())
        self._group = _Group(secret, config, 0, self.rendezvous, store)
        self._layout: Layout | None = None
        self._buckets: list = []
        self._push_id = 0
        self._applied: dict[int, int] = {}  # rank -> the version it last reported applied
        self._all_applied = False  # the last push succeeded on every rank: Note [when receivers confirm]
        self._selected: tuple = (None, [])
        self.last_stages_s: dict[str, float] = {}  # where the last push spent its time

    def join(self, timeout_s: float = 300.0) -> None:
        """Returns when every rank of the group has joined (all must call it at the same time)."""
        self._group.join(timeout_s)
        self._buffers = _buffers(self.config, self._group.device)

    def push(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> PushReport:
        """Broadcast ``version`` to every receiver; returns when all of them applied it.

        # Note [when receivers confirm]
        # Receivers check the layout and their destinations and answer before any data moves on the first
        # push, whenever the layout changes, and after any push that did not succeed everywhere. Otherwise
        # the layout is one they all accepted and applied, so the start itself says go (two store round trips
        # less). Pushing a version that every receiver has already is always confirmed (it is skipped). A receiver whose destinations no longer fit then takes part in the broadcasts into its
        # own buffers, touches nothing, and reports the mismatch at the end: an error, never a hang."""
        g = self._group
        if g.pg is None:
            raise RaysyncError("this collective group was aborted by an earlier failure; make a new one")
        started = time.perf_counter()
        try:  # a bad tensor or a layout over the bounds: every receiver raises it now, not at timeout_s
            sources = self._select(named_tensors)
            specs = tuple(s.spec for s in sources)
            new_layout = None
            if self._layout is None or self._layout.tensors != specs:
                layout_id = self._layout.layout_id + 1 if self._layout else 1
                new_layout = Layout(layout_id, self.config.bucket_bytes, self.config.align_bytes, specs)
                buckets = plan_buckets(specs, self.config.bucket_bytes, self.config.align_bytes)
        except Exception as e:
            self.abort(e, "select and layout")
            raise
        self._push_id += 1
        pid = self._push_id
        ranks = range(1, self.rendezvous.world_size)
        stale = _push_keys(pid - 1, ranks) if pid > 1 else []  # every rank is past push pid - 1
        confirm = not self._all_applied
        if new_layout is not None:
            layout_id = new_layout.layout_id
            stale += [f"layout/{layout_id - 1}"] if layout_id > 1 else []  # every rank has taken it
            self._layout, self._buckets = new_layout, buckets
            g.put(f"layout/{layout_id}", self._layout, "layout")
            confirm = True
        if stale:
            g.forget(stale)
        confirm = confirm or all(self._applied.get(r) == version for r in ranks)  # a skip is always confirmed
        self._all_applied = False
        g.put(f"{pid}/start", PushStart(pid, version, self._layout.layout_id, confirm), "control")
        skip = False
        if confirm:  # else the start itself says go
            skip = self._confirm(pid, ranks)
            g.put(f"{pid}/go", Accept(pid, skip), "control")
        accepted = time.perf_counter()
        if not skip:
            self._stream(sources, pid)
        streamed = time.perf_counter()
        if not g.agree(True, "finish"):  # every rank applied it, or someone left its reason in the store
            raise self._failure(pid, ranks)
        self._applied = dict.fromkeys(ranks, version)
        self._all_applied = True
        self.last_stages_s = {"select+accept": accepted - started, "stream": streamed - accepted,
                              "finish": time.perf_counter() - streamed}  # fmt: skip
        nbytes = total_bytes(specs) * (not skip)
        return PushReport(version, self.name, nbytes, len(self._buckets) * (not skip), len(specs),
                          time.perf_counter() - started, skipped=skip)  # fmt: skip

    def abort(self, error: BaseException, stage: str = "source") -> None:
        """This push failed here before it started (e.g. the trainer's source raised): its start is an Abort,
        so every receiver raises ``error``'s type and message at once instead of waiting timeout_s for a push
        that will not come. Nothing was touched anywhere; the group stays usable for the next push."""
        g = self._group
        if g.pg is None:
            return  # aborted by an earlier failure: the receivers know already
        self._push_id += 1
        message = f"{type(error).__name__}: {error}"
        traceback_text = "".join(traceback.format_exception(error))
        ranks = range(1, self.rendezvous.world_size)
        stale = _push_keys(self._push_id - 1, ranks) if self._push_id > 1 else []
        try:
            if stale:
                g.forget(stale)
            g.put(f"{self._push_id}/start", Abort(self._push_id, stage, message, traceback_text), "control")
        except RaysyncError:  # best effort: the receivers then time out as before
            logger.debug("could not tell the receivers that push %d failed at %s", self._push_id, stage)

    def _failure(self, pid: int, ranks: range) -> RemoteError:
        return self._reason(pid, "finish") or RemoteError(
            "a rank", "finish", "reported failure without a reason"
        )

    def _confirm(self, pid: int, ranks: range) -> bool:
        """Every receiver's Accept (returns whether all have this version already), or an Abort for all."""
        answers = {r: self._group.take(f"{pid}/accept/{r}", r, "control", "accept") for r in ranks}
        refused = {r: a for r, a in answers.items() if isinstance(a, Abort)}
        if refused:
            r, a = next(iter(refused.items()))
            self._group.put(
                f"{pid}/go", Abort(pid, "accept", f"rank {r} refused: {a.message}", ""), "control"
            )
            raise RemoteError(f"rank {r}", a.stage, a.message, a.traceback)
        return all(a.skip for a in answers.values())

    def _select(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> list:
        """``source.select``, kept while the trainer hands over the same tensors (same storage, dtype, shape,
        strides): selecting 339 tensors costs about a millisecond of Python."""
        named = list(named_tensors)
        try:
            key = tuple((n, t.data_ptr(), t.dtype, t.shape, t.stride(), t.device) for n, t in named)
        except (RuntimeError, AttributeError, TypeError):  # not a dense tensor: select() says what is wrong
            key = None
        if key is None or key != self._selected[0]:
            self._selected = (key, select(named, self.config))
        return self._selected[1]

    def _stream(self, sources, pid: int) -> None:
        """Bucket by bucket, one broadcast per chunk (grouped into one launch): a contiguous tensor that keeps
        its dtype is read in place; the others are packed into the bucket's buffer first."""
        g, n = self._group, len(self._buffers)
        device_type = "cuda" if g.device is not None else "cpu"
        works: list = [[] for _ in range(n)]
        stage = "stream"
        try:
            for k, bucket in enumerate(self._buckets):
                slot, buffer = k % n, self._buffers[k % n]
                stage = f"broadcast bucket {k}/{len(self._buckets)}"
                g.wait(works[slot], stage, block=False)  # its buffer is free again (NCCL: a stream wait)
                views = []
                for c in bucket.chunks:
                    if c.nbytes:
                        view = direct_bytes(sources[c.index], c, device_type)
                        if view is None:
                            view = buffer[c.bucket_offset : c.bucket_offset + c.nbytes]
                            write_chunk(sources[c.index], c, view)
                        views.append(view)
                works[slot] = g.broadcast(views)
            stage = "finish"
            for w in works:
                g.wait(w, stage)
        except Exception as e:
            g.abort()  # Note [no hangs in a collective]
            raise self._explain(pid, stage, e) from e

    def _explain(self, pid: int, stage: str, error: Exception) -> Exception:
        """A receiver that failed first left its reason in the store; prefer it to our own symptom."""
        return self._reason(pid, stage) or error

    def _reason(self, pid: int, stage: str) -> RemoteError | None:
        """The reasons receivers left in the store for push ``pid``: a cause rather than a symptom (a rank
        that timed out because another one failed leaves a reason too)."""
        reasons = []
        for r in range(1, self.rendezvous.world_size):
            key = f"{pid}/done/{r}"
            try:
                if self._group.store.check([key]):
                    msg = self._group.take(key, r, "control", stage, timeout_s=1)
                    if isinstance(msg, Abort):
                        reasons.append(RemoteError(f"rank {r}", msg.stage, msg.message, msg.traceback))
            except Exception:  # the store's host is this process: a rank's frame may be unreadable, not late
                continue
        symptoms = ("PeerTimeout", "PeerLost")
        return next(
            (e for e in reasons if not e.message.startswith(symptoms)), reasons[0] if reasons else None
        )

    def close(self) -> None:
        self._group.close()
        self._server.close()


def _push_keys(pid: int, ranks: range) -> list[str]:
    """Every store key push ``pid`` may have written."""
    per_rank = [f"{pid}/{what}/{r}" for r in ranks for what in ("accept", "done")]
    return [f"{pid}/start", f"{pid}/go", *per_rank]


class CollectiveReceiver:
    """Rank ``rank`` (>= 1) of a broadcast group; ``receive`` serves one push, like WeightReceiver's."""

    name = "collective"

    def __init__(self, secret: SessionSecret, config: SyncConfig, *, rank: int, rendezvous: Rendezvous):
        self.config = config
        store = StoreClient(secret, rendezvous.host, rendezvous.port, timeout_s=config.timeout_s,
                            max_value_bytes=config.max_frame_bytes)  # fmt: skip
        self._group = _Group(secret, config, rank, rendezvous, store)
        self._sinks = Sinks(config.staged, config.cuda_graphs)
        self._layout: Layout | None = None
        self._buckets: list = []
        self._push_id = 0
        self.version: Version = None  # Note [versions never lie]: an int, None, or MIXED

    def join(self, timeout_s: float = 300.0) -> None:
        """Returns when every rank of the group has joined (all must call it at the same time)."""
        self._group.join(timeout_s)
        self._buffers = _buffers(self.config, self._group.device)

    @property
    def device(self) -> torch.device | None:
        """The GPU this rank's broadcasts run on (NCCL), None on gloo."""
        return self._group.device

    @property
    def names(self) -> tuple[str, ...]:
        """The tensors of the last layout received."""
        return tuple(s.name for s in self._layout.tensors) if self._layout else ()

    def receive(self, *, into: Mapping[str, torch.Tensor] | None = None, load_fn: LoadFn | None = None,
                wait_s: float | None = None) -> PushReport:  # fmt: skip
        """Serve one push, like WeightReceiver.receive. ``version`` says what the destinations hold after it,
        also when it fails: Note [versions never lie]."""
        steps = self.receiving(into=into, load_fn=load_fn, wait_s=wait_s)
        while True:
            try:
                next(steps)
            except StopIteration as done:
                return done.value

    def receiving(self, *, into: Mapping[str, torch.Tensor] | None = None, load_fn: LoadFn | None = None,
                  wait_s: float | None = None, staging: bool = False) -> Generator[None, None, PushReport]:  # fmt: skip
        """``receive`` in steps: yields after each bucket, returns the report. raysync.sharded runs the pushes
        of several groups from one thread by taking turns (NCCL: one thread issues every group's operations).
        ``staging``: ``load_fn`` only stages what it is given and the caller applies it after the push (as a
        loader with a ``finish`` does), so a failure here leaves the destinations untouched."""
        if (into is None) == (load_fn is None):
            raise TypeError(
                "pass exactly one of into= (destination tensors) or load_fn= (a load_weights function)"
            )
        g, me = self._group, self._group.rank
        if g.pg is None:
            raise RaysyncError("this collective group was aborted by an earlier failure; make a new one")
        pid = self._push_id + 1
        start = g.take(f"{pid}/start", 0, "control", "waiting for a push", wait_s)
        self._push_id = pid
        if isinstance(start, Abort):  # the sender failed before this push started (CollectiveSender.abort)
            raise RemoteError("rank 0 (the sender)", start.stage, start.message, start.traceback)
        started = time.perf_counter()
        sink, refusal = self._check(start, into, load_fn)
        go = Accept(pid, False)  # unconfirmed: the start itself says go (Note [when receivers confirm])
        if start.confirm:
            skip = start.version == self.version
            g.put(f"{pid}/accept/{me}", Abort(pid, "accept", str(refusal), "") if refusal else Accept(pid, skip),
                  "control")  # fmt: skip
            go = g.take(f"{pid}/go", 0, "control", "go")
        names = [s.name for s in self._layout.tensors] if self._layout else []
        if isinstance(go, Abort) or (refusal is not None and start.confirm):
            raise PushIncomplete(
                start.version, "accept", str(refusal or go.message), names, mixed=False
            ) from refusal
        if not go.skip:
            if sink is not None and sink.in_place and not staging:
                self.version = MIXED  # Note [versions never lie]: before the first byte reaches a destination
            # with sink None (refused, unconfirmed) the bytes go into our buffers and touch nothing
            yield from self._stream(start, sink)
            if refusal is not None:
                g.put(f"{pid}/done/{me}", Abort(pid, "accept", str(refusal), ""), "control")
                g.agree(False, "finish")
                raise PushIncomplete(start.version, "accept", str(refusal), names, mixed=False) from refusal
            self.version = start.version
        g.agree(True, "finish")
        specs = self._layout.tensors
        return PushReport(start.version, self.name, total_bytes(specs) * (not go.skip),
                          len(self._buckets) * (not go.skip), len(specs), time.perf_counter() - started,
                          skipped=go.skip)  # fmt: skip

    def _check(self, start: PushStart, into, load_fn) -> tuple[Sink | None, RaysyncError | None]:
        """Take a new layout if there is one, and check our destinations against it."""
        g = self._group
        try:
            if self._layout is None or start.layout_id != self._layout.layout_id:
                layout = g.take(f"layout/{start.layout_id}", 0, "layout", "layout")
                if layout.bucket_bytes > self.config.bucket_bytes:
                    raise RaysyncError(f"the sender's bucket_bytes={layout.bucket_bytes} exceed this receiver's "
                                       f"buffers ({self.config.bucket_bytes}); use one SyncConfig on both sides")  # fmt: skip
                self._buckets = plan_buckets(layout.tensors, layout.bucket_bytes, layout.align_bytes)
                self._layout = layout
            return self._sinks.make(self._layout.layout_id, self._layout.tensors, into, load_fn), None
        except RaysyncError as e:
            return None, e

    def _stream(self, start: PushStart, sink: Sink | None) -> Iterator[None]:
        """Post the broadcasts of the next N buckets ahead; chunks land straight in destination tensors when
        there are some on the group's device, else in the bucket's buffer, unpacked from there."""
        g, n, nb = self._group, len(self._buffers), len(self._buckets)
        device_type = "cuda" if g.device is not None else "cpu"
        direct = isinstance(sink, IntoTensors) and sink.device_type == device_type  # else via our buffers

        def post(k: int) -> list:
            buffer = self._buffers[k % n]
            return g.broadcast([sink.target(c) if direct else buffer[c.bucket_offset : c.bucket_offset + c.nbytes]
                                for c in self._buckets[k].chunks if c.nbytes])  # fmt: skip

        works = {k: post(k) for k in range(min(n, nb))}
        stage = "stream"
        try:
            for k, bucket in enumerate(self._buckets):
                stage = f"broadcast bucket {k}/{nb}"
                g.wait(
                    works.pop(k), stage, block=k == nb - 1
                )  # the last one bounds the whole push on the host
                stage = f"unpack bucket {k}/{nb}"
                if direct:
                    sink.landed(bucket)
                elif sink is not None:
                    sink.write(bucket, self._buffers[k % n])
                if k + n < nb:  # the buffer just read takes bucket k + n (stream-ordered on GPU)
                    works[k + n] = post(k + n)
                yield
            if g.device is not None:
                torch.cuda.current_stream().synchronize()  # applied means visible: every copy is done
            stage = "apply"
            if sink is not None:
                sink.finish()  # an atomic sink: raises WeightsMixed if it failed after touching the destinations
        except Exception as e:
            if isinstance(e, WeightsMixed):
                self.version = MIXED  # Note [versions never lie]
            try:  # leave the reason where the sender looks (the store lives in the sender's process)
                g.put(f"{start.push_id}/done/{g.rank}", Abort(start.push_id, stage, f"{type(e).__name__}: {e}", ""),
                      "control")  # fmt: skip
            except Exception:
                pass
            g.abort()  # Note [no hangs in a collective]
            undelivered = sink.undelivered() if sink is not None else [s.name for s in self._layout.tensors]
            raise PushIncomplete(
                start.version, stage, str(e), undelivered, mixed=self.version == MIXED
            ) from e

    def close(self) -> None:
        self._group.close()
