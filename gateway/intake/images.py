"""Image intake: every image is judged and shrunk here, before any model time.

Two passes, both off the event loop:
- `inspect` reads only the header: format by magic bytes, byte size, declared
  pixel count (decompression bombs are refused here, before any decode),
  minimum side, aspect ratio, and the visual tokens the image will cost.
- `decode` (run only for images the encoder does not have cached, once every
  image of the request passed `inspect` and the request's token total is
  within budget): decode, EXIF transpose, RGB, downscale to the pixel budget
  → uint8 (h, w, 3).

`digest_of` covers the original bytes and every intake parameter that changes
pixels, so it is known before decoding; the encoder adds its model identity
to form the cache key.
"""

from __future__ import annotations

import base64
import binascii
import functools
import io
import re
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import msgspec
import numpy as np
import pybase64
from PIL import ExifTags, Image, ImageOps, UnidentifiedImageError

from cache import content_key, library_versions
from gateway.errors import APIError
from gateway.intake.resize import resize_pixels, smart_resize
from gateway.intake.together import Stopped
from gateway.intake.sniff import ALLOWED_NAMES, describe_refused, sniff
from common.anyres import AnyresLayout
from common.tiles import TileLayout
from protocol.to_gateway import AnyresInfo, ProcessorInfo, TilesInfo

INTAKE_VERSION = "intake-v3"  # v3: resized by resize_pixels (torch's bicubic), not Pillow's
BACKGROUND = (255, 255, 255)  # what transparent pixels become
# Prism checks the declared size itself (ImageLimits.max_pixels) with a clear
# error; Pillow's own bomb check would only warn below twice its default.
Image.MAX_IMAGE_PIXELS = None
# Pillow is a large C codec surface: whatever it raises on untrusted bytes means
# "this image cannot be decoded" (a 400), never a server error.
_DECODE_ERRORS = Exception


@dataclass(frozen=True)
class ImageLimits:
    max_bytes: int  # encoded size, checked where the bytes arrive (data: URL, fetch)
    max_pixels: int  # declared width × height, checked before decoding
    min_side: int
    max_aspect_ratio: float
    max_decode_s: float = 10.0  # one image's decode (gateway.max_image_decode_s)
    noun: ClassVar[str] = "image"  # what a fetch names in its errors (gateway/intake/fetch.py)

    def check_bytes(self, size: int, where: str, qualifier: str = "") -> None:
        """413 past `max_bytes`; `qualifier` says how `size` is known ("about", "more than")."""
        if size > self.max_bytes:
            size_text = f"{qualifier} {size}" if qualifier else str(size)
            raise APIError(413, f"{where}: image is {size_text} bytes; the limit is {self.max_bytes} bytes", param=where,
                           code="image_too_large")


@dataclass(frozen=True)
class PixelBudget:
    min_pixels: int
    max_pixels: int


