"""Judge an image by its bytes, never by a Content-Type or a file name."""

from __future__ import annotations

# Formats Prism decodes (Pillow names); anything else is refused with 415.
ALLOWED = {
    "JPEG": (b"\xff\xd8\xff",),
    "PNG": (b"\x89PNG\r\n\x1a\n",),
    "GIF": (b"GIF87a", b"GIF89a"),
    "BMP": (b"BM",),
}

# Recognised only to say what was refused.
_KNOWN_REFUSED = (
    (b"%PDF", "PDF"),
    (b"II*\x00", "TIFF"),
    (b"MM\x00*", "TIFF"),
    (b"<svg", "SVG"),
    (b"<?xml", "XML/SVG"),
    (b"\x00\x00\x00\x0cjP  ", "JPEG 2000"),
)
_ISO_BRANDS = {b"heic": "HEIC", b"heix": "HEIC", b"mif1": "HEIF", b"msf1": "HEIF", b"avif": "AVIF", b"avis": "AVIF"}


def sniff(data: bytes) -> str | None:
    """The allowed format the bytes are, or None."""
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "WEBP"
    for name, magics in ALLOWED.items():
        if any(data.startswith(m) for m in magics):
            return name
    return None


def describe_refused(data: bytes) -> str:
    """A short name for bytes that are not an allowed image, for error messages."""
    if not data:
        return "empty"
    head = data[:64].lstrip()
    for magic, name in _KNOWN_REFUSED:
        if head.startswith(magic):
            return name
    if data[4:8] == b"ftyp":
        return _ISO_BRANDS.get(data[8:12], f"ISO media ({data[8:12].decode('latin-1')!r})")
    return "unknown"


ALLOWED_NAMES = sorted([*ALLOWED, "WEBP"])
