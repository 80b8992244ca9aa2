"""The user's tools, run as a user runs them: raysync doctor, raysync bench, the command line."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys

import pytest
import torch

from raysync.tools.cli import main as cli


def test_doctor_reports_this_machine_as_json(capsys):
    """What doctor says, checked against torch and the OS on whatever machine runs it (CPU or GPUs)."""
    assert cli(["doctor", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    st = os.statvfs("/dev/shm")
    assert r["shm"]["size_bytes"] == st.f_blocks * st.f_frsize
    assert r["versions"]["torch"] == torch.__version__
    assert r["transports_built"] == ["cuda_ipc", "shm", "collective"]
    assert ("cuda_ipc" in r["transports_available_here"]) is torch.cuda.is_available()
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    assert [d["uuid"] for d in r["devices"]] == [
        str(torch.cuda.get_device_properties(i).uuid) for i in range(gpus)
    ]
    assert r["cuda_ipc_works"] is False or gpus > 0
    ends = [f"GPU {i}" for i in range(gpus)] or ["CPU"]
    pairs = {(p["sender"], p["receiver"]): p["transport"] for p in r["pairs"]}
    ray_views = {(s, f"{t}, seeing only it (Ray)") for s in ends for t in ends if gpus and s != t}
    assert set(pairs) == {(s, t) for s in ends for t in [*ends, "another node"]} | ray_views  # each once
    for (sender, receiver), transport in pairs.items():
        if receiver == "another node" or (sender, receiver) in ray_views:
            assert transport == "collective"  # NCCL reaches a GPU the receiver cannot see
        elif sender == receiver and r["cuda_ipc_works"]:
            assert transport == "cuda_ipc"  # the same GPU
        elif not r["cuda_ipc_works"]:
            assert transport == "shm"  # a CPU, or GPUs that cannot share memory here


def test_doctor_table_names_the_transport_per_pair(capsys):
    assert cli(["doctor"]) == 0
    out = capsys.readouterr().out
    assert "WeightSync would pick:" in out and "/dev/shm:" in out and "-> another node" in out


def test_doctor_covers_every_node_of_a_ray_cluster(ray_local, capsys):
    import ray

    assert cli(["doctor", "--cluster", "--json"]) == 0
    nodes = json.loads(capsys.readouterr().out)
    assert [n["node_id"] for n in nodes] == [n["NodeID"] for n in ray.nodes() if n["Alive"]]


def test_doctor_joins_an_existing_cluster_as_it_is(ray_local):
    """`raysync doctor --cluster` in a process of its own, pointed at a running cluster (this module's Ray) by
    RAY_ADDRESS, as on a cluster's head: Ray refuses num_cpus / num_gpus from a process that joins a cluster,
    so this fails if doctor passes any."""
    import ray

    env = os.environ | {"RAY_ADDRESS": ray.get_runtime_context().gcs_address}
    run = subprocess.run(
        [sys.executable, "-m", "raysync", "doctor", "--cluster", "--json"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    nodes = json.loads(run.stdout)
    assert [n["node_id"] for n in nodes] == [n["NodeID"] for n in ray.nodes() if n["Alive"]]


def _bench(tmp_path, capsys, device: str, transports: set[str]) -> None:
    """`raysync bench` on ``device`` measures ``transports`` at two bucket sizes, beside a floor, and plots."""
    out_json, out_png = tmp_path / "bench.json", tmp_path / "bench.png"
    argv = [
        "bench",
        "--device",
        device,
        "--layout",
        "qwen2-tiny",
        "--bucket-mb",
        "1",
        "2",
        "--pushes",
        "2",
        "--json",
        str(out_json),
        "--plot",
        str(out_png),
    ]
    assert cli(argv) == 0
    table = capsys.readouterr().out
    result = json.loads(out_json.read_text())
    (layout,) = result["layouts"]
    assert result["device"] == device and layout["layout"] == "qwen2-tiny" and layout["floor"]["gbps"] > 0
    assert {(r["transport"], r["bucket_mb"]) for r in layout["runs"]} == {
        (t, mb) for t in transports for mb in (1, 2)
    }
    assert all(r["gbps"] > 0 and r["median_s"] > 0 for r in layout["runs"])
    assert "floor: one copy per tensor" in table and all(t in table for t in transports)
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_bench_on_the_cpu_measures_shm_and_gloo_with_a_floor_and_a_plot(tmp_path, capsys, no_leftovers):
    """On the CPU (of any machine, GPUs or not): the shm ring and the collective over gloo."""
    _bench(tmp_path, capsys, "cpu", {"shm", "collective"})


@pytest.mark.slow
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_bench_on_a_gpu_measures_cuda_ipc_shm_and_nccl_with_two_gpus(tmp_path, capsys, no_leftovers):
    """On GPU 0: the CUDA IPC ring and the shm ring; the collective (NCCL, GPU 0 -> GPU 1) only with two GPUs."""
    _bench(
        tmp_path,
        capsys,
        "cuda",
        {"cuda_ipc", "shm"} | ({"collective"} if torch.cuda.device_count() >= 2 else set()),
    )


def test_the_command_line_lists_its_commands_and_refuses_unknown_ones():
    run = subprocess.run(
        [sys.executable, "-m", "raysync", "--help"], capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0 and all(c in run.stdout for c in ("demo", "doctor", "bench"))
    run = subprocess.run(
        [sys.executable, "-m", "raysync", "nope"], capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 2 and "unknown command 'nope'" in run.stderr


def test_bench_help_names_the_weightsync_benchmark(capsys):
    with pytest.raises(SystemExit) as stop:
        cli(["bench", "--help"])
    assert stop.value.code == 0 and "--ray" in capsys.readouterr().out
    with pytest.raises(SystemExit) as stop:
        cli(["bench", "--ray", "--help"])
    out = capsys.readouterr().out
    assert stop.value.code == 0 and out.startswith("usage: raysync bench --ray") and "--default-only" in out


@pytest.mark.slow
def test_bench_ray_pushes_through_weightsync_next_to_the_raw_session(private_tmp, tmp_path):
    """`raysync bench --ray` as a user runs it, in a process of its own with a local Ray of its own
    (RAY_ADDRESS=local; Ray's files in this test's temp dir): the default config's row per driver, each with
    WeightSync's pushes and the raw session's, measured in turn in the row, their medians, Ray's share (of the
    medians, and paired push by push), the same JSON printed and written."""
    out = tmp_path / "ws.json"
    argv = ["--device", "cpu", "--layout", "qwen2-tiny", "--pushes", "2", "--default-only", "--out", str(out)]
    env = os.environ | {"TMPDIR": private_tmp, "RAY_TMPDIR": private_tmp, "RAY_ADDRESS": "local"}
    run = subprocess.run(
        [sys.executable, "-m", "raysync", "bench", "--ray", *argv],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    table, printed = run.stdout.rstrip().rsplit("\n", 1)
    result = json.loads(printed)
    assert json.loads(out.read_text()) == result and result["pushes"] == 2
    (layout,) = result["layouts"]
    assert layout["layout"] == "qwen2-tiny" and layout["bytes"] > 0 and layout["floor_one_copy_s"] > 0
    rows = {r["config"]: r for r in layout["rows"]}
    default = "default: SyncConfig()"
    assert list(rows) == [default, f"{default}, compiled graph", f"{default}, ordinary calls"]
    for name, row in rows.items():
        assert row["transport"] == "shm" and row["rounds_went"] == [row["rounds_by"]], name
        assert row["weightsync_median_s"] > 0 and row["raw_median_s"] > 0
        ws, raw = row["weightsync_s"], row["raw_s"]  # interleaved: one raw push beside each WeightSync push
        assert len(ws) == len(raw) == 2 and row["weightsync_median_s"] == statistics.median(ws)
        assert row["raw_median_s"] == statistics.median(raw) and row["raw_min_s"] == min(raw)
        assert row["ray_share_s"] == row["weightsync_median_s"] - row["raw_median_s"]
        assert row["ray_share_paired_s"] == statistics.median(w - r for w, r in zip(ws, raw, strict=True))
        assert row["breakdown_ms"]["total"] > 0 and row["breakdown_ms"]["session"] > 0
    assert "loop: driver until the first go sent" in rows[default]["breakdown_ms"]
    assert (
        "WeightSync ms" in table
        and "paired" in table
        and f"{default:<42}shm" in table
        and "wall time:" in table
    )
