"""The user's tools, run as a user runs them: raysync doctor, raysync bench, the command line."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from raysync.cli import main as cli


def test_doctor_reports_this_machine_as_json(capsys):
    assert cli(["doctor", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    st = os.statvfs("/dev/shm")
    assert r["shm"]["size_bytes"] == st.f_blocks * st.f_frsize
    assert r["versions"]["torch"] == torch.__version__
    assert r["transports_built"] == ["cuda_ipc", "shm", "collective"]
    if not torch.cuda.is_available():
        assert r["devices"] == [] and r["cuda_ipc_works"] is False
        assert {(p["receiver"], p["transport"]) for p in r["pairs"]} == {
            ("CPU", "shm"),
            ("another node", "collective"),
        }


def test_doctor_table_names_the_transport_per_pair(capsys):
    assert cli(["doctor"]) == 0
    out = capsys.readouterr().out
    assert "WeightSync would pick:" in out and "/dev/shm:" in out and "-> another node" in out


def test_doctor_covers_every_node_of_a_ray_cluster(ray_local, capsys):
    import ray

    assert cli(["doctor", "--cluster", "--json"]) == 0
    nodes = json.loads(capsys.readouterr().out)
    assert [n["node_id"] for n in nodes] == [n["NodeID"] for n in ray.nodes() if n["Alive"]]


@pytest.mark.slow
def test_bench_measures_every_transport_here_with_a_floor_and_a_plot(tmp_path, capsys, no_leftovers):
    out_json, out_png = tmp_path / "bench.json", tmp_path / "bench.png"
    argv = [
        "bench",
        "--layout",
        "qwen2-tiny",
        "--bucket-mb",
        "1",
        "2",
        "--pushes",
        "2",
        "--json",
        str(out_json),
    ]
    assert cli([*argv, "--plot", str(out_png)]) == 0
    table = capsys.readouterr().out
    result = json.loads(out_json.read_text())
    (layout,) = result["layouts"]
    assert layout["layout"] == "qwen2-tiny" and layout["floor"]["gbps"] > 0
    assert {(r["transport"], r["bucket_mb"]) for r in layout["runs"]} == {
        (t, mb) for t in ("shm", "collective") for mb in (1, 2)
    }
    assert all(r["gbps"] > 0 and r["median_s"] > 0 for r in layout["runs"])
    assert "floor: one copy per tensor" in table and "collective" in table
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_command_line_lists_its_commands_and_refuses_unknown_ones():
    run = subprocess.run(
        [sys.executable, "-m", "raysync", "--help"], capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0 and all(c in run.stdout for c in ("demo", "doctor", "bench"))
    run = subprocess.run(
        [sys.executable, "-m", "raysync", "nope"], capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 2 and "unknown command 'nope'" in run.stderr
