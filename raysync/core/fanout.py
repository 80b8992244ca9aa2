"""A sender's channels to its N receivers, used as one (the push session's control for N receivers: a
broadcast group's ranks, or N readers of one ring)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

from raysync.core import stream
from raysync.core.control import SenderChannel
from raysync.core.errors import PeerLost, PeerTimeout, RaysyncError, RemoteError
from raysync.core.wire import Abort, Hello, Message


class Fanout:
    """A sender's channels to its N receivers, used as one: a message to all is sent N times (they are tens of
    bytes), and ``expect`` collects one answer from each under one deadline, raising at once for the first
    Abort, whichever receiver sends it. With N = 1 it is the pair channel."""

    def __init__(self, channels: list[SenderChannel]):
        if not channels:
            raise ValueError("a session needs at least one receiver")
        self.channels = channels
        self.timeout_s = channels[0].timeout_s

    @property
    def peer(self) -> str:
        peers = [c.peer for c in self.channels]
        return peers[0] if len(peers) == 1 else f"{len(peers)} receivers ({', '.join(peers)})"

    @contextlib.contextmanager
    def only(self, indices: list[int]) -> Iterator[None]:
        """Talk to the receivers at ``indices`` only, for a while: a fan-out ring serves its readers in turns
        when some cannot take a delta (raysync.core.session.PushSender, Note [the delta reference])."""
        every = self.channels
        self.channels = [every[i] for i in indices]
        try:
            yield
        finally:
            self.channels = every

    def accept(self, stage: str = "handshake") -> list[Hello]:
        return [c.accept(stage) for c in self.channels]

    def send(self, msg: Message, stage: str) -> None:
        for c in self.channels:
            c.send(msg, stage)

    def try_send(self, msg: Message) -> None:
        for c in self.channels:
            c.try_send(msg)

    def abort(self, push_id: int, stage: str, error: BaseException) -> None:
        for c in self.channels:
            c.abort(push_id, stage, error)

    def expect(self, kind: type, push_id: int, stage: str, timeout_s: float | None = None) -> list[Message]:
        """One ``kind`` message of push ``push_id`` from every receiver, in channel order; the first Abort of
        this push, from any receiver, raises RemoteError naming it (Channel.expect's rules, per receiver)."""
        if len(self.channels) == 1:
            return [self.channels[0].expect(kind, push_id, stage, timeout_s)]
        timeout = self.timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout
        got: dict[int, Message] = {}
        while len(got) < len(self.channels):
            remaining = deadline - time.monotonic()
            waiting = [c.conn for i, c in enumerate(self.channels) if i not in got]
            ready = stream.ready(waiting, remaining) if remaining > 0 else []
            if not ready:
                late = [c.peer for i, c in enumerate(self.channels) if i not in got]
                raise PeerTimeout(", ".join(late), stage, timeout)
            for i, c in enumerate(self.channels):  # what one sends after its answer waits for the next expect
                if i not in got and c.conn in ready:
                    msg = c.expected(c.recv(stage, max(1e-3, remaining)), kind, push_id, stage)
                    if msg is not None:
                        got[i] = msg
        return [got[i] for i in range(len(self.channels))]

    def reason(self, push_id: int, wait_s: float) -> RemoteError | None:
        """The Aborts of push ``push_id`` that receivers sent (waiting up to ``wait_s``), the cause preferred
        over a symptom: this side saw a broadcast fail, and a receiver that failed first says why, while the
        others only say that their broadcasts failed too (PeerTimeout, PeerLost)."""
        deadline = time.monotonic() + wait_s
        found: list[RemoteError] = []
        waiting = {id(c.conn): c for c in self.channels if c.conn is not None}  # None: it never connected
        while waiting and not any(not _symptom(e) for e in found):
            remaining = deadline - time.monotonic()
            ready = stream.ready([c.conn for c in waiting.values()], remaining) if remaining > 0 else []
            if not ready:
                break
            for conn in ready:
                c = waiting[id(conn)]
                try:
                    msg = c.recv("reason", 1e-3)
                except PeerLost:
                    del waiting[id(conn)]  # its connection ended: it says no more
                    continue
                except RaysyncError:
                    continue
                if isinstance(msg, Abort) and msg.push_id == push_id:
                    found.append(RemoteError(c.peer, msg.stage, msg.message, msg.traceback))
                    del waiting[id(conn)]
        return next((e for e in found if not _symptom(e)), found[0] if found else None)

    def close(self) -> None:
        for c in self.channels:
            c.close()


def _symptom(error: RemoteError) -> bool:
    return error.message.startswith(("PeerTimeout", "PeerLost"))
