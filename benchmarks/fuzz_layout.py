"""Fuzz layouts: hostile and degenerate Layout frames against a receiver's decode and plan, as a peer sends them.

    python benchmarks/fuzz_layout.py --layouts 20000      # the figures in docs/reliability.md
    (tests/test_wire.py and tests/test_plan.py run the same checks at a small size)

Every input is what a peer can send: a Layout frame signed with the session's key (a buggy or compromised
sender), decoded by a receiving FrameCodec exactly as a receiver decodes it, then planned with plan_buckets if it
was accepted; or, for direct mode, DirectSources values handed to plan.direct_buckets. Kinds, in equal shares:
one huge tensor in small buckets; degenerate geometry (bucket_bytes, align_bytes: zero, not a power of two,
absurd); random layouts (up to 2,000 tensors of sizes log-uniform up to 2**48 bytes, any bucket size); names,
dtypes and shapes the schema refuses; integers outside the wire's range; direct-mode storages. Then, once each,
layouts of many tiny tensors (1 to twice the bound, up to the frame cap).

Outcomes: accepted (its plan must hold the buckets and chunks that plan.layout_size counted, within the
bounds; planned in full up to --plan-max-chunks chunks, counted above), refused (BadLayout), refused by another
typed WireError (e.g. a negative integer, a frame over max_frame_bytes), crash (any other exception, or an
accepted plan beyond the bounds). Times: to refuse (from the frame to the error), to accept (decode + plan).
Last, the worst layouts the bounds accept, measured in full: decode, check and plan time, and the plan's
memory (tracemalloc); from their cost per chunk, what the refused layouts of issue 22 would have cost.
Prints a table and JSON.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import hmac
import math
import os
import platform
import random
import statistics
import time
import tracemalloc
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator

import msgpack
from common import emit

from raysync.core.errors import BadLayout, WireError
from raysync.core.frames import FrameCodec, _direction_key
from raysync.core.plan import direct_buckets, layout_size, plan_buckets
from raysync.core.wire import (
    MAX_LAYOUT_BUCKETS,
    MAX_LAYOUT_CHUNKS,
    MAX_LAYOUT_TENSORS,
    PROTOCOL,
    Layout,
    SessionSecret,
    TensorSpec,
)

DTYPES = ("bool", "uint8", "bfloat16", "float32", "float64", "complex128")
ITEMSIZE = {"bool": 1, "uint8": 1, "bfloat16": 2, "float32": 4, "float64": 8, "complex128": 16}
MAX_FRAME_BYTES = 16 << 20  # SyncConfig's default


class Peer:
    """Signs Layout frames with the session's key, as the sender of a session would."""

    def __init__(self, secret: SessionSecret):
        self._sid, self._key = secret.session_id, _direction_key(secret.key, "sender")
        self._seq = 0

    def layout(self, bucket: object, align: object, tensors: list[dict]) -> bytes:
        self._seq += 1
        body = {"layout_id": 1, "bucket_bytes": bucket, "align_bytes": align, "tensors": tensors}
        payload = msgpack.packb([PROTOCOL, self._sid, self._seq, "Layout", body])
        return payload + hmac.new(self._key, payload, hashlib.sha256).digest()


