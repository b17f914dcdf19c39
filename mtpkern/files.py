"""Reading the files of a checkpoint that may be hostile or broken.

A checkpoint directory comes from outside (a download, a shared disk), so each
file it names is checked before it is opened:

- it must be a regular file; a symlink to one is fine (Hugging Face's hub cache
  stores every snapshot file as a symlink into ``../../blobs/``), but a FIFO
  would block the reader forever and a device (``/dev/zero``) would feed it
  without end;
- a JSON file is read only up to a cap (``CONFIG_JSON_CAP``, ``INDEX_JSON_CAP``);
- a file name taken from the shard index must stay inside the checkpoint
  directory *by name* (``check_member_name``). Symlinks are not resolved to
  decide: the hub cache's own symlinks point outside the snapshot directory.

Every failure raises the caller's error class (``ConfigError`` for
``config.json``, ``CheckpointError`` for the rest) with one line naming the file.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path, PureWindowsPath
from typing import Any

from .errors import MtpError

#: config.json: published configs are 1-10 KB (Step-3.5's per-layer lists ~20 KB).
CONFIG_JSON_CAP = 1 << 20
#: model.safetensors.index.json: DeepSeek-V3's (~92k tensors) is ~9 MB.
INDEX_JSON_CAP = 64 << 20

_KINDS = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISFIFO, "a FIFO (named pipe)"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)


def _kind(mode: int) -> str:
    for test, name in _KINDS:
        if test(mode):
            return name
    return "not a regular file"


def _require_regular(path: str | os.PathLike, mode: int, error: type[MtpError]) -> None:
    if not stat.S_ISREG(mode):
        raise error(f"{os.fspath(path)}: is {_kind(mode)}, expected a regular file (or a symlink to one)")


def require_regular_file(path: str | os.PathLike, error: type[MtpError]) -> os.stat_result:
    """``stat`` ``path`` (following symlinks) and refuse anything but a regular file."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise error(f"{Path(path).name} not found at {os.fspath(path)!r}") from None
    except OSError as e:
        raise error(f"{os.fspath(path)}: cannot be read ({e.strerror})") from None
    _require_regular(path, st.st_mode, error)
    return st


def read_capped(path: str | os.PathLike, cap: int, error: type[MtpError]) -> bytes:
    """The bytes of the regular file ``path``, refused when longer than ``cap``.

    The file is checked twice: by ``stat`` before it is opened (so a device is never
    opened), and by ``fstat`` on the descriptor, opened non-blocking, in case the path
    was replaced in between. At most ``cap + 1`` bytes are read whatever happens."""
    st = require_regular_file(path, error)
    if st.st_size > cap:
        raise error(f"{os.fspath(path)}: {st.st_size} bytes, more than the cap of {cap} bytes for this file")
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        raise error(f"{os.fspath(path)}: cannot be read ({e.strerror})") from None
    with os.fdopen(fd, "rb") as f:
        _require_regular(path, os.fstat(f.fileno()).st_mode, error)
        data = f.read(cap + 1)
    if len(data) > cap:
        raise error(f"{os.fspath(path)}: more than the cap of {cap} bytes for this file")
    return data


class _DuplicateKey(Exception):
    def __init__(self, key: str):
        self.key = key


def _object(pairs: list[tuple[str, Any]]) -> dict:
    # json keeps the last of two equal keys silently: a config.json saying
    # hidden_size twice would load whichever came second.
    d = dict(pairs)
    if len(d) != len(pairs):
        seen: set[str] = set()
        for k, _ in pairs:
            if k in seen:
                raise _DuplicateKey(k)
            seen.add(k)
    return d


def read_json(path: str | os.PathLike, cap: int, error: type[MtpError]) -> Any:
    """Parse the JSON file at ``path``: a regular file of at most ``cap`` bytes of UTF-8,
    with no key twice in one object. Any failure is one ``error`` naming the file."""
    data = read_capped(path, cap, error)
    p = os.fspath(path)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise error(f"{p}: not UTF-8 text (invalid byte at offset {e.start})") from None
    try:
        return json.loads(text, object_pairs_hook=_object)
    except json.JSONDecodeError as e:
        raise error(f"{p}: not valid JSON ({e})") from None
    except RecursionError:
        raise error(f"{p}: JSON nested too deeply to parse") from None
    except ValueError as e:          # e.g. an integer of more digits than Python converts (4300)
        raise error(f"{p}: not valid JSON ({e})") from None
    except _DuplicateKey as e:
        raise error(f"{p}: key {e.key!r} appears twice in one JSON object") from None


def check_member_name(name: Any, where: str, error: type[MtpError]) -> str:
    """``name`` (a file name read from ``where``) if it names a file inside the checkpoint
    directory: a non-empty relative path without a ``..`` component, a drive, or NUL.

    Judged on the name alone, never by resolving symlinks (see the module docstring)."""
    if not isinstance(name, str) or not name:
        raise error(f"{where}: expected a file name (a non-empty string), got {name!r}")
    why = None
    if "\x00" in name:
        why = "contains a NUL character"
    elif name.startswith(("/", "\\")) or os.path.isabs(name):
        why = "is an absolute path"
    elif PureWindowsPath(name).drive:
        why = "names a drive"
    elif ".." in name.replace("\\", "/").split("/"):
        why = "has a '..' component"
    if why:
        raise error(f"{where}: file name {name!r} {why}; expected a name inside the checkpoint directory")
    return name
