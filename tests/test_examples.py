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


@pytest.mark.slow
def test_ray_quickstart_runs_under_ray_job_submit(no_leftovers, tmp_path):
    pytest.importorskip("ray.dashboard.modules.job.sdk")  # ray[default]
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"} | {"RAY_AUTH_MODE": "disabled"}
    ray_cli = os.path.join(os.path.dirname(sys.executable), "ray")
    start = [ray_cli, "start", "--head", "--num-cpus=2", "--include-dashboard=true", f"--dashboard-port={port}",
             "--port=0", "--disable-usage-stats"]  # fmt: skip
    subprocess.run(start, env=env, check=True, capture_output=True, timeout=120)
    try:
        submit = [ray_cli, "job", "submit", "--address", f"http://127.0.0.1:{port}", "--working-dir", ".", "--",
                  sys.executable, "examples/ray_quickstart.py"]  # fmt: skip
        run = subprocess.run(submit, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, run.stdout + run.stderr
        assert "equal to the trainer's: True" in run.stdout and "succeeded" in run.stdout + run.stderr
    finally:
        subprocess.run([ray_cli, "stop", "--force"], env=env, capture_output=True, timeout=120)


@pytest.mark.slow
@pytest.mark.vllm
def test_vllm_cpu_example_runs_as_a_script(no_leftovers):
    pytest.importorskip("vllm")
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    run = subprocess.run([sys.executable, "examples/vllm_cpu.py"], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=600)  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "vLLM generates with the pushed weights: True; changed: True" in run.stdout