def tensor(name: str, nbytes: int, dtype: str, rng: random.Random) -> dict:
    """A tensor of about ``nbytes`` bytes, in 0-3 dimensions."""
    numel = nbytes // ITEMSIZE[dtype]
    nd = rng.randrange(4) if numel else rng.randrange(1, 3)
    if nd == 0:
        return {"name": name, "dtype": dtype, "shape": []}
    head = max(1, round(numel ** (1 / nd)))
    return {"name": name, "dtype": dtype, "shape": [head] * (nd - 1) + [numel // head ** (nd - 1)]}


def log_uniform(rng: random.Random, top_bits: int) -> int:
    return int(2 ** rng.uniform(0, top_bits)) - 1


def inputs(n: int, seed: int) -> Iterator[tuple[str, Callable[[Peer], tuple]]]:
    """``n`` hostile inputs as (kind, make); make(peer) gives ("frame", bytes) or ("direct", args)."""
    rng = random.Random(seed)

    def huge_tensor(peer: Peer) -> tuple:
        align = rng.choice([16, 64, 256])
        bucket = align << rng.randrange(0, 24)
        return "frame", peer.layout(bucket, align, [tensor("w", 1 << rng.randrange(20, 49), "uint8", rng)])

    def degenerate(peer: Peer) -> tuple:
        def value() -> int:
            return rng.choice(
                [
                    0,
                    1,
                    rng.randrange(2, 4096),
                    1 << rng.randrange(0, 63),
                    2**63 - 1,
                    (1 << rng.randrange(4, 40)) + rng.choice([-16, -1, 1, 16]),
                ]
            )

        return "frame", peer.layout(value(), value(), [tensor("w", 4096, "float32", rng)])

    def random_layout(peer: Peer) -> tuple:
        count = log_uniform(rng, 11) + 1
        specs = [tensor(f"t{i}", log_uniform(rng, 48), rng.choice(DTYPES), rng) for i in range(count)]
        align = rng.choice([16, 32, 256, 4096])
        bucket = rng.choice([align << rng.randrange(0, 28), align * rng.randrange(1, 1 << 16)])
        return "frame", peer.layout(bucket, align, specs)

    def bad_schema(peer: Peer) -> tuple:
        bad = rng.choice(
            [
                {"name": "", "dtype": "uint8", "shape": [1]},
                {"name": "x" * 2000, "dtype": "uint8", "shape": [1]},
                {"name": "w", "dtype": rng.choice(["object", "float128", "", "pickle"]), "shape": [1]},
                {"name": "w", "dtype": "uint8", "shape": [2] * rng.randrange(17, 64)},
                {"name": "w", "dtype": "float64", "shape": [1 << 30, 1 << 30]},  # 2**63 bytes
                {"name": "t0", "dtype": "uint8", "shape": [8]},  # a duplicate of the first name
            ]
        )
        return "frame", peer.layout(1 << 20, 256, [tensor("t0", 64, "uint8", rng), bad])

    def out_of_range(peer: Peer) -> tuple:
        extreme = rng.choice([-1, -(2**63), 2**63, 2**64 - 1, True, 1.5, "256"])
        where = rng.randrange(3)
        dims = [extreme] if where == 2 else [8]
        return "frame", peer.layout(
            extreme if where == 0 else 1 << 20,
            extreme if where == 1 else 256,
            [{"name": "w", "dtype": "uint8", "shape": dims}],
        )

    def direct(peer: Peer) -> tuple:
        """Storages and offsets as a sender would export them (each tensor in its own storage, or several
        in one), then, half the time, one value made hostile."""
        count = log_uniform(rng, 10) + 1
        specs = [TensorSpec(f"t{i}", "float32", (rng.randrange(0, 1 << 12),)) for i in range(count)]
        storages = rng.randrange(1, count + 1)
        storage = [rng.randrange(storages) for _ in range(count)]
        offsets = [4 * rng.randrange(1 << 10) for _ in range(count)]
        sizes = [0] * storages  # each storage just large enough for what lies in it
        for spec, k, offset in zip(specs, storage, offsets, strict=True):
            sizes[k] = max(sizes[k], offset + spec.nbytes)
        hostile = rng.randrange(8)
        if hostile == 1:
            sizes += [1 << 22] * log_uniform(rng, 20)  # more storages than tensors
        elif hostile == 2:
            storage[rng.randrange(count)] = storages + rng.randrange(1 << 20)  # a storage never exported
        elif hostile == 3:
            offsets[rng.randrange(count)] = rng.randrange(1 << 62)  # beyond its storage
        elif hostile == 4:
            offsets[rng.randrange(count)] += rng.choice([1, 2, 3])  # half an element
        elif hostile == 5:
            storage.pop()  # lists that disagree
        return "direct", (specs, storage, offsets, sizes)

    makers = {
        "huge tensor, small buckets": huge_tensor,
        "degenerate geometry": degenerate,
        "random layout": random_layout,
        "names, dtypes, shapes": bad_schema,
        "integers out of range": out_of_range,
        "direct-mode storages": direct,
    }
    kinds = list(makers)
    for i in range(n):
        kind = kinds[i % len(kinds)]
        yield kind, makers[kind]
    for count in (
        1,
        1000,
        100_000,
        MAX_LAYOUT_TENSORS - 1,
        MAX_LAYOUT_TENSORS,
        MAX_LAYOUT_TENSORS + 1,
        2 * MAX_LAYOUT_TENSORS,
        3 * MAX_LAYOUT_TENSORS,
    ):
        for bucket, align in ((1 << 20, 256), (16, 16)):
            yield (
                "many tiny tensors",
                lambda peer, n=count, b=bucket, a=align: (
                    "frame",
                    peer.layout(b, a, [{"name": f"{i:x}", "dtype": "bool", "shape": []} for i in range(n)]),
                ),
            )


def attempt(rx: FrameCodec, what: str, value: object, plan_max_chunks: int) -> tuple[str, str, float, int]:
    """(outcome, detail, seconds, chunks planned) of one input, as a receiver meets it."""
    t0 = time.perf_counter()
    try:
        if what == "direct":
            specs, storage, offsets, sizes = value  # type: ignore[misc]
            buckets = direct_buckets(specs, storage, offsets, sizes)
            chunks = sum(len(b.chunks) for b in buckets)
            ok = chunks == len(specs) and len(buckets) <= max(1, len(specs))
            return ("accepted" if ok else "crash"), "", time.perf_counter() - t0, chunks
        layout = rx.decode(value)  # type: ignore[arg-type]
        size = layout_size(layout.tensors, layout.bucket_bytes, layout.align_bytes)
        within = size.buckets <= MAX_LAYOUT_BUCKETS and size.chunks <= MAX_LAYOUT_CHUNKS
        if size.chunks > plan_max_chunks:
            return ("accepted, counted" if within else "crash"), "", time.perf_counter() - t0, 0
        buckets = plan_buckets(layout.tensors, layout.bucket_bytes, layout.align_bytes)
        planned = (len(buckets), sum(len(b.chunks) for b in buckets))
        ok = within and planned == (size.buckets, size.chunks)
        return ("accepted" if ok else "crash"), "", time.perf_counter() - t0, planned[1]
    except BadLayout as e:
        return "refused", _reason(str(e)), time.perf_counter() - t0, 0
    except WireError as e:
        return "refused (other WireError)", type(e).__name__, time.perf_counter() - t0, 0
    except Exception as e:  # a crash: anything but a typed refusal
        return "crash", f"{type(e).__name__}: {e}", time.perf_counter() - t0, 0


def _reason(message: str) -> str:
    for key, reason in (
        ("buckets and", "buckets / chunks over the bound"),
        ("tensors is above", "tensor count"),
        ("align_bytes=", "geometry"),
        ("bucket_bytes=", "geometry"),
        ("beyond any real", "tensor size"),
        ("do not fit", "direct: outside its storage"),
        ("itemsize", "direct: half an element"),
        ("offsets for", "direct: lists disagree"),
        ("storages exported for", "direct: storage count"),
        ("more than once", "duplicate name"),
        ("allowlist", "dtype"),
        ("shape", "shape"),
        ("name must", "name"),
    ):
        if key in message:
            return reason
    return "other: " + message[:80]


def sweep(n: int, seed: int, plan_max_chunks: int) -> dict:
    secret = SessionSecret.generate()
    peer, rx = Peer(secret), FrameCodec(secret, "receiver", "sender", MAX_FRAME_BYTES)
    outcomes: dict[str, Counter] = defaultdict(Counter)
    reasons: Counter = Counter()
    refuse_s: dict[str, list[float]] = defaultdict(list)
    accept_s: list[float] = []
    crashes: list[str] = []
    slowest: list[tuple[float, str, str, int]] = []  # (seconds, kind, reason, input bytes) of refusals
    max_chunks_planned = 0
    for kind, make in inputs(n, seed):
        what, value = make(peer)
        outcome, detail, seconds, chunks = attempt(rx, what, value, plan_max_chunks)
        outcomes[kind][outcome] += 1
        max_chunks_planned = max(max_chunks_planned, chunks)
        if outcome.startswith("refused"):
            refuse_s[kind].append(seconds)
            reasons[detail] += 1
            size = len(value) if isinstance(value, bytes) else 0
            slowest = sorted([*slowest, (seconds, kind, detail, size)], reverse=True)[:8]
        elif outcome.startswith("accepted"):
            accept_s.append(seconds)
        else:
            crashes.append(f"{kind}: {detail}")
    # the random inputs; the fixed layouts of many tiny tensors are reported in their own row
    every_refusal = sorted(t for k, ts in refuse_s.items() if k != "many tiny tensors" for t in ts)
    return {
        "inputs": sum(sum(c.values()) for c in outcomes.values()),
        "outcomes": {k: dict(c) for k, c in outcomes.items()},
        "totals": dict(sum(outcomes.values(), Counter())),
        "crashes": crashes,
        "refusal_reasons": dict(reasons),
        "refuse_us": {
            "median": 1e6 * statistics.median(every_refusal),
            "p99": 1e6 * every_refusal[int(0.99 * (len(every_refusal) - 1))],
            "max": 1e6 * every_refusal[-1],
            "by_kind_median": {k: 1e6 * statistics.median(v) for k, v in refuse_s.items()},
            "by_kind_max": {k: 1e6 * max(v) for k, v in refuse_s.items()},
        },
        "accept_s": {"median": statistics.median(accept_s), "max": max(accept_s)} if accept_s else {},
        "max_chunks_planned": max_chunks_planned,
        "slowest_refusals": [
            {"us": 1e6 * t, "kind": k, "reason": why, "frame_bytes": b} for t, k, why, b in slowest
        ],
    }


def worst_accepted() -> dict:
    """The most expensive layouts within the bounds, decoded, checked and planned in full."""
    cases = {
        # every bucket holds two tensors: the tensor and bucket bounds at once
        "262,144 tensors in 131,072 buckets": (512, 256, [("uint8", (100,))] * MAX_LAYOUT_TENSORS),
        # one tensor sliced over every bucket the bound allows, then zero-size tensors: the chunk bound
        "1 tensor over 131,071 buckets + 262,143 empty": (
            256,
            256,
            [("uint8", ((MAX_LAYOUT_BUCKETS - 1) * 256,))] + [("uint8", (0,))] * (MAX_LAYOUT_TENSORS - 1),
        ),
    }
    secret = SessionSecret.generate()
    peer = Peer(secret)
    out = {}
    for name, (bucket, align, items) in cases.items():
        rx = FrameCodec(secret, "receiver", "sender", MAX_FRAME_BYTES)
        frame = peer.layout(
            bucket,
            align,
            [{"name": f"{i:x}", "dtype": d, "shape": list(s)} for i, (d, s) in enumerate(items)],
        )
        t0 = time.perf_counter()
        layout = rx.decode(frame)
        t1 = time.perf_counter()
        plan = plan_buckets(layout.tensors, bucket, align)  # runs the check first, as every caller does
        t2 = time.perf_counter()
        size = layout_size(layout.tensors, bucket, align)
        t3 = time.perf_counter()
        chunks = sum(len(b.chunks) for b in plan)
        del plan
        gc.collect()
        tracemalloc.start()
        plan = plan_buckets(layout.tensors, bucket, align)
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        del plan
        out[name] = {
            "frame_bytes": len(frame),
            "decode_s": t1 - t0,
            "check_s": t3 - t2,
            "plan_s": t2 - t1,
            "buckets": size.buckets,
            "chunks": chunks,
            "plan_peak_bytes": peak,
            "plan_bytes_per_chunk": peak / chunks,
            "plan_s_per_chunk": (t2 - t1) / chunks,
        }
    return out


def issue_cases(per_chunk_s: float, per_chunk_bytes: float) -> dict:
    """The layouts of issue 22: time to refuse on each side, and what planning them would have cost."""
    out = {}
    secret = SessionSecret.generate()
    peer = Peer(secret)
    for name, bucket, align, nbytes in (
        ("1 GiB tensor, 16-byte buckets", 16, 16, 1 << 30),
        ("2**47-byte tensor, 4 KiB buckets", 4096, 256, 1 << 47),
    ):
        rx = FrameCodec(secret, "receiver", "sender", MAX_FRAME_BYTES)
        frame = peer.layout(bucket, align, [{"name": "w", "dtype": "uint8", "shape": [nbytes]}])
        times, sender_times = [], []
        for _ in range(200):
            t0 = time.perf_counter()
            try:
                rx.decode(frame)
            except BadLayout:
                times.append(time.perf_counter() - t0)
            spec = (TensorSpec("w", "uint8", (nbytes,)),)
            t0 = time.perf_counter()
            try:
                Layout(1, bucket, align, spec)  # the sender's side: making the Layout
            except BadLayout:
                sender_times.append(time.perf_counter() - t0)
        chunks = math.ceil(nbytes / bucket)
        out[name] = {
            "refused_by_receiver": len(times),
            "refused_by_sender": len(sender_times),
            "receiver_refuse_us_median": 1e6 * statistics.median(times),
            "sender_refuse_us_median": 1e6 * statistics.median(sender_times),
            "chunks_if_planned": chunks,
            "unbounded_plan_s_estimate": chunks * per_chunk_s,
            "unbounded_plan_bytes_estimate": chunks * per_chunk_bytes,
        }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layouts", type=int, default=20000, help="random inputs (then the fixed ones)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--plan-max-chunks", type=int, default=50_000, help="plan accepted layouts up to this")
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args()
    load_start = os.getloadavg()[0]  # timings on a shared machine: say how busy it was
    r = sweep(args.layouts, args.seed, args.plan_max_chunks)
    worst = worst_accepted()
    per_chunk_s = max(w["plan_s_per_chunk"] for w in worst.values())
    per_chunk_bytes = max(w["plan_bytes_per_chunk"] for w in worst.values())
    r |= {
        "worst_accepted": worst,
        "issue_22": issue_cases(per_chunk_s, per_chunk_bytes),
        "bounds": {"tensors": MAX_LAYOUT_TENSORS, "buckets": MAX_LAYOUT_BUCKETS, "chunks": MAX_LAYOUT_CHUNKS},
        "machine": {
            "cpus": os.cpu_count(),
            "loadavg_1min_start": load_start,
            "loadavg_1min_end": os.getloadavg()[0],
            "python": platform.python_version(),
        },
    }
    t = r["totals"]
    print(
        f"{r['inputs']} hostile layouts: {t.get('accepted', 0) + t.get('accepted, counted', 0)} accepted "
        f"({t.get('accepted, counted', 0)} counted, not planned), {t.get('refused', 0)} refused (BadLayout), "
        f"{t.get('refused (other WireError)', 0)} refused by another WireError, {len(r['crashes'])} crashes"
    )
    print(
        f"time to refuse (random inputs): median {r['refuse_us']['median']:.1f} us, p99 "
        f"{r['refuse_us']['p99']:.1f} us, max {r['refuse_us']['max']:.1f} us; "
        f"to accept and plan: median {1e3 * r['accept_s'].get('median', 0):.2f} ms, "
        f"max {1e3 * r['accept_s'].get('max', 0):.1f} ms; largest plan made: {r['max_chunks_planned']} chunks"
    )
    print(f"{'kind':<28}{'outcomes':<80}refuse median / max us")
    for kind, c in r["outcomes"].items():
        med, top = r["refuse_us"]["by_kind_median"].get(kind, 0), r["refuse_us"]["by_kind_max"].get(kind, 0)
        print(f"{kind:<28}{', '.join(f'{o} {n}' for o, n in sorted(c.items())):<80}{med:.1f} / {top:.1f}")
    print(
        "slowest refusals: "
        + "; ".join(
            f"{s['kind']} ({s['reason']}, {s['frame_bytes']} B) {s['us']:.0f} us"
            for s in r["slowest_refusals"]
        )
    )
    print("refusals by reason: " + ", ".join(f"{k} {v}" for k, v in sorted(r["refusal_reasons"].items())))
    for name, w in worst.items():
        print(
            f"worst accepted, {name}: frame {w['frame_bytes'] / 2**20:.1f} MiB, decode {w['decode_s']:.2f} s, "
            f"check {1e3 * w['check_s']:.0f} ms, plan {w['plan_s']:.2f} s, {w['chunks']} chunks, plan memory "
            f"{w['plan_peak_bytes'] / 2**20:.0f} MiB"
        )
    for name, c in r["issue_22"].items():
        print(
            f"{name}: refused in {c['receiver_refuse_us_median']:.1f} us (receiver), "
            f"{c['sender_refuse_us_median']:.1f} us (sender); unbounded it would plan {c['chunks_if_planned']} "
            f"chunks: ~{c['unbounded_plan_s_estimate']:.3g} s, ~{c['unbounded_plan_bytes_estimate'] / 2**30:.3g} GiB"
        )
    print(
        f"machine: {r['machine']['cpus']} CPUs, 1-minute load average {load_start:.1f} at the start, "
        f"{r['machine']['loadavg_1min_end']:.1f} at the end"
    )
    emit(r, args.json)


if __name__ == "__main__":
    main()
