"""A push loop, the member's side (raysync.ray.push_loop has the driver's, and Note [push loops]): a thread in
each sender and plain-actor receiver that waits on the loops' channel for the driver's go, runs its endpoint's
part of the round (endpoint.sender_round / receiver_round) and answers with a signed frame.

    start_loop (through __ray_call__, at setup) -> _serve: recv go -> _run -> send answer ... -> stop_loops
"""

from __future__ import annotations

import logging
import os
import threading
import traceback
from typing import Any

from raysync.core import errors
from raysync.ray import endpoint as ep
from raysync.ray.loop_channel import MemberEnd
from raysync.ray.loop_wire import Codec, to_wire

logger = logging.getLogger(__name__)

_MAX_DRIVER_FRAME = 4096  # what a loop takes from the driver: go, stop
_IDLE_POLL_S = 1.0  # an idle loop looks whether close() stopped it this often
_ANSWER_SEND_S = 60.0  # how long an answer may wait for the driver to read it (a late one: the next push's)
_LOOPS = "_raysync_loops"  # on the actor: (sync_id, member) -> (its thread, the Event that stops it)


def start_loop(actor: Any, sync_id: str, member: str, job: tuple, address: str, secret: bytes) -> None:
    """(Re)start this actor's push loop as ``member`` of WeightSync ``sync_id`` (through ``__ray_call__``); it has
    connected and said hello when this returns. ``job``: ("sender", its receivers) or ("receiver", its slots)."""
    import torch

    stop_loops(actor, sync_id, member, 0.0)  # an earlier one has lost its driver: it is ending
    codec = Codec(secret, member, "actor")
    hello = codec.encode("hello", [os.getpid()])
    # made here, then used by the loop's thread only
    end = MemberEnd.connect(address, member, hello, _MAX_DRIVER_FRAME, timeout_s=30.0)
    device = torch.cuda.current_device() if torch.cuda.is_initialized() else None  # the thread works there
    stop = threading.Event()
    args = (actor, sync_id, job, end, codec, device, stop)
    thread = threading.Thread(target=_serve, args=args, name=f"raysync-push-loop-{member}", daemon=True)
    actor.__dict__.setdefault(_LOOPS, {})[(sync_id, member)] = (thread, stop)
    thread.start()


def _serve(actor: Any, sync_id: str, job: tuple, end: MemberEnd, codec: Codec, device, stop) -> None:
    try:
        if device is not None:
            import torch

            torch.cuda.set_device(device)
        while not stop.is_set():
            frame = end.recv(_IDLE_POLL_S)
            if frame is None:
                continue
            try:
                kind, body = codec.decode(frame)
            except errors.WireError as e:
                logger.warning("a push loop dropped a frame: %s", e)
                continue
            if kind == "stop":
                break
            if kind == "go" and len(body) == 2 and all(type(v) is int for v in body):
                end.send(_run(codec, actor, sync_id, job, *body), _ANSWER_SEND_S)
    except (OSError, errors.WireError) as e:  # the driver's end closed (or died), or sent too much
        logger.info("a push loop of WeightSync %s ended: %s", sync_id, e)
    finally:
        end.close()


def _run(codec: Codec, actor: Any, sync_id: str, job: tuple, round_: int, version: int) -> bytes:
    """This member's part of the round, as the frame that answers it."""
    role, members = job
    try:
        run = ep.sender_round if role == "sender" else ep.receiver_round
        return codec.encode("answer", [round_, to_wire(run(actor, version, sync_id, list(members)))])
    except Exception as e:  # the endpoint functions answer failures themselves: this is anything else
        text = "".join(traceback.format_exception(e))
        return codec.encode("failed", [round_, f"{type(e).__name__}: {e}", text])


def stop_loops(actor: Any, sync_id: str, member: str, timeout_s: float) -> bool:
    """End this actor's push loop as ``member`` of ``sync_id``; returns whether it still runs after ``timeout_s``
    (busy with a push that has not ended)."""
    thread, stop = actor.__dict__.get(_LOOPS, {}).pop((sync_id, member), (None, None))
    if thread is None:
        return False
    stop.set()
    thread.join(timeout_s)
    return thread.is_alive()


def loop_alive(actor: Any, sync_id: str, member: str) -> bool:
    thread, _ = actor.__dict__.get(_LOOPS, {}).get((sync_id, member), (None, None))
    return thread is not None and thread.is_alive()
