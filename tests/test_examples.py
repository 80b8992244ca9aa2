"""The examples run as a user runs them."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("ray")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
def test_ray_quickstart_runs_as_a_script(no_leftovers):
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    run = subprocess.run([sys.executable, "examples/ray_quickstart.py"], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=300)  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr
    assert "engine weights changed: True; equal to the trainer's: True" in run.stdout
