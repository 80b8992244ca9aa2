from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import shutil
import tempfile
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future

import pytest
import torch

from raysync import SessionSecret, SyncConfig, WeightReceiver, WeightSender
from raysync.core import leftovers


def raysync_shm_entries() -> set[str]:
    """Every raysync-named entry in /dev/shm, whoever made it (tests/test_shm.py compares two of these)."""
    return {n for n in os.listdir("/dev/shm") if n.startswith("raysync-")}


# --- what this test's processes made ---------------------------------------------------------------------------
# Other programs share /dev/shm and the temp dir with a test (other test runs on the machine, vLLM, Ray): a test
# looks only at names its own processes made. raysync's names carry their owner (Note [names that outlive a
# crash] in raysync.core.leftovers): this process, a process under it (Ray's workers, a spawned child), or a child the
# spawn fixture started and that may have been killed since.
_SPAWNED: set[tuple[int, int]] = set()  # (pid, start) of every process the spawn fixture started


def _start_time(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().decode("ascii", "replace").rsplit(")", 1)[-1].split()
    except OSError:
        return None
    return int(fields[19])  # field 22, counted from field 3 (leftovers._STAT_START)


def _tree(root: int) -> set[tuple[int, int]]:
    """``root`` and every process under it now, as (pid, start)."""
    children: dict[int, list[int]] = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                parent = int(f.read().decode("ascii", "replace").rsplit(")", 1)[-1].split()[1])
        except (OSError, IndexError, ValueError):
            continue  # exited meanwhile
        children.setdefault(parent, []).append(int(entry))
    found, todo = set(), [root]
    while todo:
        pid = todo.pop()
        start = _start_time(pid)
        if start is not None:
            found.add((pid, start))
        todo += children.get(pid, [])
    return found


def own_entries(temp_dir: str | None = None) -> set[str]:
    """Paths in /dev/shm and the temp dir (``temp_dir``, default the current one) that raysync named for one of
    this test's processes."""
    ours = _tree(os.getpid()) | _SPAWNED
    found = set()
    for directory in (leftovers.SHM_DIR, temp_dir or tempfile.gettempdir()):
        for name in os.listdir(directory):
            owner = leftovers.owner_of(name)
            if owner is not None and (owner.pid, owner.start) in ours:
                found.add(os.path.join(directory, name))
    return found


def mapping_of(tensor: torch.Tensor) -> tuple[str, int]:
    """What this process maps ``tensor``'s first byte from, as /proc/self/maps says: (path, inode). A ring
    segment: ("/memfd:raysync-... (deleted)", its inode); a file in /dev/shm would show its path there."""
    address = tensor.data_ptr()
    with open("/proc/self/maps") as maps:
        for line in maps:
            span, _, _, _, inode, *path = line.split(maxsplit=5)
            start, end = (int(x, 16) for x in span.split("-"))
            if start <= address < end:
                return (path[0].strip() if path else ""), int(inode)
    raise AssertionError(f"address {address:#x} is in no mapping of this process")


def fds_of_segment(tensor: torch.Tensor) -> list[int]:
    """This process's open fds of the ring segment (a raysync memfd) that ``tensor`` maps: the ring's own fd,
    and the dup that Python's mmap keeps. Found through /proc/self, as any code in the process could."""
    path, inode = mapping_of(tensor)
    assert path.startswith("/memfd:raysync-"), f"not a raysync memfd: {path!r}"
    fds = []
    for name in sorted(os.listdir("/proc/self/fd"), key=int):
        try:
            if os.readlink(f"/proc/self/fd/{name}").startswith("/memfd:raysync-"):
                if os.fstat(int(name)).st_ino == inode:
                    fds.append(int(name))
        except OSError:  # the fd listing itself, or an fd closed meanwhile
            continue
    return fds


@pytest.fixture
def private_tmp(monkeypatch) -> Iterator[str]:
    """A temp dir of its own for this test (children inherit TMPDIR); asserts raysync left nothing in it, nor in
    /dev/shm under the names of this test's processes. Short, because unix socket paths (ours, Ray's) are
    limited to 107 bytes."""
    d = tempfile.mkdtemp(prefix="rs", dir="/tmp")
    monkeypatch.setenv("TMPDIR", str(d))
    monkeypatch.setattr(tempfile, "tempdir", str(d))
    before = own_entries(d)
    yield str(d)
    left = [p for p in os.listdir(d) if p.startswith("raysync-")]
    made = own_entries(d) - before
    shutil.rmtree(d, ignore_errors=True)
    assert left == [] and made == set()


@pytest.fixture
def no_leftovers() -> Iterator[None]:
    """Nothing raysync makes for this test's processes may stay in /dev/shm or the temp dir once it is over."""
    before = own_entries()
    yield
    assert own_entries() - before == set()


@contextlib.contextmanager
def session_pair(config: SyncConfig) -> Iterator[tuple[WeightSender, WeightReceiver]]:
    """A sender and a receiver in this process (drive them from two threads)."""
    secret = SessionSecret.generate()
    with WeightSender(secret, config) as sender, WeightReceiver(sender.endpoint, secret, config) as receiver:
        yield sender, receiver


# --- calls in threads: every outcome is looked at -------------------------------------------------------------
class CollectedFuture(Future):
    """A future that remembers whether the test asked for its outcome (``result`` or ``exception``)."""

    collected = False

    def result(self, timeout: float | None = None):
        self.collected = True
        return super().result(timeout)

    def exception(self, timeout: float | None = None):
        self.collected = True
        return super().exception(timeout)


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item, call):
    """Keep each phase's report on the test item: a fixture's teardown may ask whether the test passed."""
    report = yield
    setattr(item, f"report_{report.when}", report)
    return report


