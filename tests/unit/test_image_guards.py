"""What one image may cost the gateway before it is refused, and pixels as vLLM's loader makes
them where an image is odd (gateway/intake/images.py). vLLM's own ImageMediaIO is the reference."""

from __future__ import annotations

import io
import struct
import zlib

import numpy as np
import pytest
from PIL import ExifTags, Image

from gateway.errors import APIError
from gateway.intake import images
from gateway.intake.images import ImageLimits, IntakePolicy, decode, inspect
from protocol.to_gateway import ProcessorInfo

POLICY = IntakePolicy(ProcessorInfo(14, 2, 3136, 12845056), ImageLimits(20 * 2**20, 50_000_000, 2, 200))


def encoded(image: Image.Image, fmt: str, **options) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt, **options)
    return buffer.getvalue()


def prism_pixels(raw: bytes, policy: IntakePolicy = POLICY) -> np.ndarray:
    return decode(inspect(raw, "img", policy, policy.default_budget), policy).pixels


def vllm_pixels(raw: bytes) -> np.ndarray:
    from vllm.multimodal.media.image import ImageMediaIO

    return np.asarray(ImageMediaIO().load_bytes(raw).media)


def with_repeated_scans(times: int) -> bytes:
    """A progressive JPEG with its last scan repeated: libjpeg decodes every copy."""
    jpeg = encoded(Image.new("L", (64, 64), 128), "JPEG", progressive=True)
    last_scan = jpeg.rindex(b"\xff\xda")
    return jpeg[:-2] + jpeg[last_scan:-2] * times + b"\xff\xd9"


def rle8_bmp(width: int, height: int) -> bytes:
    """An 8-bit BMP run-length encoded (BI_RLE8), which Pillow cannot write: rows of 255-pixel runs."""
    runs = width // 255 * bytes([255, 7]) + (bytes([width % 255, 7]) if width % 255 else b"")
    pixels = (runs + b"\x00\x00") * height + b"\x00\x01"  # end of line, end of bitmap
    palette = b"".join(bytes([i, i, i, 0]) for i in range(256))
    offset = 14 + 40 + len(palette)
    info = struct.pack("<IiiHHIIiiII", 40, width, height, 1, 8, 1, len(pixels), 2835, 2835, 256, 0)
    return b"BM" + struct.pack("<IHHI", offset + len(pixels), 0, 0, offset) + info + palette + pixels


def test_a_large_run_length_encoded_bmp_is_refused_before_pillow_decodes_it_in_python():
    """Seconds of the GIL for a 7000² image in 400 KB; a small one is decoded as vLLM decodes it."""
    with pytest.raises(APIError, match="run-length-encoded BMP") as refused:
        inspect(rle8_bmp(7000, 7000), "img", POLICY, POLICY.default_budget)
    assert refused.value.status == 415
    small = rle8_bmp(600, 400)
    assert np.array_equal(prism_pixels(small), vllm_pixels(small))


def test_a_jpeg_of_thousands_of_scans_is_refused_before_it_is_decoded():
    with pytest.raises(APIError, match=r"scans; at most 100 are decoded") as refused:
        inspect(with_repeated_scans(1000), "img", POLICY, POLICY.default_budget)
    assert refused.value.status == 400
    assert prism_pixels(with_repeated_scans(20)).shape == (64, 64, 3)  # a few more than usual: decoded


def test_only_the_jpeg_s_own_scans_count():
    """A motion photo carries its video after the image's end marker, where any two bytes may read
    as a start of scan, and an EXIF thumbnail has a scan of its own: neither is the image's."""
    photo = Image.new("RGB", (64, 64), (200, 30, 30))
    thumbnail = encoded(Image.new("RGB", (16, 16)), "JPEG")
    exif = Image.Exif()
    exif[ExifTags.Base.Orientation] = 1
    with_thumbnail = encoded(photo, "JPEG", progressive=True, exif=exif.tobytes() + thumbnail)
    motion_photo = with_thumbnail + b"ftypmp42" + b"\xff\xda\x00\x04\x01\x02" * 500
    assert images.jpeg_scans(motion_photo) == images.jpeg_scans(encoded(photo, "JPEG", progressive=True)) < 20
    assert np.array_equal(prism_pixels(motion_photo), vllm_pixels(motion_photo))


def test_a_jpeg_whose_scans_hide_past_thousands_of_markers_is_refused_before_it_is_decoded():
    """Empty comment markers past the count's cap, then thousands of scans: counted, they would pass
    as none, and their decode would run seconds between two looks at its deadline."""
    jpeg = with_repeated_scans(3000)
    hidden = jpeg[:2] + b"\xff\xfe\x00\x02" * images.MAX_JPEG_MARKERS + jpeg[2:]
    with pytest.raises(APIError, match=f"more than {images.MAX_JPEG_MARKERS} markers") as refused:
        inspect(hidden, "img", POLICY, POLICY.default_budget)
    assert (refused.value.status, refused.value.code) == (413, "image_too_complex")


