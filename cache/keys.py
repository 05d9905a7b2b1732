"""Content keys: BLAKE3 (256-bit) over length-prefixed, type-tagged parts.

Each part is written as tag byte + 8-byte length + payload, so differently
structured inputs can never produce the same byte stream (("ab", "c") and
("a", "bc") hash apart). Mappings are canonicalised by sorting their keys.

The hash is cryptographic because clients choose the bytes: with a fast
non-cryptographic hash (xxh3) two different images can be crafted to share a
key, and whoever sent the first would have its tokens served to everyone who
sends the second, from every cache tier. BLAKE3 is also what vLLM hashes its
multimodal inputs with, and hashes an image's megabytes in a fraction of its
decode time.
"""

from __future__ import annotations

import functools
import importlib
import json
import struct
from collections.abc import Mapping
from typing import Any

from blake3 import blake3

_TAGS = {bytes: b"b", str: b"s", int: b"i", float: b"f", dict: b"m"}


def _encode(part: Any) -> tuple[bytes, bytes]:
    if isinstance(part, (bytes, bytearray, memoryview)):
        return _TAGS[bytes], bytes(part)
    if isinstance(part, bool) or part is None or isinstance(part, (list, tuple)):
        return _TAGS[dict], json.dumps(part).encode()
    if isinstance(part, str):
        return _TAGS[str], part.encode()
    if isinstance(part, int):
        return _TAGS[int], str(part).encode()
    if isinstance(part, float):
        return _TAGS[float], repr(part).encode()
    if isinstance(part, Mapping):
        return _TAGS[dict], json.dumps(part, sort_keys=True, separators=(",", ":")).encode()
    raise TypeError(f"cannot hash a {type(part).__name__} into a content key")


def content_key(*parts: Any) -> bytes:
    """32-byte digest of the parts, in order."""
    hasher = blake3()
    for part in parts:
        tag, payload = _encode(part)
        hasher.update(tag + struct.pack("<Q", len(payload)))
        hasher.update(payload)
    return hasher.digest()


@functools.cache
def library_versions(*modules: str) -> dict[str, str]:
    """The versions of the libraries (by module: however they were installed) that make a key's pixels
    or tokens: a key part, so that an upgrade whose decoder, resize or tower rounds otherwise shares no
    key with the last one."""
    return {name: str(importlib.import_module(name).__version__) for name in modules}


def salted(digest: bytes, cache_salt: str | None) -> bytes:
    """An image's or video's digest under a request's `cache_salt` (vLLM's): its visual tokens are
    then cached, shared between requests and referenced only under the same salt, as vLLM keeps
    its prefix cache apart by it, so one tenant cannot time another's images out of the caches."""
    return digest if cache_salt is None else content_key("cache_salt", cache_salt, digest)
