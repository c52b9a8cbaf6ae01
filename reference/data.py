"""Deterministic synthetic token data with learnable structure, for training the tiny model.

Tokens follow a random sparse Markov chain: from each token, `branching` successors carry
`1 - noise` of the probability (random weights), and `noise` is spread uniformly over the whole
vocabulary. A model that learns the bigram table reaches the chain's entropy rate (see
`entropy_rate`), well below `log(vocab)`, so training measurably lowers the loss.

Everything is drawn in float64 on the CPU from a `torch.Generator` with a fixed seed, and sampling
uses `torch.rand` + `searchsorted` (no `torch.multinomial`), so the same arguments give the same
tokens on every call, in every process and on every thread count. Torch's global RNG is untouched.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch

from canzona.errors import SpecError

__all__ = [
    "entropy_rate",
    "fixed_batch",
    "shard_batch",
    "synthetic_batches",
    "transition_matrix",
    "uniform_loss",
]

# Offset so the chain's generator and the sampling generator are different streams.
_SAMPLE_STREAM = 0x5EED_DA7A


def _check_int(name: str, value, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise SpecError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return value


def _generator(seed: int) -> torch.Generator:
    gen = torch.Generator(device="cpu")
    gen.manual_seed(int(seed) & 0xFFFF_FFFF_FFFF_FFFF)
    return gen


def transition_matrix(vocab: int, seed: int = 0, branching: int = 4,
                      noise: float = 0.05) -> torch.Tensor:
    """Row-stochastic `vocab x vocab` float64 matrix: P[a, b] = probability that b follows a."""
    _check_int("vocab", vocab, 2)
    _check_int("branching", branching, 1)
    if branching > vocab:
        raise SpecError(f"branching ({branching}) cannot exceed vocab ({vocab})")
    if not (isinstance(noise, (int, float)) and 0.0 <= noise <= 1.0):
        raise SpecError(f"noise must be in [0, 1], got {noise!r}")
    gen = _generator(seed)
    probs = torch.full((vocab, vocab), noise / vocab, dtype=torch.float64)
    for a in range(vocab):
        succ = torch.randperm(vocab, generator=gen)[:branching]
        w = torch.rand(branching, generator=gen, dtype=torch.float64) + 0.25
        probs[a, succ] += (1.0 - noise) * w / w.sum()
    return probs / probs.sum(dim=1, keepdim=True)


def entropy_rate(probs: torch.Tensor) -> float:
    """Entropy rate (nats per token) of the chain at its stationary distribution: the best
    next-token cross-entropy any model can reach on long sequences."""
    evals, evecs = torch.linalg.eig(probs.T)
    pi = evecs[:, torch.argmin((evals - 1).abs())].real
    pi = pi / pi.sum()
    plogp = torch.where(probs > 0, probs * probs.clamp_min(1e-300).log(), torch.zeros_like(probs))
    return float(-(pi * plogp.sum(dim=1)).sum())


def synthetic_batches(vocab: int, batch: int, seq_len: int, steps: int, seed: int = 0, *,
                      branching: int = 4, noise: float = 0.05, chain_seed: int | None = None,
                      device: torch.device | str | None = None) -> Iterator[torch.Tensor]:
    """Yield `steps` LongTensors of shape `batch x seq_len` sampled from the Markov chain.

    The chain is `transition_matrix(vocab, chain_seed, branching, noise)` (`chain_seed` defaults to
    `seed`); the first token of each row is uniform. Pass a different `seed` with the same
    `chain_seed` for fresh samples (e.g. held-out data) of the same language. Each call starts
    afresh, so two calls with the same arguments yield identical batches.
    """
    _check_int("batch", batch, 1)
    _check_int("seq_len", seq_len, 1)
    _check_int("steps", steps, 0)
    probs = transition_matrix(vocab, seed if chain_seed is None else chain_seed, branching, noise)
    cum = probs.cumsum(dim=1)
    cum[:, -1] = 1.0  # guard against round-off: every uniform draw in [0, 1) lands in a bucket
    gen = _generator(int(seed) + _SAMPLE_STREAM)
    return _sample(cum, batch, seq_len, steps, gen, device)


def _sample(cum: torch.Tensor, batch: int, seq_len: int, steps: int, gen: torch.Generator,
            device) -> Iterator[torch.Tensor]:
    vocab = cum.shape[0]
    for _ in range(steps):
        u = torch.rand(batch, seq_len, generator=gen, dtype=torch.float64)
        out = torch.empty(batch, seq_len, dtype=torch.long)
        out[:, 0] = (u[:, 0] * vocab).long().clamp_(max=vocab - 1)
        for t in range(1, seq_len):
            rows = cum[out[:, t - 1]]
            nxt = torch.searchsorted(rows, u[:, t : t + 1].contiguous(), right=True).squeeze(1)
            out[:, t] = nxt.clamp_(max=vocab - 1)
        yield out if device is None else out.to(device)


def fixed_batch(vocab: int, batch: int, seq_len: int, seed: int = 0, **kwargs) -> torch.Tensor:
    """The first batch of `synthetic_batches(vocab, batch, seq_len, 1, seed, **kwargs)`."""
    return next(synthetic_batches(vocab, batch, seq_len, 1, seed, **kwargs))


def shard_batch(tokens: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """Rows `[rank * b, (rank + 1) * b)` of a global batch, `b = batch / world` (data parallel)."""
    _check_int("world", world, 1)
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world:
        raise SpecError(f"rank must be in [0, {world}), got {rank!r}")
    n = tokens.shape[0]
    if n % world:
        raise SpecError(f"global batch {n} does not split evenly over {world} data-parallel ranks")
    b = n // world
    return tokens[rank * b : (rank + 1) * b]


def uniform_loss(vocab: int) -> float:
    """Cross-entropy of the uniform guess, `log(vocab)` (an untrained model's loss)."""
    return math.log(vocab)
