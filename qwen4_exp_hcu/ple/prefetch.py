"""Prefetch workspace: start each PLE lookup on a side stream while the preceding decoder layer runs.

`PrefetchWorkspace(layers, max_tokens, device).handles[i]` (or `.add(layer)`) is layer i's `Prefetch`:
`start(batch, state)` launches its hash + lookup + ETP combine, `wait()` joins it and returns the embeddings to pass to
`PLELayer.forward(..., embeddings=)`. Persistent output buffers sized for `max_tokens` keep addresses
fixed, so `start`/`wait` capture into one CUDA graph as a fork/join of the side stream (event record +
wait) and replay with new inputs. On CPU, `start` runs the lookup at once. A handle holds the inputs of a
started lookup until its `wait`, so the caching allocator cannot hand their memory to the main stream
while the side stream still reads them (eager steps build fresh index tensors each step).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from qwen4_exp_hcu.ple.batch import PLEBatch, PLEState
from qwen4_exp_hcu.ple.layer import PLELayer


class Prefetch:
    """One layer's slot in the workspace: its output buffer, its ready event and its in-flight inputs."""

    def __init__(self, layer: PLELayer, capacity: int, side: torch.cuda.Stream | None, device: torch.device):
        self.layer, self.capacity, self.side = layer, capacity, side
        self.buffer = torch.empty(capacity, layer.spec.num_heads * layer.spec.head_dim, dtype=torch.bfloat16, device=device)
        self.ready = torch.cuda.Event() if side is not None else None
        self._inflight: tuple[PLEBatch, PLEState] | None = None

    def start(self, batch: PLEBatch, state: PLEState) -> None:
        """Launch the lookup. Across DP every rank checks capacity against the same token bound."""
        T = batch.num_tokens
        bound = self.layer.etp.token_bound(T, batch.max_tokens, batch.input_ids.device)
        need = T if bound is None else max(T, bound)
        if need > self.capacity:
            raise ValueError(
                f"PLE prefetch: {need} tokens exceed the workspace capacity max_tokens={self.capacity} "
                "(raise max_num_batched_tokens for the workspace)."
            )
        batch = dataclasses.replace(batch, max_tokens=bound)  # resolved once: the lookup exchanges nothing
        out = self.buffer[:T]
        if self.side is None:
            self.layer.lookup(batch, state, out=out)
        else:
            self.side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(self.side):
                self.layer.lookup(batch, state, out=out)
                self.ready.record(self.side)
        self._inflight = (batch, state)

    def wait(self) -> torch.Tensor:
        """Join the lookup; returns its [T, ple_embed_dim] bf16 embeddings (a view of the buffer)."""
        if self._inflight is None:
            raise RuntimeError("PLE prefetch: wait() without a start() in this step.")
        batch, _ = self._inflight
        self._inflight = None
        if self.side is not None:
            torch.cuda.current_stream().wait_event(self.ready)
        return self.buffer[: batch.num_tokens]


class PrefetchWorkspace:
    """The handles of `layers` (`handles`, in order), more added one at a time (`add`), sharing one side stream."""

    def __init__(self, layers: Sequence[PLELayer], max_tokens: int, device: torch.device | str):
        self.max_tokens, self.device = max_tokens, torch.device(device)
        self.side = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self.handles: list[Prefetch] = []
        for layer in layers:
            self.add(layer)

    def add(self, layer: PLELayer) -> Prefetch:
        """A handle for one more layer (a vLLM decoder layer adds its own while it is built)."""
        handle = Prefetch(layer, self.max_tokens, self.side, self.device)
        self.handles.append(handle)
        return handle
