"""Prefetch workspace: start each PLE lookup on a side stream while the preceding decoder layer runs.

Persistent output buffers sized for `max_tokens` keep addresses fixed, so `start`/`wait` capture into
one CUDA graph as a fork/join of the side stream (event record + wait; no eager break) and replay with
new inputs. On CPU, `start` runs the lookup at once. The workspace holds the inputs of a started
lookup until its `wait`, so the caching allocator cannot hand their memory to the main stream while the
side stream still reads them (eager steps build fresh index tensors each step).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from qwen4_exp_hcu.ple.layer import PLELayer


class PrefetchWorkspace:
    def __init__(self, layers: Sequence[PLELayer], max_tokens: int, device: torch.device | str):
        self.layers, self.max_tokens, device = list(layers), max_tokens, torch.device(device)
        self.buffers = [
            torch.empty(max_tokens, l.spec.num_heads * l.spec.head_dim, dtype=torch.bfloat16, device=device)
            for l in self.layers
        ]
        self.side = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.ready = [torch.cuda.Event() for _ in self.layers] if self.side is not None else []
        self._inflight: dict[int, tuple] = {}  # layer -> (tokens, inputs kept alive)

    def start(self, i: int, input_ids, query_start_loc, slot_ids, ngram_state, has_initial_state, max_tokens=None) -> None:
        """Launch layer i's hash + lookup + ETP combine. `max_tokens`: the most tokens any ETP rank holds
        (across DP; exchanged here when not given, so every rank sees the same capacity error)."""
        T, etp = input_ids.shape[0], self.layers[i].etp
        if etp.across_dp and max_tokens is None:
            max_tokens = etp.step_max_tokens(T, input_ids.device)
        need = max(T, max_tokens) if etp.across_dp else T
        if need > self.max_tokens:
            raise ValueError(
                f"PLE prefetch: {need} tokens exceed the workspace capacity max_tokens={self.max_tokens} "
                "(raise max_num_batched_tokens for the workspace)."
            )
        out = self.buffers[i][:T]
        args = (input_ids, query_start_loc, slot_ids, ngram_state, has_initial_state)
        if self.side is None:
            self.layers[i].lookup(*args, out=out, max_tokens=max_tokens)
        else:
            self.side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(self.side):
                self.layers[i].lookup(*args, out=out, max_tokens=max_tokens)
                self.ready[i].record(self.side)
        self._inflight[i] = (T, args)

    def wait(self, i: int) -> torch.Tensor:
        """Join layer i's lookup; returns its [T, ple_embed_dim] bf16 embeddings (a view of the buffer)."""
        if i not in self._inflight:
            raise RuntimeError(f"PLE prefetch: wait({i}) without a start({i}) in this step.")
        T, _ = self._inflight.pop(i)
        if self.side is not None:
            torch.cuda.current_stream().wait_event(self.ready[i])
        return self.buffers[i][:T]
