"""Hostile input, at a small size (benchmarks/fuzz_wire.py runs the same generator at full size for
docs/reliability.md)."""

from __future__ import annotations

import importlib.util
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _fuzz_module():
    spec = importlib.util.spec_from_file_location(
        "fuzz_wire", os.path.join(ROOT, "benchmarks", "fuzz_wire.py")
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("seed", [1, 2])
def test_hostile_frames_are_all_refused_and_nothing_runs(seed):
    r = _fuzz_module().run(1400, seed=seed)  # 100 frames of each of the 14 kinds
    assert r["crashes"] == [] and r["accepted"] == []
    assert r["pickle_side_effect"] is False and r["receiver_usable_after"] is True
    assert len(r["rejections"]) == 14 and sum(sum(k.values()) for k in r["rejections"].values()) == 1400
    assert r["rss_growth_bytes"] < 64 << 20
