"""Workloads: which requests a load test sends, decided entirely by a seed.

A request has 0..n images drawn from weighted resolution buckets, each a JPEG
or PNG; with probability `repeat_ratio` an image slot reuses an image already
sent (from a pool of the last `pool_size` new ones), so caches see repeats at
a known rate; a request whose every image is a repeat is reported apart
("<bucket>-repeat"). Questions and optional system prompts vary per request (the
same image with different questions and system prompts is `pool_size=1,
repeat_ratio=1`). With a video mix (`VideoMix`, loadtest/videos.py), a share
of the requests carry one clip instead of images: its length drawn from
weighted lengths, new or a repeat of a recent clip. Images and clips are
rendered once, before any clock starts.
"""

from __future__ import annotations

import base64
import random
from dataclasses import dataclass, field

from loadtest.synthetic import encode, make_image
from loadtest.videos import VideoMix, VideoSpec, pick_video

# Named resolutions (width, height): the mix plus strips.
RESOLUTIONS = {
    "256x256": (256, 256),
    "720p": (1280, 720),
    "1080p": (1920, 1080),
    "4k": (3840, 2160),
    "wide-strip": (2048, 256),
    "tall-strip": (256, 2048),
}
QUESTIONS = (
    "What is in this image?", "Describe the picture briefly.", "Which colours do you see?",
    "How many shapes are there?", "Is there a circle?", "What stands out here?",
)
FILLER = "please answer in one short sentence and be precise about what you can see".split()


@dataclass(frozen=True)
class Bucket:
    name: str
    width: int
    height: int
    weight: float


@dataclass(frozen=True)
class ImageSpec:
    bucket: str
    width: int
    height: int
    fmt: str  # "JPEG" or "PNG"
    seed: int  # distinct images have distinct seeds; a repeat is the same spec

    part = "image_url"  # the chat content part that carries it

    @property
    def mime(self) -> str:
        return "image/png" if self.fmt == "PNG" else "image/jpeg"

    @property
    def path(self) -> str:
        return f"/{self.seed}.{'png' if self.fmt == 'PNG' else 'jpg'}"

    def render(self) -> bytes:
        return encode(make_image(f"load-{self.seed}", (self.width, self.height)), self.fmt)


@dataclass(frozen=True)
class RequestSpec:
    index: int
    images: tuple[ImageSpec, ...]
    question: str
    system: str | None
    max_tokens: int
    videos: tuple[VideoSpec, ...] = ()
    video_repeat: bool = False  # its clip was sent before (a cache can answer it)
    video_fps: float | None = None  # media_io_kwargs.video.fps
    video_max_pixels: int | None = None  # mm_processor_kwargs.max_pixels
    images_repeated: bool = False  # every image of it was sent before (a cache can answer them all)
    priority: int = 0  # vLLM's `priority` (lower first; sent only where set): bench/priority.py

    @property
    def bucket(self) -> str:
        """The request's kind: "video-<length>-new|repeat", its first image's bucket ("<bucket>-repeat"
        when every image was sent before: a cache hit's TTFT is not a new image's), or "text"."""
        if self.videos:
            return f"video-{self.videos[0].length}-{'repeat' if self.video_repeat else 'new'}"
        if not self.images:
            return "text"
        return f"{self.images[0].bucket}-repeat" if self.images_repeated else self.images[0].bucket

    @property
    def media(self) -> tuple:
        """Images, then videos: the content parts before the question."""
        return (*self.images, *self.videos)


@dataclass(frozen=True)
class WorkloadSpec:
    buckets: tuple[Bucket, ...]
    images_per_request: tuple[tuple[int, float], ...] = ((1, 1.0),)  # (count, weight)
    png_fraction: float = 0.0
    repeat_ratio: float = 0.0
    pool_size: int = 32
    prompt_words: int = 0  # filler words appended to each question (longer prompts)
    max_tokens: int = 16
    system_prompts: str = "none"  # none | fixed | unique
    seed: int = 0
    # Mixed into every image's seed: the same sizes, formats and repeats in the
    # same order with other pixels (two loads side by side on one cache).
    image_salt: int = 0
    videos: VideoMix | None = None  # None: images only

    def __post_init__(self) -> None:
        if not self.buckets or any(b.weight < 0 for b in self.buckets) or sum(b.weight for b in self.buckets) <= 0:
            raise ValueError("buckets need non-negative weights with a positive sum")
        if not 0 <= self.repeat_ratio <= 1 or not 0 <= self.png_fraction <= 1:
            raise ValueError("repeat_ratio and png_fraction lie in [0, 1]")
        if self.pool_size < 1:
            raise ValueError("pool_size must be at least 1")
        if self.system_prompts not in ("none", "fixed", "unique"):
            raise ValueError("system_prompts is none, fixed or unique")


