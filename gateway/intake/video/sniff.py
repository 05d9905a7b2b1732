"""Judge a video by its bytes: only containers FFmpeg is asked to open.

Without this gate FFmpeg's probe would open an image (a PNG is a one-frame
"video" to its png_pipe demuxer) or guess a format from noise.
"""

from __future__ import annotations

from gateway.intake.sniff import describe_refused, sniff

_ISO_BOXES = {b"ftyp", b"moov", b"mdat", b"free", b"wide", b"skip"}  # mp4 / mov first boxes
_ISO_IMAGE_BRANDS = {b"heic", b"heix", b"mif1", b"msf1", b"avif", b"avis"}  # still images in ISO media


def is_video_container(data: bytes) -> bool:
    if data[4:8] in _ISO_BOXES:
        return not (data[4:8] == b"ftyp" and data[8:12] in _ISO_IMAGE_BRANDS)
    if data.startswith(b"\x1a\x45\xdf\xa3"):  # EBML: Matroska, WebM
        return True
    return data[:4] == b"RIFF" and data[8:12] == b"AVI "


def counts_frames_exactly(data: bytes) -> bool:
    """Whether the container's header counts its frames (mp4 and mov's sample tables, AVI's index).
    Matroska and WebM give a duration and a nominal rate, from which OpenCV estimates the count: a
    clip of variable frame rate (a screen or browser recording) holds fewer."""
    return not data.startswith(b"\x1a\x45\xdf\xa3")


def describe_not_video(data: bytes) -> str:
    image = sniff(data)
    if image is not None:
        return f"a {image} image"
    described = describe_refused(data)
    return "unrecognised bytes" if described == "unknown" else described
