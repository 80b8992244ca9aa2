"""vLLM's OpenAI-compatible server as a WeightSync receiver (issue 17, item 4).

Engine side, the server started with raysync's worker extension, vLLM's dev endpoints and a key that only the
driver and the server know (hex, e.g. ``secrets.token_hex(32)``):

    RAYSYNC_SERVER_KEY=<key> VLLM_SERVER_DEV_MODE=1 vllm serve MODEL \\
        --worker-extension-cls raysync.engines.vllm.WorkerExtension

Driver side: ``WeightSync([trainer], [ServerEngine("http://host:port", key)], config)``. Each call of the driver
runs as a small Ray task on the server's node (``node_id``, default: where Ray places it), which posts it to
the server; the data plane is the same as for an engine in an actor: the server's workers connect to the
trainer's ring or broadcast group themselves. A push goes: ``/pause?mode=wait`` (running requests finish, new
ones wait), the receive, ``/reset_prefix_cache``, ``/resume`` (Note [a push into a generating engine] in
raysync.engines.vllm_async, whose steps 3-5 these are). A staged push (``push(v, staged=True)``) is refused
before any byte moves: the check that precedes a WeightSync's first staged push gets the server's refusal
(``STAGING_REFUSED``), and the driver raises StageFailed naming the server. Its requests do not come through
raysync, so WeightSync's ``max_version_lag`` has nothing to hold there either.

# Note [a signed call through the server]
# The driver's calls cross HTTP through the dev endpoint ``/collective_rpc`` as one string argument: a
# msgpack body (the endpoint function's name, its plain arguments, a nonce: the time in ns) and its
# HMAC-SHA256 under the key, in hex. Each worker checks the signature with the key it read from
# RAYSYNC_SERVER_KEY, refuses a nonce it has seen or one older than REPLAY_WINDOW_S, and only then decodes
# the body and runs raysync_call (Note [what crosses vLLM's channel] in raysync.engines.vllm). A call without
# the key is refused before anything runs, and a worker started without a key refuses every call. vLLM's own
# dev endpoints (/collective_rpc of its own methods, /sleep, /pause, ...) are not raysync's and are not
# authenticated: a server in dev mode belongs on a private network.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import json
import os
import time
import urllib.request
from collections.abc import Callable
from typing import Any

import msgpack

from raysync.core.errors import BadSignature, ReplayedFrame, SchemaError

KEY_ENV = "RAYSYNC_SERVER_KEY"
STAGING_REFUSED = (
    "vLLM's OpenAI server at {url} (ServerEngine) takes no staged push: push it live (push(version)), or serve "
    "the engine from a Ray actor (VllmEngine over an LLM or AsyncLLM) to stage and flip"
)
REPLAY_WINDOW_S = 300.0
_SEEN = "_raysync_nonces"  # on the worker: {nonce: time seen} within the window


# --- the engine's side -----------------------------------------------------------------------------------------
def open_call(worker: Any, frame: str) -> tuple[str, Any]:
    """The (name, plain args) of a signed call (Note [a signed call through the server]); raises BadSignature,
    ReplayedFrame or SchemaError, touching nothing, when the frame is not one the driver signed just now."""
    key = os.environ.get(KEY_ENV, "")
    if not key:
        raise BadSignature(f"this server was started without {KEY_ENV}: it takes no raysync call")
    try:
        signature, body = frame[:64], bytes.fromhex(frame[64:])
    except ValueError as e:
        raise BadSignature("a raysync call must be hex: a signature, then a body") from e
    if not hmac.compare_digest(signature, _sign(key, body)):
        raise BadSignature("the raysync call is not signed with this server's key")
    try:
        name, args, nonce = msgpack.unpackb(body, raw=False, strict_map_key=False)
    except (ValueError, TypeError, msgpack.UnpackException) as e:
        raise SchemaError(f"a signed raysync call that is not (name, args, nonce): {e}") from e
    now = time.time_ns()
    seen: dict[int, int] = worker.__dict__.setdefault(_SEEN, {})
    for old in [n for n, at in seen.items() if now - at > REPLAY_WINDOW_S * 1e9]:
        del seen[old]
    if nonce in seen or abs(now - nonce) > REPLAY_WINDOW_S * 1e9:
        raise ReplayedFrame(f"a raysync call seen before or older than {REPLAY_WINDOW_S:g}s was refused")
    seen[nonce] = now
    return name, args


def _sign(key: str, body: bytes) -> str:
    return hmac.new(bytes.fromhex(key), body, hashlib.sha256).hexdigest()


def signed_call(key: str, name: str, args: Any) -> str:
    """The frame of one call (Note [a signed call through the server])."""
    body = msgpack.packb([name, args, time.time_ns()], use_bin_type=True)
    return _sign(key, body) + body.hex()


# --- the driver's adapter ----------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class ServerEngine:
    """A vLLM OpenAI-compatible server at ``url`` (started as the module docstring says), for WeightSync's
    ``receivers``. ``node_id``: the Ray node it runs on (the calls run there); ``timeout_s``: the limit of one
    HTTP call (a receive included)."""

    url: str
    key: str
    node_id: str | None = None
    timeout_s: float = 600.0

    def call(self, fn: Callable, args: tuple | dict[int, tuple] = ()) -> Any:
        """Like ActorEndpoint.call; slots are the server's worker ranks. Returns a Ray ObjectRef."""
        import ray

        from raysync.engines.vllm import _FUNCTIONS, _STAGED, to_plain

        if (
            _STAGED.get(fn.__name__) is fn
        ):  # the check before a first staged push gets the refusal, as its answer
            if fn.__name__ != "receiver_stageable":  # never asked: the check refused the push
                raise ValueError(f"{fn.__name__} cannot run in a vLLM server: it takes no staged push")
            return ray.put(
                {s: STAGING_REFUSED.format(url=self.url) for s in (args if isinstance(args, dict) else [0])}
            )
        if _FUNCTIONS.get(fn.__name__) is not fn:
            raise ValueError(f"{fn.__name__} cannot run in a vLLM worker")
        plain = {str(s): to_plain(a) for s, a in args.items()} if isinstance(args, dict) else to_plain(args)
        task = ray.remote(num_cpus=0)(_on_server)
        if self.node_id is not None:
            strategy = ray.util.scheduling_strategies.NodeAffinitySchedulingStrategy(self.node_id, soft=False)
            task = task.options(scheduling_strategy=strategy)
        return task.remote(self, fn.__name__, plain)