def parse_buckets(text: str) -> tuple[Bucket, ...]:
    """"720p=2,4k=1,640x480=1": names from RESOLUTIONS or WxH, each with a weight."""
    buckets = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, _, weight = item.partition("=")
        if name in RESOLUTIONS:
            width, height = RESOLUTIONS[name]
        else:
            try:
                width, height = (int(v) for v in name.lower().split("x"))
            except ValueError:
                raise ValueError(f"unknown resolution {name!r}: use WxH or one of {', '.join(RESOLUTIONS)}") from None
        buckets.append(Bucket(name, width, height, float(weight or 1)))
    return tuple(buckets)


def parse_distribution(text: str) -> tuple[tuple[int, float], ...]:
    """"1=0.8,2=0.2": images per request and their weights."""
    pairs = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        count, _, weight = item.partition("=")
        pairs.append((int(count), float(weight or 1)))
    return tuple(pairs)


@dataclass
class _Pool:
    size: int
    images: list[ImageSpec] = field(default_factory=list)

    def add(self, image: ImageSpec) -> None:
        self.images.append(image)
        del self.images[: -self.size]


def _images(spec: WorkloadSpec, rng: random.Random, pool: _Pool) -> tuple[tuple[ImageSpec, ...], bool]:
    """A request's images, and whether every one is a repeat."""
    counts, count_weights = zip(*spec.images_per_request)
    images, repeats = [], 0
    for _ in range(rng.choices(counts, count_weights)[0]):
        if pool.images and rng.random() < spec.repeat_ratio:
            images.append(rng.choice(pool.images))
            repeats += 1
            continue
        bucket = rng.choices(spec.buckets, [b.weight for b in spec.buckets])[0]
        fmt = "PNG" if rng.random() < spec.png_fraction else "JPEG"
        image = ImageSpec(bucket.name, bucket.width, bucket.height, fmt, rng.getrandbits(48) ^ spec.image_salt)
        pool.add(image)
        images.append(image)
    return tuple(images), bool(images) and repeats == len(images)


def generate(spec: WorkloadSpec, count: int, first_index: int = 0) -> list[RequestSpec]:
    """`count` requests, the same for the same spec and seed (a spec without
    videos draws exactly what it drew before videos existed)."""
    rng = random.Random(spec.seed)
    pool, clips = _Pool(spec.pool_size), []
    requests = []
    for index in range(first_index, first_index + count):
        video, repeat = None, False
        if spec.videos and rng.random() < spec.videos.fraction:
            video, repeat = pick_video(spec.videos, rng, clips, spec.image_salt)
        images, images_repeated = ((), False) if video else _images(spec, rng, pool)
        question = rng.choice(QUESTIONS)
        if spec.prompt_words:
            question += " " + " ".join(rng.choice(FILLER) for _ in range(spec.prompt_words))
        system = {"none": None, "fixed": "You are a helpful assistant.", "unique": f"You are assistant number {index}; answer briefly."}[spec.system_prompts]
        sampling = (spec.videos.sample_fps, spec.videos.max_pixels) if video else (None, None)
        requests.append(RequestSpec(index, images, question, system, spec.max_tokens, (video,) if video else (), repeat, *sampling,
                                    images_repeated))
    return requests


def render(requests: list[RequestSpec]) -> dict:
    """Every distinct image's and clip's encoded bytes (done once, before timing)."""
    rendered = {}
    for request in requests:
        for media in request.media:
            if media not in rendered:
                rendered[media] = media.render()
    return rendered


def data_url(media, data: bytes) -> str:
    return f"data:{media.mime};base64,{base64.b64encode(data).decode()}"
