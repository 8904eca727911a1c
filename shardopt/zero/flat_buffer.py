"""The contiguous buffers of one key and the views the engine hands out (see Note: buckets and
shards in layout.py).

Per key:
  - ``param_space``: the params themselves, back to back in the key space (params are rebound to
    views of it, so an all-gather writes straight into the params);
  - ``sync_space``: the all-gather buffer when ``param_sync_dtype`` differs from the param dtype
    (else the same tensor as ``param_space``);
  - ``grad_space``: gradients accumulated across micro-batches in the grad-sync dtype;
  - ``grad_shard``: this rank's reduce-scattered (summed) gradient chunks;
  - ``master`` and one tensor per optimizer state: this rank's shard in the state dtype.
"""

from __future__ import annotations

import torch

from shardopt.zero.layout import Bucket, Fragment, KeyLayout, Range


def _view(t: torch.Tensor, r: Range) -> torch.Tensor:
    return t.narrow(0, r.start, r.numel)


class KeyBuffers:
    """Owns the flat tensors of one key on one rank."""

    def __init__(
        self,
        layout: KeyLayout,
        rank: int,
        *,
        device: torch.device,
        param_dtype: torch.dtype,
        grad_sync_dtype: torch.dtype,
        param_sync_dtype: torch.dtype,
        state_dtype: torch.dtype,
        state_names: tuple[str, ...],
    ) -> None:
        self.layout = layout
        self.rank = rank
        space, shard = layout.space_numel, layout.shard_numel
        self.param_space = torch.zeros(space, dtype=param_dtype, device=device)
        self.sync_space = (
            self.param_space
            if param_sync_dtype == param_dtype
            else torch.zeros(space, dtype=param_sync_dtype, device=device)
        )
        self.grad_space = torch.zeros(space, dtype=grad_sync_dtype, device=device)
        self.grad_shard = torch.zeros(shard, dtype=grad_sync_dtype, device=device)
        self.master = torch.zeros(shard, dtype=state_dtype, device=device)
        self.state = {n: torch.zeros(shard, dtype=state_dtype, device=device) for n in state_names}
        self.fragments = layout.rank_fragments(rank)

    # -- views -----------------------------------------------------------------------------------

    def param_view(self, param: int, shape: torch.Size) -> torch.Tensor:
        return _view(self.param_space, self.layout.space_ranges[param]).view(shape)

    def grad_view(self, param: int) -> torch.Tensor:
        return _view(self.grad_space, self.layout.space_ranges[param])

    def bucket(self, space: torch.Tensor, bucket: Bucket) -> torch.Tensor:
        return _view(space, bucket.space_range)

    def chunk(self, space: torch.Tensor, bucket: Bucket) -> torch.Tensor:
        """This rank's chunk of ``bucket`` in a key-space tensor."""
        return _view(self.bucket(space, bucket), bucket.chunk_range(self.rank))

    def shard_of_bucket(self, shard: torch.Tensor, bucket: Bucket) -> torch.Tensor:
        """The part of a shard tensor that holds ``bucket``'s chunk."""
        return shard.narrow(0, bucket.shard_offset, bucket.chunk_numel)

    def per_bucket(self, shard: torch.Tensor) -> list[torch.Tensor]:
        return [self.shard_of_bucket(shard, b) for b in self.layout.buckets]

    def chunks(self, space: torch.Tensor) -> list[torch.Tensor]:
        return [self.chunk(space, b) for b in self.layout.buckets]

    def per_fragment(self, shard: torch.Tensor) -> list[torch.Tensor]:
        return [_view(shard, f.shard_range) for f in self.fragments]

    def fragment_outs(self, space: torch.Tensor) -> list[torch.Tensor]:
        """Key-space views (e.g. of ``sync_space``) of this rank's fragments."""
        return [
            _view(space, f.bucket_range.shift(self.layout.buckets[f.bucket].space_range.start))
            for f in self.fragments
        ]

    def fragment_param_view(self, full: torch.Tensor, fragment: Fragment) -> torch.Tensor:
        """A fragment's elements of a flattened full param."""
        return _view(full.reshape(-1), fragment.param_range)

    def bytes(self) -> dict[str, int]:
        """Bytes held per buffer (``sync_space`` only when separate)."""
        out = {
            "param_space": self.param_space.numel() * self.param_space.element_size(),
            "grad_space": self.grad_space.numel() * self.grad_space.element_size(),
            "grad_shard": self.grad_shard.numel() * self.grad_shard.element_size(),
            "master": self.master.numel() * self.master.element_size(),
        }
        if self.sync_space is not self.param_space:
            out["sync_space"] = self.sync_space.numel() * self.sync_space.element_size()
        for name, t in self.state.items():
            out[name] = t.numel() * t.element_size()
        return out
