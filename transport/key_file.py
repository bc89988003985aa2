"""A run's key file: the file a controller writes its run's curve keys to, for node agents
started by hand, held for the run's lifetime.

Guarantees:
- The file holds the keys of the run that holds it, mode 0600, owned by this user (a symlink
  is refused). A run with the same path after this one ends, or after it died (even killed),
  just writes its own keys there: the hold is an exclusive `flock` on the file, which the
  kernel drops when the holder's process ends.
- While one run holds the file, another that names it is refused (`KeyFileInUse`), so the
  keys agents read are never changed under a live run.
- `release` removes the file (agents started after the run find no stale keys) and then drops
  the hold.
- A reader never sees another run's keys once `hold` returns; while it writes (in place: the
  hold is on the file itself), a reader may see a short file, which `CurveKeys.load` refuses.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from pathlib import Path

from transport.curve import CurveKeys
from transport.errors import TransportError

__all__ = ["HeldKeyFile", "KeyFileInUse", "hold"]

# Tries to open a file that is being removed by the run before (it holds it until removed).
_TRIES = 10


class KeyFileInUse(TransportError):
    """Another live run holds the key file."""


class HeldKeyFile:
    """A key file this process holds; `release` once the run ends."""

    def __init__(self, path: Path, fd: int) -> None:
        self.path = path
        self._fd = fd

    def release(self) -> None:
        """Remove the file, if it is still the one held, and drop the hold."""
        if self._fd < 0:
            return
        try:
            if _same_file(self.path, self._fd):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self.path)
        finally:
            os.close(self._fd)
            self._fd = -1


def hold(keys: CurveKeys, path: str | os.PathLike[str]) -> HeldKeyFile:
    """Write `keys` to `path` (created, or replacing the keys of a run that has ended) and hold
    it until `release`. KeyFileInUse while a live run holds it; PermissionError when it belongs
    to another user; OSError when it cannot be written."""
    target = Path(path)
    for _ in range(_TRIES):
        fd = os.open(target, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise KeyFileInUse(
                    f"{target} holds the keys of a run that is still running (its controller "
                    "holds the file); give this run another key file") from None
            if not _same_file(target, fd):
                os.close(fd)  # its run removed it between our open and our lock: open anew
                continue
            if os.fstat(fd).st_uid != os.getuid():
                raise PermissionError(f"{target} belongs to another user")
            os.fchmod(fd, 0o600)  # before the keys go in: an old file may have been wider
            os.ftruncate(fd, 0)
            data = keys.to_json().encode()
            written = 0
            while written < len(data):
                written += os.pwrite(fd, data[written:], written)
            return HeldKeyFile(target, fd)
        except BaseException:
            with contextlib.suppress(OSError):
                os.close(fd)
            raise
    raise KeyFileInUse(f"{target} keeps being replaced by other runs; give this run its own "
                       "key file")


def _same_file(path: Path, fd: int) -> bool:
    try:
        named = os.stat(path, follow_symlinks=False)
    except FileNotFoundError:
        return False
    held = os.fstat(fd)
    return (named.st_dev, named.st_ino) == (held.st_dev, held.st_ino)
