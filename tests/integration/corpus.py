"""A generated corpus of bad and odd images, each with the answer Prism owes it.

Bad inputs get a 4xx with a message naming the image and the limit; odd but
valid ones are served. Built in memory from fixed seeds.
"""

from __future__ import annotations

import base64
import io
import struct
import zlib
from dataclasses import dataclass

import numpy as np
from PIL import Image

from loadtest.synthetic import make_image


@dataclass(frozen=True)
class Sample:
    name: str
    url: str  # what goes into image_url.url
    status: int  # 200 for odd-but-valid
    needle: str = ""  # part of the error message


def b64(data: bytes, media: str = "image/png") -> str:
    return f"data:{media};base64," + base64.b64encode(data).decode()


def save(image: Image.Image, fmt: str, **kwargs) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt, **kwargs)
    return buffer.getvalue()


def png_chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def bomb_png(width: int, height: int) -> bytes:
    """A valid PNG header claiming a huge size, with a tiny (incomplete) body."""
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + png_chunk(b"IHDR", header) + png_chunk(b"IDAT", zlib.compress(b"\x00" * 64)) + png_chunk(b"IEND", b"")


def scene(size=(160, 120), name="corpus") -> Image.Image:
    return make_image(name, size)


def exif_rotated_png() -> tuple[bytes, bytes]:
    """(PNG with EXIF orientation 6, PNG of the same pixels already rotated)."""
    image = scene((200, 120), "exif")
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90° clockwise when displayed
    return save(image, "PNG", exif=exif.tobytes()), save(image.transpose(Image.Transpose.ROTATE_270), "PNG")


def animated_gif() -> tuple[bytes, bytes, bytes]:
    """(a two-frame GIF, PNGs of its first and second frames as Prism would see them)."""
    first = scene((96, 64), "gif-a").quantize(64)
    second = scene((96, 64), "gif-b").quantize(64)
    gif = save(first, "GIF", save_all=True, append_images=[second], duration=100, loop=0)
    frames = Image.open(io.BytesIO(gif))
    first_frame = save(frames.convert("RGB"), "PNG")
    frames.seek(1)
    return gif, first_frame, save(frames.convert("RGB"), "PNG")


def sixteen_bit_png() -> bytes:
    ramp = (np.linspace(0, 65535, 64 * 48).reshape(48, 64)).astype(np.uint16)
    return save(Image.fromarray(ramp), "PNG")  # uint16 → mode I;16


def palette_png_with_transparency() -> bytes:
    image = scene((80, 60), "palette").quantize(16)
    return save(image, "PNG", transparency=0)


