"""Decode that writes natural text: a vLLM logits processor that makes each request's greedy output the token ids
its `SamplingParams.extra_args["follow"]` lists, in order.

A random model's own greedy tokens land uniformly over the vocabulary, so the PLE rows a decode step reads would be
uniform too whatever the prompt. Served text repeats its n-grams, and the file tier's resident rows are chosen for
that: with `--follow-text`, `bench_serve`'s text prompts decode the text that follows them, so decode reads the
rows text reads. The model still computes every step in full; only the sampled token is chosen.

vLLM's model runner V2 interface (`vllm.v1.worker.gpu.sample.logits_processor`, the same from 0.32 through 0.34; V2
is what the GPU runs): device tensors only, no host sync in `apply`."""

from __future__ import annotations

import torch
from vllm.v1.worker.gpu.sample.logits_processor import LogitsContext, LogitsProcessor, LogitsProcRequestState

FOLLOW_KEY = "follow"
MAX_FOLLOW = 1024  # token ids a request may list
LIFT = 1e4  # added to the listed token's logit: far above any logit a model gives, so greedy takes it


def follow_args(token_ids: list[int]) -> dict:
    """`SamplingParams(extra_args=...)` for a request whose output must be `token_ids`."""
    return {FOLLOW_KEY: [int(t) for t in token_ids]}


class FollowText(LogitsProcessor):
    """Greedy output = the request's listed ids: output token i is the i-th id. Requests without a list are left
    alone."""

    def __init__(self, vllm_config, req_states: LogitsProcRequestState):
        self.req_states = req_states
        self.ids = torch.zeros(req_states.max_num_reqs, MAX_FOLLOW, dtype=torch.int64, device=req_states.device)
        self.lengths = torch.zeros(req_states.max_num_reqs, dtype=torch.int64, device=req_states.device)
        self.staged: dict[int, list[int]] = {}

    @classmethod
    def validate_params(cls, sampling_params) -> None:
        ids = (sampling_params.extra_args or {}).get(FOLLOW_KEY)
        if ids is None:
            return
        if not (isinstance(ids, list) and 0 < len(ids) <= MAX_FOLLOW and all(isinstance(t, int) for t in ids)):
            raise ValueError(f"extra_args[{FOLLOW_KEY!r}] must list 1 to {MAX_FOLLOW} token ids")

    def add_request(self, req_idx: int, sampling_params) -> bool:
        ids = (sampling_params.extra_args or {}).get(FOLLOW_KEY) or []
        self.staged[req_idx] = ids  # a recycled slot's old list is cleared too
        return bool(ids)

    def apply_staged_writes(self) -> None:
        for req_idx, ids in self.staged.items():
            self.lengths[req_idx] = len(ids)
            if ids:
                self.ids[req_idx, : len(ids)] = torch.tensor(ids, dtype=torch.int64).to(self.ids.device)
        self.staged.clear()

    def apply(self, logits: torch.Tensor, ctx: LogitsContext) -> torch.Tensor:
        slots = ctx.expanded_idx_mapping.long()
        lengths = self.lengths[slots]
        # The row samples the token after its input position: output index pos + 1 - prompt length.
        index = ctx.pos.long() + 1 - self.req_states.prompt_len.gpu[slots].long()
        token = self.ids[slots, index.clamp(min=0) % lengths.clamp(min=1)]
        lift = torch.where(lengths > 0, LIFT, 0.0).to(logits.dtype)
        return logits.scatter_add_(1, token[:, None], lift[:, None])
