"""Fuzz the wire: hostile frames against a receiving FrameCodec, as an attacker on the control socket sends them.

    python benchmarks/fuzz_wire.py --frames 20000          # the figures in docs/reliability.md
    (tests/test_hardening.py runs the same generator at a smaller size)

Kinds of frame, in equal shares: random bytes; valid frames truncated or with a flipped bit; oversized frames;
frames signed with another key (forged); unsigned msgpack; valid frames replayed; pickle payloads whose side
effect would create a file (raw, "signed" with a fake MAC, signed with the real key inside fields and ext
types); and, signed with the real key (a buggy or compromised peer), deeply nested values, wrong types,
unknown kinds and random msgpack. Every frame must be refused with a WireError (a typed rejection): a crash
is any other exception, an acceptance is any frame decoded. After the run a valid frame must still decode,
the file must not exist, and the process's memory must not have grown beyond a bound. Prints a table and
JSON; the time to reject is measured per frame.
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import os
import pickle
import random
import statistics
import tempfile
import time

import msgpack
from common import emit

from raysync.core.errors import WireError
from raysync.core.frames import FrameCodec, _direction_key
from raysync.core.wire import PROTOCOL, Hello, PushStart, SessionSecret


class _Bomb:
    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _sign(payload: bytes, key: bytes, role: str = "sender") -> bytes:
    return payload + hmac.new(_direction_key(key, role), payload, hashlib.sha256).digest()


def _nested_frame(head: list, depth: int) -> bytes:
    """msgpack of ``head + [[[...[1]...]]]`` nested ``depth`` deep (built as bytes: msgpack's own packer
    refuses such depths)."""
    prefix = msgpack.packb(head)
    assert len(head) < 15 and prefix[0] == 0x90 + len(head)
    return bytes([0x90 + len(head) + 1]) + prefix[1:] + b"\x91" * depth + b"\x01"


def frames(
    n: int, secret: SessionSecret, valid: list[bytes], bomb_path: str, max_frame_bytes: int, seed: int = 0
):
    """``n`` hostile frames as (kind, bytes); ``valid`` are frames the receiver has already accepted."""
    rng = random.Random(seed)
    other = SessionSecret.generate()
    bomb = pickle.dumps(_Bomb(bomb_path))
    sid = secret.session_id

    def signed(obj: object) -> bytes:
        return _sign(msgpack.packb(obj), secret.key)

    def random_msgpack() -> object:
        pick = rng.randrange(6)
        return [
            None,
            rng.random(),
            rng.getrandbits(64),
            os.urandom(rng.randrange(16)).hex(),
            [1, "a"],
            {"x": b"y"},
        ][pick]

    makers = {
        "random bytes": lambda: os.urandom(rng.randrange(0, 512)),
        "truncated": lambda: (v := rng.choice(valid))[: rng.randrange(len(v))],
        "bit flipped": lambda: (lambda v, i: v[:i] + bytes([v[i] ^ (1 << rng.randrange(8))]) + v[i + 1 :])(
            (v := rng.choice(valid)), rng.randrange(len(v))
        ),
        "oversized": lambda: os.urandom(max_frame_bytes + 1 + rng.randrange(1024)),
        "forged (other key)": lambda: _sign(
            msgpack.packb([PROTOCOL, sid, 10**6, "Hello", {"pid": 1, "host": "x"}]), other.key
        ),
        "unsigned": lambda: msgpack.packb([PROTOCOL, sid, 10**6, "Hello", {"pid": 1, "host": "x"}]),
        "replayed": lambda: rng.choice(valid),
        "pickle raw": lambda: bomb,
        "pickle, fake MAC": lambda: bomb + os.urandom(32),
        "pickle, signed": lambda: rng.choice(
            [
                _sign(bomb, secret.key),
                signed([PROTOCOL, sid, 10**7 + rng.getrandbits(20), "Hello", {"pid": 1, "host": bomb}]),
                signed([PROTOCOL, sid, 10**7 + rng.getrandbits(20), "Hello", msgpack.ExtType(0x50, bomb)]),
            ]
        ),
        "signed, deeply nested": lambda: _sign(
            _nested_frame(
                [PROTOCOL, sid, 10**7 + rng.getrandbits(20), "Layout"], rng.choice([100, 1000, 100_000])
            ),
            secret.key,
        ),
        "signed, wrong types": lambda: signed(
            [
                PROTOCOL,
                sid,
                10**7 + rng.getrandbits(20),
                "PushStart",
                {"push_id": "1", "version": -1, "layout_id": 1.5, "verify": 2},
            ]
        ),
        "signed, unknown kind": lambda: signed(
            [PROTOCOL, sid, 10**7 + rng.getrandbits(20), "Exec", {"cmd": "id"}]
        ),
        "signed, random msgpack": lambda: signed(
            rng.choice([random_msgpack(), [PROTOCOL, sid, random_msgpack(), "Hello", random_msgpack()]])
        ),
    }
    kinds = list(makers)
    for i in range(n):
        kind = kinds[i % len(kinds)]
        yield kind, makers[kind]()


def run(n: int, max_frame_bytes: int = 1 << 16, seed: int = 0) -> dict:
    secret = SessionSecret.generate()
    tx = FrameCodec(secret, "sender", "receiver", max_frame_bytes)
    rx = FrameCodec(secret, "receiver", "sender", max_frame_bytes)
    valid = [tx.encode(Hello(1, "peer"))] + [tx.encode(PushStart(i + 1, i, 1)) for i in range(8)]
    for frame in valid:  # the session's own traffic: from now on each of these is a replay
        rx.decode(frame)
    with tempfile.TemporaryDirectory() as tmp:
        bomb_path = os.path.join(tmp, "pwned")
        crashes, accepted, per_kind, times = [], [], {}, []
        rss_before = _rss_bytes()
        for kind, frame in frames(n, secret, valid, bomb_path, max_frame_bytes, seed):
            t0 = time.perf_counter()
            try:
                rx.decode(frame)
                accepted.append(kind)
            except WireError as e:
                per_kind.setdefault(kind, {}).setdefault(type(e).__name__, 0)
                per_kind[kind][type(e).__name__] += 1
            except Exception as e:  # a crash: anything but a typed rejection
                crashes.append(f"{kind}: {type(e).__name__}: {e}")
            times.append(time.perf_counter() - t0)
        rss_growth = _rss_bytes() - rss_before
        bomb_ran = os.path.exists(bomb_path)
    usable = rx.decode(tx.encode(PushStart(99, 1, 1))) == PushStart(99, 1, 1)  # the peer goes on
    times.sort()
    return {
        "frames": n,
        "crashes": crashes,
        "accepted": accepted,
        "pickle_side_effect": bomb_ran,
        "receiver_usable_after": usable,
        "rss_growth_bytes": rss_growth,
        "reject_us": {
            "median": 1e6 * statistics.median(times),
            "p99": 1e6 * times[int(0.99 * (len(times) - 1))],
            "max": 1e6 * times[-1],
        },
        "rejections": per_kind,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--frames", type=int, default=20000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args()
    r = run(args.frames, seed=args.seed)
    print(
        f"{r['frames']} hostile frames: {len(r['crashes'])} crashes, {len(r['accepted'])} accepted, pickle side "
        f"effect: {r['pickle_side_effect']}, receiver usable after: {r['receiver_usable_after']}, RSS growth "
        f"{r['rss_growth_bytes'] / 2**20:.1f} MiB"
    )
    print(
        f"time to reject: median {r['reject_us']['median']:.1f} us, p99 {r['reject_us']['p99']:.1f} us, "
        f"max {r['reject_us']['max']:.1f} us"
    )
    print(f"{'kind':<26}rejections")
    for kind, by_error in r["rejections"].items():
        print(f"{kind:<26}" + ", ".join(f"{e} {c}" for e, c in sorted(by_error.items())))
    emit(r, args.json)


if __name__ == "__main__":
    main()
