"""Which pushes go as a delta, by time (issue 24, item 3), and the clock that times a push's stages. Pure host
code: the sender's reference (raysync.core.delta_push.Reference) asks ``TimeRule.choose`` before each push and
tells it what each push cost; ``StageClock`` sums the seconds of each stage of a push when asked to.

# Note [the density rule by time]
# A delta is worth sending only when encoding it and moving its bytes is faster than moving the full bytes on
# this plane, and which is faster depends on the plane and the machine, not only on the sizes: on a GPU
# trainer over a host ring (shm) the full push is bounded by PCIe and the delta's compare runs at GPU memory
# speed; on one GPU (a cuda_ipc ring) a full push is two device copies, which one compare pass already costs;
# on a CPU trainer over shm a memcpy beats the compare and the compaction; over other nodes (the collective)
# the network is slow and a delta wins. So the sender measures, per push, the seconds from ``start`` to
# ``finish`` (the receivers have applied it) over the layout's full bytes, for full pushes and for delta
# pushes separately (the last of each), and before a push:
#   * no full push measured yet (the first push of a layout sets the session up, so it is not counted): full;
#   * no delta push measured yet on this session: a delta (the first attempt measures, whole);
#   * else a delta when its last measured time is below the last full one; full otherwise ("time" in the
#     report's ``why``), with the other kind measured again after ``probe_every`` pushes of the faster one, in
#     case the density changed or the plane did, the interval doubling each time the probe confirms the
#     faster kind (up to 64 x) and back to ``probe_every`` when the other kind wins. Both ways: a full push
#     measured once, e.g. slowed by the one-time capture of the Packer's CUDA graph (its second run, which
#     can be the first full push measured), would otherwise never be measured again while deltas win.
# Within a delta push the chunk rule still applies ("size": a GAPS payload no smaller than the full bytes,
# "density": denser than SyncConfig.delta_max_density, a user's cap). A push that went full after all (a
# receiver could not take the delta), one served in turns and one that set a layout up are not measured, with
# one exception: a delta refused a second time in a row (a receiver that never takes one: a load function, on
# a broadcast group or a pair; a fan-out reader served in turns every push) is measured as a delta push, for
# that is what choosing a delta costs there (the buckets encoded ahead and thrown away, or the second turn).
# Without it the rule never measured a delta and tried one every push; a refusal once (an engine that joined
# late or lost its version) is not measured, and a delta every receiver takes counts the refusals from zero.
# SyncConfig(delta_by_time=False) turns this rule off: every push that can be a delta is one.

# Note [a delta push that falls behind]
# Choosing a delta is a bet made before the push: the measuring push, each probe after 8..512 full pushes, and
# a step denser than the last can each be slower than a full push (a delta's compare alone reads twice what a
# full push over a cuda_ipc ring copies once: 178 ms against 35 ms for the 7B layout on an H200). So a delta
# push under the time rule, once a full push was measured, checks before each bucket k > 0 that its buckets so
# far (since the receivers accepted the push: a receiver slow to answer is not the delta's cost) took at most
# FALL_BEHIND x what the last full push took for as many bytes (``behind``); past that, it sends
# the rest of its buckets full (a bucket without a base applies on top of any version: Note [delta pushes]). The
# push still counts as a delta push for the rule (that is what choosing a delta cost), and its report says from
# which bucket it went full and why. The measuring delta push is checked too (since stop 46). Until then it was
# not: it paid the delta path's one-time work, and cut it measured a mixed push (on an H200, 7B over shm, a cut
# first probe went full from bucket 2 -- its first 1.07 GB took 67.6 ms, a full push's 26.6 -- and measured 26.7
# ms/GB, where later deltas took 14-17 ms/GB and full pushes 23-25). That work is done at set-up now (Note [the
# first delta push's one-time work] in raysync.core.delta_workspace: the rule's measuring delta 40-60 ms, ~3-4
# ms/GB, against full pushes of ~22 ms/GB), while uncut the measuring delta cost a CPU trainer over shm a push of
# 448 ms against full ones of 120 (the VM, 0.5B layout, docs/benchmarks.md 12d). A measuring delta that is cut
# measures as slower than a full push, so full pushes follow until the next probe.

# Note [no reference while full wins]
# A full push in delta mode also rewrites the reference, so that the next push can be a delta: one more copy of the
# model's bytes on the trainer's device (7B on an H200: full pushes 340-351 ms with it over shm against 330-338 ms
# without delta mode, and 27.0 against 20.7 ms over a cuda_ipc ring; on the VM's CPU, 0.5B over shm, 73-141 ms
# against 62-80, docs/benchmarks.md 12). While the rule measured full pushes faster, the next push is full as well
# until a probe is due, so that copy bought nothing: a full push the rule chose by time keeps no reference
# (``keeps_reference``: not while full pushes win and the next push is not a delta probe) and costs what a full
# push without delta mode costs; the reference is left at no version, and the push before a probe rewrites it.
# A push whose reference holds no version (none kept, or the last push failed or was skipped) asks the rule as if
# one were there: full by time, again without one; a delta (the rule changed its mind, or a probe is due) goes
# full and keeps one, and the delta waits a push. A lazy source keeps it always (its packer writes into the
# reference's scratch). The rule's full figure is what full pushes cost while they win, without the reference: a
# full push that keeps it only for the delta after it (the push before a probe) counts towards the probe, and its
# time is not the figure (``Choice.figure``), or probes would compare deltas with the dearer kind of full push.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from raysync.core.config import SyncConfig

DIRECT_OFF = (
    "direct mode reads the trainer's tensors in place with one copy each; encoding a delta reads the "
    "reference and the new bytes at least once each, more than that copy, so its pushes go full"
)

ONE_GPU_OFF = (
    "a cuda_ipc ring whose readers are on the trainer's GPU moves a push as two device copies; encoding a delta "
    "reads the reference and the new bytes once each, as much, so the time rule sends full pushes "
    "(SyncConfig(delta_by_time=False) sends deltas anyway)"
)
PROBE_EVERY = 8  # pushes of the faster kind before the other is measured again (doubling, Note above)
FALL_BEHIND = 1.1  # a delta push goes on full past this x a full push's time for its bytes so far
PROBE_MAX = 64 * PROBE_EVERY
NOT_KEPT = "the reference is not kept while full pushes win (until the push before a delta probe)"
KEPT_AGAIN = "no reference was kept while full pushes won: full, keeping it"
NO_BASE = "no reference of the receivers' version: full"


@dataclass
class TimeRule:
    """Note [the density rule by time]: the last measured seconds per full byte of each kind of push."""

    probe_every: int = PROBE_EVERY
    full_s_per_byte: float | None = None
    delta_s_per_byte: float | None = None
    _probe_in: int = field(default=PROBE_EVERY, repr=False)  # full pushes until the next delta probe
    _interval: int = field(default=PROBE_EVERY, repr=False)

    def choose(self) -> tuple[bool, str]:
        """(send this push as a delta, why): the reason is for the report either way."""
        d, f = self.delta_s_per_byte, self.full_s_per_byte
        if f is None:
            return False, "time: no full push measured yet, this one measures"
        if d is None:
            return True, "time: no delta push measured yet, this one measures"
        measured = f"the last delta push took {_per_gb(d)}, the last full push {_per_gb(f)}"
        wins = d < f
        if self._probe_in <= 0:  # the other kind is measured again
            return not wins, (
                f"time: {measured}; measured again after {self._interval} {'delta' if wins else 'full'} pushes"
            )
        return wins, f"time: {measured}"

    def observe(self, delta: bool, seconds: float, full_bytes: int, figure: bool = True) -> None:
        """A push of ``full_bytes`` (the layout's: what a full push moves) took ``seconds`` end to end.
        ``figure=False``: it counts towards the next probe, and its time is not its kind's figure (Note [no
        reference while full wins])."""
        before = self._winner()
        probed = self._probe_in <= 0 and before is not None and delta != before
        if delta and figure:
            self.delta_s_per_byte = seconds / max(full_bytes, 1)
        elif figure:
            self.full_s_per_byte = seconds / max(full_bytes, 1)
        after = self._winner()
        if after is None:
            return
        if after != before:  # the first comparison, or the other kind is faster now: probed after 8 again
            self._interval = self._probe_in = self.probe_every
        elif probed:  # the probe confirmed the winner: the interval doubles
            self._interval = self._probe_in = min(2 * self._interval, PROBE_MAX)
            return
        if delta == after:  # a push of the faster kind: one fewer before the probe
            self._probe_in -= 1

    def full_wins(self) -> bool:
        """Full pushes measured faster than deltas (or as fast)."""
        return self._winner() is False

    def keeps_reference(self) -> bool:
        """Whether a full push this rule chose keeps the reference (Note [no reference while full wins]): unless
        full pushes win and the next push is not a delta probe."""
        return not self.full_wins() or self._probe_in <= 1

    def behind(self, seconds: float, nbytes: int) -> str | None:
        """Why a delta push that took ``seconds`` for its first ``nbytes`` (of the layout's full bytes) should
        send the rest full (Note [a delta push that falls behind]); None to go on."""
        f = self.full_s_per_byte
        if f is None or nbytes <= 0 or seconds <= FALL_BEHIND * f * nbytes:
            return None
        return (
            f"its first {nbytes / 1e6:.1f} MB took {seconds * 1e3:.1f} ms as a delta, the last full push "
            f"{f * nbytes * 1e3:.1f} ms for as many"
        )

    def _winner(self) -> bool | None:
        """True: delta pushes measured faster, False: full ones (or as fast), None: not both measured."""
        d, f = self.delta_s_per_byte, self.full_s_per_byte
        return None if d is None or f is None else d < f


def _per_gb(seconds_per_byte: float) -> str:
    return f"{seconds_per_byte * 1e12:.1f} ms/GB"


class StageClock:
    """Seconds per stage of a push, summed over its buckets (``seconds``), when ``enabled`` (off by default:
    on a GPU each mark synchronizes the device first, which ordinary pushes must not). ``mark(stage)`` ends
    the stage under way; ``start`` begins a push."""

    def __init__(self, now: Callable[[], float] = time.perf_counter):
        self.enabled = False
        self.device: torch.device | None = None
        self.seconds: dict[str, float] = {}
        self._now, self._last = now, 0.0

    def start(self, device: torch.device | None = None) -> None:
        self.seconds, self.device = {}, device
        self.restart()

    def restart(self) -> None:
        """The next stage starts now (time between pushes' stages, e.g. waiting for a buffer, not counted)."""
        if self.enabled:
            self._sync()
            self._last = self._now()

    def mark(self, stage: str) -> None:
        if not self.enabled:
            return
        self._sync()
        now = self._now()
        self.seconds[stage] = self.seconds.get(stage, 0.0) + now - self._last
        self._last = now

    def _sync(self) -> None:
        if self.device is not None and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


@dataclass(frozen=True)
class Choice:
    """What a push in delta mode does (``decide``): go as a delta, rewrite the reference (``keeps``), give the
    rule its kind's figure (``figure``), and why."""

    delta: bool
    keeps: bool
    figure: bool
    why: str


def decide(
    config: SyncConfig,
    rule: TimeRule,
    usable: bool,
    based: bool,
    full: bool,
    since: int,
    lazy: bool,
    unkept: bool,
) -> Choice:
    """``choose``, and what the reference does (Note [no reference while full wins]): ``usable``, a reference of
    this layout; ``based``, at the receivers' version; ``unkept``, the last push left it at none by choice."""
    delta, why = choose(config, rule, usable, full, since)
    by_time = why.startswith("time:")
    if not (delta or lazy or not by_time or rule.keeps_reference()):
        return Choice(False, False, True, f"{why}; {NOT_KEPT}")
    if delta and not based:  # a delta asked for, and the reference holds no version: full, rewriting it
        because = KEPT_AGAIN if unkept else NO_BASE
        return Choice(False, True, rule.full_s_per_byte is None, f"{why}; {because}" if why else because)
    # a full push that keeps the reference only for the probe after it costs more than those that kept none
    return Choice(delta, True, delta or lazy or not by_time or not rule.full_wins(), why)


def choose(
    config: SyncConfig, rule: TimeRule, based: bool, full: bool, deltas_since_full: int
) -> tuple[bool, str]:
    """(this push goes as a delta, why): not without a reference (``based``; ``decide`` checks its version), nor
    when asked ``full``, nor when an anchor is due (SyncConfig.delta_full_every); else as the time rule
    says (SyncConfig.delta_by_time), or always."""
    every = config.delta_full_every
    if not based:
        return False, NO_BASE
    if full:
        return False, "full=True"
    if every > 0 and deltas_since_full + 1 >= every:
        return False, f"an anchor (delta_full_every={every})"
    return rule.choose() if config.delta_by_time else (True, "")
