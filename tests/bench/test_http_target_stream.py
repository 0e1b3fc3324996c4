"""The HTTP target's stream against a fake OpenAI-compatible server on a loopback socket: SSE
chunks holding several tokens, the usage chunk, an error event, a body cut before [DONE], a
server that answers 429, one that sends no usage, one that goes silent (the read timeout ends it).
Every broken stream is a failed request with its reason; none hangs (the silent one is bounded by
a 0.5 s read timeout, the whole test by pytest-timeout)."""

from __future__ import annotations

import asyncio
import json

import pytest

from jaxserve.bench.http_target import HTTPTarget, base_url, completion_body, run_http_load, served_model
from jaxserve.bench.loadgen import TextChunk, TokenCount
from jaxserve.bench.sse_completions import StreamFailed, completion_events
from jaxserve.bench.workloads import BenchRequest

pytestmark = pytest.mark.timeout(120)

GOOD, ERROR_EVENT, CUT, REFUSED, NO_USAGE, SILENT, EMPTY_TEXT = range(7)


def _chunk(text: str, finish: str | None = None) -> dict:
    return {"object": "text_completion", "choices": [{"index": 0, "text": text, "finish_reason": finish}]}


class FakeServer:
    """A raw HTTP/1.1 server: the scenario is the prompt's first token id; GOOD sends two tokens per
    chunk ('ab' is two) and the usage alone after the finish chunk, as jaxserve and vLLM do."""

    def __init__(self) -> None:
        self.bodies: list[dict] = []
        self.release = asyncio.Event()

    async def __aenter__(self) -> "FakeServer":
        self.server = await asyncio.start_server(self.handle, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"
        return self

    async def __aexit__(self, *exc) -> None:
        self.release.set()
        self.server.close()
        await self.server.wait_closed()

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = (await reader.readuntil(b"\r\n\r\n")).decode()
            request_line, *header_lines = head.split("\r\n")
            headers = {k.lower(): v.strip() for k, _, v in (h.partition(":") for h in header_lines if h)}
            raw = await reader.readexactly(int(headers.get("content-length", 0)))
            if request_line.startswith("GET /v1/models"):
                await self.send(writer, "200 OK", "application/json",
                                json.dumps({"object": "list", "data": [{"id": "fake-model", "object": "model"}]}))
                return
            body = json.loads(raw)
            self.bodies.append(body)
            await self.stream(writer, body)
        finally:
            writer.close()

    async def send(self, writer, status: str, ctype: str, text: str) -> None:
        data = text.encode()
        writer.write(f"HTTP/1.1 {status}\r\nContent-Type: {ctype}\r\nContent-Length: {len(data)}\r\n"
                     "Connection: close\r\n\r\n".encode() + data)
        await writer.drain()

    async def stream(self, writer, body: dict) -> None:
        scenario, n = body["prompt"][0], body["max_tokens"]
        if scenario == REFUSED:
            await self.send(writer, "429 Too Many Requests", "application/json",
                            json.dumps({"error": {"message": "too many waiting requests"}}))
            return
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: close\r\n\r\n")

        async def event(obj) -> None:
            writer.write(f"data: {obj if isinstance(obj, str) else json.dumps(obj)}\n\n".encode())
            await writer.drain()
            await asyncio.sleep(0.001)

        writer.write(b": ping\n\n")   # a comment: skipped
        if scenario == SILENT:
            await writer.drain()
            await self.release.wait()
            return
        if scenario == EMPTY_TEXT:   # every token decoded to nothing: only the finish chunk
            await event(_chunk("", "length"))
            await event({"choices": [], "usage": {"completion_tokens": n}})
            await event("[DONE]")
            return
        await event(_chunk("ab"))
        if scenario == ERROR_EVENT:
            await event({"error": {"message": "the engine stopped", "type": "internal_error"}})
            await event("[DONE]")
            return
        if scenario == CUT:
            return   # the connection closes without [DONE]
        for _ in range((n - 2 + 1) // 2):
            await event(_chunk("cd"))
        await event(_chunk("", "length"))
        if scenario != NO_USAGE:
            await event({"choices": [], "usage": {"prompt_tokens": len(body["prompt"]), "completion_tokens": n}})
        await event("[DONE]")


def _request(scenario: int, output_len: int, i: int = 0) -> BenchRequest:
    return BenchRequest(f"r{scenario}-{i}", (scenario, 7, 8, 9), output_len)


def test_chunks_of_several_tokens_count_the_servers_usage_and_broken_streams_fail_with_their_reason():
    requests = [_request(GOOD, 6, 0), _request(GOOD, 5, 1), _request(ERROR_EVENT, 4), _request(CUT, 4),
                _request(REFUSED, 4), _request(NO_USAGE, 4), _request(SILENT, 4), _request(EMPTY_TEXT, 3)]
    failed: dict[str, str] = {}

    async def main():
        async with FakeServer() as srv:
            target = HTTPTarget(srv.url, api_key="k", read_timeout_s=0.5)
            out = await run_http_load(target, "fake-model", requests, None, False, failed)
            return out, srv.bodies

    (records, outputs, duration), bodies = asyncio.run(main())
    by_id = {r.request_id: r for r in records}
    assert sorted(by_id) == ["r0-0", "r0-1", "r6-0"]
    for rid, asked, chunks in [("r0-0", 6, 3), ("r0-1", 5, 3)]:
        r = by_id[rid]
        assert r.output_len == asked and r.chunked and len(r.token_times) == chunks
        assert r.arrival_time <= r.first_token_time == r.token_times[0] <= r.finished_time
        assert len(r.itls) == chunks - 1
    empty = by_id["r6-0"]   # no text at all: the finish chunk stands as the first output
    assert empty.output_len == 3 and len(empty.token_times) == 1
    assert outputs == {}    # no token ids over HTTP
    assert duration > 0
    assert "the engine stopped" in failed["r1-0"]
    assert "before [DONE]" in failed["r2-0"]
    assert "HTTP 429" in failed["r3-0"] and "too many waiting requests" in failed["r3-0"]
    assert "usage" in failed["r4-0"]
    assert "Timeout" in failed["r5-0"]
    assert len(failed) == 5
    # what every server got: the token ids, greedy, max_tokens, ignore_eos, the usage asked for
    good = next(b for b in bodies if b["prompt"][0] == GOOD)
    assert good == {"model": "fake-model", "prompt": [GOOD, 7, 8, 9], "max_tokens": good["max_tokens"],
                    "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True}


def test_served_model_reads_the_first_model_id_and_the_url_drops_v1():
    async def main():
        async with FakeServer() as srv:
            return await asyncio.to_thread(served_model, HTTPTarget(base_url(srv.url + "/v1/")))

    assert asyncio.run(main()) == "fake-model"
    assert base_url("https://h:1/prefix/v1") == "https://h:1/prefix"
    with pytest.raises(ValueError):
        base_url("ftp://h:1")


async def _events(text: str) -> list:
    async def lines():
        for line in text.split("\n"):
            yield line

    return [e async for e in completion_events(lines())]


def test_sse_parsing_joins_data_lines_skips_comments_and_reads_usage_beside_choices():
    # llama-server sends usage on the chunk with finish_reason
    text = (': hello\n\ndata: {"choices":[{"text":"x y","finish_reason":null}]}\n\n'
            'event: message\ndata: {"choices":[{"text":"","finish_reason":"length"}],\ndata: "usage":{"completion_tokens":4}}\n\n'
            'data: [DONE]\n\n')
    evs = asyncio.run(_events(text))
    assert [(e.text, e.finish_reason, e.completion_tokens) for e in evs] == [("x y", None, None), ("", "length", 4)]


@pytest.mark.parametrize("text, reason", [
    ('data: {"choices":[{"text":"a"}]}\n\n', "before [DONE]"),
    ('data: not json\n\n', "not JSON"),
    ('event: error\ndata: {"message": "boom"}\n\n', "boom"),
    ('data: {"error": "overloaded"}\n\ndata: [DONE]\n\n', "overloaded"),
])
def test_sse_parsing_fails_on_broken_streams(text, reason):
    with pytest.raises(StreamFailed, match=reason if reason != "before [DONE]" else r"before \[DONE\]"):
        asyncio.run(_events(text))


def test_body_carries_the_salt_only_when_asked():
    assert "cache_salt" not in completion_body("m", [1], {"max_tokens": 2, "ignore_eos": True})
    assert completion_body("m", "hi", {"max_tokens": 2, "cache_salt": "a"})["cache_salt"] == "a"
    assert isinstance(TextChunk(1.0).time, float) and TokenCount(3).output_tokens == 3
