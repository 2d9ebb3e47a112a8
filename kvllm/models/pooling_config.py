"""Which runner a model gets, and its resolved PoolerConfig: vLLM's rules, read from the model folder.

Runner `auto` is `pooling` for an embedding architecture (BertModel) or a sentence-transformers folder
(a modules.json with a Pooling module), `generate` otherwise. The pooler's settings come, field by
field, from the user's --pooler-config, then the folder's sentence-transformers files (1_Pooling's
mode, a Normalize module), then the model's defaults (CLS for BERT, LAST for a converted causal LM;
normalized).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kvllm.config.pooler import PoolerConfig
from kvllm.logger import init_logger

logger = init_logger(__name__)

# sentence-transformers' Pooling config keys -> vLLM's pooling types, in its order of precedence.
_ST_POOLING_MODES = (
    ("pooling_mode_cls_token", "CLS"),
    ("pooling_mode_mean_tokens", "MEAN"),
    ("pooling_mode_lasttoken", "LAST"),
)


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def sentence_transformers_pooling(model_path: str) -> dict[str, Any] | None:
    """{"seq_pooling_type", "use_activation"} from a sentence-transformers folder; None if it is not one."""
    folder = Path(model_path)
    modules = _read_json(folder / "modules.json")
    if not isinstance(modules, list):
        return None
    found: dict[str, Any] = {}
    for module in modules:
        kind = str(module.get("type", ""))
        if kind.endswith(".Pooling"):
            config = _read_json(folder / module.get("path", "") / "config.json") or {}
            modes = [name for key, name in _ST_POOLING_MODES if config.get(key)]
            unknown = [
                k
                for k, v in config.items()
                if k.startswith("pooling_mode_") and v and not any(k == key for key, _ in _ST_POOLING_MODES)
            ]
            if unknown:
                raise ValueError(
                    f"{model_path}: the sentence-transformers Pooling module uses {', '.join(unknown)}, which "
                    "kvllm does not implement; allowed modes: CLS, MEAN, LAST (override with --pooler-config)"
                )
            if modes:
                found["seq_pooling_type"] = modes[0]
        elif kind.endswith(".Normalize"):
            found["use_activation"] = True
    if "seq_pooling_type" not in found:
        return None
    found.setdefault("use_activation", False)
    return found


def sentence_transformers_max_seq_length(model_path: str) -> int | None:
    """max_seq_length of sentence_bert_config.json (what sentence-transformers truncates to), if any."""
    config = _read_json(Path(model_path) / "sentence_bert_config.json")
    value = config.get("max_seq_length") if isinstance(config, dict) else None
    return int(value) if isinstance(value, int) and value > 0 else None


def resolve_runner_type(
    runner: str, convert: str, architecture: str, model_path: str, is_pooling_arch: bool
) -> str:
    """ "generate" or "pooling" for the engine's runner / convert settings (vLLM's ModelConfig rules)."""
    if runner == "auto":
        if convert == "embed" or is_pooling_arch or sentence_transformers_pooling(model_path) is not None:
            resolved = "pooling"
            logger.info("Resolved `--runner auto` to `--runner pooling` for %s", architecture)
        else:
            resolved = "generate"
    else:
        resolved = runner
    if resolved == "generate" and is_pooling_arch:
        raise ValueError(
            f"Embedding models do not support `--runner generate` ({architecture} is an embedding model). "
            "Use `--runner pooling` or `--runner auto` for embedding models."
        )
    if resolved == "pooling" and convert == "none" and not is_pooling_arch:
        raise ValueError(
            f"This model does not support `--runner pooling` with `--convert none` ({architecture} is a "
            "generative model). You can pass `--convert embed` to adapt it into a pooling model."
        )
    return resolved


def resolve_pooler_config(
    user: PoolerConfig | None, model_path: str, default_pooling_type: str
) -> PoolerConfig:
    """The pooler settings: the user's, then the folder's sentence-transformers ones, then the model's."""
    config = user or PoolerConfig()
    folder = sentence_transformers_pooling(model_path)
    if folder:
        config = config.resolved(folder)
    return config.resolved({"seq_pooling_type": default_pooling_type, "use_activation": True})
