"""The real texts quantization uses: the default calibration text and the held-out text accuracy
is measured on (data/README.md says what they are and why they may be here)."""

from __future__ import annotations

import hashlib
import os

_DATA = os.path.join(os.path.dirname(__file__), "data")
DEFAULT_CALIBRATION = os.path.join(_DATA, "calibration_declaration.txt")
HELDOUT = os.path.join(_DATA, "heldout_gettysburg.txt")


def read_text(path: str | None) -> str:
    with open(path or DEFAULT_CALIBRATION, encoding="utf-8") as f:
        return f.read()


def text_id(text: str) -> str:
    """What a cache keyed on calibration data keys on."""
    return "sha256:" + hashlib.sha256(text.encode()).hexdigest()