@dataclass(frozen=True)
class IntakePolicy:
    """What the gateway does to pixels. `processor` is the encoder's, from its
    handshake: a Qwen pixel budget, or the family's own tiling (LLaVA's anyres,
    InternVL's tiles)."""

    processor: ProcessorInfo | AnyresInfo | TilesInfo
    limits: ImageLimits
    jpeg_draft: bool = False  # decode JPEGs at a reduced DCT scale (changes pixels: see `_draft`)

    @functools.cached_property  # asked for every image; the handshake's numbers never change
    def tiling(self) -> AnyresLayout | TileLayout | None:
        """The family's own tiling (LLaVA, InternVL), or None for Qwen's pixel budget."""
        p = self.processor
        if isinstance(p, AnyresInfo):
            return AnyresLayout(p.tile_size, p.patch_size, p.grid_pinpoints, p.max_tiles)
        if isinstance(p, TilesInfo):
            return TileLayout(p.tile_size, p.min_tiles, p.max_tiles, p.crop, p.tokens_per_tile)
        return None

    @property
    def factor(self) -> int:
        return self.processor.patch_size * self.processor.merge_size

    @property
    def default_budget(self) -> PixelBudget:
        if self.tiling is not None:  # informational: the tiling, not a budget, sizes the image
            return PixelBudget(1, self.limits.max_pixels)
        return PixelBudget(self.processor.min_pixels, self.processor.max_pixels)

    def target(self, height: int, width: int, budget: PixelBudget) -> tuple[int, int]:
        """(height, width) of the pixels sent to the encoder."""
        if (tiling := self.tiling) is not None:
            return tiling.sent_size(height, width)
        return smart_resize(height, width, self.factor, budget.min_pixels, budget.max_pixels)

    def visual_tokens(self, height: int, width: int, target: tuple[int, int]) -> int:
        if (tiling := self.tiling) is not None:
            return tiling.visual_tokens(height, width)  # the original size: the encoder tiles by it
        return (target[0] // self.factor) * (target[1] // self.factor)

    def key_part(self, budget: PixelBudget) -> dict:
        sizing = {"tiling": msgspec.structs.asdict(self.processor)} if self.tiling else {
            "min_pixels": budget.min_pixels,
            "max_pixels": budget.max_pixels,
            "passthrough_budget": [self.processor.min_pixels, self.processor.max_pixels],
            "factor": self.factor,
        }
        return {
            "version": INTAKE_VERSION,
            **sizing,
            "resample": "bicubic",
            "background": list(BACKGROUND),
            "exif_transpose": True,
            "first_frame": True,
            "jpeg_draft": self.jpeg_draft,
            "libraries": library_versions("PIL", "torch"),  # the decode, the resize
        }


# What a decode holds at its peak, per pixel of the larger of the decoded image and
# the one sent on (docs/measurements/gateway-memory-burst.md): the decoded image, the
# array `_fit` takes of it, the resize's own; an alpha channel or an EXIF turn adds a
# full-size copy, and WebP decodes through RGBA buffers of its own.
DECODE_BYTES_PER_PIXEL = 16
TURNED_OR_ALPHA_BYTES_PER_PIXEL = 18
WEBP_BYTES_PER_PIXEL = 26
# A header parses in milliseconds of CPU; one that takes longer was built to (millions of
# empty markers or chunks, each parsed in Python).
HEADER_READ_S = 1.0
# Progressive JPEGs have about ten scans; libjpeg decodes every one, so thousands of
# repeated scans make a small file take minutes.
MAX_JPEG_SCANS = 100
# Markers walked to count them; a file with more before its image ends is refused: scans hide
# among them, and a decode's deadline is asked only between reads, each of which holds hundreds.
MAX_JPEG_MARKERS = 2000
# The next marker from within a scan's data: not a stuffed 0xFF00, a restart marker or fill.
_JPEG_MARKER = re.compile(rb"\xff[^\x00\xd0-\xd7\xff]")
JPEG_SOS, JPEG_EOI, JPEG_TEM = 0xDA, 0xD9, 0x01


class _TooSlow(Exception):
    pass


class _Deadline(io.BytesIO):
    """The image's bytes, not to be read past a deadline: Pillow parses headers and feeds
    its decoders from reads, so a file built to be slow stops at its next read. The time
    is the reading thread's CPU time: waiting for the GIL or for a busy machine is not the
    image's doing. `stop`, asked at every read: True ends the decode (its request ended)."""

    def __init__(self, data: bytes, seconds: float, stop: Callable[[], bool] | None) -> None:
        super().__init__(data)
        self.deadline = time.thread_time() + seconds
        self.stop = stop

    def read(self, size: int | None = -1) -> bytes:
        if self.stop is not None and self.stop():
            raise Stopped()
        if time.thread_time() > self.deadline:
            raise _TooSlow()
        return super().read(size)


def _opened(raw: bytes, fmt: str, seconds: float, stop: Callable[[], bool] | None = None) -> Image.Image:
    image = Image.open(_Deadline(raw, seconds, stop), formats=[fmt])
    image.decodermaxblock = 16384  # a decode reads (and so meets its deadline) every 16 KB
    return image


@dataclass(frozen=True)
class Inspected:
    raw: bytes
    where: str
    format: str
    size: tuple[int, int]  # (width, height) as stored, before EXIF transpose
    budget: PixelBudget
    target: tuple[int, int]  # (height, width) the encoder will be sent, as stored (before EXIF transpose)
    visual_tokens: int
    decoded_pixels: int = 0  # what `decode` decodes: fewer than stored where a JPEG is drafted
    bytes_per_pixel: int = DECODE_BYTES_PER_PIXEL

    @property
    def decoding_bytes(self) -> int:
        """The gateway memory its decode takes (gateway/intake/memory.py), upscaled or not."""
        return max(self.decoded_pixels, self.target[0] * self.target[1]) * self.bytes_per_pixel


@dataclass(frozen=True)
class PreparedImage:
    pixels: np.ndarray  # uint8 (h, w, 3), C-contiguous
    original_size: tuple[int, int]  # (width, height) after EXIF transpose
    # At the size vLLM's processor makes of the original under the request's budget (a Qwen
    # family's, resized or already there): the encoder must not size it again under its own.
    sized: bool = False

    @property
    def nbytes(self) -> int:
        return self.pixels.nbytes


def _b64decode(payload: str) -> bytes:
    """pybase64 (SIMD: an order of magnitude faster than the standard
    library's on an image's payload; docs/measurements/floor.md). What it refuses,
    the standard library decides: it accepts a few payloads pybase64 does not
    (padding after a whole quantum, "AAAA="), so the answers stay the standard
    library's (tests/unit/test_intake_fuzz.py)."""
    try:
        return pybase64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        return base64.b64decode(payload, validate=True)


def decode_data_url(url: str, where: str, limits: ImageLimits) -> bytes:
    """The bytes of a base64 data: URL (an image's, or a video's with its limits: errors name `limits.noun`)."""
    code = f"invalid_{limits.noun}_url"
    header, sep, payload = url[5:].partition(",")
    if not sep:
        raise APIError(400, f"{where}: malformed data: URL (no comma)", param=where, code=code)
    if not header.endswith(";base64"):
        raise APIError(400, f"{where}: data: URL must be base64-encoded (';base64,')", param=where, code=code)
    limits.check_bytes(len(payload) * 3 // 4 - 3, where, "about")  # before decoding (padding: up to 3 fewer)
    try:
        raw = _b64decode(payload)
    except (binascii.Error, ValueError):
        raise APIError(400, f"{where}: data: URL is not valid base64", param=where, code=code) from None
    limits.check_bytes(len(raw), where)
    return raw


def _reason(exc: Exception) -> str:
    if isinstance(exc, UnidentifiedImageError):
        return "not a valid file of that format"  # Pillow's text names an in-memory object
    return str(exc) or type(exc).__name__


def _invalid(where: str, message: str, status: int = 400, code: str = "invalid_image") -> APIError:
    return APIError(status, f"{where}: {message}", param=where, code=code)


def jpeg_scans(raw: bytes) -> int | None:
    """The JPEG's own scans, counted from its markers (the count stops past MAX_JPEG_SCANS);
    None past MAX_JPEG_MARKERS markers. Segments are skipped by their length and nothing after
    the end-of-image marker is read: an EXIF thumbnail, or the video or pictures a motion or
    multi-picture photo carries after its image, have scans of their own."""
    scans, position = 0, 2  # past the start-of-image marker
    for _ in range(MAX_JPEG_MARKERS):
        if (found := _JPEG_MARKER.search(raw, position)) is None:
            return scans
        marker, position = found[0][1], found.end()
        if marker == JPEG_EOI:
            return scans
        if marker != JPEG_TEM:  # every other marker here has a length (and a scan's data follows its header)
            position += int.from_bytes(raw[position:position + 2], "big")
        if marker == JPEG_SOS and (scans := scans + 1) > MAX_JPEG_SCANS:
            return scans
    return None


def inspect(raw: bytes, where: str, policy: IntakePolicy, budget: PixelBudget) -> Inspected:
    """Header-only checks; nothing is decoded. (The byte limit was checked where
    the bytes arrived: decode_data_url, ImageFetcher.)"""
    if not raw:
        raise _invalid(where, "image is empty (0 bytes)")
    fmt = sniff(raw)
    if fmt is None:
        raise _invalid(where, f"unsupported image format ({describe_refused(raw)}); allowed: {', '.join(ALLOWED_NAMES)}", 415, "unsupported_image_format")
    if fmt == "JPEG" and (scans := jpeg_scans(raw)) is None:
        raise _invalid(where, f"the JPEG has more than {MAX_JPEG_MARKERS} markers before its image ends", 413, "image_too_complex")
    if fmt == "JPEG" and scans > MAX_JPEG_SCANS:
        raise _invalid(where, f"the JPEG has more than {MAX_JPEG_SCANS} scans; at most {MAX_JPEG_SCANS} are decoded")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with _opened(raw, fmt, HEADER_READ_S) as image:
                width, height = image.size
                _check_declared_size(where, width, height, policy.limits)
                _check_bmp_compression(where, image, fmt)
                # Sized and counted as the encoder sees it, turned by its EXIF orientation: a tiling
                # family's grid is not symmetric in height and width.
                turned = _sides_swap(image)
                shown = (width, height) if turned else (height, width)
                shown_target = policy.target(*shown, budget)
                target = shown_target[::-1] if turned else shown_target  # as stored, for libjpeg's draft
                _scale_down(image, fmt, target, policy)  # the header only: nothing is decoded
                decoded_pixels = image.size[0] * image.size[1]
                bytes_per_pixel = _bytes_per_pixel(image, fmt)
    except APIError:
        raise
    except _TooSlow:
        raise _invalid(where, f"its {fmt} header took more than {HEADER_READ_S:g} s to read", 413, "image_too_complex") from None
    except _DECODE_ERRORS as exc:
        raise _invalid(where, f"cannot read the {fmt} header ({_reason(exc)})") from None
    return Inspected(raw, where, fmt, (width, height), budget, target, policy.visual_tokens(*shown, shown_target),
                     decoded_pixels, bytes_per_pixel)


def _bytes_per_pixel(opened: Image.Image, fmt: str) -> int:
    if fmt == "WEBP":
        return WEBP_BYTES_PER_PIXEL
    alpha = opened.mode in ("RGBA", "LA", "PA") or "transparency" in opened.info
    return TURNED_OR_ALPHA_BYTES_PER_PIXEL if alpha or _orientation(opened) != 1 else DECODE_BYTES_PER_PIXEL


# Pillow decodes a run-length-encoded BMP in Python, holding the GIL: some 70 ns a pixel, seconds for a
# large one sent in a few hundred KB. Past this many pixels it is refused; uncompressed BMP is C's.
MAX_RLE_BMP_PIXELS = 4_000_000


def _check_bmp_compression(where: str, image: Image.Image, fmt: str) -> None:
    if fmt == "BMP" and image.info.get("compression") in (1, 2) and image.size[0] * image.size[1] > MAX_RLE_BMP_PIXELS:
        raise _invalid(where, f"a run-length-encoded BMP of more than {MAX_RLE_BMP_PIXELS:,} pixels is not decoded; "
                       "send it uncompressed or as PNG", 415, "unsupported_image_format")


def _check_declared_size(where: str, width: int, height: int, limits: ImageLimits) -> None:
    if width * height > limits.max_pixels:
        raise _invalid(where, f"image is {width}×{height} = {width * height} pixels; the limit is {limits.max_pixels}", 413, "image_too_large")
    if min(width, height) < limits.min_side:
        raise _invalid(where, f"image is {width}×{height}; the minimum side is {limits.min_side} pixels")
    if max(width, height) / min(width, height) > limits.max_aspect_ratio:
        raise _invalid(where, f"image is {width}×{height}: aspect ratio {max(width, height) / min(width, height):.0f} exceeds the model's limit of {limits.max_aspect_ratio:g}")


def _high_bit_depth_to_l(image: Image.Image) -> Image.Image:
    """16/32-bit greyscale to 8 bits by scaling (Pillow's convert would clip at 255). In place on
    one float64 copy: a temporary per step held 24 bytes a pixel, past DECODE_BYTES_PER_PIXEL."""
    values = np.array(image, dtype=np.float64)
    top = 65535.0 if image.mode.startswith("I;16") or values.max(initial=0) > 255 else 255.0
    values *= 255.0 / top
    np.clip(values, 0, 255, out=values)
    np.rint(values, out=values)  # what .round() did: halves to even
    return Image.fromarray(values.astype(np.uint8), mode="L")


def to_rgb(image: Image.Image) -> Image.Image:
    """As vLLM's convert_image_mode: transparency (an alpha channel, or a tRNS colour in a palette or
    greyscale image) onto white. 16-bit greyscale is scaled to 8 bits, where vLLM clips it at 255."""
    if image.mode == "RGB":
        return image
    if image.mode.startswith("I") or image.mode == "F":
        return _high_bit_depth_to_l(image).convert("RGB")
    if image.mode in ("RGBA", "LA", "PA") or "transparency" in image.info:
        rgba = image.convert("RGBA")
        canvas = Image.new("RGB", rgba.size, BACKGROUND)
        canvas.paste(rgba, mask=rgba.getchannel("A"))
        return canvas
    return image.convert("RGB")


def _orientation(opened: Image.Image) -> int:
    """The orientation exif_transpose will turn the image by (1: as stored, or none in the header); 1
    where it cannot be read, as vLLM then turns nothing. A JPEG's from getexif(), which reads its
    header and falls back to XMP's tiff:Orientation as exif_transpose does; other formats' from the
    header's own EXIF bytes: a PNG's getexif() decodes the whole image looking for an eXIf chunk."""
    try:
        if opened.format == "JPEG":
            return opened.getexif().get(ExifTags.Base.Orientation, 1)
        if "exif" not in opened.info:
            return 1
        exif = Image.Exif()
        exif.load(opened.info["exif"])
        return exif.get(ExifTags.Base.Orientation, 1)
    except _DECODE_ERRORS:
        return 1


def _sides_swap(opened: Image.Image) -> bool:
    """Whether the EXIF orientation turns the image by 90° (what exif_transpose will do)."""
    return _orientation(opened) in (5, 6, 7, 8)


def _scale_down(opened: Image.Image, fmt: str, target: tuple[int, int], policy: IntakePolicy) -> bool:
    """Set libjpeg to decode `opened` at 1/2, 1/4 or 1/8 scale, never below
    `target` (as stored, before any EXIF turn), where `jpeg_draft` allows; True
    if it will. Its size is then the scaled one; nothing is decoded yet."""
    if not policy.jpeg_draft or fmt != "JPEG":
        return False
    size = opened.size
    opened.draft(opened.mode, (target[1], target[0]))
    return opened.size != size


def _draft(opened: Image.Image, item: Inspected, policy: IntakePolicy, turn: bool = True) -> tuple[int, int] | None:
    """Let libjpeg decode at 1/2, 1/4 or 1/8 scale, never below the target
    size: a 4K JPEG's decode then skips most of its work (docs/measurements/intake.md).
    The DCT's scaling is not a full decode
    followed by bicubic, so pixels (and visual tokens) differ from vLLM's
    raw-image path: it is a setting (`gateway.jpeg_draft`), and in the cache
    key. Returns the original (width, height) after EXIF transpose if the
    decode was scaled, else None."""
    width, height = opened.size
    if not _scale_down(opened, item.format, item.target, policy):
        return None
    return (height, width) if turn and _sides_swap(opened) else (width, height)


def _fit(image: Image.Image, item: Inspected, policy: IntakePolicy, original: tuple[int, int] | None = None) -> tuple[np.ndarray, bool]:
    """The RGB image's uint8 (h, w, 3) pixels at the size the encoder takes, and whether that is
    the final size (PreparedImage.sized)."""
    width, height = image.size
    sized = policy.tiling is None  # a tiling family's encoder tiles by the original size whatever it is sent
    if original is not None:  # drafted: to the original's target (the drafted size would round to another grid)
        target_h, target_w = policy.target(original[1], original[0], item.budget)
        return resize_pixels(image, target_w, target_h), sized
    if policy.tiling is None and item.budget == policy.default_budget and width * height <= item.budget.max_pixels:
        # Within the encoder's own budget: its processor does the final rounding,
        # exactly as vLLM's would on the raw image.
        return np.asarray(image), False
    target_h, target_w = policy.target(height, width, item.budget)
    return (np.asarray(image) if (target_w, target_h) == (width, height) else resize_pixels(image, target_w, target_h)), sized


def digest_of(item: Inspected, policy: IntakePolicy) -> bytes:
    """The image's part of the cache key: its original bytes and every intake
    parameter that shapes its pixels. Cheap (cache/keys.py), so it is known before decoding."""
    return content_key(policy.key_part(item.budget), item.raw)


def decode(item: Inspected, policy: IntakePolicy, stop: Callable[[], bool] | None = None) -> PreparedImage:
    """Decode and normalise one inspected image (CPU-bound: run it off the event loop).
    `stop`: asked at every read of the bytes; True raises Stopped."""
    seconds = policy.limits.max_decode_s
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                return _decoded(item, policy, seconds, turn=True, stop=stop)
            except _ExifUnusable:  # as vLLM: an EXIF block exif_transpose cannot apply turns nothing
                return _decoded(item, policy, seconds, turn=False, stop=stop)
    except Stopped:
        raise
    except _TooSlow:
        raise _invalid(item.where, f"took more than {seconds:g} s to decode (gateway.max_image_decode_s)", 413, "image_too_complex") from None
    except _DECODE_ERRORS as exc:
        raise _invalid(item.where, f"cannot decode the {item.format} image ({_reason(exc)})") from None


class _ExifUnusable(Exception):
    pass


def _decoded(item: Inspected, policy: IntakePolicy, seconds: float, turn: bool,
             stop: Callable[[], bool] | None) -> PreparedImage:
    with _opened(item.raw, item.format, seconds, stop) as opened:
        opened.seek(0)  # animated images: the first frame
        drafted_from = _draft(opened, item, policy, turn)
        image = opened
        if turn:
            try:
                image = ImageOps.exif_transpose(opened, in_place=True) or opened  # in place: no copy of a full-size image
            except (_TooSlow, Stopped):
                raise
            except _DECODE_ERRORS as exc:  # in place, it may have turned the pixels before failing: decoded afresh
                raise _ExifUnusable() from exc
        image.load()
        original_size = drafted_from or image.size
        pixels, sized = _fit(to_rgb(image), item, policy, drafted_from)
    return PreparedImage(np.ascontiguousarray(pixels, dtype=np.uint8), original_size, sized)
