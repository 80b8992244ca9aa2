"""The density rule by time (raysync.core.delta_rule, Note [the density rule by time]): a push goes as a delta
only when the sender measured delta pushes faster than full ones on its plane; the first delta attempt
measures; full pushes chosen by time are probed again; the report says which rule sent what full and why.
Costs are injected through the rule's ``observe`` (what the session calls with the seconds it measured), the
pushes themselves are real (an shm ring between two threads) and checked bit-exact."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import same_bits, session_pair
from test_delta_push import CFG, bf16, rl_step, small_model

from raysync import SessionSecret, SyncConfig, WeightReceiver, WeightSender
from raysync.core.delta_rule import (
    KEPT_AGAIN,
    NO_BASE,
    NOT_KEPT,
    PROBE_EVERY,
    StageClock,
    TimeRule,
    choose,
    decide,
)

GB = 10**9


# --- the rule alone -------------------------------------------------------------------------------------------------
def test_a_full_push_measures_first_then_a_delta_then_the_faster_one_wins():
    rule = TimeRule()
    assert rule.choose() == (False, "time: no full push measured yet, this one measures")
    rule.observe(False, 1.0, GB)
    assert rule.choose() == (True, "time: no delta push measured yet, this one measures")
    rule.observe(True, 2.0, GB)
    delta, why = rule.choose()
    assert not delta and why == "time: the last delta push took 2000.0 ms/GB, the last full push 1000.0 ms/GB"
    rule.observe(True, 0.5, GB)  # the delta got cheaper (a sparser step): it wins
    assert rule.choose()[0]


@pytest.mark.parametrize(
    "delta_s, full_s, as_delta", [(5.0, 1.0, False), (0.2, 1.0, True), (1.0, 1.0, False)]
)
def test_expensive_encoding_picks_full_and_cheap_encoding_picks_delta(delta_s, full_s, as_delta):
    rule = TimeRule()
    rule.observe(True, delta_s * 3, 3 * GB)  # per byte: pushes of other sizes compare
    rule.observe(False, full_s, GB)
    assert rule.choose()[0] is as_delta


def test_full_by_time_is_probed_again_and_the_interval_doubles_while_full_stays_faster():
    rule = TimeRule()
    rule.observe(True, 4.0, GB)
    choices = []
    for _ in range(3 * PROBE_EVERY + 4):
        delta, why = rule.choose()
        choices.append(delta)
        rule.observe(delta, 4.0 if delta else 1.0, GB)  # delta stays slower
        if delta:
            assert why.endswith(f"measured again after {PROBE_EVERY * (1 + (sum(choices) > 1))} full pushes")
    probes = [i for i, d in enumerate(choices) if d]
    assert probes == [PROBE_EVERY, 3 * PROBE_EVERY + 1]  # after 8 full pushes, then after 16


def test_a_full_push_is_measured_again_while_deltas_win():
    """The rule probes both ways: a first full push measured slow (e.g. it captured the Packer's CUDA graph)
    is measured again after 8 delta pushes, then after 16 while deltas stay faster; when the full push turns
    out faster, full pushes win and deltas are probed after 8 of them."""
    rule = TimeRule()
    rule.observe(True, 1.0, GB)
    rule.observe(False, 5.0, GB)  # the slow first full push
    choices = []
    for i in range(3 * PROBE_EVERY + 2):
        delta, why = rule.choose()
        choices.append(delta)
        if not delta:
            assert why.endswith(f"measured again after {PROBE_EVERY * (1 + (i > PROBE_EVERY))} delta pushes")
        rule.observe(delta, 1.0 if delta else 2.0, GB)  # deltas stay faster than a full push's true cost
    fulls = [i for i, d in enumerate(choices) if not d]
    assert fulls == [PROBE_EVERY, 3 * PROBE_EVERY + 1]  # after 8 delta pushes, then after 16
    rule.observe(False, 0.5, GB)  # a full push (e.g. an anchor) faster now: full wins, it counts as one
    choices = []
    for _ in range(PROBE_EVERY):
        delta = rule.choose()[0]
        choices.append(delta)
        rule.observe(delta, 1.0 if delta else 0.5, GB)
    assert choices == [False] * (PROBE_EVERY - 1) + [True]


@pytest.mark.parametrize(
    "based, full, since, config, want",
    [
        (False, False, 0, {}, (False, "no reference of the receivers' version: full")),
        (True, True, 0, {}, (False, "full=True")),
        (True, False, 2, {"delta_full_every": 3}, (False, "an anchor (delta_full_every=3)")),
        (
            True,
            False,
            1,
            {"delta_full_every": 3},
            (False, "time: no full push measured yet, this one measures"),
        ),
        (True, False, 0, {"delta_by_time": False}, (True, "")),
    ],
)
def test_which_rule_decides_a_push(based, full, since, config, want):
    rule = TimeRule()
    assert choose(SyncConfig(delta=True, **config), rule, based, full, since) == want


def test_what_a_push_does_with_the_reference():
    """Note [no reference while full wins]: ``decide`` on a rule in each state, for a reference of this layout."""
    on, off = SyncConfig(delta=True), SyncConfig(delta=True, delta_by_time=False)
    full_wins = TimeRule()
    full_wins.observe(False, 1.0, 1)
    full_wins.observe(True, 2.0, 1)  # full pushes win: a probe after PROBE_EVERY of them
    c = decide(on, full_wins, True, True, False, 0, False, False)
    assert (c.delta, c.keeps, c.figure) == (False, False, True) and c.why.endswith(NOT_KEPT)
    assert decide(on, full_wins, True, True, False, 0, True, False).keeps  # a lazy source keeps it
    assert decide(on, full_wins, True, True, True, 0, False, False).keeps  # full=True keeps it
    full_wins._probe_in = 1  # the next push probes: this one keeps it, and its time is not the full figure
    c = decide(on, full_wins, True, True, False, 0, False, False)
    assert (c.delta, c.keeps, c.figure) == (False, True, False) and NOT_KEPT not in c.why
    delta_wins = TimeRule()
    delta_wins.observe(False, 2.0, 1)
    delta_wins.observe(True, 1.0, 1)
    c = decide(on, delta_wins, True, False, False, 0, False, True)  # none kept: full, keeping it
    assert (c.delta, c.keeps, c.figure) == (False, True, False) and c.why.endswith(KEPT_AGAIN)
    c = decide(off, TimeRule(), True, False, False, 0, False, False)  # no version (a failed push), no rule
    assert (c.delta, c.keeps, c.why) == (False, True, NO_BASE)
    c = decide(off, TimeRule(), True, True, False, 0, False, False)  # the rule off: a delta, kept
    assert (c.delta, c.keeps, c.figure, c.why) == (True, True, True, "")


def test_a_stage_clock_sums_marked_stages_only_when_enabled():
    ticks = iter([0.0, 1.0, 3.0, 10.0, 11.0, 20.0])
    clock = StageClock(now=lambda: next(ticks))
    clock.mark("pack")  # off: nothing read
    clock.enabled = True
    clock.start()  # 0
    clock.mark("pack")  # 1
    clock.mark("compare")  # 3
    clock.restart()  # 10: a wait between buckets is not counted
    clock.mark("pack")  # 11
    assert clock.seconds == {"pack": 2.0, "compare": 2.0}


RULE = dataclasses.replace(CFG, cast_dtype="bfloat16", delta_by_time=True)  # the time rule on


def models(seed: int) -> tuple[dict, dict, int]:
    """A small model (the trainer's fp32 master), its engine's bf16 destinations, and the bytes of a full push."""
    master = small_model(seed=seed)
    return master, bf16(small_model(seed=seed + 1)), sum(t.numel() * 2 for t in master.values())


# --- in pushes ------------------------------------------------------------------------------------------------------
def test_pushes_go_full_when_delta_measured_slower_and_delta_when_faster(private_tmp, in_thread):
    """Real pushes over shm with the time rule on: push 1 is full (nothing to diff), push 2 full (a full push
    is measured), push 3 a delta (the first attempt measures); then the costs are injected through the rule's
    ``observe``: a delta much slower than a full push sends push 4 full, said so in the report, and without
    rewriting the reference (Note [no reference while full wins]); a delta much faster then makes push 5 full,
    keeping the reference again, and push 6 a delta from it. Every push lands bit-exact. (Full pushes are made
    slow before push 3 and push 5, so that no bucket of these deltas falls behind: Note [a delta push that
    falls behind]; push 5 keeps the reference only for push 6, so its time is not the full pushes' figure.)"""
    master, dest, full_bytes = models(seed=5)
    reports = []
    with session_pair(RULE) as (sender, receiver):
        rule = sender._delta.rule  # the seam: what the session tells the rule after each push
        for version in range(1, 7):
            rl_step(master, version)
            if version == 3:
                rule.observe(False, 100.0, full_bytes)
            if version == 4:
                rule.observe(True, 1000.0, full_bytes)  # encoding made expensive relative to moving bytes
                kept = sender._delta.bucket(0).clone()  # the reference, at version 3
            if version == 5:
                assert torch.equal(sender._delta.bucket(0), kept) and sender._delta.version is None
                rule.observe(False, 100.0, full_bytes)
                rule.observe(True, 1e-9, full_bytes)  # and cheap
            got = in_thread(receiver.receive, into=dest)
            reports.append(sender.push(master.items(), version))
            assert got.result(timeout=30).base_version == reports[-1].base_version
            assert all(same_bits(dest[n], t) for n, t in bf16(master).items()), version
    assert [r.base_version for r in reports] == [None, None, 2, None, None, 5]
    full = [r.bytes == r.sent_as_full == full_bytes for r in reports]
    assert full == [True, True, False, True, True, False]
    assert reports[0].why.startswith("new tensors or a new layout")
    assert reports[1].why == "time: no full push measured yet, this one measures"
    assert reports[2].why == "time: no delta push measured yet, this one measures"
    assert reports[3].why.startswith("time: the last delta push took") and reports[3].why.endswith(NOT_KEPT)
    assert reports[4].why.endswith(KEPT_AGAIN) and reports[5].why.startswith("time: ")
    assert "(time: " in str(reports[3])


def test_while_full_pushes_win_the_reference_is_kept_only_by_the_push_before_a_delta_probe(
    private_tmp, in_thread
):
    """Note [no reference while full wins]: with deltas measured slower (probes every 2 full pushes), push 4 goes
    full without rewriting the reference (it stays at version 3, and at no version for the rule), push 5, the
    one before the probe, rewrites it (its time is not the rule's full figure: push 4's stays), and push 6, the
    probe, is a delta from it; every push lands bit-exact."""
    master, dest, full_bytes = models(seed=21)
    reports, versions = [], []
    with session_pair(RULE) as (sender, receiver):
        rule = sender._delta.rule = TimeRule(probe_every=2)
        for version in range(1, 7):
            rl_step(master, version)
            if version == 3:  # full pushes slow: the measuring delta does not fall behind
                rule.observe(False, 100.0, full_bytes)
            if version == 4:  # deltas slower still: full pushes win
                rule.observe(True, 1000.0, full_bytes)
                kept = sender._delta.bucket(0).clone()
            got = in_thread(receiver.receive, into=dest)
            reports.append(sender.push(master.items(), version))
            versions.append(sender._delta.version)
            assert got.result(timeout=30).version == version
            assert all(same_bits(dest[n], t) for n, t in bf16(master).items()), version
            if version == 4:
                assert torch.equal(sender._delta.bucket(0), kept)
                figure = rule.full_s_per_byte
            if version == 5:
                assert rule.full_s_per_byte == figure
    assert [r.base_version for r in reports] == [None, None, 2, None, None, 5]
    assert versions == [1, 2, 3, None, 5, 6]
    assert reports[3].why.endswith(NOT_KEPT) and NOT_KEPT not in reports[4].why
    assert reports[4].why.startswith("time: the last delta push took")
    assert "measured again after 2 full pushes" in reports[5].why


def test_after_a_skipped_push_a_full_push_by_time_still_keeps_no_reference(private_tmp, in_thread):
    """Note [no reference while full wins]: full pushes win; a push of the version the receiver holds is skipped
    (the reference stays at no version); the next push asks the rule, not "no reference", and keeps none."""
    master, dest, full_bytes = models(seed=23)
    reports = []
    with session_pair(RULE) as (sender, receiver):
        rule = sender._delta.rule
        for i, version in enumerate((1, 2, 3, 4, 4, 5)):
            again = i == 4  # version 4 a second time: the receiver holds it, so the push is skipped
            if not again:
                rl_step(master, version)
            if version == 3:
                rule.observe(False, 100.0, full_bytes)
            if version == 4 and not again:
                rule.observe(True, 1000.0, full_bytes)  # full pushes win
            got = in_thread(receiver.receive, into=dest)
            reports.append(sender.push(master.items(), version))
            assert got.result(timeout=30).version == version
            assert all(same_bits(dest[n], t) for n, t in bf16(master).items()), version
    assert [r.skipped for r in reports] == [False, False, False, False, True, False]
    assert reports[3].why.endswith(NOT_KEPT) and reports[5].why.endswith(NOT_KEPT)
    assert reports[5].why.startswith("time: ") and sender._delta.version is None


def test_a_delta_falls_behind_by_its_buckets_time_from_the_receivers_accept(private_tmp, in_thread):
    """Note [a delta push that falls behind]: the clock of a delta's buckets starts when the receivers accepted
    the push, so a receiver slow to answer does not cut it. Here the push started 10 s before the check and the
    full pushes' figure is 1 s a push: behind, unless the receivers accepted just now."""
    master, dest, full_bytes = models(seed=25)
    with session_pair(RULE) as (sender, receiver):
        for version in (1, 2):
            got = in_thread(receiver.receive, into=dest)
            sender.push(master.items(), version)
            got.result(timeout=30)
        ref = sender._delta
        ref.rule.observe(False, 1.0, full_bytes)
        ref.start(full=False)
        assert ref.base == 2  # a delta (the rule has measured none yet)
        ref._started = ref._streaming = ref._started - 10.0
        ref.accepted()
        assert ref._on_time(1)
        ref._streaming -= 10.0  # as if it had not been told
        assert not ref._on_time(1) and "buckets 1.." in ref.stats.why
        ref.demote("the test's push ends here", refused=False)


def test_a_delta_push_that_falls_behind_a_full_one_sends_its_other_buckets_full(private_tmp, in_thread):
    """Note [a delta push that falls behind]: full pushes measured near-instant. The measuring delta push
    (push 3) cannot keep up, nor can push 4, a delta the rule chose (measured faster): bucket 0 goes as a
    delta, the others full, from the same base; the receiver applies both kinds in one push and ends
    bit-exact; the report says from which bucket and why, and the push counts as a delta push for the rule.
    With full pushes measured slow, push 5 goes whole."""
    master, dest, full_bytes = models(seed=13)
    reports = []
    with session_pair(RULE) as (sender, receiver):
        rule = sender._delta.rule
        for version in range(1, 6):
            rl_step(master, version)
            if version == 3:  # full pushes near-instant; no delta measured yet
                rule.observe(False, 1e-9, full_bytes)
            if version == 4:  # deltas measured faster than full pushes, which are still near-instant
                rule.observe(False, 1e-9, full_bytes)
                rule.observe(True, 1e-10, full_bytes)
            if version == 5:  # full pushes slow: nothing falls behind
                rule.observe(False, 100.0, full_bytes)
                rule.observe(True, 1e-10, full_bytes)
            got = in_thread(receiver.receive, into=dest)
            reports.append(sender.push(master.items(), version))
            assert got.result(timeout=30).version == version
            assert all(same_bits(dest[n], t) for n, t in bf16(master).items()), version
            if version == 4:
                assert rule.delta_s_per_byte > 1e-10 / full_bytes  # the push was measured as a delta push
    measuring, behind, whole = reports[2], reports[3], reports[4]
    buckets = len(sender._delta._ref.offsets) - 1
    assert buckets > 2 and [r.base_version for r in reports[2:]] == [2, 3, 4]
    assert measuring.why.startswith("time: no delta push measured yet, this one measures; ")
    for cut in (measuring, behind):
        assert 0 < cut.sent_as_full < full_bytes and cut.sent_as_delta > 0
        assert f"buckets 1..{buckets - 1} of {buckets} full: its first" in cut.why
        assert "the last full push" in cut.why
        assert whole.sent_as_full < cut.sent_as_full
    assert "full:" not in whole.why


def test_the_report_says_which_chunks_went_full_by_the_density_cap(private_tmp, in_thread):
    """delta_max_density (the user's cap): chunks denser than it go full inside a delta push, and the report
    counts their bytes under "density"; the time rule is off, so the push is a delta."""
    master = small_model(seed=7)
    dest = bf16(small_model(seed=8))
    config = dataclasses.replace(CFG, cast_dtype="bfloat16", delta_max_density=0.0)
    with session_pair(config) as (sender, receiver):
        for version in (1, 2):
            rl_step(master, version)
            got = in_thread(receiver.receive, into=dest)
            report = sender.push(master.items(), version)
            assert got.result(timeout=30).version == version
    assert report.base_version == 1 and sender._delta.stats.full_by_density == report.sent_as_full > 0
    assert "MB full by density" in report.why
    assert all(same_bits(dest[n], t) for n, t in bf16(master).items())


def test_a_delta_push_of_tensors_that_did_not_change_sends_headers_only(private_tmp, in_thread):
    master = bf16(small_model(seed=9))
    dest = bf16(small_model(seed=10))
    with session_pair(CFG) as (sender, receiver):
        for version in (1, 2):
            got = in_thread(receiver.receive, into=dest)
            report = sender.push(master.items(), version)
            assert got.result(timeout=30).version == version
    assert report.base_version == 1 and report.sent_as_full == 0 and report.density == 0.0
    assert 0 < report.bytes < 64 * len(sender._agreed.buckets) * 8
    assert all(torch.equal(dest[n], t) for n, t in master.items())


def test_buckets_of_sizes_not_a_multiple_of_16_take_deltas_bit_exact(private_tmp, in_thread):
    """Tensors of odd element counts end their buckets off the 16-byte grid of the reference's layout."""
    g = torch.Generator().manual_seed(11)
    master = {f"t{i}": torch.randn(n, generator=g).to(torch.bfloat16) for i, n in enumerate((7, 333, 1001))}
    dest = {n: torch.zeros_like(t) for n, t in master.items()}
    config = dataclasses.replace(CFG, bucket_bytes=4096)
    with session_pair(config) as (sender, receiver):
        for version in (1, 2, 3):
            for t in master.values():
                t.view(-1)[version::5].add_(1.0)
            got = in_thread(receiver.receive, into=dest)
            report = sender.push(master.items(), version)
            assert got.result(timeout=30).base_version == report.base_version == (version - 1 or None)
            assert all(same_bits(dest[n], t) for n, t in master.items()), version
    assert any(b.nbytes % 16 for b in sender._agreed.buckets)


def test_a_receiver_that_never_takes_a_delta_is_measured_after_its_second_refusal(private_tmp, in_thread):
    """A receiver with a load function never takes a delta (a vLLM engine's load_weights): each delta the rule
    chose was encoded ahead, refused and sent full. A first refusal is not measured (an engine that joined
    late); the second in a row is measured as what a delta costs here, so from push 5 on the rule compares it
    with the full push that push 2 measured, instead of trying a delta every push. Every push bit-exact."""
    master = small_model(seed=8)
    config = dataclasses.replace(CFG, cast_dtype="bfloat16", delta_by_time=True)
    loaded: dict[str, torch.Tensor] = {}
    reports = []
    with session_pair(config) as (sender, receiver):
        rule = sender._delta.rule
        for version in range(1, 7):
            rl_step(master, version)
            got = in_thread(receiver.receive, load_fn=lambda b: loaded.update((n, t.clone()) for n, t in b))
            reports.append(sender.push(master.items(), version))
            assert got.result(timeout=30).version == version
            assert all(same_bits(loaded[n], t) for n, t in bf16(master).items()), version
            if version == 3:
                assert rule.delta_s_per_byte is None  # one refusal: not measured
    assert [r.base_version for r in reports] == [None] * 6
    assert rule.delta_s_per_byte is not None and rule.full_s_per_byte is not None
    assert reports[1].why == "time: no full push measured yet, this one measures"
    assert reports[2].why == reports[3].why == "a receiver needs a full push"
    assert reports[4].why.startswith(("time: the last delta push took", "a receiver needs a full push"))


def test_a_fanout_reader_that_never_takes_a_delta_stops_the_turns_by_time(private_tmp, in_thread):
    """Two readers of one shm ring, one with a load function (it never takes a delta): a delta push serves
    them in turns (the delta, then a full push: more than a full push costs). The second time in a row it is
    measured as a delta push, so from push 5 on the rule compares it with the full push that push 2 measured,
    instead of serving every push in turns (full when the turns measured slower; in turns again, by that
    comparison, when a loaded machine measured them faster: both seen on the 2-core VM). Every push bit-exact at both readers."""
    master = small_model(seed=11)
    config = dataclasses.replace(CFG, cast_dtype="bfloat16", delta_by_time=True)
    dest, loaded = bf16(small_model(seed=12)), {}
    secret = SessionSecret.generate()
    reports = []
    with WeightSender(secret, config, receivers=2) as sender:
        receivers = [WeightReceiver(e, secret, config) for e in sender.endpoints]
        try:
            for version in range(1, 6):
                rl_step(master, version)
                got = [
                    in_thread(receivers[0].receive, into=dest),
                    in_thread(
                        receivers[1].receive, load_fn=lambda b: loaded.update((n, t.clone()) for n, t in b)
                    ),
                ]
                reports.append(sender.push(master.items(), version))
                assert [g.result(timeout=30).version for g in got] == [version] * 2
                want = bf16(master)
                assert all(same_bits(dest[n], t) and same_bits(loaded[n], t) for n, t in want.items()), (
                    version
                )
                if version == 3:
                    assert sender._delta.rule.delta_s_per_byte is None  # one refusal: not measured
        finally:
            for r in receivers:
                r.close()
    assert reports[1].why == "time: no full push measured yet, this one measures"
    assert [r.why.split(":")[0] for r in reports[2:4]] == ["in turns"] * 2
    assert sender._delta.rule.delta_s_per_byte is not None
    why = reports[4].why  # the rule compared the two measured kinds; which one was faster is the machine's
    assert why.startswith(
        ("time: the last delta push took", "in turns: the delta turn: time: the last delta")
    ), why
