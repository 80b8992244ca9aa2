"""vLLM's OpenAI-compatible server (the CPU build), started as a subprocess on a free port, takes pushes from a
trainer through WeightSync and then answers over HTTP with the trainer's tokens; a raysync call without the
server's key, or one replayed, is refused (Note [a signed call through the server] in
raysync.engines.vllm_server)."""

from __future__ import annotations

import collections
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import pytest
from vllm_cpu import EngineProcesses, require_vllm_cpu

ray = require_vllm_cpu()

from actors import Policy  # noqa: E402
from test_vllm import CFG, PROMPTS, TOKENS  # noqa: E402

from raysync import WeightSync  # noqa: E402
from raysync.engines.vllm_server import ServerEngine, signed_call  # noqa: E402
from raysync.tools.models import tiny_qwen2  # noqa: E402

pytestmark = pytest.mark.vllm

START_S = 600  # a bound on the server's start on a loaded 2-core machine


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerOutput:
    """What the server prints, read line by line on a thread from its start (a full pipe would stall it): the
    last lines, and ``wait(marker)`` until a line holds ``marker`` (or the server ends, or the time is up)."""

    def __init__(self, process: subprocess.Popen, markers: tuple[str, ...]):
        self.lines: collections.deque[str] = collections.deque(maxlen=80)
        self._seen = {m: threading.Event() for m in markers}
        self._ended = threading.Event()
        self.thread = threading.Thread(target=self._read, args=(process,), daemon=True)
        self.thread.start()

    def _read(self, process: subprocess.Popen) -> None:
        for line in process.stdout:
            self.lines.append(line)
            for marker, seen in self._seen.items():
                if marker in line:
                    seen.set()
        self._ended.set()
        for seen in self._seen.values():  # wake whoever waits: the server ended
            seen.set()

    def wait(self, marker: str, timeout_s: float) -> None:
        if not self._seen[marker].wait(timeout_s) or self._ended.is_set():
            said = "".join(self.lines)
            raise AssertionError(f"the vLLM server did not say {marker!r} within {timeout_s}s:\n{said}")

    def wait_listening(self, port: int, timeout_s: float) -> None:
        """uvicorn says "Application startup complete" just before it listens on the socket vLLM bound (it then
        logs nothing more): try to connect until it takes the connection, every 20 ms, at most ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=timeout_s).close()
                return
            except ConnectionRefusedError:
                if self._ended.wait(0.02) or time.monotonic() > deadline:  # wakes at once if the server ended
                    said = "".join(self.lines)
                    raise AssertionError(
                        f"the vLLM server did not listen within {timeout_s}s:\n{said}"
                    ) from None


@pytest.fixture
def server(tmp_path):
    """A vLLM OpenAI server with raysync's extension, vLLM's dev endpoints and a key: (url, key, model dir).
    At the end it is stopped, and nothing raysync made in its processes may be left (vllm_cpu.EngineProcesses)."""
    model_dir = str(tmp_path / "tiny-qwen2")
    tiny_qwen2(seed=1).save_pretrained(model_dir)
    port, key = free_port(), secrets.token_hex(32)
    env = {**os.environ, "RAYSYNC_SERVER_KEY": key, "VLLM_SERVER_DEV_MODE": "1"}
    args = [
        "--model",
        model_dir,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--skip-tokenizer-init",
        "--worker-extension-cls",
        "raysync.engines.vllm.WorkerExtension",
        "--dtype",
        "float32",
        "--max-model-len",
        "160",
        "--max-num-seqs",
        "4",
        "--max-num-batched-tokens",
        "256",
        "--kv-cache-memory-bytes",
        str(32 << 20),
        "--block-size",
        "32",
        "--enforce-eager",
        "--enable-prefix-caching",
    ]
    process = subprocess.Popen(
        [sys.executable, "-m", "vllm.entrypoints.openai.api_server", *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    output, processes = ServerOutput(process, ("Application startup complete",)), EngineProcesses()
    try:
        output.wait("Application startup complete", START_S)
        output.wait_listening(port, 60)
        processes.look(process.pid)
        yield f"http://127.0.0.1:{port}", key, model_dir
    finally:
        processes.look(process.pid)
        ended = process.poll()
        if ended is not None:
            sys.stderr.write(
                f"the vLLM server ended by itself (code {ended}); it said last:\n{''.join(output.lines)}"
            )
        try:
            os.killpg(process.pid, signal.SIGTERM)  # the server and its EngineCore (its own session)
        except ProcessLookupError:  # the whole session had ended already
            pass
        process.wait(timeout=120)
        output.thread.join(timeout=30)
    processes.clean_up_and_check()


def post(url: str, path: str, body: dict) -> dict:
    request = urllib.request.Request(
        url + path,
        data=json.dumps(body).encode(),
        method="POST",
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=300) as response:
        return json.loads(response.read())


def completions(url: str, model: str) -> list[list[int]]:
    """Greedy tokens for PROMPTS, asked over HTTP as any client of the server would."""
    out = []
    for prompt in PROMPTS:
        body = {
            "model": model,
            "prompt": prompt,
            "max_tokens": TOKENS,
            "min_tokens": TOKENS,
            "temperature": 0,
            "return_token_ids": True,
        }
        out.append(post(url, "/v1/completions", body)["choices"][0]["token_ids"])
    return out


def refused(url: str, body: dict) -> str:
    """The server answers ``body`` on /collective_rpc with an error; its text."""
    with pytest.raises(urllib.error.HTTPError) as failed:
        post(url, "/collective_rpc", body)
    return failed.value.read().decode(errors="replace")


def test_the_openai_server_takes_pushes_and_refuses_calls_without_its_key(ray_local, server, no_leftovers):
    url, key, model_dir = server
    trainer = ray.remote(num_cpus=0.25)(Policy).remote(seed=12)
    start = completions(url, model_dir)
    with WeightSync([trainer], [ServerEngine(url, key)], CFG) as sync:
        for version in (1, 2):
            ray.get(trainer.step.remote(version))
            assert sync.push(version).pairs[0].bytes > 0
            assert completions(url, model_dir) == ray.get(trainer.greedy.remote(PROMPTS, TOKENS))
        assert sync.versions() == [2] and sync.push(2).pairs[0].bytes == 0
        pushed = completions(url, model_dir)
        assert pushed != start
        other_key = signed_call(secrets.token_hex(32), "receiver_version", ["no-session"])
        texts = [
            refused(url, {"method": "raysync_signed_call", "args": [other_key]}),
            refused(url, {"method": "raysync_signed_call", "args": ["00" * 40]}),  # no signature at all
            refused(url, {"method": "raysync_call", "args": ["receiver_version", "[]"]}),  # around the key
        ]
        unsigned = "the raysync call is not signed with this server"
        assert unsigned in texts[0] and unsigned in texts[1] and "takes a list or a dict" in texts[2], texts
        frame = signed_call(key, "receiver_version", ["no-session"])
        assert post(url, "/collective_rpc", {"method": "raysync_signed_call", "args": [frame]})["results"]
        text = refused(url, {"method": "raysync_signed_call", "args": [frame]})  # the same frame again
        assert "seen before" in text, text
        assert sync.versions() == [2]
    assert completions(url, model_dir) == pushed
