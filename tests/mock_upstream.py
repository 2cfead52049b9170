"""A mock OpenAI-compatible upstream on a loopback port (a real uvicorn server), for the router tests.

It answers chat and completions (streamed or not) with its own id and system_fingerprint, lists one model,
serves vLLM-named /metrics from its own requests in flight, and can be made slow, failing (500 everywhere) or
broken mid-stream on demand. It counts what it saw, including streams the client closed before the end.
"""
from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Iterator

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class MockUpstream:
    name: str
    delay: float = 0.0  # seconds before the answer (non-streamed) or before the first chunk
    chunk_delay: float = 0.0  # seconds between streamed chunks
    chunks: int = 5  # content chunks per streamed answer
    # None | "down" (500 everywhere) | "500" or "400" (on requests; /v1/models still answers) | "midstream"
    # (streams break after 2 chunks)
    fail: str | None = None
    requests: int = 0  # chat/completion requests received
    streams_completed: int = 0
    closed_early: int = 0  # streams or delayed answers whose client went away first
    in_flight: int = 0
    headers_seen: list[dict[str, str]] = field(default_factory=list)
    bodies_seen: list[bytes] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.fingerprint = f"fp_{self.name}"
        self._ids = itertools.count()
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/v1"
        self.app = Starlette(routes=[Route("/v1/chat/completions", self.generate, methods=["POST"]),
                                     Route("/v1/completions", self.generate, methods=["POST"]),
                                     Route("/v1/models", self.models), Route("/metrics", self.metrics)])

    def start(self) -> "MockUpstream":
        """Start serving on its port (again, after stop(): a restarted upstream); returns once it listens."""
        self.server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=self.port, log_level="error"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        while not self.server.started:
            assert self.thread.is_alive(), f"the mock upstream {self.name} did not start"
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        """Stop serving: its port refuses connections until start() again."""
        self.server.should_exit = True
        self.thread.join(timeout=10)

    def text(self) -> str:
        return "".join(f"{self.name}{i} " for i in range(self.chunks))

    # ---- endpoints ------------------------------------------------------------------------------------------------
    async def models(self, request: Request) -> Response:
        if self.fail == "down":
            return JSONResponse({"error": {"message": "down"}}, status_code=500)
        return JSONResponse({"object": "list", "data": [{"id": self.name, "object": "model", "owned_by": "mock"}]})

    async def metrics(self, request: Request) -> Response:
        return PlainTextResponse(
            "# TYPE vllm:num_requests_running gauge\n"
            f'vllm:num_requests_running{{model_name="{self.name}"}} {self.in_flight}\n'
            f'vllm:num_requests_waiting{{model_name="{self.name}"}} 0.0\n'
            f'vllm:kv_cache_usage_perc{{model_name="{self.name}"}} 0.1\n')

    async def generate(self, request: Request) -> Response:
        body = await request.json()
        self.requests += 1
        self.headers_seen.append(dict(request.headers))
        self.bodies_seen.append(await request.body())
        if self.fail in ("500", "400", "down"):
            code = 400 if self.fail == "400" else 500
            return JSONResponse({"error": {"message": f"{self.name} says {code}", "type": "mock", "param": None,
                                           "code": code}}, status_code=code)
        chat = request.url.path.endswith("/chat/completions")
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{self.name}-{next(self._ids)}"
        common = {"id": rid, "created": 1700000000, "model": body.get("model"),
                  "system_fingerprint": self.fingerprint}
        if body.get("stream"):
            return StreamingResponse(self.stream(request, chat, common), media_type="text/event-stream")
        self.in_flight += 1
        try:
            if not await self.wait(request, self.delay):
                return Response(status_code=499)
        finally:
            self.in_flight -= 1
        n = self.chunks
        choice = ({"index": 0, "message": {"role": "assistant", "content": self.text()}, "finish_reason": "stop"}
                  if chat else {"index": 0, "text": self.text(), "finish_reason": "stop"})
        return JSONResponse({**common, "object": "chat.completion" if chat else "text_completion",
                             "choices": [choice], "usage": {"prompt_tokens": 3, "completion_tokens": n,
                                                            "total_tokens": 3 + n}})

    async def wait(self, request: Request, seconds: float) -> bool:
        """Sleep, watching for the client going away (False then)."""
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            await asyncio.sleep(min(0.02, max(0.0, end - time.monotonic())))
            if await request.is_disconnected():
                self.closed_early += 1
                return False
        return True

    async def stream(self, request: Request, chat: bool, common: dict):
        obj = "chat.completion.chunk" if chat else "text_completion"

        def event(delta: str | None, finish: str | None = None, role: bool = False) -> bytes:
            if chat:
                d = {"role": "assistant", "content": ""} if role else ({"content": delta} if delta else {})
                choice = {"index": 0, "delta": d, "finish_reason": finish}
            else:
                choice = {"index": 0, "text": delta or "", "finish_reason": finish}
            return f"data: {json.dumps({**common, 'object': obj, 'choices': [choice]})}\n\n".encode()

        self.in_flight += 1
        done = False
        try:
            await asyncio.sleep(self.delay)
            if chat:
                yield event(None, role=True)
            for i in range(self.chunks):
                if self.fail == "midstream" and i == 2:
                    raise ConnectionError(f"{self.name} broke mid-stream")
                yield event(f"{self.name}{i} ")
                if self.chunk_delay:
                    await asyncio.sleep(self.chunk_delay)
            yield event(None, "stop")
            yield b"data: [DONE]\n\n"
            done = True
            self.streams_completed += 1
        finally:
            self.in_flight -= 1
            if not done and self.fail != "midstream":
                self.closed_early += 1


@contextlib.contextmanager
def serving(app) -> Iterator[str]:
    """Any ASGI app (the gateway) on a real uvicorn server on a loopback port; yields its base URL."""
    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=free_port(), log_level="error"))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    try:
        while not srv.started:
            if not thread.is_alive():
                raise RuntimeError("the server did not start")
            time.sleep(0.02)
        yield f"http://127.0.0.1:{srv.config.port}"
    finally:
        srv.should_exit = True
        thread.join(timeout=10)


@contextlib.contextmanager
def serving_engines(engines: dict) -> Iterator[str]:
    """A gateway on a real uvicorn server routing each name of `engines` (AsyncLLMEngines, loaded first) to its
    engine; shuts them all down afterwards. Yields the base URL."""
    from kvgate.gateway.app import create_app
    from kvgate.gateway.router import ModelRouter

    try:
        router = ModelRouter()
        for name, e in engines.items():
            asyncio.run(e.wait_until_ready(timeout=60))
            router.add_model(name, e)
        with serving(create_app(router)) as base:
            yield base
    finally:
        for e in engines.values():
            e.shutdown()


def route_by_length(request) -> str:
    """A route function for config tests: short prompts to "small", long ones to "big"."""
    return "small" if request.len < 20 else "big"
