"""Shared-memory segments of the sample store: naming, mapping, ownership and cleanup.

A segment is a file in ``/dev/shm`` named::

    flowrl-<run_id>-<owner pid>-<owner start>-<writer pid>-<seq>[.tmp|.pool]

*owner* is the node's store process (it owns the capacity and frees segments); *owner start* is
its start time in clock ticks since boot, so a recycled pid never makes a dead owner look alive.
*writer* is the process that filled the segment. A segment is written under its ``.tmp`` (fresh)
or ``.pool`` (recycled) name and renamed to its plain name only when complete: a plain name
always denotes a complete buffer, and handles only ever name plain segments.

Guarantees:
- names of one store never collide with another store's (owner pid + start) nor with another
  run's; names are parsed from the right, so run ids may contain ``-``;
- `sweep` removes segments whose owner is dead and the run directories (``/tmp/flowrl-<run_id>``)
  of runs that have no live owner left, and empty unmarked ones past a grace period (what a run
  killed while starting leaves); it never removes anything a live owner holds, nor anything
  another user owns.
- `check_room` refuses a capacity the shared-memory filesystem cannot hold, naming it and its
  free space: a tmpfs past its size raises SIGBUS in whoever touches the page, long after start.

Readers map segments copy-on-write (`map_private`): zero-copy reads, and a reader that writes
into its view can never corrupt the shared buffer. Writers map them shared and pre-faulted.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import re
import shutil
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from transport import endpoints
from transport.errors import SharedMemoryTooSmall

SHM_DIR = Path("/dev/shm")
RUN_DIR_BASE = Path("/tmp")
PREFIX = "flowrl-"
PAGE = mmap.PAGESIZE

# Run ids as `transport.endpoints` accepts them. They may contain "-": a name is parsed from the
# right (four numbers, then the run id), and a run's segments are found by parsing, never by
# prefix alone ("flowrl-a-1-2-" also begins the names of run "a-1-2").
_RUN_ID = re.compile(r"[A-Za-z0-9_.-]{1,48}")
_SEGMENT = re.compile(
    r"flowrl-(?P<run>[A-Za-z0-9_.-]{1,48})-(?P<opid>\d{1,10})-(?P<ostart>\d{1,20})"
    r"-(?P<wpid>\d{1,10})-(?P<seq>\d{1,20})(?:\.(?P<state>tmp|pool))?"
)
_MARKER = re.compile(r"owner-(?P<pid>\d{1,10})-(?P<start>\d{1,20})")


def check_run_id(run_id: str) -> str:
    """Return `run_id` if it is a valid run id (1-48 of ``[A-Za-z0-9_.-]``); else raise."""
    if not _RUN_ID.fullmatch(run_id) or run_id in {".", ".."}:
        raise ValueError(f"invalid run id {run_id!r}: use 1-48 of [A-Za-z0-9_.-]")
    return run_id


def process_start(pid: int) -> int | None:
    """Start time of `pid` in clock ticks since boot, or None if it is not running."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return None
    # The command name (field 2) may contain spaces and parentheses: parse after the last ')'.
    fields = stat[stat.rindex(b")") + 2 :].split()
    if fields[0] in (b"Z", b"X"):  # a zombie has exited; only its parent has not reaped it yet
        return None
    return int(fields[19])


@dataclass(frozen=True, slots=True)
class Owner:
    """A process identity that survives pid reuse: (pid, start time)."""

    pid: int
    start: int

    @classmethod
    def current(cls) -> Owner:
        start = process_start(os.getpid())
        assert start is not None, "/proc/self/stat must be readable"
        return cls(os.getpid(), start)

    def alive(self) -> bool:
        return process_start(self.pid) == self.start


@dataclass(frozen=True, slots=True)
class SegmentName:
    """The parsed name of a segment."""

    run_id: str
    owner: Owner
    writer: int
    seq: int
    state: str = ""  # "" (published), "tmp" (being written) or "pool" (free, kept for reuse)

    def __str__(self) -> str:
        base = f"{owner_prefix(self.run_id, self.owner)}{self.writer}-{self.seq}"
        return f"{base}.{self.state}" if self.state else base

    @classmethod
    def parse(cls, name: str) -> SegmentName | None:
        m = _SEGMENT.fullmatch(name)
        if m is None:
            return None
        owner = Owner(int(m["opid"]), int(m["ostart"]))
        return cls(m["run"], owner, int(m["wpid"]), int(m["seq"]), m["state"] or "")


