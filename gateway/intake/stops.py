"""The one exception work on an intake thread (or in a video decoder process) ends with when it
was told to stop. Here, apart, because a decoder process imports it without the gateway's web
stack (gateway/intake/video/decoder_process.py)."""


class Stopped(Exception):
    """Work that ended because it was told to (`together.on_thread`'s stop, a decode's deadline)."""
