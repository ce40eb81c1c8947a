"""What a PLE layer is called with: one step's packed requests (`PLEBatch`, built once per step and shared
by every PLE layer) and one layer's per-request state (`PLEState`, indexed by slot).

Requests are packed: request r owns tokens `query_start_loc[r] : query_start_loc[r+1]` and state slot
`slot_ids[r]`; slot < 0 marks a padding request (never read, never written) and tokens past
`query_start_loc[-1]` (or `num_real_tokens`) are padding (CUDA-graph batches: computed, never stored).
`has_initial_state[r]` is False for a request's first chunk (its state starts from EOS context and a zero
conv window).

Speculative decoding (vLLM's layout for stateful layers): a state made with `num_speculative_tokens=E`
keeps E more entries than the layer needs. A request with `verify[r]` sends its last token and k <= E draft
tokens; every position gets the output it would get without speculation, and the state keeps the window
after each of them. The next step's `num_accepted[r]` (1..k+1: the last token plus the accepted drafts)
commits that many: the state is read from there, and rejected drafts leave no trace.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PLEBatch:
    input_ids: torch.Tensor  # [T] token ids
    query_start_loc: torch.Tensor  # [B + 1]
    slot_ids: torch.Tensor  # [B] int64
    has_initial_state: torch.Tensor  # [B] bool
    max_tokens: int | None = None
    """Across-DP ETP only: the most tokens any rank holds this step (every rank must agree; exchanged
    when None). vLLM knows it from its DP metadata."""
    verify: torch.Tensor | None = None  # [B] bool: the request's tokens are its last token + drafts
    num_accepted: torch.Tensor | None = None  # [B] int: tokens accepted of the request's previous verify step
    num_real_tokens: torch.Tensor | None = None
    """0-d: the tokens from here on are padding, where a CUDA graph pads whole requests (vLLM's decodes at a
    captured size, their `query_start_loc` fixed when the graph was captured); None: `query_start_loc[-1]`."""

    @classmethod
    def from_lengths(
        cls, input_ids, lengths, slot_ids, has_initial_state, max_tokens=None, verify=None, num_accepted=None
    ) -> PLEBatch:
        """From per-request token counts and Python/tensor slot ids and flags (notebooks, tests)."""
        device = input_ids.device
        qsl = torch.zeros(len(lengths) + 1, dtype=torch.int64)
        qsl[1:] = torch.as_tensor(list(lengths), dtype=torch.int64).cumsum(0)
        as_tensor = lambda v, dtype: None if v is None else torch.as_tensor(v, dtype=dtype).to(device)  # noqa: E731
        return cls(
            input_ids,
            qsl.to(device),
            as_tensor(slot_ids, torch.int64),
            as_tensor(has_initial_state, torch.bool),
            max_tokens,
            as_tensor(verify, torch.bool),
            as_tensor(num_accepted, torch.int64),
        )

    @property
    def real_tokens(self) -> torch.Tensor:
        """Where the padding starts, on the batch's device (no host sync)."""
        return self.query_start_loc[-1] if self.num_real_tokens is None else self.num_real_tokens

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]

    @property
    def num_requests(self) -> int:
        return self.slot_ids.shape[0]


@dataclass(frozen=True)
class PLEState:
    ngram: torch.Tensor  # [S, ngram_size - 1 + E] int64: the last tokens each request sent
    conv: torch.Tensor  # [S, (K - 1) * ngram_size + E, hc * hidden]: the dilated short-conv window

    @classmethod
    def zeros(cls, shapes, slots: int, dtype: torch.dtype, device=None) -> PLEState:
        """Fresh state for `slots` requests; `shapes` = `state_shapes(text_config, num_speculative_tokens)`
        (per slot)."""
        ngram_shape, conv_shape = shapes
        return cls(
            torch.zeros(slots, *ngram_shape, dtype=torch.int64, device=device),
            torch.zeros(slots, *conv_shape, dtype=dtype, device=device),
        )

    def clone(self) -> PLEState:
        return PLEState(self.ngram.clone(), self.conv.clone())
