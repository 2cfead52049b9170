"""A minimal mock OpenAI upstream for the gateway-overhead benchmark: plain asyncio, HTTP/1.1 keep-alive.

POST /v1/chat/completions and /v1/completions answer at once with a fixed JSON body, or (with "stream": true)
with 20 SSE chunks and [DONE]; GET /v1/models lists the model; GET /metrics gives vLLM's gauges (zero). It does
as little work per request as it can, so that what the benchmark measures is the gateway in front of it.

    python benchmarks/mock_upstream.py --port 9100 [--cpu 1]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os

MODEL = "mock"
N_CHUNKS = 20
_BODY = json.dumps({
    "id": "chatcmpl-mock-0", "object": "chat.completion", "created": 1700000000, "model": MODEL,
    "system_fingerprint": "fp_mock",
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok " * 16}, "finish_reason": "stop"}],
    "usage": {"prompt_tokens": 8, "completion_tokens": 16, "total_tokens": 24}}).encode()
JSON_RESPONSE = (b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
                 % (len(_BODY), _BODY))


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


def _event(delta: dict, finish: str | None = None) -> bytes:
    event = {"id": "chatcmpl-mock-0", "object": "chat.completion.chunk", "created": 1700000000, "model": MODEL,
             "system_fingerprint": "fp_mock", "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
    return b"data: " + json.dumps(event).encode() + b"\n\n"


STREAM_HEAD = (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncache-control: no-cache\r\n"
               b"transfer-encoding: chunked\r\n\r\n")
STREAM_CHUNKS = ([_chunk(_event({"role": "assistant", "content": ""}))]
                 + [_chunk(_event({"content": f"t{i} "})) for i in range(N_CHUNKS - 2)]
                 + [_chunk(_event({}, "stop")), _chunk(b"data: [DONE]\n\n"), b"0\r\n\r\n"])
_MODELS = json.dumps({"object": "list", "data": [{"id": MODEL, "object": "model", "owned_by": "mock"}]}).encode()
_METRICS = (f'vllm:num_requests_running{{model_name="{MODEL}"}} 0.0\n'
            f'vllm:num_requests_waiting{{model_name="{MODEL}"}} 0.0\n'
            f'vllm:kv_cache_usage_perc{{model_name="{MODEL}"}} 0.0\n').encode()


def _ok(body: bytes, ctype: bytes) -> bytes:
    return b"HTTP/1.1 200 OK\r\ncontent-type: %s\r\ncontent-length: %d\r\n\r\n%s" % (ctype, len(body), body)


class MockProtocol(asyncio.Protocol):
    """Parses pipelined requests out of the byte stream; answers each in order."""

    def __init__(self, chunk_delay: float) -> None:
        self.buf = b""
        self.chunk_delay = chunk_delay
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.buf += data
        while True:
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                return
            head = self.buf[:end]
            length = 0
            i = head.lower().find(b"content-length:")
            if i >= 0:
                j = head.find(b"\r\n", i)
                length = int(head[i + 15:j if j > 0 else None])
            if len(self.buf) < end + 4 + length:
                return
            body = self.buf[end + 4:end + 4 + length]
            self.buf = self.buf[end + 4 + length:]
            self.answer(head, body)

    def answer(self, head: bytes, body: bytes) -> None:
        line = head[:head.find(b"\r\n")]
        if line.startswith(b"GET /v1/models"):
            self.transport.write(_ok(_MODELS, b"application/json"))
        elif line.startswith(b"GET /metrics"):
            self.transport.write(_ok(_METRICS, b"text/plain"))
        elif line.startswith(b"POST") and (b'"stream": true' in body or b'"stream":true' in body):
            if self.chunk_delay:
                asyncio.get_running_loop().create_task(self.slow_stream())
            else:
                self.transport.write(STREAM_HEAD + b"".join(STREAM_CHUNKS))
        elif line.startswith(b"POST"):
            self.transport.write(JSON_RESPONSE)
        else:
            self.transport.write(b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\n\r\n")

    async def slow_stream(self) -> None:
        self.transport.write(STREAM_HEAD)
        for c in STREAM_CHUNKS:
            self.transport.write(c)
            await asyncio.sleep(self.chunk_delay)


async def serve(host: str, port: int, chunk_delay: float = 0.0) -> None:
    server = await asyncio.get_running_loop().create_server(lambda: MockProtocol(chunk_delay), host, port,
                                                            backlog=1024)
    async with server:
        await server.serve_forever()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=9100)
    p.add_argument("--cpu", type=int, default=None, help="pin this process to one CPU core")
    p.add_argument("--chunk-delay", type=float, default=0.0, help="seconds between streamed chunks")
    a = p.parse_args()
    if a.cpu is not None:
        os.sched_setaffinity(0, {a.cpu})
    asyncio.run(serve(a.host, a.port, a.chunk_delay))


if __name__ == "__main__":
    main()
