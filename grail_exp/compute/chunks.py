"""``(name, tensor)`` pairs in chunks of bounded size: the form in which the policy's full parameters travel to a
rollout engine that keeps its own copy of the weights (``rollout/base.py``'s ``load_weights``).

The update backends produce the stream (gathering sharded parameters one chunk at a time) and the vLLM engine
consumes it; both sit on floors above this file, so neither imports the other for it.
"""

from __future__ import annotations


def chunked(pairs, max_bytes: int):
    """Group ``(name, tensor)`` pairs into lists of at most ``max_bytes`` bytes (a larger tensor forms a list of its
    own), lazily: a chunk's tensors are produced only when the chunk is asked for."""
    chunk: list = []
    size = 0
    for name, t in pairs:
        nbytes = t.numel() * t.element_size()
        if chunk and size + nbytes > max_bytes:
            yield chunk
            chunk, size = [], 0
        chunk.append((name, t))
        size += nbytes
    if chunk:
        yield chunk
