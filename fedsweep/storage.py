"""Where run folders and checkpoints live: a local path, or any URI pyarrow.fs understands
(``s3://bucket/prefix``, ``gs://…``, ``hdfs://…``, ``abfs://…``, ``file:///…``).

:func:`location` returns a :class:`pathlib.Path` for a plain path and a :class:`RemotePath`
for a URI; both offer the few path operations the runner, the actors and
``fedsweep.checkpoint`` use (``/``, ``name``, ``with_suffix``, ``exists``, ``is_dir``,
``iterdir``, ``mkdir``, ``read_bytes``/``write_bytes``, ``read_text``/``write_text``), plus
:func:`remove_tree`. Object stores have no atomic rename, so a remote round is sealed by
writing its ``COMPLETE`` marker last (see ``fedsweep.checkpoint``).

Credentials come from the environment of each process (``AWS_*``, ``GOOGLE_APPLICATION_CREDENTIALS``,
…: pass them with ``fedsweep submit --env``), never from configs.
"""

from __future__ import annotations

import os
import shutil
from functools import lru_cache
from pathlib import Path, PurePosixPath
from typing import Iterator, Union


def is_uri(path: object) -> bool:
    return isinstance(path, RemotePath) or "://" in str(path)


SQLITE = "sqlite:///"

_USERINFO = __import__("re").compile(r"(?P<scheme>\b[A-Za-z][A-Za-z0-9+.-]*://)[^/@\s]+@")


def without_userinfo(text: str) -> str:
    """``text`` with the ``user:token@`` of every URI in it removed: what is written to disk, logged to
    MLflow or printed (a tracking URI with credentials in it is used to connect, never shown or kept)."""
    return _USERINFO.sub(r"\g<scheme>", text)


