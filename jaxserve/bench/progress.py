"""A progress bar over finished requests (tqdm on stderr), or a silent stand-in."""

from __future__ import annotations

import contextlib
import sys
from typing import Iterator, Protocol


class Bar(Protocol):
    def update(self, n: int = 1) -> object: ...


class _Silent:
    def update(self, n: int = 1) -> None:
        pass


@contextlib.contextmanager
def progress_bar(total: int, desc: str, enabled: bool = True) -> Iterator[Bar]:
    if not enabled:
        yield _Silent()
        return
    from tqdm import tqdm

    with tqdm(total=total, desc=desc, unit="req", file=sys.stderr, dynamic_ncols=True) as bar:
        yield bar
