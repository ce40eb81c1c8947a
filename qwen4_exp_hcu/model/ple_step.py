"""Per-step batch building for the PLE ops: vLLM's PLE short-conv metadata -> one `PLEBatch` per state group,
built once per step and shared by every PLE layer of the group."""

from __future__ import annotations

import torch
from vllm.forward_context import get_forward_context

from qwen4_exp_hcu.ple.batch import PLEBatch


class StepBatches:
    """The `PLEBatch` of each state group, built once per step by the first PLE op that asks.

    Keyed by the forward context (new every step, also at every breakable-graph replay) and by the
    group's metadata object (every PLE layer of one KV-cache group shares it)."""

    def __init__(self) -> None:
        self._context, self._batches = None, {}

    def get(self, metadata, build) -> PLEBatch:
        context = get_forward_context()
        if context is not self._context:
            self._context, self._batches = context, {}
        key = id(metadata)
        if key not in self._batches:
            self._batches[key] = (metadata, build(metadata))  # holds the metadata: its id stays unique
        return self._batches[key][1]


STEP_BATCHES = StepBatches()


def pack(metadata, input_ids: torch.Tensor) -> PLEBatch:
    """PLEBatch from the PLE short-conv metadata. Without speculation this step it orders decodes (one
    token each) before prefills and keeps each part's slots and flags separately. A full graph's decodes are
    its captured size, padding requests included; vLLM fills `metadata.query_start_loc` past the real requests
    with their token count, which marks the padding."""
    if metadata.spec_sequence_masks is not None:
        return pack_speculative(metadata, input_ids)
    device = input_ids.device
    d, p = metadata.num_decodes, metadata.num_prefills
    qsl, slots, initial = [torch.arange(d + 1, dtype=torch.int64, device=device)], [], []
    if d:
        slots.append(metadata.state_indices_tensor_d[:d, 0].long())
        initial.append(torch.ones(d, dtype=torch.bool, device=device))
    if p:
        qsl.append(metadata.query_start_loc_p[1:].long() + metadata.num_decode_tokens)
        slots.append(metadata.state_indices_tensor_p[:p].long())
        initial.append(metadata.has_initial_states_p[:p])
    return PLEBatch(input_ids, _cat(qsl), _cat(slots), _cat(initial), dp_max_tokens(),
                    num_real_tokens=metadata.query_start_loc[-1])


def _cat(parts: list[torch.Tensor]) -> torch.Tensor:
    """`torch.cat` without its copy kernel for one part (a decode-only step: three kernels fewer a step)."""
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def pack_speculative(metadata, input_ids: torch.Tensor) -> PLEBatch:
    """PLEBatch in request order when some requests verify drafts. The metadata lists the verifying
    requests' slots and accepted counts, and the others' slots (plain decodes, then prefills) apart;
    each request finds its entry by its rank within its group (no host syncs)."""
    B = metadata.num_reqs
    spec = metadata.spec_sequence_masks[:B]
    qsl = metadata.query_start_loc[: B + 1].long()
    one = (qsl[1:] - qsl[:-1]) == 1
    decode, prefill = ~spec & one, ~spec & ~one
    n_spec, d, p = metadata.num_spec_decodes, metadata.num_decodes, metadata.num_prefills
    at_spec, at_decode, at_prefill = _rank(spec), _rank(decode), _rank(prefill)
    others = metadata.state_indices_tensor.long()
    slots = torch.where(spec, _entry(metadata.spec_state_indices_tensor.long(), at_spec, n_spec),
                        torch.where(decode, _entry(others, at_decode, d), _entry(others[d:], at_prefill, p)))  # fmt: skip
    initial = spec | torch.where(
        decode,
        _entry(metadata.has_initial_states_d, at_decode, d) if d else False,
        _entry(metadata.has_initial_states_p, at_prefill, p) if p else False,
    )
    accepted = torch.where(spec, _entry(metadata.num_accepted_tokens.long(), at_spec, n_spec), 1)
    return PLEBatch(input_ids, qsl, slots, initial, dp_max_tokens(), verify=spec, num_accepted=accepted)


def _rank(mask: torch.Tensor) -> torch.Tensor:
    """Each request's position among the requests `mask` selects, counted on the device (no host sync). Requests
    outside the mask get their predecessor's rank (0 before the first): `torch.where` discards them."""
    return (mask.long().cumsum(0) - 1).clamp_min(0)


def _entry(values: torch.Tensor, rank: torch.Tensor, n: int) -> torch.Tensor:
    """`values[rank]` within a group's first `n` entries, for every request. Ranks of requests outside the group
    are clamped into range, their entries discarded by `torch.where`; an empty group gives zeros."""
    return values[:n][rank.clamp_max(max(n - 1, 0))] if n else torch.zeros_like(rank)


def dp_max_tokens() -> int | None:
    """The most tokens any DP rank holds this step (what across-DP ETP lookups agree on)."""
    dp = get_forward_context().dp_metadata
    return None if dp is None else int(dp.num_tokens_across_dp_cpu.max())
