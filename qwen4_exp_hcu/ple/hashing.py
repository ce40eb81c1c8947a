"""N-gram hash of Qwen4Exp PLE: token ids -> one table row id per head.

Token t of a request sees its previous ``ngram_size - 1`` tokens; the first ones come from the
request's n-gram context (the tail of what it sent before, EOS for a new request). A shift that
crosses an EOS yields EOS, so n-grams never span two documents. For order n (2..N) the mixed key is
``XOR_{k<n} shift_k * mult[k]`` (int64 wrap-around) and head h's row is ``offset[h] + key mod size[h]``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import torch

from qwen4_exp_hcu.kernels import dispatch
from qwen4_exp_hcu.kernels.ngram_hash import ngram_hash, ngram_ids_reference

_MASK64 = (1 << 64) - 1
_GAMMA = 0x9E3779B97F4A7C15
_LAYER_STRIDE = 10007


def _splitmix64(x: int) -> int:
    x = (x + _GAMMA) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def _is_prime(n: int) -> bool:
    if n < 2 or n % 2 == 0:
        return n == 2
    return all(n % d for d in range(3, math.isqrt(n) + 1, 2))


@lru_cache(maxsize=None)
def _primes_after(start: int, count: int) -> tuple[int, ...]:
    """The first `count` primes greater than `start` (cached: every PLE layer asks for a prefix)."""
    primes, n = [], start
    while len(primes) < count:
        n += 1
        if _is_prime(n):
            primes.append(n)
    return tuple(primes)


def eos_id(text_config) -> int:
    eos = text_config.eos_token_id
    if isinstance(eos, (list, tuple)):
        eos = eos[0] if eos else None
    if eos is None:
        raise ValueError("config.eos_token_id must be set: the PLE n-gram hash pads with EOS.")
    return int(eos)


def ngram_heads(text_config) -> int:
    """Hash heads per token of a PLE layer: `heads_per_ngram` for each n-gram order 2..ngram_size."""
    return (text_config.ngram_size - 1) * text_config.heads_per_ngram


def ple_embed_dim(text_config) -> int:
    """The width of one layer's looked-up row (all heads): `ple_embed_dim`, or the hidden size when unset."""
    return text_config.ple_embed_dim or text_config.hidden_size


def validate_ple_config(text_config) -> None:
    """Reject PLE settings the layer cannot serve, naming the offending setting."""
    ids = list(text_config.ple_layer_ids or [])
    if not ids:
        return
    heads = ngram_heads(text_config)
    if text_config.ngram_size < 2 or text_config.heads_per_ngram < 1:
        raise ValueError(
            f"ngram_size must be >= 2 and heads_per_ngram >= 1, got {text_config.ngram_size}, "
            f"{text_config.heads_per_ngram}."
        )
    embed_dim = ple_embed_dim(text_config)
    if embed_dim % heads:
        raise ValueError(
            f"ple_embed_dim={embed_dim} is not divisible by the number of n-gram heads "
            f"(ngram_size-1)*heads_per_ngram={heads}."
        )
    n_layers = text_config.num_hidden_layers
    bad = [i for i in ids if not 1 <= i <= n_layers]
    if bad:
        raise ValueError(f"ple_layer_ids are 1-indexed decoder layers in [1, {n_layers}], got {bad}.")
    not_linear = [i for i in ids if text_config.layer_types[i - 1] != "linear_attention"]
    if not_linear:
        raise ValueError(f"ple_layer_ids {not_linear} are not linear_attention layers; PLE needs one.")
    eos_id(text_config)


# Releases' config.json carry no `seed`; transformers' class defaults it, vLLM 0.29-0.30's config class does not.
DEFAULT_SEED = 1234


@dataclass(frozen=True)
class NgramHashSpec:
    """Everything the hash of one PLE layer needs; derived from the config alone."""

    ngram_size: int
    heads_per_ngram: int
    eos_token_id: int
    head_dim: int
    multipliers: tuple[int, ...]  # [ngram_size]
    head_sizes: tuple[int, ...]  # [H] primes
    head_offsets: tuple[int, ...]  # [H]
    rows: int  # table rows, padded

    @property
    def num_heads(self) -> int:
        return len(self.head_sizes)

    @property
    def context_len(self) -> int:
        return self.ngram_size - 1

    @classmethod
    def from_config(cls, text_config, ple_layer_index: int) -> NgramHashSpec:
        validate_ple_config(text_config)
        n_ple = len(text_config.ple_layer_ids or [])
        if not 0 <= ple_layer_index < n_ple:
            raise ValueError(f"ple_layer_index={ple_layer_index} outside [0, {n_ple}) (ple_layer_ids).")
        n, per = text_config.ngram_size, text_config.heads_per_ngram
        heads = ngram_heads(text_config)
        primes = _primes_after(text_config.ngram_vocab_size_base - 1, (ple_layer_index + 1) * heads)
        sizes = primes[ple_layer_index * heads :]
        offsets = tuple(sum(sizes[:h]) for h in range(heads))
        div = text_config.make_ngram_vocab_size_divisible_by
        rows = -(-sum(sizes) // div) * div

        half = max(1, ((1 << 63) - 1) // max(text_config.vocab_size, 1) // 2)
        base = getattr(text_config, "seed", DEFAULT_SEED) + _LAYER_STRIDE * ple_layer_index
        mults = tuple(2 * (_splitmix64((base + _GAMMA * (i + 1)) & _MASK64) % half) + 1 for i in range(n))
        embed_dim = ple_embed_dim(text_config)
        return cls(n, per, eos_id(text_config), embed_dim // heads, mults, sizes, offsets, rows)

    def check_buffer(self, name: str, stored, where: str = "") -> None:
        """Compare one stored hash buffer of the checkpoint with what the config implies."""
        expected = {
            "layer_multipliers": self.multipliers,
            "ngram_heads_vocab_sizes": self.head_sizes,
            "ngram_heads_offsets": self.head_offsets,
        }[name]
        got = tuple(int(v) for v in torch.as_tensor(stored).flatten().tolist())
        if got != expected:
            raise ValueError(
                f"checkpoint buffer {where}{name} = {list(got)[:8]} disagrees with the config "
                f"(expected {list(expected)[:8]}): ngram/seed/vocab settings do not match the checkpoint."
            )

    def tensors(self, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(multipliers [N], head sizes [H], head offsets [H]) as int64 tensors on `device`."""
        return tuple(torch.tensor(v, dtype=torch.int64, device=device) for v in (self.multipliers, self.head_sizes, self.head_offsets))


def ngram_ids(spec: NgramHashSpec, input_ids, query_start_loc, ngram_context, out=None) -> torch.Tensor:
    """Row ids [T, H] int64 for a packed batch (request r = tokens qsl[r]:qsl[r+1]): Triton on accelerators, the
    torch reference on the CPU (`kernels.dispatch`). No host syncs."""
    return dispatch(ngram_hash, ngram_ids_reference, spec, input_ids, query_start_loc, ngram_context, out=out)
