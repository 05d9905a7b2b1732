"""What a streamed video request holds in the gateway's memory budget while its
answer streams (figures in docs/measurements/video-held.md).

A `LocalStack` on the demo model from the checkout it runs in; one request at a
time, each a new 8 s clip (640×480, 10 fps, sampled at the loader's default 2
fps), max_tokens 400, streamed: after its first content token, one scrape of
`prism_gateway_memory_held_bytes` (with it the only request in flight), then
the rest of the answer is read.

Run: .venv/bin/python -m bench.video_held --trials 3
"""

from __future__ import annotations

import argparse
import base64
import tempfile
from pathlib import Path

from openai import OpenAI

from loadtest.clips import clip
from testing.stack import LocalStack, scrape


def held_while_streaming(base_url: str, seed: int) -> tuple[int, float, float]:
    """(the clip's bytes, the bytes held after the first token, requests in flight then)."""
    raw = clip(640, 480, fps=10, num_frames=80, seed=seed)
    client = OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)
    content = [{"type": "video_url", "video_url": {"url": "data:video/mp4;base64," + base64.b64encode(raw).decode()}},
               {"type": "text", "text": "Describe it at length."}]
    chunks = iter(client.chat.completions.create(model="prism-demo", max_tokens=400, stream=True,
                                                 messages=[{"role": "user", "content": content}]))
    while not next(chunks).choices[0].delta.content:
        pass
    samples = scrape(base_url)
    held = samples[("prism_gateway_memory_held_bytes", ())]
    in_flight = samples[("prism_in_flight_requests", (("service", "gateway"),))]
    for _ in chunks:
        pass
    return len(raw), held, in_flight


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=3)
    args = parser.parse_args()
    with LocalStack(Path(tempfile.mkdtemp(prefix="video-held-"))) as stack:
        for trial in range(args.trials):
            body, held, in_flight = held_while_streaming(stack.base_url, seed=100 + trial)
            print(f"clip {body / 2**20:.2f} MiB; held while its answer streams {held / 2**20:.2f} MiB; in flight {in_flight:.0f}")


if __name__ == "__main__":
    main()
