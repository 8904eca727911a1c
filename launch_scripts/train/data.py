"""Corpora for the training example: an embedded synthetic default, a text file, or a token file.

The default corpus needs no download. It is sampled from a random sparse second-order Markov chain
over 32 tokens (each pair of tokens has 4 possible successors with Dirichlet-drawn probabilities),
generated from a fixed seed, so its entropies are known exactly: the entropy rate
``H = sum_c pi(c) * H(P[c, :])`` nats per token, with ``pi`` the stationary distribution over
contexts ``c`` (token pairs), and the entropy of a token given only the one before it. The
lowest mean loss over a block (``Corpus.loss_floor``) is H at every position but the first, which
sees one token of context. A run shows a plateau near the one-token entropy (about 3.2) until the
model learns to attend to the token before last, then its loss approaches the floor.

Note: world-size-independent batches. The batch of a step is drawn by a generator seeded with
``(seed, split, step, micro_step)`` only: it draws the start offsets of the whole global batch
(``world_size * batch_size`` sequences) and rank ``r`` takes the ``r``-th slice. So the global batch
is the concatenation of the ranks' batches, identical for a ZeRO run and a DDP run (and for any
world size with the same global batch), and a resumed run draws exactly what an uninterrupted run
draws, with no sampler state to checkpoint.

Example:
    >>> corpus = load_corpus(None)
    >>> x, y = corpus.batch("train", (0, 0, 0), batch_size=4, block_size=32)
    >>> x.shape, corpus.loss_floor is not None
    (torch.Size([4, 32]), True)
"""

from __future__ import annotations

import dataclasses
import math
import os
import pickle

import numpy as np
import torch

SPLITS = ("train", "val")
GPT2_PADDED_VOCAB = 50304  # nanoGPT's GPT-2 BPE vocabulary, padded to a multiple of 64
VAL_FRACTION = 0.1


class DataError(ValueError):
    """A data file that cannot be used (missing, empty, too short, undecodable)."""


