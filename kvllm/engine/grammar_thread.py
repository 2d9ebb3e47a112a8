"""The grammar masks of a constrained step filled on a thread of their own, during the step's launch.

At batch 64 the engine's thread is the wall of a constrained decode step: after the forward pass is
launched it takes the previous step's tokens, advances the grammars by them and fills this step's masks
(xgrammar holds the GIL throughout), then launches the sampling. A CUDA graph's launch lets go of the GIL,
so that work can run beside it on another thread. It must not start earlier: once that thread holds the
GIL, the engine's thread waits for all of its work at its next Python step, which before the launch would
leave the device idle. So the thread first waits (without the GIL) for the previous step's tokens, then for
`launching()`, which the worker calls right before the launch, and only then takes the GIL.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch


class GrammarThread:
    """The one thread that fills the masks, made on first use (an engine without structured outputs
    never starts it)."""

    def __init__(self) -> None:
        self._pool: ThreadPoolExecutor | None = None

    def masks_ahead(
        self, wait_for_tokens: Callable[[], None], fill: Callable[[], torch.Tensor | None], num_rows: int
    ) -> MasksAhead:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="kvllm-grammar")
        return MasksAhead(self._pool, wait_for_tokens, fill, num_rows)

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False)


class MasksAhead:
    """One step's masks (a GrammarBitmaskFn): `wait_for_tokens` runs on the thread at once, `fill` (for
    all `num_rows` scheduled rows) once the worker calls `launching()`; called with the rows that sample,
    it waits for the masks and picks those rows."""

    def __init__(
        self,
        pool: ThreadPoolExecutor,
        wait_for_tokens: Callable[[], None],
        fill: Callable[[], torch.Tensor | None],
        num_rows: int,
    ) -> None:
        self._launching = threading.Event()
        self._every_row = list(range(num_rows))
        self._future = pool.submit(self._run, wait_for_tokens, fill)

    @torch.inference_mode()  # as the worker's own call would be (the mode is per thread)
    def _run(self, wait_for_tokens: Callable[[], None], fill: Callable[[], torch.Tensor | None]):
        wait_for_tokens()
        self._launching.wait()
        return fill()

    def launching(self) -> None:
        """The step's forward pass is being launched: the fill may take the GIL from now on."""
        self._launching.set()

    def __call__(self, rows: list[int]) -> torch.Tensor | None:
        masks = self.result()
        return masks if masks is None or rows == self._every_row else masks[rows]

    def result(self) -> torch.Tensor | None:
        """The masks of every scheduled row, once filled (also when the worker never asked: a step in
        which no row samples), with the previous step's tokens taken; raises what the thread raised."""
        self.launching()  # never wait on a launch that is not coming
        return self._future.result()