def bad_samples(max_image_bytes: int) -> list[Sample]:
    jpeg = save(scene(), "JPEG", quality=90)
    png = save(scene(), "PNG")
    return [
        Sample("truncated-jpeg", b64(jpeg[: len(jpeg) // 2], "image/jpeg"), 400, "cannot decode the JPEG"),
        Sample("truncated-png", b64(png[: len(png) // 2]), 400, "cannot decode the PNG"),
        Sample("png-header-only", b64(png[:40]), 400, "PNG"),
        Sample("wrong-magic", b64(b"\x13\x37" * 200), 415, "unsupported image format (unknown)"),
        Sample("zero-bytes", "data:image/png;base64,", 400, "empty (0 bytes)"),
        Sample("bomb-100k-square", b64(bomb_png(100_000, 100_000)), 413, "10000000000 pixels; the limit"),
        Sample("bomb-wide", b64(bomb_png(60_000, 1_000)), 413, "pixels; the limit"),
        Sample("strip-1x20000", b64(save(Image.new("RGB", (1, 20000)), "PNG")), 400, "1×20000; the minimum side is 2"),
        Sample("strip-3x20000", b64(save(Image.new("RGB", (3, 20000)), "PNG")), 400, "aspect ratio 6667 exceeds"),
        Sample("strip-4000x10", b64(save(Image.new("RGB", (4000, 10)), "PNG")), 400, "aspect ratio 400 exceeds"),
        Sample("one-pixel", b64(save(Image.new("RGB", (1, 1)), "PNG")), 400, "minimum side is 2"),
        Sample("svg", b64(b'<?xml version="1.0"?><svg xmlns="http://www.w3.org/2000/svg"/>', "image/svg+xml"), 415, "XML/SVG"),
        Sample("svg-bare", b64(b'<svg width="10" height="10"></svg>', "image/svg+xml"), 415, "SVG"),
        Sample("heic-like", b64(b"\x00\x00\x00\x18ftypheic" + b"\x00" * 64, "image/heic"), 415, "HEIC"),
        Sample("avif-like", b64(b"\x00\x00\x00\x1cftypavif" + b"\x00" * 64, "image/avif"), 415, "AVIF"),
        Sample("pdf", b64(b"%PDF-1.7\n" + b"0" * 100, "application/pdf"), 415, "PDF"),
        Sample("tiff", b64(save(scene(), "TIFF"), "image/tiff"), 415, "TIFF"),
        Sample("gif-magic-garbage", b64(b"GIF89a" + b"\xff" * 50, "image/gif"), 400, "GIF"),
        Sample("bmp-magic-garbage", b64(b"BM" + b"\x00" * 50, "image/bmp"), 400, "BMP"),
        Sample("webp-magic-garbage", b64(b"RIFF\x10\x00\x00\x00WEBPVP8 " + b"\x00" * 40, "image/webp"), 400, "WEBP"),
        Sample("base64-garbage", "data:image/png;base64,iVBORw0KGgo!!!***", 400, "not valid base64"),
        Sample("base64-bad-padding", "data:image/png;base64,iVBORw0KGgo", 400, "not valid base64"),
        Sample("png-magic-only", "data:image/png;base64,iVBORw0KGgoA", 400, "cannot read the PNG header (not a valid file"),
        Sample("data-url-not-base64", "data:image/png,%89PNG", 400, "must be base64-encoded"),
        Sample("data-url-no-comma", "data:image/png;base64", 400, "no comma"),
        Sample("oversized-image", b64(b"\x89PNG\r\n\x1a\n" + bytes(max_image_bytes)), 413, f"the limit is {max_image_bytes} bytes"),
        Sample("file-scheme", "file:///etc/passwd", 400, "scheme 'file' is not allowed"),
        Sample("ftp-scheme", "ftp://example.org/a.png", 400, "scheme 'ftp' is not allowed"),
        Sample("no-scheme", "cat.png", 400, "scheme '' is not allowed"),
    ]


def odd_valid_samples() -> list[Sample]:
    rgba = scene((90, 70), "rgba").convert("RGBA")
    rgba.putalpha(128)
    return [
        Sample("cmyk-jpeg", b64(save(scene(name="cmyk").convert("CMYK"), "JPEG"), "image/jpeg"), 200),
        Sample("sixteen-bit-png", b64(sixteen_bit_png()), 200),
        Sample("palette-png-transparent", b64(palette_png_with_transparency()), 200),
        Sample("exif-rotated-png", b64(exif_rotated_png()[0]), 200),
        Sample("animated-gif", b64(animated_gif()[0], "image/gif"), 200),
        Sample("rgba-png", b64(save(rgba, "PNG")), 200),
        Sample("la-png", b64(save(scene(name="la").convert("LA"), "PNG")), 200),
        Sample("one-bit-png", b64(save(scene(name="1bit").convert("1"), "PNG")), 200),
        Sample("greyscale-jpeg", b64(save(scene(name="grey").convert("L"), "JPEG"), "image/jpeg"), 200),
        Sample("webp-lossless", b64(save(scene(name="webp"), "WEBP", lossless=True), "image/webp"), 200),
        Sample("bmp", b64(save(scene(name="bmp"), "BMP"), "image/bmp"), 200),
        Sample("two-by-two", b64(save(scene((2, 2), "tiny"), "PNG")), 200),
        Sample("no-media-type", "data:;base64," + base64.b64encode(save(scene(name="nomedia"), "PNG")).decode(), 200),
        Sample("lying-media-type", b64(save(scene(name="liar"), "PNG"), "image/gif"), 200),
        Sample("jpeg-progressive", b64(save(scene(name="prog"), "JPEG", progressive=True), "image/jpeg"), 200),
    ]
