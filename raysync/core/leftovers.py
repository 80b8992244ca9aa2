"""Names that say which process made them, so that what a SIGKILLed raysync process left is found and removed.

# Note [names that outlive a crash]
# Every entry raysync makes in a directory other processes share (the private directories of the control
# socket and of the shm ring's fd handoff socket, in the temp dir; shm segments in /dev/shm, made by raysync
# before its rings were memfds, which have no name) is named
#
#     raysync-<pid>-<start>-<pidns>-<random>
#     pid     the process that made it
#     start   when that process started (clock ticks since boot, /proc/<pid>/stat field 22): a pid reused by
#             another process does not keep a dead owner's entries alive
#     pidns   the inode of the owner's pid namespace: a process in another namespace (another container that
#             shares /dev/shm) has pids this one cannot look up, so its entries are never judged here
#     random  unguessable (nobody can open or pre-create the name)
#
# A raysync process removes its own entries on every path it survives (close, errors); a SIGKILL gives it no
# chance. So ``sweep`` runs whenever a sender, a receiver or a shm ring is made: it removes the entries of this
# naming scheme, owned by this user, whose owner is dead (no such pid, a zombie, or a pid that started at
# another time). A live owner's entries, other users' and other naming schemes' files are never touched.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import stat
import tempfile
from dataclasses import dataclass

logger = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
PREFIX = "raysync"
OWNED = re.compile(
    rf"{PREFIX}-(?P<pid>[0-9]{{1,10}})-(?P<start>[0-9]{{1,20}})-(?P<ns>[0-9]{{1,20}})-[0-9a-z_]{{8,64}}"
)
_STAT_START = 19  # /proc/<pid>/stat field 22 (starttime), counted from field 3 (state), after the ")"


@dataclass(frozen=True)
class Owner:
    pid: int
    start: int  # 0: unknown (no /proc)
    ns: int  # 0: unknown


def _stat_fields(pid: int) -> list[str] | None:
    """/proc/<pid>/stat from field 3 on (the command name, field 2, may hold spaces and parentheses)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            text = f.read().decode("ascii", "replace")
    except OSError:
        return None
    return text.rsplit(")", 1)[-1].split()


def _pid_namespace() -> int:
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def this_process() -> Owner:
    """This process as an owner (read each time: a forked child is another owner)."""
    pid = os.getpid()
    fields = _stat_fields(pid)
    start = int(fields[_STAT_START]) if fields and len(fields) > _STAT_START else 0
    return Owner(pid, start, _pid_namespace())


def owner_tag() -> str:
    """``raysync-<pid>-<start>-<pidns>``: the start of every shared name this process makes."""
    me = this_process()
    return f"{PREFIX}-{me.pid}-{me.start}-{me.ns}"


def owner_of(name: str) -> Owner | None:
    """The owner a name of this scheme carries; None for any other name."""
    m = OWNED.fullmatch(name)
    return Owner(int(m["pid"]), int(m["start"]), int(m["ns"])) if m else None


def is_dead(owner: Owner) -> bool:
    """Surely dead: judged only within this pid namespace, and a process we cannot inspect counts as alive."""
    if owner.ns == 0 or owner.ns != _pid_namespace():
        return False
    try:
        os.kill(owner.pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # the pid is another user's process now: its start time says whether it is ours
        pass
    fields = _stat_fields(owner.pid)
    if fields is None or len(fields) <= _STAT_START:
        return False
    if fields[0] in ("Z", "X"):  # a zombie runs no code: it will never use or remove its entries
        return True
    return owner.start != 0 and int(fields[_STAT_START]) != owner.start  # the pid was reused


def sweep(directory: str) -> list[str]:
    """Remove the entries of this naming scheme in ``directory`` whose owner is dead; returns their paths."""
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    removed = []
    for name in names:
        owner = owner_of(name)
        if owner is None or not is_dead(owner):
            continue
        path = os.path.join(directory, name)
        if _remove_if_ours(path):
            removed.append(path)
    if removed:
        logger.info("removed %d entries left by dead raysync processes: %s", len(removed), ", ".join(removed))
    return removed


def _remove_if_ours(path: str) -> bool:
    try:
        st = os.lstat(path)
        if st.st_uid != os.geteuid():
            return False
        if stat.S_ISDIR(st.st_mode):  # a control socket's private directory (never a link: lstat)
            shutil.rmtree(path)
        else:
            os.unlink(path)
        return True
    except FileNotFoundError:  # another process swept it first
        return False
    except OSError as e:
        logger.debug("could not remove %s: %s", path, e)
        return False


def sweep_shared_dirs(temp_base: str | None = None) -> list[str]:
    """Sweep the directory where private socket directories are made, and /dev/shm (older raysync's segments)."""
    removed = sweep(SHM_DIR)
    return removed + sweep(temp_base or tempfile.gettempdir())
