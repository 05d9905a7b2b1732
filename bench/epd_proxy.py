"""The small proxy in front of vLLM's disaggregated encoder, for bench.compare.

vLLM's own example (examples/online_serving/disaggregated_encoder) puts a
proxy before its two instances; this one does the same, and nothing more: a
chat request with images is first sent to the encoder instance
(`--mm-encoder-only`, an `ec_producer`) with max_tokens 1, which encodes the
images and writes their encoder outputs to the connector's shared storage;
then the request as sent goes to the prefill+decode instance (an
`ec_consumer`), which loads those outputs instead of encoding, and its answer
(a stream or a body) is passed back as it comes.

Run: python -m bench.epd_proxy --encoder http://127.0.0.1:8101 --pd http://127.0.0.1:8102 --port 8100
"""

from __future__ import annotations

import argparse
import uuid

import httpx
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask


def has_images(body: dict) -> bool:
    return any(isinstance(m.get("content"), list) and any(p.get("type") == "image_url" for p in m["content"])
               for m in body.get("messages", []))


def create_app(encoder_url: str, pd_url: str) -> FastAPI:
    app = FastAPI()
    client = httpx.AsyncClient(timeout=httpx.Timeout(600), limits=httpx.Limits(max_connections=None))

    @app.get("/health")
    async def health() -> Response:
        answers = [await client.get(f"{url}/health") for url in (encoder_url, pd_url)]
        return Response(status_code=200 if all(a.status_code == 200 for a in answers) else 503)

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        return JSONResponse((await client.get(f"{pd_url}/v1/models")).json())

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        body = await request.json()
        headers = {"x-request-id": request.headers.get("x-request-id") or uuid.uuid4().hex}
        if has_images(body):
            primer = {**body, "max_tokens": 1, "stream": False}
            primer.pop("stream_options", None)
            primer.pop("max_completion_tokens", None)
            encoded = await client.post(f"{encoder_url}/v1/chat/completions", json=primer, headers=headers)
            if encoded.status_code != 200:
                return Response(encoded.content, status_code=encoded.status_code, media_type="application/json")
        upstream = await client.send(client.build_request("POST", f"{pd_url}/v1/chat/completions", json=body, headers=headers),
                                     stream=True)
        if not body.get("stream"):
            content = await upstream.aread()
            await upstream.aclose()
            return Response(content, status_code=upstream.status_code, media_type="application/json")
        return StreamingResponse(upstream.aiter_raw(), status_code=upstream.status_code, media_type="text/event-stream",
                                 background=BackgroundTask(upstream.aclose))

    return app


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--encoder", required=True)
    parser.add_argument("--pd", required=True)
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args()
    uvicorn.run(create_app(args.encoder, args.pd), host="127.0.0.1", port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
