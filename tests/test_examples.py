"""The examples run as a user runs them."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("ray")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _env(private_tmp: str, **extra: str) -> dict[str, str]:
    """The environment a script runs in: Ray's files (sessions, sockets, the address of the cluster that
    `ray start` made) in this test's own temp dir, so that no other Ray on the machine sees them or is seen."""
    return os.environ | {"TMPDIR": private_tmp, "RAY_TMPDIR": private_tmp, **extra}


@pytest.mark.slow
def test_ray_quickstart_runs_as_a_script(private_tmp):
    # RAY_ADDRESS=local: the script's ray.init() starts a Ray of its own, never joins a running one
    run = subprocess.run(
        [sys.executable, "examples/ray_quickstart.py"],
        cwd=ROOT,
        capture_output=True,
        env=_env(private_tmp, RAY_ADDRESS="local"),
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert "engine weights changed: True; equal to the trainer's: True" in run.stdout


@pytest.mark.slow
def test_ray_quickstart_runs_under_ray_job_submit(private_tmp):
    pytest.importorskip("ray.dashboard.modules.job.sdk")
    # the head's dashboard and job agent need ray[default]'s packages (a bare Ray imports the SDK above, but its
    # dashboard never serves: seen on the GPU image, whose Ray is installed without them)
    pytest.importorskip(
        "aiohttp_cors", reason="`ray job submit` needs ray[default] (its dashboard's packages)"
    )
    import socket

    with socket.socket() as s, socket.socket() as a:
        s.bind(("127.0.0.1", 0))
        a.bind(("127.0.0.1", 0))
        port, agent_port = s.getsockname()[1], a.getsockname()[1]
    env = {k: v for k, v in _env(private_tmp, RAY_AUTH_MODE="disabled").items() if k != "RAY_ADDRESS"}
    # the `ray` CLI of this interpreter's Ray, wherever pip put its script (a venv's bin/, or a --target dir)
    ray_cli = [sys.executable, "-m", "ray.scripts.scripts"]
    # the job agent's HTTP port is 52365 unless given: another Ray on the machine (an earlier test's) may hold it,
    # and then no agent ever serves this head ("No available agent"), so it gets a free port of its own.
    # --block: the head's processes are this command's children, and stop with it (`ray stop` would stop
    # every Ray on the machine, other tests' included)
    start = [
        *ray_cli,
        "start",
        "--head",
        "--block",
        "--num-cpus=2",
        "--include-dashboard=true",
        f"--dashboard-port={port}",
        f"--dashboard-agent-listen-port={agent_port}",
        "--port=0",
        "--disable-usage-stats",
    ]
    head = subprocess.Popen(
        start, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        said: list[str] = []
        assert _started(head, said).wait(120) and head.poll() is None, "".join(said)
        submit = [
            *ray_cli,
            "job",
            "submit",
            "--address",
            f"http://127.0.0.1:{port}",
            "--working-dir",
            ".",
            "--",
            sys.executable,
            "examples/ray_quickstart.py",
        ]
        run = _submit_when_the_agent_is_up(submit, env)
        assert run.returncode == 0, run.stdout + run.stderr
        assert "equal to the trainer's: True" in run.stdout and "succeeded" in run.stdout + run.stderr
    finally:
        _stop(head)


def _submit_when_the_agent_is_up(submit: list[str], env: dict, deadline_s: float = 300.0):
    """`ray start` says its head runs before the head's job agent serves: until it does, a submit is refused at
    once with "No available agent" (nothing was run). Submit again while it says so, up to a deadline (a loaded
    2-core machine took over 120 s once)."""
    import time

    deadline = time.monotonic() + deadline_s
    while True:
        run = subprocess.run(submit, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
        if "No available agent" not in run.stdout + run.stderr or time.monotonic() > deadline:
            return run
        time.sleep(1.0)  # between two polls of the agent's readiness, bounded by the deadline


def _started(head: subprocess.Popen, said: list[str]):
    """An event set once `ray start --block` says its head runs (or once it ended: then ``said`` tells why).
    A thread reads what the command says to the end, into ``said``, so that it never blocks on a full pipe."""
    import threading

    started = threading.Event()

    def read() -> None:
        for line in head.stdout:
            said.append(line)
            if "Ray runtime started." in line:
                started.set()
        started.set()

    threading.Thread(target=read, daemon=True).start()
    return started


def _stop(head: subprocess.Popen) -> None:
    """SIGTERM to `ray start --block`: it stops the processes it started and exits; whatever is still in its
    session after that (a job's processes) is killed."""
    import signal

    head.terminate()
    try:
        head.wait(timeout=120)
    finally:
        try:
            os.killpg(head.pid, signal.SIGKILL)
        except ProcessLookupError:  # nothing left
            pass
        head.wait(timeout=30)


@pytest.mark.slow
@pytest.mark.vllm
def test_vllm_cpu_example_runs_as_a_script(private_tmp):
    pytest.importorskip("vllm")
    run = subprocess.run(
        [sys.executable, "examples/vllm_cpu.py"],
        cwd=ROOT,
        capture_output=True,
        env=_env(private_tmp, RAY_ADDRESS="local"),
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "vLLM generates with the pushed weights: True; changed: True" in run.stdout
