"""`kvllm collect-env`: what to paste into a bug report.

OS, Python, library versions, devices, every attention backend's import status (failures with
the library and the fix) and the relevant environment variables, with secrets masked.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import os
import platform
import re
import sys
from typing import Any

# Distribution name -> label. Versions come from package metadata, so nothing heavy is imported.
_LIBRARIES = {
    "torch": "torch",
    "triton": "triton",
    "transformers": "transformers",
    "tokenizers": "tokenizers",
    "safetensors": "safetensors",
    "flash-attn-4": "flash-attn-4 (FlashAttention-4)",
    "flash-attn": "flash-attn",
    "flashinfer-python": "flashinfer",
    "numpy": "numpy",
}
_ENV_PREFIXES = (
    "KVLLM_",
    "CUDA_",
    "HF_",
    "HUGGINGFACE_",
    "TRANSFORMERS_",
    "TORCH_",
    "TRITON_",
    "NCCL_",
    "PYTORCH_",
    "OMP_",
    "MKL_",
    "FLASHINFER_",
    "HIP_",
    "ROCM_",
    "NVIDIA_",
    "CUBLAS_",
)
_ENV_NAMES = ("LD_LIBRARY_PATH",)
_SECRET = re.compile(r"KEY|TOKEN|SECRET|PASSWORD|PASSWD|CREDENTIAL|AUTH", re.IGNORECASE)


def register(subparsers: Any) -> None:
    """Add the `collect-env` subcommand."""
    parser = subparsers.add_parser(
        "collect-env",
        help="Print the environment (versions, devices, backends) for bug reports.",
        description=__doc__.split("\n\n")[0],
    )
    parser.set_defaults(dispatch=run)


def relevant_environment(environ: dict[str, str] | None = None) -> list[tuple[str, str]]:
    """(name, value) of the environment variables that matter to kvllm; secrets masked."""
    environ = dict(os.environ if environ is None else environ)
    out = []
    for name in sorted(environ):
        if not (name.startswith(_ENV_PREFIXES) or name in _ENV_NAMES):
            continue
        out.append((name, "***" if _SECRET.search(name) else environ[name]))
    return out


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _devices() -> list[str]:
    try:
        import torch
    except ImportError as exc:
        return [f"torch not importable: {exc}{_library_fix(exc, 'torch')}"]
    lines = [f"torch CUDA build: {torch.version.cuda}, HIP build: {torch.version.hip}"]
    if not torch.cuda.is_available():
        return [*lines, "GPUs: none visible (CPU only)"]
    for i in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(i)
        major, minor = torch.cuda.get_device_capability(i)
        lines.append(
            f"GPU {i}: {props.name}, compute capability {major}.{minor}, {props.total_memory / 2**30:.1f} GiB"
        )
    return lines


_SHARED_LIBRARY = re.compile(r"(lib[\w+-]+\.so(?:\.\d+)*)")
_CUDA_LIBRARIES = (
    "libcuda",
    "libcudart",
    "libcublas",
    "libcudnn",
    "libnccl",
    "libnvrtc",
    "libcusparse",
    "libnvjit",
)


def _library_fix(exc: BaseException, package: str = "the package") -> str:
    """For an import that failed because a shared library did not load: which library, and the fix.

    Empty when the error names no shared library (then the caller's generic fix applies).
    """
    match = _SHARED_LIBRARY.search(str(exc))
    if match is None:
        return ""
    library = match.group(1)
    if not library.startswith(_CUDA_LIBRARIES):
        return (
            f" (the shared library {library} could not be loaded: install the system package that provides "
            f"it, or add its folder to LD_LIBRARY_PATH)"
        )
    version = re.search(r"\.so\.(\d+)", library)
    major = int(version.group(1)) if version else None
    needs = f"CUDA {major}" if major else "a CUDA runtime"
    if major is None:
        wheel = "the CUDA toolkit"
    elif major >= 13:
        wheel = f"pip install 'nvidia-cuda-runtime=={major}.*'"
    else:
        wheel = f"pip install nvidia-cuda-runtime-cu{major}"
    return (
        f" (the CUDA library {library} could not be loaded: {package} was built for {needs}, whose "
        f"runtime is not installed or not on the library path. Fix: install a build of {package} for the "
        "CUDA version your driver supports (see `nvidia-smi`; torch's build is listed under Devices), or "
        f"install that runtime ({wheel}, or conda install cuda -c nvidia) and put its lib folder on "
        "LD_LIBRARY_PATH, e.g. export LD_LIBRARY_PATH=$CONDA_PREFIX/lib:$LD_LIBRARY_PATH)"
    )


def backend_import_status() -> list[str]:
    """One line per registered backend: declarations and kernel module import, or why not."""
    from kvllm.attention import registry

    lines = []
    for name in registry.registered_backend_names():
        try:
            backend = registry.get_backend_class(name)
        except ImportError as exc:
            lines.append(f"  ❌ {name}: declarations do not import: {exc}{_library_fix(exc)}")
            continue
        if not getattr(backend, "implemented", True):  # declared so selection can explain it (MLA family)
            lines.append(f"  ❌ {name}: declared only, no kernel binding in this build (always rejected)")
            continue
        missing = backend.missing_package_reason()
        if missing:
            lines.append(f"  ❌ {name}: {missing}")
            continue
        try:
            backend.get_impl_cls()
            backend.get_builder_cls()
        except Exception as exc:  # any failure of a kernel library's import is reported, not raised
            library = backend.required_package or "its kernel module"
            fix = f"pip install 'kvllm[{backend.pip_extra}]'" if backend.pip_extra else "reinstall kvllm"
            explained = _library_fix(exc, library)
            if not explained:
                explained = f" (fix: {fix})"
            lines.append(f"  ❌ {name}: importing {library} failed: {type(exc).__name__}: {exc}{explained}")
            continue
        lines.append(f"  ✅ {name}: imports")
    return lines


def collect_env() -> str:
    """The whole report as text."""
    from kvllm import __version__
    from kvllm.platforms import current_device_info

    lines = [
        f"kvllm: {__version__}",
        f"OS: {platform.platform()}",
        f"Python: {sys.version.split()[0]} ({sys.executable})",
        f"CPU: {platform.machine()}, {os.cpu_count()} cores",
        "",
        "Libraries:",
    ]
    for dist, label in _LIBRARIES.items():
        lines.append(f"  {label}: {_version(dist) or 'not installed'}")
    lines += ["", "Devices:", *(f"  {line}" for line in _devices())]
    lines.append(f"  kvllm platform: {current_device_info().describe()}")
    lines += ["", "Attention backends:", *backend_import_status()]
    lines += ["", "Environment variables:"]
    env = relevant_environment()
    lines += [f"  {name}={value}" for name, value in env] or ["  (none relevant)"]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    """Print the report."""
    print(collect_env())
    return 0
