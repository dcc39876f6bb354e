"""A deterministic toy corpus: token sequences from a fixed sparse Markov chain.

Each token has a few likely successors, so a small model's loss falls visibly from
ln(vocab) towards the chain's entropy within a few dozen steps. Everything derives from
seeds: every rank, every run and every machine sees the same data.
"""

from __future__ import annotations

import torch


def markov_chain(vocab_size: int, successors: int = 3, seed: int = 1234) -> torch.Tensor:
    """Row-stochastic [vocab, vocab] transition matrix with ``successors`` non-zeros per row."""
    generator = torch.Generator().manual_seed(seed)
    matrix = torch.zeros(vocab_size, vocab_size)
    for token in range(vocab_size):
        targets = torch.randperm(vocab_size, generator=generator)[:successors]
        weights = torch.rand(successors, generator=generator) + 0.5
        matrix[token, targets] = weights / weights.sum()
    return matrix


def sample_batch(chain: torch.Tensor, batch_size: int, length: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets), each [batch_size, length]: targets are inputs shifted by one."""
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.empty(batch_size, length + 1, dtype=torch.long)
    tokens[:, 0] = torch.randint(chain.shape[0], (batch_size,), generator=generator)
    for position in range(length):
        tokens[:, position + 1] = torch.multinomial(chain[tokens[:, position]], 1, generator=generator).squeeze(1)
    return tokens[:, :-1], tokens[:, 1:]


def batch_seed(step: int, rank: int, micro_batch: int) -> int:
    """A distinct seed per (step, rank, micro-batch), the same for any launcher."""
    return 1_000_003 * step + 1009 * rank + micro_batch + 17
