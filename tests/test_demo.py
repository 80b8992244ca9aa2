"""The README's first command, for real: a local Ray, a trainer actor, an engine actor, pushes over shm."""

from __future__ import annotations

import re

import pytest

pytest.importorskip("ray")


@pytest.mark.slow
def test_demo_pushes_bit_exact_through_ray_actors(private_tmp, capsys):
    from raysync.tools.demo import main

    assert main(["--engine", "torch", "--engines", "1", "--pushes", "2", "--bucket-mb", "1"]) == 0
    out = capsys.readouterr().out
    assert "engines: 1 x torch module" in out  # it says which engines and which model it used
    described = (
        r"model: (Qwen2ForCausalLM: 4 layers, hidden 256, .*|Sequential \(torch\)), [\d.]+M parameters"
    )
    assert re.search(described, out), out
    assert (
        "engine versions: [2]" in out and "OK: every engine holds the trainer's weights, bit for bit" in out
    )


@pytest.mark.slow
@pytest.mark.vllm
def test_demo_with_vllm_engines_generates_the_trainers_tokens(private_tmp, capsys):
    vllm = pytest.importorskip("vllm")
    from raysync.tools.demo import main

    assert main(["--engine", "vllm", "--engines", "1", "--pushes", "2", "--bucket-mb", "1", "--tied"]) == 0
    out = capsys.readouterr().out
    assert f"engines: 1 x vLLM {vllm.__version__}" in out
    assert (
        "model: Qwen2ForCausalLM: 4 layers, hidden 256, vocab 8192, output head tied to the embedding" in out
    )
    assert "engine versions: [2]" in out and "OK: every engine generates the trainer's tokens" in out
