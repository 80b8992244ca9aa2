"""The README's first command, for real: a local Ray, a trainer actor, an engine actor, pushes over shm."""

from __future__ import annotations

import pytest

pytest.importorskip("ray")


@pytest.mark.slow
def test_demo_pushes_bit_exact_through_ray_actors(private_tmp, capsys):
    from raysync.demo import main

    assert main(["--engine", "torch", "--engines", "1", "--pushes", "2", "--bucket-mb", "1"]) == 0
    out = capsys.readouterr().out
    assert (
        "engine versions: [2]" in out and "OK: every engine holds the trainer's weights, bit for bit" in out
    )


@pytest.mark.slow
@pytest.mark.vllm
def test_demo_with_vllm_engines_generates_the_trainers_tokens(private_tmp, capsys):
    pytest.importorskip("vllm")
    from raysync.demo import main

    assert main(["--engine", "vllm", "--engines", "1", "--pushes", "2", "--bucket-mb", "1"]) == 0
    out = capsys.readouterr().out
    assert "engine versions: [2]" in out and "OK: every engine generates the trainer's tokens" in out