@dataclasses.dataclass(frozen=True)
class Corpus:
    """Token streams for training and validation.

    Attributes:
        name: where the tokens come from, for logs.
        train: 1-D array of token ids (uint16; a read-only memmap for ``.bin`` files).
        val: 1-D array of token ids.
        vocab_size: number of distinct token ids the model must embed.
        entropies: when the source is known, ``entropies[m - 1]`` is the entropy (nats) of a token
            given the ``m`` tokens before it, the last entry being the entropy rate; else None.
    """

    name: str
    train: np.ndarray
    val: np.ndarray
    vocab_size: int
    entropies: tuple[float, ...] | None = None

    def loss_floor(self, block_size: int) -> float | None:
        """The lowest mean loss over a block: position ``t`` predicts from ``t + 1`` tokens, so the
        first positions of a block see less context than the source's order.
        """
        if self.entropies is None:
            return None
        k = len(self.entropies)
        return sum(self.entropies[min(t, k - 1)] for t in range(block_size)) / block_size

    def check_block_size(self, block_size: int) -> None:
        """Raises DataError when a split is too short for one sequence of ``block_size`` + 1."""
        for split in SPLITS:
            n = len(getattr(self, split))
            if n < block_size + 1:
                raise DataError(
                    f"{self.name}: the {split} split has {n} tokens, too few for --block-size "
                    f"{block_size}; use a longer file or a smaller --block-size"
                )

    def batch(
        self,
        split: str,
        key: tuple[int, ...],
        batch_size: int,
        block_size: int,
        rank: int = 0,
        world_size: int = 1,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's slice of the global batch that ``key`` names (see Note above).

        Args:
            split: ``"train"`` or ``"val"``.
            key: integers naming the batch, e.g. ``(seed, step, micro_step)``.
            batch_size: sequences per rank.
            block_size: tokens per sequence.
            rank: this rank; it gets sequences ``rank * batch_size`` to ``(rank + 1) * batch_size``.
            world_size: number of ranks sharing the global batch.

        Returns:
            ``(inputs, targets)``: int64 CPU tensors of shape (batch_size, block_size), targets
            shifted by one token.
        """
        tokens = getattr(self, split)
        rng = np.random.default_rng([SPLITS.index(split), *key])
        starts = rng.integers(0, len(tokens) - block_size, size=world_size * batch_size)
        starts = starts[rank * batch_size : (rank + 1) * batch_size]
        x = np.stack([tokens[i : i + block_size] for i in starts]).astype(np.int64)
        y = np.stack([tokens[i + 1 : i + 1 + block_size] for i in starts]).astype(np.int64)
        return torch.from_numpy(x), torch.from_numpy(y)


@dataclasses.dataclass(frozen=True)
class MarkovSource:
    """A sparse Markov chain of order ``k`` over ``vocab_size`` tokens.

    A context is the last ``k`` tokens, numbered ``sum(token_i * vocab_size**(k-1-i))``; context
    ``s`` is followed by token ``successors[s, j]`` with probability ``probs[s, j]``.
    """

    vocab_size: int
    order: int
    successors: np.ndarray  # (vocab_size**order, branching) int64
    probs: np.ndarray  # (vocab_size**order, branching) float64, rows sum to 1

    @classmethod
    def random(
        cls, seed: int, vocab_size: int, order: int, branching: int, alpha: float = 1.0
    ) -> MarkovSource:
        """Each context gets ``branching`` distinct random successors, Dirichlet(alpha) weights."""
        rng = np.random.default_rng(seed)
        contexts = vocab_size**order
        successors = np.argsort(rng.random((contexts, vocab_size)), axis=1)[:, :branching]
        probs = rng.dirichlet([alpha] * branching, size=contexts)
        return cls(vocab_size, order, successors, probs)

    def _next_context(self, context: np.ndarray, token: np.ndarray) -> np.ndarray:
        return (context * self.vocab_size + token) % self.vocab_size**self.order

    def stationary(self) -> np.ndarray:
        """Stationary distribution over contexts: power iteration on the lazy chain (which has
        the same stationary distribution and always converges).
        """
        contexts = len(self.successors)
        source = np.repeat(np.arange(contexts), self.successors.shape[1])
        target = self._next_context(source, self.successors.reshape(-1))
        weights = self.probs.reshape(-1)
        pi = np.full(contexts, 1.0 / contexts)
        for _ in range(100_000):
            moved = np.bincount(target, weights=pi[source] * weights, minlength=contexts)
            nxt = 0.5 * (pi + moved)
            if np.abs(nxt - pi).max() < 1e-14 / contexts:
                break
            pi = nxt
        return nxt / nxt.sum()

    def conditional_entropies(self) -> list[float]:
        """``H[m]`` = entropy in nats of the next token given the ``m`` previous ones, for
        ``m = 1 .. order``, at stationarity. ``H[-1]`` is the entropy rate.
        """
        pi = self.stationary()
        p = self.probs
        per_context = -(p * np.log(np.where(p > 0, p, 1.0))).sum(axis=1)
        entropies = []
        grams = pi.reshape((self.vocab_size,) * self.order)
        for m in range(1, self.order):
            # H(next | m previous) = H(m+1 consecutive tokens) - H(m consecutive tokens)
            joint = grams.sum(axis=tuple(range(self.order - m - 1)))
            marginal = joint.sum(axis=-1)
            entropies.append(_entropy(joint) - _entropy(marginal))
        entropies.append(float(pi @ per_context))
        return entropies

    def sample(self, n_chains: int, length: int, seed: int) -> np.ndarray:
        """``n_chains`` independent chains of ``length`` tokens started from the stationary
        distribution, concatenated (vectorised over chains: one numpy op per token).
        """
        rng = np.random.default_rng(seed)
        cumulative = np.cumsum(self.probs, axis=1)
        cumulative[:, -1] = 1.0
        out = np.empty((n_chains, length), dtype=np.uint16)
        context = rng.choice(len(self.successors), size=n_chains, p=self.stationary())
        for i in range(self.order):
            out[:, i] = context // self.vocab_size ** (self.order - 1 - i) % self.vocab_size
        for t in range(self.order, length):
            pick = (rng.random(n_chains)[:, None] > cumulative[context]).sum(axis=1)
            token = self.successors[context, pick]
            out[:, t] = token
            context = self._next_context(context, token)
        return out.reshape(-1)


def _entropy(p: np.ndarray) -> float:
    p = p.reshape(-1)
    p = p[p > 0]
    return float(-(p * np.log(p)).sum())


SYNTHETIC = dict(seed=20240601, vocab_size=32, order=2, branching=4)
SYNTHETIC_CHAINS = 256
SYNTHETIC_CHAIN_LENGTH = 8192  # 2,097,152 tokens in all; the last 1/16 of the chains is val


def synthetic_corpus() -> Corpus:
    """The embedded default: about two million tokens of a fixed random Markov chain."""
    source = MarkovSource.random(**SYNTHETIC)
    tokens = source.sample(SYNTHETIC_CHAINS, SYNTHETIC_CHAIN_LENGTH, SYNTHETIC["seed"] + 1)
    n_val = SYNTHETIC_CHAINS // 16 * SYNTHETIC_CHAIN_LENGTH
    return Corpus(
        name=(
            f"synthetic order-{source.order} Markov chain (vocab {source.vocab_size}, "
            f"{len(tokens):,} tokens)"
        ),
        train=tokens[:-n_val],
        val=tokens[-n_val:],
        vocab_size=source.vocab_size,
        entropies=tuple(source.conditional_entropies()),
    )


def text_corpus(path: str) -> Corpus:
    """A character-level corpus: the vocabulary is the sorted set of characters in the file."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except UnicodeDecodeError as e:
        raise DataError(
            f"{path} is not UTF-8 text ({e.reason} at byte {e.start}); for pre-tokenized data "
            "pass a nanoGPT-style uint16 token file ending in .bin"
        ) from None
    if not text:
        raise DataError(f"{path} is empty")
    chars = sorted(set(text))
    if len(chars) > np.iinfo(np.uint16).max:
        raise DataError(f"{path} has {len(chars)} distinct characters; at most 65535 fit uint16")
    lookup = {c: i for i, c in enumerate(chars)}
    tokens = np.fromiter((lookup[c] for c in text), dtype=np.uint16, count=len(text))
    n_val = max(1, int(len(tokens) * VAL_FRACTION))
    return Corpus(
        name=f"{path} (characters, vocab {len(chars)}, {len(tokens):,} tokens)",
        train=tokens[:-n_val],
        val=tokens[-n_val:],
        vocab_size=len(chars),
    )


def _token_file(path: str) -> np.ndarray:
    size = os.path.getsize(path)
    if size == 0:
        raise DataError(f"{path} is empty")
    if size % 2:
        raise DataError(f"{path} has an odd number of bytes ({size}); expected uint16 tokens")
    return np.memmap(path, dtype=np.uint16, mode="r")


def token_corpus(path: str) -> Corpus:
    """A nanoGPT-style token file: raw uint16 ids, read through a memmap.

    ``train.bin`` next to a ``val.bin`` uses that file for validation; otherwise the last 10% of the
    tokens are held out. The vocabulary size comes from a nanoGPT ``meta.pkl`` in the same folder
    (``vocab_size``), else it is GPT-2's, padded to 50304.
    """
    tokens = _token_file(path)
    folder, base = os.path.split(path)
    val_path = os.path.join(folder, "val.bin")
    if base == "train.bin" and os.path.exists(val_path):
        train, val = tokens, _token_file(val_path)
    else:
        n_val = max(1, int(len(tokens) * VAL_FRACTION))
        train, val = tokens[:-n_val], tokens[-n_val:]
    vocab_size = GPT2_PADDED_VOCAB
    meta_path = os.path.join(folder, "meta.pkl")
    if os.path.exists(meta_path):
        with open(meta_path, "rb") as f:
            vocab_size = int(pickle.load(f)["vocab_size"])
    return Corpus(
        name=f"{path} (uint16 tokens, vocab {vocab_size}, {len(tokens):,} tokens)",
        train=train,
        val=val,
        vocab_size=vocab_size,
    )


def load_corpus(path: str | None) -> Corpus:
    """The corpus for ``--data``: None is the synthetic default, ``*.bin`` a token file, else text.

    Raises:
        DataError: the file is missing, not a file, empty, or cannot be decoded.
    """
    if path is None:
        return synthetic_corpus()
    if not os.path.exists(path):
        raise DataError(f"data file not found: {path}")
    if not os.path.isfile(path):
        raise DataError(f"--data must be a file, got {path}")
    if path.endswith(".bin"):
        return token_corpus(path)
    return text_corpus(path)


def uniform_loss(vocab_size: int) -> float:
    """Cross-entropy of a uniform guess: where training starts."""
    return math.log(vocab_size)
