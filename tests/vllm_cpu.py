"""The guard of every test module that drives vLLM's CPU build: import it first, at module level."""

from __future__ import annotations

import pytest


def require_vllm_cpu():
    """Skip the calling module unless Ray, vLLM's CPU build and transformers are installed; returns ``ray``."""
    ray = pytest.importorskip("ray")
    pytest.importorskip("vllm")
    pytest.importorskip("transformers")
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        pytest.skip(
            "these tests drive vLLM's CPU build (engines tuned for a CPU, in actors without a GPU)",
            allow_module_level=True,
        )
    return ray
