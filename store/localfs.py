"""Local file operations that cannot be steered outside their root.

Whoever can write the output root (a shared or NFS shard directory) can plant a symlink in it:
`out/evil -> ~/.ssh`, and a later move onto `evil/authorized_keys` would replace a file outside
the root. A check of the path before the call (`realpath`) is a race: the link can appear between
the check and the call. So every operation here walks the path from the root one directory at a
time with `os.open(name, O_DIRECTORY | O_NOFOLLOW, dir_fd=parent)` and acts on the last component
through its directory's descriptor (`dir_fd=`, `src_dir_fd=`/`dst_dir_fd=`, `O_NOFOLLOW` on files):
a symlink anywhere below the root makes the operation fail with `EscapesRoot` (a
`PermissionError`: not retried), and nothing outside the root is read, written or deleted. The
root itself is resolved once, when the store is opened: the operator chose it.

POSIX only (`dir_fd` support); used by `rlrec.store.storage.Storage` for ``kind == "local"``.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import uuid
from collections.abc import Iterator
from typing import Any

__all__ = ["EscapesRoot", "LocalRoot"]

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
_FILE_NOFOLLOW = os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)


class EscapesRoot(PermissionError):
    """A path below the root goes through a symlink (or a non-directory): refused, since it
    could lead outside the root."""


class LocalRoot:
    """A local directory tree whose operations stay inside it.

    Args:
        root: the directory (resolved once: symlinks above and at the root are the operator's).
        fsync: fsync files and the directories whose entries change (durability).

    Example::

        >>> import os, tempfile
        >>> d = tempfile.mkdtemp()
        >>> r = LocalRoot(d, fsync=False)
        >>> r.write("a/b.txt", b"hi"); r.read("a/b.txt")
        b'hi'
        >>> os.symlink("/etc", os.path.join(d, "evil"))
        >>> r.write("evil/x", b"no")
        Traceback (most recent call last):
        ...
        rlrec.store.localfs.EscapesRoot: [Errno 40] a component of the path is a symlink: 'evil/x'
    """

    def __init__(self, root: str, *, fsync: bool = True) -> None:
        self.root = os.path.realpath(root)
        self.fsync = fsync

    # -- walking ------------------------------------------------------------------------------

    @contextlib.contextmanager
    def _dir(self, rel: str, *, create: bool) -> Iterator[tuple[int, str]]:
        """(descriptor of the directory holding `rel`'s last component, that component)."""
        parts = [p for p in rel.split("/") if p]
        if not parts:
            raise IsADirectoryError(errno.EISDIR, "the root itself", self.root)
        flags = os.O_RDONLY | os.O_DIRECTORY | getattr(os, "O_CLOEXEC", 0)
        try:
            fd = os.open(self.root, flags)
        except FileNotFoundError:  # made on the first write (not tried on every one: a syscall each)
            if not create:
                raise
            os.makedirs(self.root, exist_ok=True)
            fd = os.open(self.root, flags)
        try:
            for name in parts[:-1]:
                parent, fd = fd, self._enter(fd, name, rel, create)
                os.close(parent)
            yield fd, parts[-1]
        finally:
            os.close(fd)

    def _enter(self, fd: int, name: str, rel: str, create: bool) -> int:
        """Open directory `name` in `fd` without following a symlink (creating it if asked)."""
        try:
            try:
                return os.open(name, _DIR_FLAGS, dir_fd=fd)
            except FileNotFoundError:
                if not create:
                    raise
            with contextlib.suppress(FileExistsError):  # made meanwhile by another writer
                os.mkdir(name, 0o755, dir_fd=fd)
                self._sync_fd(fd)
            return os.open(name, _DIR_FLAGS, dir_fd=fd)
        except OSError as e:
            _refuse_links(e, fd, name, rel)
            raise

    def _sync_fd(self, fd: int) -> None:
        if self.fsync:
            with contextlib.suppress(OSError):
                os.fsync(fd)

    # -- files --------------------------------------------------------------------------------

    def _write_tmp(self, d: int, name: str, data: bytes) -> str:
        tmp = f".{name}.tmp-{uuid.uuid4().hex[:12]}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _FILE_NOFOLLOW, 0o644, dir_fd=d)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                if self.fsync:
                    f.flush()
                    os.fsync(f.fileno())
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp, dir_fd=d)
            raise
        return tmp

    def write(self, rel: str, data: bytes) -> None:
        """Write `data` to `rel` (replacing it) atomically for readers: temp file + rename."""
        with self._dir(rel, create=True) as (d, name):
            tmp = self._write_tmp(d, name, data)
            try:
                os.replace(tmp, name, src_dir_fd=d, dst_dir_fd=d)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(tmp, dir_fd=d)
                raise
            self._sync_fd(d)

    def create_once(self, rel: str, data: bytes) -> bool:
        """Create `rel` with `data` unless it exists; True if this call created it (a hard link
        of a complete temp file: readers never see a partial file)."""
        with self._dir(rel, create=True) as (d, name):
            tmp = self._write_tmp(d, name, data)
            try:
                try:
                    os.link(tmp, name, src_dir_fd=d, dst_dir_fd=d, follow_symlinks=False)
                except FileExistsError:
                    return False
                except OSError as e:
                    if e.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EMLINK, errno.EXDEV):
                        raise
                    # no hard links here: an O_EXCL create (a reader may briefly see a partial file)
                    try:
                        fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _FILE_NOFOLLOW, 0o644, dir_fd=d)
                    except FileExistsError:
                        return False
                    with os.fdopen(fd, "wb") as f:
                        f.write(data)
                        if self.fsync:
                            f.flush()
                            os.fsync(f.fileno())
            finally:
                with contextlib.suppress(OSError):
                    os.unlink(tmp, dir_fd=d)
            self._sync_fd(d)
            return True

    def read(self, rel: str, size: int = -1) -> bytes:
        """The content of the regular file `rel`, at most `size` bytes when not negative
        (FileNotFoundError if missing)."""
        with self._dir(rel, create=False) as (d, name):
            try:
                fd = os.open(name, os.O_RDONLY | os.O_NONBLOCK | _FILE_NOFOLLOW, dir_fd=d)
            except OSError as e:
                if e.errno == errno.ELOOP:
                    raise EscapesRoot(errno.ELOOP, "the file is a symlink", rel) from None
                raise
            with os.fdopen(fd, "rb") as f:
                st = os.fstat(f.fileno())
                if not stat.S_ISREG(st.st_mode):
                    raise EscapesRoot(errno.EPERM, "not a regular file", rel)
                return f.read() if size < 0 else read_at_most(f, size, first=st.st_size + 1)

    def replace(self, src: str, dst: str) -> None:
        """Move `src` onto `dst` (atomic; replaces `dst`)."""
        with self._dir(src, create=False) as (ds, s), self._dir(dst, create=True) as (dd, t):
            if not stat.S_ISREG(os.stat(s, dir_fd=ds, follow_symlinks=False).st_mode):
                raise EscapesRoot(errno.EPERM, "not a regular file", src)
            os.replace(s, t, src_dir_fd=ds, dst_dir_fd=dd)
            self._sync_fd(dd)

    def check(self, rel: str) -> None:
        """Raise EscapesRoot unless `rel` is a regular file or a directory reached without a
        symlink (FileNotFoundError if it is missing): for a path another library (pyarrow, Ray
        Data) is about to open, which would follow links."""
        with self._dir(rel, create=False) as (d, name):
            mode = os.stat(name, dir_fd=d, follow_symlinks=False).st_mode
            if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
                raise EscapesRoot(errno.ELOOP, "a symlink or a special file", rel)

    def unlink(self, rel: str) -> None:
        """Delete the file (or symlink: the link, never its target) `rel`; FileNotFoundError if
        missing."""
        with self._dir(rel, create=False) as (d, name):
            if stat.S_ISDIR(os.stat(name, dir_fd=d, follow_symlinks=False).st_mode):
                raise IsADirectoryError(errno.EISDIR, "is a directory", rel)
            os.unlink(name, dir_fd=d)

    def remove_tree(self, rel: str) -> int:
        """Delete the directory `rel` and everything in it, never following a symlink (a link
        is deleted, not its target); the number of files deleted (0 if missing)."""
        try:
            with self._dir(rel, create=False) as (d, name):
                try:
                    top = os.open(name, _DIR_FLAGS, dir_fd=d)
                except OSError as e:
                    _refuse_links(e, d, name, rel)
                    raise
                try:
                    n = _empty_dir(top)
                finally:
                    os.close(top)
                os.rmdir(name, dir_fd=d)
                return n
        except FileNotFoundError:
            return 0