def png_chunk(kind: bytes, data: bytes = b"") -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def test_a_header_built_to_take_long_is_refused_at_its_deadline(monkeypatch):
    """Half a million empty chunks, each parsed in Python: past the header's deadline, a 413."""
    png = encoded(Image.new("RGB", (64, 64)), "PNG")
    header_end = 8 + 25  # the signature, then IHDR
    padded = png[:header_end] + png_chunk(b"prSm") * 500_000 + png[header_end:]
    monkeypatch.setattr(images, "HEADER_READ_S", 0.05)
    with pytest.raises(APIError, match="header took more than 0.05 s") as refused:
        inspect(padded, "img", POLICY, POLICY.default_budget)
    assert (refused.value.status, refused.value.code) == (413, "image_too_complex")


def test_a_decode_past_its_deadline_is_refused():
    slow = IntakePolicy(POLICY.processor, ImageLimits(20 * 2**20, 50_000_000, 2, 200, max_decode_s=0.0))
    item = inspect(encoded(Image.new("RGB", (512, 512)), "PNG"), "img", slow, slow.default_budget)
    with pytest.raises(APIError, match=r"took more than 0 s to decode \(gateway.max_image_decode_s\)") as refused:
        decode(item, slow)
    assert refused.value.status == 413


def test_a_decode_told_to_stop_ends_at_its_next_read_whatever_the_format():
    for fmt in ("PNG", "JPEG", "WEBP"):
        item = inspect(encoded(Image.new("RGB", (512, 512)), fmt), "img", POLICY, POLICY.default_budget)
        with pytest.raises(images.Stopped):  # not a 400: its request has ended, nobody reads the error
            decode(item, POLICY, stop=lambda: True)
        assert decode(item, POLICY, stop=lambda: False).pixels.shape[2] == 3


def test_an_upscaled_image_is_counted_at_the_size_it_is_sent():
    """A 64² PNG asked for at 3584² (mm_processor_kwargs min_pixels = max_pixels) holds that size's pixels."""
    raw = encoded(Image.new("RGB", (64, 64)), "PNG")
    budget = images.PixelBudget(3584 * 3584, 3584 * 3584)
    item = inspect(raw, "img", POLICY, budget)
    assert item.target == (3584, 3584) and item.decoding_bytes == 3584 * 3584 * images.DECODE_BYTES_PER_PIXEL


def test_images_that_decode_through_larger_buffers_are_counted_so():
    webp, rgba = encoded(Image.new("RGB", (64, 64)), "WEBP"), encoded(Image.new("RGBA", (64, 64)), "PNG")
    for raw, per_pixel in ((webp, images.WEBP_BYTES_PER_PIXEL), (rgba, images.TURNED_OR_ALPHA_BYTES_PER_PIXEL)):
        assert inspect(raw, "img", POLICY, POLICY.default_budget).bytes_per_pixel == per_pixel


def test_inspect_reads_the_header_alone_whatever_the_format(monkeypatch):
    """A PNG's getexif() decodes the whole image: inspect must not ask it, turned or not."""
    from PIL import ImageFile

    turned = Image.Exif()
    turned[0x0112] = 6
    raws = [encoded(Image.new("RGB", (64, 32)), "PNG"), encoded(Image.new("RGB", (64, 32)), "PNG", exif=turned.tobytes())]
    monkeypatch.setattr(ImageFile.ImageFile, "load", lambda self: pytest.fail("inspect decoded the image"))
    plain, rotated = (inspect(raw, "img", POLICY, POLICY.default_budget) for raw in raws)
    assert (plain.bytes_per_pixel, rotated.bytes_per_pixel) == (images.DECODE_BYTES_PER_PIXEL, images.TURNED_OR_ALPHA_BYTES_PER_PIXEL)


def test_greyscale_with_a_transparent_colour_goes_onto_white_as_vllm_s_loader_puts_it():
    grey = np.zeros((56, 56), np.uint8)
    grey[:, 28:] = 100
    raw = encoded(Image.fromarray(grey), "PNG", transparency=0)
    assert np.array_equal(prism_pixels(raw), vllm_pixels(raw)) and prism_pixels(raw)[0, 0].tolist() == [255, 255, 255]


def exif_block(entries: list[bytes]) -> bytes:
    """A little-endian EXIF block with one IFD of these entries (tag, type, count, value)."""
    return b"Exif\x00\x00II*\x00" + struct.pack("<IH", 8, len(entries)) + b"".join(entries) + struct.pack("<I", 0)


def test_an_exif_block_pillow_cannot_apply_leaves_the_image_unturned_as_vllm_does():
    """Orientation 6 beside an ImageDescription typed as a fraction: exif_transpose raises on it."""
    turn = struct.pack("<HHI", 0x0112, 3, 1) + struct.pack("<HH", 6, 0)
    odd_description = struct.pack("<HHI", 0x010E, 5, 1) + struct.pack("<I", 26)
    pixels = np.random.default_rng(3).integers(0, 255, (40, 60, 3), dtype=np.uint8)
    raw = encoded(Image.fromarray(pixels), "PNG", exif=exif_block([turn, odd_description]))
    assert vllm_pixels(raw).shape == (40, 60, 3)  # vLLM keeps it as stored
    assert np.array_equal(prism_pixels(raw), vllm_pixels(raw))
