"""A checkpoint's files, and the identity of its vision weights.

An encoder and an engine must run one checkpoint: the engine hands vLLM the
encoder's tokens as its own tower's, and another tower's tokens of the same
width are taken without an error and answered wrongly. Each service reports
the digest of its checkpoint's vision weights in its handshake, and the
gateway serves a model only where the two agree (gateway/api/models.py).

Read from the safetensors files' headers and bytes alone (no torch: the
engine's process does not load the weights, vLLM's engine core does), one
tensor at a time, so hashing a 7B checkpoint's tower holds no copy of it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import mmap
from pathlib import Path

import xxhash

from common.families import Family

log = logging.getLogger("prism")

_HEADER_LENGTH_BYTES = 8  # safetensors: a little-endian u64, then that many bytes of JSON


def weight_files(checkpoint: Path) -> list[Path]:
    index = checkpoint / "model.safetensors.index.json"
    if index.exists():
        names = set(json.loads(index.read_text())["weight_map"].values())
        return sorted(checkpoint / n for n in names)
    return sorted(checkpoint.glob("*.safetensors"))


def model_vision_weights(model: str, family: Family) -> str:
    """`vision_weights_digest` of a checkpoint directory, or of a hub id's snapshot in the local cache
    (vLLM has downloaded it by the time the engine asks); "" where there is none to read."""
    path = Path(model)
    if not path.is_dir():
        from huggingface_hub import snapshot_download

        try:
            path = Path(snapshot_download(model, local_files_only=True))
        except Exception as exc:  # not in the cache (another layout, a mirror): the gateway cannot check the pair
            log.warning("the vision weights of %s were not read (%s): the gateway cannot check that its encoders run "
                        "this checkpoint", model, exc)
            return ""
    return vision_weights_digest(path, family)


def vision_weights_digest(checkpoint: Path, family: Family) -> str:
    """xxh3-128 of the vision tensors' names, dtypes, shapes and bytes, in name order; "" for a
    checkpoint with no vision weights (a text-only model)."""
    headers = {file: _header(file) for file in weight_files(checkpoint)}
    tensors = sorted((name, file, info) for file, (_, entries) in headers.items()
                     for name, info in entries.items() if family.is_vision_weight(name))
    if not tensors:
        return ""
    hasher = xxhash.xxh3_128()
    with contextlib.ExitStack() as opened:
        data = {file: opened.enter_context(_mapped(file)) for file in {file for _, file, _ in tensors}}
        for name, file, info in tensors:
            hasher.update(json.dumps([name, info["dtype"], info["shape"]]).encode())
            start, end = (headers[file][0] + offset for offset in info["data_offsets"])
            with data[file][start:end] as tensor:  # a view of the file: no copy
                hasher.update(tensor)
    return hasher.hexdigest()


@contextlib.contextmanager
def _mapped(file: Path):
    with file.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data, memoryview(data) as view:
        yield view


def _header(file: Path) -> tuple[int, dict]:
    """Where the file's tensor data starts, and its tensors' entries (dtype, shape, data_offsets from there)."""
    with file.open("rb") as f:
        length = int.from_bytes(f.read(_HEADER_LENGTH_BYTES), "little")
        header = json.loads(f.read(length))
    header.pop("__metadata__", None)
    return _HEADER_LENGTH_BYTES + length, header
