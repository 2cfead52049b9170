"""The relay's HTTP/1.1 client against real servers on loopback: bodies by length, chunked and by close, keep-alive
reuse, connections the server closed, timeouts, and the chunked decoder on every split of its input."""
from __future__ import annotations

import asyncio
import json

import pytest

from kvgate.gateway.upstream_client import UpstreamError, UpstreamPool, take_chunks
from mock_upstream import MockUpstream, free_port


@pytest.fixture(scope="module")
def mock():
    m = MockUpstream("U", chunks=7).start()
    yield m
    m.stop()


def test_take_chunks_on_every_split() -> None:
    for raw in (b"5\r\nhello\r\n3\r\nabc\r\n0\r\n\r\n", b"5;ext=1\r\nhello\r\n3\r\nabc\r\n0\r\nX-T: 1\r\n\r\n"):
        for cut in range(len(raw) + 1):
            first, rest, done = take_chunks(raw[:cut])
            second, left, done2 = take_chunks(rest + raw[cut:])
            assert b"".join(first + second) == b"helloabc" and left == b"" and (done or done2)
            assert done == (cut == len(raw))


def test_lengths_chunks_and_keep_alive_reuse(mock: MockUpstream) -> None:
    async def main() -> None:
        pool = UpstreamPool(mock.url.removesuffix("/v1"))
        r = await pool.request("GET", "/v1/models")
        assert r.status == 200 and json.loads(await r.read())["data"][0]["id"] == "U"
        assert len(pool._idle) == 1
        conn = pool._idle[0]
        body = json.dumps({"model": "U", "messages": [], "stream": True}).encode()
        r = await pool.request("POST", "/v1/chat/completions", body, b"content-type: application/json\r\n")
        assert r._conn is conn and r.headers[b"transfer-encoding"] == b"chunked"  # the same connection again
        text = (await r.read()).decode()
        events = [json.loads(e[6:]) for e in text.split("\n\n") if e.startswith("data: {")]
        assert "".join(e["choices"][0]["delta"].get("content") or "" for e in events) == mock.text()
        assert text.rstrip().endswith("data: [DONE]") and pool._idle == [conn]
        # a body left half read: that connection is closed, not reused
        r = await pool.request("POST", "/v1/chat/completions", body, b"content-type: application/json\r\n")
        chunks = r.iter_chunks()
        await chunks.__anext__()
        r.close()
        assert pool._idle == [] and conn.writer.is_closing()
        r = await pool.request("GET", "/v1/models")
        assert r.status == 200 and r._conn is not conn
        await r.read()
        await pool.close()

    asyncio.run(main())


def test_server_closing_idle_connections_and_bodies_ended_by_close() -> None:
    async def main() -> None:
        async def one_shot(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await reader.readuntil(b"\r\n\r\n")
            writer.write(b"HTTP/1.1 200 OK\r\nconnection: close\r\n\r\nuntil the end")
            await writer.drain()
            writer.close()

        server = await asyncio.start_server(one_shot, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        pool = UpstreamPool(f"http://127.0.0.1:{port}")
        for _ in range(3):  # every request needs a fresh connection; none fails because of it
            r = await pool.request("GET", "/x")
            assert await r.read() == b"until the end"
        assert pool._idle == []
        server.close()
        await pool.close()

    asyncio.run(main())


def test_timeouts_and_refused_connections_are_upstream_errors() -> None:
    async def main() -> None:
        async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await asyncio.sleep(30)

        server = await asyncio.start_server(silent, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        pool = UpstreamPool(f"http://127.0.0.1:{port}")
        with pytest.raises(UpstreamError, match="TimeoutError"):
            await pool.request("POST", "/v1/completions", b"{}", timeout=0.2)
        server.close()
        with pytest.raises(UpstreamError, match="cannot connect"):  # nothing listens on a fresh free port
            await UpstreamPool(f"http://127.0.0.1:{free_port()}").request("GET", "/")
        with pytest.raises(ValueError, match="not an http"):
            UpstreamPool("ftp://example")

    asyncio.run(main())