#: the first read of `read_at_most` when the file's size is not known; later reads double it
READ_PIECE = 1024 * 1024


def read_at_most(f: Any, size: int, first: int = READ_PIECE) -> bytes:
    """Up to `size` bytes of the binary file object `f` (to its end if shorter). The first read
    asks for at most `first` bytes (give the file's size + 1 when known: then one read does it),
    each later one for twice as many: memory follows what the file holds, not `size` (a
    buffered reader, or Arrow's input streams, allocate what one read asks for). A short read
    is followed by a 1-byte probe, so that only an empty read ends it.

    Example:
        >>> import io
        >>> read_at_most(io.BytesIO(b"0123456789"), 4), read_at_most(io.BytesIO(b"01"), 4)
        (b'0123', b'01')
        >>> read_at_most(io.BytesIO(b"0123456789"), 20, first=3)
        b'0123456789'
    """
    pieces: list[bytes] = []
    left, ask = size, max(1, first)
    while left > 0:
        want = min(left, ask)
        piece = f.read(want)
        if not piece:
            break
        pieces.append(piece)
        left -= len(piece)
        ask = 1 if len(piece) < want else READ_PIECE if ask == 1 else ask * 2  # short: probably its end
    return pieces[0] if len(pieces) == 1 else b"".join(pieces)


def _refuse_links(e: OSError, dir_fd: int, name: str, rel: str) -> None:
    """Opening directory `name` failed with `e`: raise EscapesRoot if it is a symlink (a plain
    file stays the caller's NotADirectoryError)."""
    if e.errno not in (errno.ELOOP, errno.ENOTDIR):
        return
    try:
        link = stat.S_ISLNK(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode)
    except OSError:
        link = False
    if link or e.errno == errno.ELOOP:
        raise EscapesRoot(errno.ELOOP, "a component of the path is a symlink", rel) from None


def _empty_dir(fd: int) -> int:
    """Delete what directory `fd` holds, depth first, following no symlink."""
    n = 0
    with os.scandir(fd) as it:
        entries = list(it)
    for entry in entries:
        if entry.is_dir(follow_symlinks=False):
            sub = os.open(entry.name, _DIR_FLAGS, dir_fd=fd)
            try:
                n += _empty_dir(sub)
            finally:
                os.close(sub)
            os.rmdir(entry.name, dir_fd=fd)
        else:
            os.unlink(entry.name, dir_fd=fd)
            n += 1
    return n
