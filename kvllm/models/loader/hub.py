"""Turning what the user passed as `model` into a local folder: a path, a GGUF file or a hub repo id."""

from __future__ import annotations

import os
import re
from pathlib import Path

# owner/name, as the hub spells repo ids (no leading dot or slash, one slash).
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_HUB_TIMEOUT_S = 5.0
_ALLOW_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "tokenizer*", "*.model", "*.txt"]


def looks_like_repo_id(model: str) -> bool:
    return bool(_REPO_ID.match(model)) and not model.endswith(".gguf")


def _hub_offline() -> bool:
    # Read at call time: huggingface_hub reads HF_HUB_OFFLINE once, at import.
    return any(
        os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")
        for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
    )


def resolve_model_path(
    model: str,
    revision: str | None = None,
    what: str = "Model",
    cache_dir: str | None = None,
    token: str | None = None,
) -> str:
    """A local folder or file for `model`: an existing path as is, a repo id downloaded from the hub
    (into `cache_dir`, vLLM's --download-dir, when given; with `token`, vLLM's --hf-token)."""
    path = Path(model).expanduser()
    if path.exists():
        return str(path.resolve())
    if not looks_like_repo_id(model):
        raise ValueError(
            f"{what} path {model!r} does not exist and is not a hub repo id (owner/name); "
            "pass an existing model folder, a GGUF file or a repo id"
        )
    return download_repo(model, revision, what, cache_dir=cache_dir, token=token)


def download_repo(
    repo_id: str,
    revision: str | None,
    what: str = "Model",
    cache_dir: str | None = None,
    token: str | None = None,
) -> str:
    """snapshot_download of the files an engine needs; a clear ValueError when no hub is reachable."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, RepositoryNotFoundError, RevisionNotFoundError

    offline = _hub_offline()
    at = f" at revision {revision!r}" if revision else ""
    try:
        return snapshot_download(
            repo_id,
            revision=revision,
            allow_patterns=_ALLOW_PATTERNS,
            local_files_only=offline,
            etag_timeout=_HUB_TIMEOUT_S,
            cache_dir=cache_dir,
            token=token,
        )
    except HFValidationError as e:
        raise ValueError(f"{what} {repo_id!r} is not a valid hub repo id: {e}") from e
    except (RepositoryNotFoundError, RevisionNotFoundError) as e:
        raise ValueError(
            f"{what} repo {repo_id!r}{at} was not found on the hub (or is private or gated). "
            "Check the name, or pass a local model folder or a GGUF file instead."
        ) from e
    except Exception as e:  # connection errors, or an offline cache miss
        if offline:
            reason = "HF_HUB_OFFLINE is set and the repo is not in the local hub cache"
        else:
            reason = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        raise ValueError(
            f"{what} repo {repo_id!r}{at} could not be downloaded: no model hub is reachable ({reason}). "
            "Pass a local model folder or a GGUF file instead."
        ) from e