def redacted(value):
    """``value`` (plain data: dicts, lists, strings) with :func:`without_userinfo` applied to every string."""
    if isinstance(value, str):
        return without_userinfo(value)
    if isinstance(value, dict):
        return {k: redacted(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(redacted(v) for v in value)
    return value


def sqlite_file(uri: str) -> Path | None:
    """The database file of a ``sqlite:///PATH`` tracking URI (``~`` expanded); None for other URIs."""
    return Path(uri.removeprefix(SQLITE)).expanduser() if uri.startswith(SQLITE) else None


@lru_cache(maxsize=16)
def _filesystem(uri_root: str):
    from pyarrow import fs

    return fs.FileSystem.from_uri(uri_root)


class RemotePath:
    """A path inside a pyarrow filesystem, addressed by its URI."""

    def __init__(self, uri: str):
        scheme, _, rest = str(uri).partition("://")
        self.scheme = scheme
        self._rest = rest.rstrip("/") or "/"

    # ------------------------------------------------------------------ naming
    def __str__(self) -> str:
        return f"{self.scheme}://{self._rest}"

    def __repr__(self) -> str:
        return f"RemotePath({str(self)!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, RemotePath) and str(self) == str(other)

    def __hash__(self) -> int:
        return hash(str(self))

    def __lt__(self, other: "RemotePath") -> bool:
        return str(self) < str(other)

    def __truediv__(self, part: str) -> "RemotePath":
        return RemotePath(f"{self}/{str(part).strip('/')}")

    @property
    def name(self) -> str:
        return PurePosixPath(self._rest).name

    def with_suffix(self, suffix: str) -> "RemotePath":
        return RemotePath(f"{self.scheme}://{PurePosixPath(self._rest).with_suffix(suffix)}")

    @property
    def _fs_path(self):
        fs, path = _filesystem_for(str(self))
        return fs, path

    # ------------------------------------------------------------------ queries
    def _info(self):
        fs, path = self._fs_path
        return fs.get_file_info(path)

    def exists(self) -> bool:
        from pyarrow import fs

        return self._info().type != fs.FileType.NotFound

    def is_dir(self) -> bool:
        from pyarrow import fs

        return self._info().type == fs.FileType.Directory

    def iterdir(self) -> Iterator["RemotePath"]:
        from pyarrow import fs as pafs

        fs, path = self._fs_path
        if not self.is_dir():
            return iter(())
        infos = fs.get_file_info(pafs.FileSelector(path, recursive=False))
        return iter(sorted(self / PurePosixPath(i.path).name for i in infos))

    def glob(self, pattern: str) -> Iterator["RemotePath"]:
        import fnmatch

        return (p for p in self.iterdir() if fnmatch.fnmatch(p.name, pattern))

    # ------------------------------------------------------------------ changes
    def mkdir(self, parents: bool = True, exist_ok: bool = True) -> None:
        fs, path = self._fs_path
        if self.exists() and not exist_ok:
            raise FileExistsError(str(self))
        fs.create_dir(path, recursive=True)

    def write_bytes(self, data: bytes) -> None:
        fs, path = self._fs_path
        parent = str(PurePosixPath(path).parent)
        if parent not in ("", "."):
            fs.create_dir(parent, recursive=True)
        with fs.open_output_stream(path) as out:
            out.write(data)

    def read_bytes(self) -> bytes:
        fs, path = self._fs_path
        with fs.open_input_stream(path) as src:
            return src.read()

    def write_text(self, text: str, encoding: str = "utf-8") -> None:
        self.write_bytes(text.encode(encoding))

    def read_text(self, encoding: str = "utf-8") -> str:
        return self.read_bytes().decode(encoding)

    def resolve(self) -> "RemotePath":
        return self

    def copy_to(self, target: "RemotePath") -> None:
        """A copy inside the store (server-side where the store supports it: nothing passes this node)."""
        fs, src = self._fs_path
        _, dst = target._fs_path
        fs.copy_file(src, dst)


AnyPath = Union[Path, RemotePath]


def _filesystem_for(uri: str):
    """(filesystem, path inside it) for a URI; the filesystem object is cached per bucket/host."""
    scheme, _, rest = uri.partition("://")
    if scheme == "file":
        fs, _ = _filesystem("file:///")
        return fs, "/" + rest.lstrip("/")
    head = rest.split("/", 1)[0]
    fs, root = _filesystem(f"{scheme}://{head}")
    inner = rest[len(head):].strip("/")
    return fs, f"{root.rstrip('/')}/{inner}" if inner else root


def location(path: str | Path | RemotePath) -> AnyPath:
    """A Path for a local path, a RemotePath for a URI."""
    if isinstance(path, (Path, RemotePath)):
        return path
    return RemotePath(path) if is_uri(path) else Path(path)


def reuse_file(source: AnyPath, target: AnyPath) -> None:
    """Put ``source``'s bytes at ``target`` without rewriting them: a hard link locally (a copy
    across devices), a store-side copy on a URI."""
    if isinstance(source, RemotePath):
        source.copy_to(target)
        return
    try:
        os.link(source, target)
    except OSError:
        shutil.copy2(source, target)


def remove_tree(path: AnyPath) -> None:
    """Delete a folder and everything in it; nothing if it does not exist."""
    if isinstance(path, RemotePath):
        if path.exists():
            fs, inner = path._fs_path
            fs.delete_dir(inner)
    else:
        shutil.rmtree(path, ignore_errors=True)


PRIVATE_FILE, PRIVATE_DIR = 0o600, 0o700
"""The modes of what a run writes on a local disk: its folders and files are its user's alone (a tracking
URI, a dataset's records and a model's outputs are in them)."""


def write_atomic(path: AnyPath, data: bytes) -> None:
    """``data`` as the whole of ``path``, never half written: on a local disk written beside it, fsynced,
    renamed over it and its folder fsynced (the file is its user's alone, :data:`PRIVATE_FILE`); an
    object store writes an object whole."""
    if not isinstance(path, Path):
        path.write_bytes(data)
        return
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, PRIVATE_FILE)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    folder = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(folder)
    finally:
        os.close(folder)


def private_dir(path: AnyPath) -> AnyPath:
    """``path`` made (with its parents) and, on a local disk, its user's alone (:data:`PRIVATE_DIR`)."""
    path.mkdir(parents=True, exist_ok=True)
    if isinstance(path, Path):
        path.chmod(PRIVATE_DIR)
    return path


def named_below(root: Path, name: str) -> list[Path]:
    """Every file or folder named ``name`` in or below the local folder ``root``, sorted. Read while runs
    write there: a folder renamed or removed under the walk (a round's ``round_NNNN.partial`` renamed at
    its commit, a checkpoint pruned) is passed over, where ``Path.rglob`` raises FileNotFoundError."""
    return sorted(Path(top) / name for top, dirs, files in os.walk(root) if name in dirs or name in files)
