"""Where the visual tokens of images this gateway process has had encoded
are: each image's reference (content key, encoder, shape, grid), by digest.

A repeated image goes to the engine with its reference at once, with no
round to an encoder: that round was 1.4 ms of a repeat's ~30 ms TTFT with
the demo model on a slow day, and the encoder's loop does not have to answer
it under load (docs/architecture.md, "Per-hop costs"). The engine finds the tokens
in its own LRU (a repeat moves no bytes), else fetches them from the encoder
the reference names, else from the shared tier (llm_engine/fetch.py).

Found nowhere, the engine answers 503 `embeddings_unavailable`: the pipeline
forgets the images' references and encodes them again (ChatPipeline.generate),
so a stale reference costs one round trip more than asking the encoder would
have. A reference whose encoder is not up is not used at all.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import msgspec

from protocol.to_engine import ImageEmbedding

KNOWN_IMAGES = 16384  # references kept, least recently used out first (~250 bytes each)


class KnownTokens:
    def __init__(self, capacity: int = KNOWN_IMAGES) -> None:
        self.capacity = capacity
        self._refs: OrderedDict[bytes, ImageEmbedding] = OrderedDict()

    def __len__(self) -> int:
        return len(self._refs)

    def remember(self, digests: Sequence[bytes], refs: Sequence[ImageEmbedding]) -> None:
        for digest, ref in zip(digests, refs, strict=True):
            # A push was for the request the image was encoded for; a later one
            # finds the tokens in the engine's LRU or fetches them.
            self._refs[digest] = msgspec.structs.replace(ref, pushed=False)
            self._refs.move_to_end(digest)
        while len(self._refs) > self.capacity:
            self._refs.popitem(last=False)

    def recall(self, digests: Sequence[bytes]) -> list[ImageEmbedding] | None:
        """Every image's reference, in order; None unless all are known."""
        refs = [self._refs.get(digest) for digest in digests]
        if None in refs:
            return None
        for digest in digests:
            self._refs.move_to_end(digest)
        return refs

    def forget(self, digests: Sequence[bytes]) -> None:
        for digest in digests:
            self._refs.pop(digest, None)
