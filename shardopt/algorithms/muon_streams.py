"""Newton-Schulz of a group's stacks (one per matrix shape) on side CUDA streams, at once.

The stacks of one group are independent chains of ``bmm`` calls. Small stacks (the 124M GPT
set's: 768-row matrices, a dozen per shape) leave much of the GPU idle in each product's
last wave, so ``orthogonalized`` runs each stack on its own stream: their products overlap. The
caller's stream waits for each result before using it, and each tensor crossing streams is
recorded on the stream that uses it (the caching allocator then never hands its memory out
early). Large stacks fill the GPU alone and would hold all their outputs at once: above
``CONCURRENT_MAX_ELEMENTS`` in all, on the CPU, while torch.compile traces, and while a CUDA
graph is captured (capturable steps), the stacks run one after another on the caller's stream,
each one only when the caller asks for it, as before. The arithmetic is the same either way:
each stack's products are the same calls in the same order.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch

#: the most elements of all stacks together that run on side streams (128 Mi: 256 MiB in bf16;
#: the outputs of all stacks are alive at once then, beside the inputs)
CONCURRENT_MAX_ELEMENTS = 1 << 27

_STREAMS: dict[torch.device, list] = {}


def _side_streams(device: torch.device, count: int) -> list:
    """``count`` side streams of ``device``, made once and reused (a stream per call would be
    a new CUDA stream each step)."""
    pool = _STREAMS.setdefault(device, [])
    while len(pool) < count:
        pool.append(torch.cuda.Stream(device=device))
    return pool[:count]


def concurrent(stacks: list[torch.Tensor]) -> bool:
    """Whether ``orthogonalized`` runs ``stacks`` on side streams (see the module's docstring)."""
    if len(stacks) < 2 or not all(s.is_cuda for s in stacks):
        return False
    if torch.compiler.is_compiling() or torch.cuda.is_current_stream_capturing():
        return False
    return sum(s.numel() for s in stacks) <= CONCURRENT_MAX_ELEMENTS


def orthogonalized(
    stacks: list[torch.Tensor], fn: Callable[[torch.Tensor], torch.Tensor]
) -> Iterator[torch.Tensor]:
    """``fn(stack)`` for each stack, in order, usable on the caller's stream as it is yielded;
    on side streams at once where ``concurrent(stacks)``, else lazily one after another."""
    if not concurrent(stacks):
        for stack in stacks:
            yield fn(stack)
        return
    device = stacks[0].device
    main = torch.cuda.current_stream(device)
    streams = _side_streams(device, len(stacks))
    results = []
    for stack, stream in zip(stacks, streams):
        stream.wait_stream(main)  # the stack's values were written on the caller's stream
        with torch.cuda.stream(stream):
            results.append(fn(stack))
        stack.record_stream(stream)
    for result, stream in zip(results, streams):
        main.wait_stream(stream)
        result.record_stream(main)
        yield result
