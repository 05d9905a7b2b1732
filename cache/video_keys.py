"""The cache key of a video's visual tokens.

A video's tokens depend on the source bytes, on which frames the gateway's
loader kept (its fps / num_frames / frame limits), on the encoder's model and
weights, on its video processor's defaults (pixel budget, with the
deployment's `encoder.min_pixels`/`max_pixels` over it, patch sizes,
normalisation, its own frame sampling) and on the request's processor knobs
(fps, num_frames, do_sample_frames, min/max pixels). The gateway's digest
covers the first two (gateway/intake/video/intake.py: the bytes and the loader's
sampling); the encoder adds the rest, and the loader's metadata of the frames
sent: the bytes do not always decide them (a header that counts one frame more
than its stream promises a frame no decode reads, so a lookup made from the
header alone must not find the tokens of the frames a decode read). The
"video" tag keeps a video's key apart from an image's with the same digest.
"""

from __future__ import annotations

from collections.abc import Mapping

from cache.keys import content_key


def video_key(encoder_fingerprint: str, video_processor: Mapping, request_sampling: Mapping, digest: bytes,
              loader_metadata: Mapping) -> bytes:
    """32-byte key: the encoder's identity, its video processor's defaults, the request's knobs, the gateway's
    digest, the frames' metadata (`LoaderMetadata`: which source frames, of how many, at what rate)."""
    return content_key(encoder_fingerprint, "video", dict(video_processor), dict(request_sampling), digest, dict(loader_metadata))
