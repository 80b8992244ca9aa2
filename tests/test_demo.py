"""The README's first command, for real: a local Ray, a trainer actor, an engine actor, pushes over shm."""

from __future__ import annotations

import pytest

pytest.importorskip("ray")


@pytest.mark.slow
def test_demo_pushes_bit_exact_through_ray_actors(private_tmp, capsys):
    from raysync.demo import main

    assert main(["--engines", "1", "--pushes", "2", "--bucket-mb", "1"]) == 0
    out = capsys.readouterr().out
    assert "engine versions: [2]" in out and "OK: every engine" in out
