"""DiskCache: a folder of small files under content keys, written so readers never see half a file.

jaxserve keeps what start-up would otherwise redo in such folders: checkpoint identities (here),
prepared checkpoints, serialized executables and calibration results (jaxserve.runner). It lives
in this package because it is the lowest layer that needs it, and it imports nothing heavy.
A cache is an optimisation: a folder that cannot be read or written costs the work it would have
saved, never the start-up.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile

log = logging.getLogger(__name__)


class DiskCache:
    def __init__(self, directory: str | os.PathLike):
        self.directory = os.fspath(directory)

    def path(self, key: str) -> str:
        return os.path.join(self.directory, key)

    def get(self, key: str) -> bytes | None:
        """The entry's bytes, or None; a hit marks the entry used (its mtime), for `trim`."""
        try:
            with open(self.path(key), "rb") as f:
                data = f.read()
        except OSError:
            return None
        try:
            os.utime(self.path(key))
        except OSError:
            pass
        return data

    def trim(self, max_bytes: int) -> None:
        """Delete the least recently used entries until the folder holds at most `max_bytes`."""
        try:
            entries = [e for e in os.scandir(self.directory) if e.is_file() and not e.name.startswith(".")]
            entries = sorted(((e.stat().st_mtime_ns, e.stat().st_size, e.path) for e in entries), reverse=True)
        except OSError:
            return
        total = 0
        for _, size, path in entries:
            total += size
            if total > max_bytes:
                try:
                    os.remove(path)
                except OSError:
                    pass

    def put(self, key: str, data: bytes) -> None:
        """Write to a temporary file beside the entry, then rename it into place (atomic on POSIX):
        a concurrent reader sees no entry or the whole entry."""
        try:
            os.makedirs(self.directory, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.directory, prefix=f".{key}.", suffix=".tmp")
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(data)
                os.replace(tmp, self.path(key))
            except BaseException:
                os.remove(tmp)
                raise
        except OSError as e:
            log.warning("cache %s: could not write %s: %s", self.directory, key, e)

    def get_json(self, key: str):
        data = self.get(key)
        if data is None:
            return None
        try:
            return json.loads(data)
        except ValueError:
            return None

    def put_json(self, key: str, value) -> None:
        self.put(key, json.dumps(value, indent=1, sort_keys=True).encode())