@pytest.fixture
def in_thread(request) -> Iterator[Callable[..., CollectedFuture]]:
    """``in_thread(fn, *args, **kwargs)`` runs the call in a thread of its own and returns its future. The test
    must collect every future's outcome: a call whose result (or error) nobody checks proves nothing. At the end
    every thread must have finished (the sessions it used are closed by then)."""
    calls: list[tuple[threading.Thread, CollectedFuture, str]] = []

    def submit(fn: Callable, *args: object, **kwargs: object) -> CollectedFuture:
        future = CollectedFuture()
        future.set_running_or_notify_cancel()

        def run() -> None:
            try:
                future.set_result(fn(*args, **kwargs))
            except BaseException as e:  # handed to whoever collects the future
                future.set_exception(e)

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        calls.append((thread, future, getattr(fn, "__qualname__", repr(fn))))
        return future

    yield submit
    for thread, _, _ in calls:
        thread.join(timeout=60)
    running = [name for thread, _, name in calls if thread.is_alive()]
    assert not running, f"calls still running at the end of the test: {running}"
    report = getattr(request.node, "report_call", None)
    if report is not None and report.passed:  # a failed test has said what went wrong already
        uncollected = [name for _, future, name in calls if not future.collected]
        assert not uncollected, f"the outcome of these calls was never checked: {uncollected}"


@pytest.fixture
def spawn() -> Iterator[Callable[..., mp.Process]]:
    """Start ``fn(*args)`` in a spawned process; every process still alive at the end is killed."""
    ctx = mp.get_context("spawn")
    procs: list[mp.Process] = []

    def start(fn: Callable, *args: object) -> mp.Process:
        p = ctx.Process(target=fn, args=args, daemon=True)
        p.start()
        started = _start_time(p.pid)
        if started is not None:
            _SPAWNED.add((p.pid, started))
        procs.append(p)
        return p

    start.ctx = ctx  # type: ignore[attr-defined]
    yield start
    for p in procs:
        if p.is_alive():
            p.kill()
        p.join(timeout=10)


def random_tensor(dtype: torch.dtype, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    """Random bits of any dtype (via raw bytes, so fp8, bool and complex work alike)."""
    itemsize = dtype.itemsize
    n = int(torch.Size(shape).numel()) * itemsize
    raw = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen)
    if dtype == torch.bool:
        raw = raw % 2
    return raw.view(dtype).reshape(shape)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(
        a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8)
    )


# --- Ray -----------------------------------------------------------------------------------------------------------
def worker_pythonpath() -> str:
    """PYTHONPATH for Ray's workers: the test helpers (tests/), the checkout's root (raysync itself, where it is
    not installed: the GPU machine runs a checkout) and this process's own PYTHONPATH (packages put there)."""
    here = os.path.dirname(os.path.abspath(__file__))
    return os.pathsep.join(p for p in (here, os.path.dirname(here), os.environ.get("PYTHONPATH")) if p)


def _local_ray(**resources: object) -> Iterator[None]:
    ray = pytest.importorskip("ray")
    path = worker_pythonpath()
    # address="local": always a Ray of this test's own. Without it ray.init joins whatever cluster RAY_ADDRESS or
    # /tmp/ray/ray_current_cluster names (another test's `ray start` or cluster_utils.Cluster on the machine), and
    # refuses num_cpus/num_gpus there ("When connecting to an existing cluster, ... must not be provided").
    ray.init(
        address="local",
        include_dashboard=False,
        logging_level="warning",
        runtime_env={"env_vars": {"PYTHONPATH": path}},
        **resources,
    )
    yield
    ray.shutdown()


@pytest.fixture
def made() -> Iterator[list]:
    """The test's Ray actors (append them), ended with ray.kill when it is over: one that took part in a compiled
    graph is not released by Ray 2.60 when its handles go (Note [a push round in a compiled graph])."""
    import ray

    actors: list = []
    yield actors
    for actor in actors:
        ray.kill(actor)


@pytest.fixture(scope="module")
def ray_local() -> Iterator[None]:
    """A local Ray for this module; the test helpers (tests/) are importable in its workers."""
    yield from _local_ray(num_cpus=2)


@pytest.fixture(scope="module")
def ray_gpu() -> Iterator[None]:
    """A local Ray with this machine's GPUs."""
    yield from _local_ray(num_cpus=4, num_gpus=torch.cuda.device_count())


# --- gloo ----------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="session")
def gloo_warm() -> None:
    """One push of the tiny model through a gloo group of two processes, with a long timeout_s, before the tests
    that give their ranks a short one (they test what a rank that dies leaves behind, and so wait it out). The
    first group on a cold machine took over 5 s to broadcast (an H200 host); later ones take well under one."""
    pytest.importorskip("transformers")
    from workers import collective_receiver, digest

    from raysync.tools.models import tiny_qwen2
    from raysync.transport.collective import CollectiveSender

    config = SyncConfig(bucket_bytes=64 << 10, timeout_s=120, progress=False)
    ctx = mp.get_context("spawn")
    secret, out = SessionSecret.generate(), ctx.Queue()
    group = CollectiveSender(secret, config, host="127.0.0.1", num_receivers=1, backend="gloo")
    child = ctx.Process(
        target=collective_receiver, args=(secret, config, 1, group.rendezvous, 1, out), daemon=True
    )
    child.start()
    try:
        model = tiny_qwen2(seed=0)
        group.join().push(model.named_parameters(), 1)
        assert out.get(timeout=120) == (1, "ok", (1, digest(model.named_parameters())))
    finally:
        group.close()
        child.join(timeout=30)
        if child.is_alive():
            child.kill()
            child.join(timeout=10)