def owner_prefix(run_id: str, owner: Owner) -> str:
    """The name prefix shared by every segment of one store."""
    return f"{PREFIX}{run_id}-{owner.pid}-{owner.start}-"


def path_of(name: str) -> str:
    if "/" in name or not name.startswith(PREFIX):
        raise ValueError(f"not a segment name: {name!r}")
    return f"{SHM_DIR}/{name}"


def round_size(nbytes: int) -> int:
    """Bytes a segment of `nbytes` occupies: whole pages, at least one."""
    return max(PAGE, -(-nbytes // PAGE) * PAGE)


def create(name: str, size: int) -> mmap.mmap:
    """Create segment `name` of `size` bytes (exclusive) and map it shared, pages pre-faulted."""
    fd = os.open(path_of(name), os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_CLOEXEC, 0o600)
    try:
        os.ftruncate(fd, size)
        return mmap.mmap(fd, size, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
    except BaseException:
        unlink(name)
        raise
    finally:
        os.close(fd)


def map_shared(name: str) -> mmap.mmap:
    """Map an existing segment shared and writable, pages pre-faulted (for rewriting it)."""
    fd = os.open(path_of(name), os.O_RDWR | os.O_CLOEXEC)
    try:
        return mmap.mmap(fd, 0, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
    finally:
        os.close(fd)


def map_private(name: str) -> mmap.mmap:
    """Map an existing segment copy-on-write: zero-copy reads; writes stay private."""
    fd = os.open(path_of(name), os.O_RDONLY | os.O_CLOEXEC)
    try:
        return mmap.mmap(fd, 0, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)


def map_readonly(name: str) -> mmap.mmap:
    """Map an existing segment shared and read-only: reads see the segment's current bytes
    (a recycled segment's new contents too); a write through it is a segfault, never a
    silent divergence of this process's copy."""
    fd = os.open(path_of(name), os.O_RDONLY | os.O_CLOEXEC)
    try:
        return mmap.mmap(fd, 0, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
    finally:
        os.close(fd)


def free_bytes(directory: Path = SHM_DIR) -> int:
    """Bytes an unprivileged process may still write to the filesystem of `directory`."""
    st = os.statvfs(directory)
    return st.f_bavail * st.f_frsize


def check_room(capacity: int, directory: Path = SHM_DIR) -> None:
    """Raise `SharedMemoryTooSmall` when `directory` (the shared-memory filesystem) has less
    than `capacity` bytes free."""
    free = free_bytes(directory)
    if capacity > free:
        raise SharedMemoryTooSmall(
            f"{directory} has {_mib(free)} free, less than the store's capacity of "
            f"{_mib(capacity)}: workers would die of SIGBUS once the store fills. Lower the "
            f"store's capacity, or give {directory} more room (a container's --shm-size)")


def _mib(nbytes: int) -> str:
    return f"{nbytes / (1 << 20):.1f} MiB"


def size_of(name: str) -> int:
    return os.stat(path_of(name)).st_size


def rename(src: str, dst: str) -> None:
    os.rename(path_of(src), path_of(dst))


def unlink(name: str) -> bool:
    """Remove segment `name`; False if it was already gone. Existing mappings stay valid."""
    try:
        os.unlink(path_of(name))
    except FileNotFoundError:
        return False
    return True


def list_segments(prefix: str = PREFIX) -> list[str]:
    """Names of the files in /dev/shm that start with `prefix`."""
    try:
        return [n for n in os.listdir(SHM_DIR) if n.startswith(prefix)]
    except FileNotFoundError:
        return []


def segments_of(run_id: str, owner: Owner | None = None, writer: int | None = None) -> list[str]:
    """Names of the segments of `run_id` (of one `owner`, written by one `writer`, if given)."""
    prefix = f"{PREFIX}{run_id}-" if owner is None else owner_prefix(run_id, owner)
    if owner is not None and writer is not None:
        prefix = f"{prefix}{writer}-"
    out = []
    for name in list_segments(prefix):
        parsed = SegmentName.parse(name)
        if (
            parsed is not None
            and parsed.run_id == run_id
            and (owner is None or parsed.owner == owner)
            and (writer is None or parsed.writer == writer)
        ):
            out.append(name)
    return out


# ---------------------------------------------------------------------------------------------
# Run directories and their owners


def run_dir_path(run_id: str) -> Path:
    return RUN_DIR_BASE / f"{PREFIX}{check_run_id(run_id)}"


def claim_run_dir(run_id: str, owner: Owner | None = None) -> Path:
    """Create the run directory (0700) if needed and mark `owner` (default: this process) in it.

    A run directory with a live marked owner is never swept.
    """
    owner = owner or Owner.current()
    path = endpoints.run_dir(check_run_id(run_id))
    (path / f"owner-{owner.pid}-{owner.start}").touch()
    return path


def release_run_dir(run_id: str, owner: Owner | None = None) -> None:
    """Remove `owner`'s marker; remove the directory too if nothing else is left in it."""
    owner = owner or Owner.current()
    path = run_dir_path(run_id)
    with contextlib.suppress(FileNotFoundError):
        (path / f"owner-{owner.pid}-{owner.start}").unlink()
    with contextlib.suppress(OSError):
        path.rmdir()  # only succeeds when empty


def _mine(path: Path) -> bool:
    try:
        return path.lstat().st_uid == os.getuid()
    except OSError:
        return False


def _bound_unix_paths() -> list[str]:
    """Paths of the unix sockets bound in this network namespace."""
    try:
        lines = Path("/proc/net/unix").read_text().splitlines()[1:]
    except OSError:
        return []
    return [parts[7] for parts in (line.split() for line in lines) if len(parts) >= 8]


def _run_dir_state(path: Path, sockets: Iterable[str]) -> tuple[bool, bool]:
    """(marked, alive) for a run directory: any owner marker at all, any live owner or socket."""
    marked = alive = False
    with contextlib.suppress(OSError):
        for entry in path.iterdir():
            m = _MARKER.fullmatch(entry.name)
            if m is not None:
                marked = True
                alive = alive or Owner(int(m["pid"]), int(m["start"])).alive()
    prefix = f"{path}/"
    alive = alive or any(s.startswith(prefix) for s in sockets)
    return marked, alive


def sweep(*, unowned: bool = False, run_id: str | None = None, grace_s: float = 30.0) -> list[str]:
    """Remove what dead runs left behind; return the removed paths.

    Always: segments whose owner process is dead, run directories whose owner markers all
    name dead processes (with no segment of a live owner and no bound socket inside), and
    empty unmarked run directories older than `grace_s` (a run that is starting up has not
    marked its directory yet; one killed then leaves it empty, and an empty directory holds
    nothing anyone uses).
    With `unowned`: also ``flowrl-*`` segments whose names carry no owner (no store wrote
    them), and unmarked run directories with nothing live inside that are older than `grace_s`.
    With `run_id`: only that run's segments and directory.
    """
    removed: list[str] = []
    live_runs: set[str] = set()
    prefix = PREFIX if run_id is None else f"{PREFIX}{check_run_id(run_id)}-"
    for name in list_segments(prefix):
        parsed = SegmentName.parse(name)
        if run_id is not None and parsed is not None and parsed.run_id != run_id:
            continue  # another run whose id starts with "<run_id>-"
        if parsed is None:
            if unowned and _mine(SHM_DIR / name) and unlink(name):
                removed.append(f"{SHM_DIR}/{name}")
            continue
        if parsed.owner.alive():
            live_runs.add(parsed.run_id)
        elif _mine(SHM_DIR / name) and unlink(name):
            removed.append(f"{SHM_DIR}/{name}")
    if run_id is not None:
        dirs = [run_dir_path(run_id)]
    else:
        try:
            dirs = [p for p in RUN_DIR_BASE.iterdir() if p.name.startswith(PREFIX)]
        except OSError:
            dirs = []
    sockets = _bound_unix_paths()
    now = time.time()
    for path in dirs:
        if path.is_symlink() or not path.is_dir() or path.name[len(PREFIX) :] in live_runs:
            continue
        if not _mine(path):
            continue
        marked, alive = _run_dir_state(path, sockets)
        if alive:
            continue
        if not marked:
            with contextlib.suppress(OSError):
                if now - path.stat().st_mtime < grace_s:
                    continue
            if not unowned:
                # rmdir, not rmtree: whatever appeared inside meanwhile is spared with it
                with contextlib.suppress(OSError):
                    path.rmdir()
                    removed.append(str(path))
                continue
        shutil.rmtree(path, ignore_errors=True)
        if not path.exists():
            removed.append(str(path))
    return removed
