"""Where auto-tune results are kept: one JSON file per key under the user's kvllm cache directory.

The key names everything a timing depends on: the machine (platform, compute capability, device
name), the model's attention shapes and the shapes timed, the selector config (dtype, KV dtype,
block size, features), the valid backends and the versions of the libraries and of kvllm's own
attention code. Change any of them and the key (so the file) changes, so a stale table is never read.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import platform
import tempfile
from pathlib import Path
from typing import Any

from kvllm.logger import init_logger

logger = init_logger(__name__)

CACHE_SUBDIR = "attention-autotune"
FORMAT_VERSION = 1
# Distributions whose version changes what a backend's kernels do.
LIBRARIES = ("torch", "triton", "flashinfer-python", "flash-attn-4", "flash-attn", "nvidia-cutlass-dsl")


def cache_root() -> Path:
    """$KVLLM_CACHE_DIR, else $XDG_CACHE_HOME/kvllm, else ~/.cache/kvllm."""
    if os.environ.get("KVLLM_CACHE_DIR"):
        return Path(os.environ["KVLLM_CACHE_DIR"]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "kvllm"


def library_versions() -> dict[str, str | None]:
    """Versions of kvllm, Python and every kernel library (None = not installed), plus a hash of
    kvllm's attention sources, so that editing a kernel invalidates its timings."""
    versions: dict[str, str | None] = {"python": platform.python_version()}
    for dist in ("kvllm", *LIBRARIES):
        try:
            versions[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            versions[dist] = None
    versions["kvllm_attention_sources"] = _attention_sources_hash()
    return versions


def _attention_sources_hash() -> str:
    root = Path(__file__).resolve().parent
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        digest.update(str(path.relative_to(root)).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def key_digest(key: dict[str, Any]) -> str:
    """A stable file name for a key (canonical JSON, SHA-256)."""
    text = json.dumps({"format": FORMAT_VERSION, **key}, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:24]


def cache_path(key: dict[str, Any], root: Path | None = None) -> Path:
    return (root or cache_root()) / CACHE_SUBDIR / f"{key_digest(key)}.json"


def load(key: dict[str, Any], root: Path | None = None) -> dict[str, Any] | None:
    """The stored entry for `key`, or None (missing, unreadable or not for this key)."""
    path = cache_path(key, root)
    try:
        entry = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(entry, dict) or entry.get("key") != json.loads(json.dumps(key, default=str)):
        return None
    return entry


def store(key: dict[str, Any], entry: dict[str, Any], root: Path | None = None) -> Path | None:
    """Write the entry atomically (rename); a cache that cannot be written is not an error."""
    path = cache_path(key, root)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False, suffix=".tmp") as f:
            json.dump({"key": key, **entry}, f, indent=1, sort_keys=True, default=str)
        os.replace(f.name, path)
    except OSError as exc:
        logger.warning("Cannot write the attention auto-tune cache %s: %s", path, exc)
        return None
    return path
