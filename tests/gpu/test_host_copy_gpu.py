"""StagingBuffer on the GPU: uploads queued behind device work land in order from rotating pinned buffers.

Run on the H200: `PYTHONPATH=. python -m pytest -q -m gpu tests/gpu/test_host_copy_gpu.py`.
"""

from __future__ import annotations

import pytest
import torch

from kvllm.utils.host_copy import StagingBuffer

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.mark.parametrize("depth", [2, 8])
def test_uploads_behind_queued_work_land_in_order(depth: int) -> None:
    """Each upload is queued behind a long matmul chain and read by a copy after it: a host buffer reused before
    its upload ran would make an earlier snapshot read a later step's values."""
    device = torch.device("cuda")
    staging = StagingBuffer(64, torch.int64, device, depth=depth)
    gen = torch.Generator(device="cpu").manual_seed(0)
    expected, seen = [], []
    busy = torch.randn(2048, 2048, device=device)
    for _ in range(3 * depth):
        for _ in range(4):  # device work ahead of the upload, so the host runs ahead of the stream
            busy = torch.tanh(busy @ busy)
        values = torch.randint(0, 1 << 40, (64,), generator=gen)
        staging.next_host_numpy()[:] = values.numpy()
        expected.append(values)
        seen.append(staging.upload().clone())
    torch.cuda.synchronize()
    for step, (want, got) in enumerate(zip(expected, seen, strict=True)):
        assert torch.equal(got.cpu(), want), f"upload {step} of depth {depth} read another step's values"
