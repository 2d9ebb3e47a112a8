"""Start `kvllm serve` in a subprocess with given engine arguments, for `kvllm bench serve --launch-server`."""

from __future__ import annotations

import enum
import json
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, is_dataclass
from typing import Any


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def engine_flags(engine_kwargs: dict[str, Any]) -> list[str]:
    """The command-line flags that reproduce `engine_kwargs` (the inverse of the shared parser)."""
    flags: list[str] = []
    for name, value in engine_kwargs.items():
        flag = "--" + name.replace("_", "-")
        if value is None:
            continue
        if isinstance(value, bool):
            flags.append(flag if value else f"--no-{name.replace('_', '-')}")
        elif is_dataclass(value):
            data = {
                k: (v.name if isinstance(v, enum.Enum) else v)
                for k, v in asdict(value).items()
                if v is not None
            }
            if data:
                flags += [flag, json.dumps(data)]
        elif isinstance(value, enum.Enum):
            flags += [flag, value.name]
        else:
            flags += [flag, str(value)]
    return flags


def _is_up(base_url: str) -> bool:
    import httpx

    try:
        return httpx.get(base_url + "/v1/models", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


@contextmanager
def launched_server(engine_kwargs: dict[str, Any], timeout_s: float = 600.0) -> Iterator[str]:
    """Run `kvllm serve` on a free local port until the block ends; yields its base URL."""
    import importlib.util

    if importlib.util.find_spec("kvllm.entrypoints.cli.serve") is None:
        raise ValueError("this build has no `kvllm serve`; start a server yourself and pass --base-url")
    port = free_port()
    base_url = f"http://127.0.0.1:{port}"
    cmd = [
        sys.executable,
        "-m",
        "kvllm.entrypoints.cli.main",
        "serve",
        *engine_flags(engine_kwargs),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
    ]
    print("Launching:", " ".join(cmd))
    proc = subprocess.Popen(cmd)
    try:
        deadline = time.monotonic() + timeout_s
        while not _is_up(base_url):
            if proc.poll() is not None:
                raise ValueError(f"`kvllm serve` exited with code {proc.returncode} before it was up")
            if time.monotonic() > deadline:
                raise ValueError(f"`kvllm serve` was not up after {timeout_s:.0f} s (--server-timeout)")
            time.sleep(0.5)
        yield base_url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