def _on_server(server: ServerEngine, name: str, args: Any) -> dict[int, Any]:
    """A Ray task on the server's node: the call over HTTP, around a receive the pause and the cache reset."""
    from raysync.engines.vllm import _replies

    if name == "where":  # the server's workers do not see Ray: they run on this task's node
        import ray

        args = [[ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address()]]
    if name != "receiver_receive":
        return _replies(_rpc(server, name, args))
    _post(server, "/pause?mode=wait&clear_cache=false")
    try:
        replies = _replies(_rpc(server, name, args))
        if any(r.ok and not r.report.skipped for r in replies.values()):
            if not _post(server, "/reset_prefix_cache").get("success"):
                raise RuntimeError(
                    f"the server at {server.url} took the push but did not reset its prefix cache"
                )
        return replies
    finally:
        _post(server, "/resume")


def _rpc(server: ServerEngine, name: str, args: Any) -> list[dict]:
    body = {"method": "raysync_signed_call", "args": [signed_call(server.key, name, args)]}
    body["timeout"] = server.timeout_s
    return _post(server, "/collective_rpc", body)["results"]


def _post(server: ServerEngine, path: str, body: dict | None = None) -> dict:
    request = urllib.request.Request(
        server.url.rstrip("/") + path,
        data=json.dumps(body or {}).encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    with urllib.request.urlopen(request, timeout=server.timeout_s) as response:
        text = response.read()
    return json.loads(text) if text else {}
