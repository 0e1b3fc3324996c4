"""The gRPC front in-process (grpc.aio on loopback, the compiled tiny runner shared), with the
server's own interceptors and reflection: no request's input stalls the step thread (text is
tokenized in a tokenizer thread, a text too long for max_model_len is refused before it is
tokenized), malformed bytes give INVALID_ARGUMENT in one line, reflection answers as v1 and
v1alpha, the bearer scheme is case-insensitive, an unknown chat role is refused, and the
end-to-end latency histogram counts aborted and cancelled requests."""

import asyncio
import logging
import threading
import time

import grpc
import pytest
from google.protobuf import descriptor_pb2
from grpc import aio
from grpc_reflection.v1alpha import reflection_pb2 as refl_pb

from jaxserve import LLM
from jaxserve.client import AsyncGenerationClient
from jaxserve.engine.async_engine import AsyncEngine
from jaxserve.server.request_caps import RequestCaps
from jaxserve.server.metrics import ServerMetrics
from jaxserve.proto import generation_pb2 as pb
from jaxserve.proto import generation_pb2_grpc as pb_grpc
from jaxserve.server.reflection import enable_server_reflection
from jaxserve.server.grpc_front import SERVICE_NAME, server_interceptors
from jaxserve.server.servicer import GenerationServicer
from jaxserve.server.state import Phase, ServerState

PROMPT = "The tide comes in"
STEP_THREAD = "jaxserve-step-loop"
HANG_GUARD_S = 120   # turns a hang into a failure; never a bound on how fast anything is
E2E_COUNT = "jaxserve_e2e_request_latency_seconds_count"


class SpyTokenizer:
    """The engine's tokenizer, recording which thread encodes or renders what."""

    def __init__(self, inner):
        self._inner = inner
        self.calls: list[tuple[str, str, int]] = []     # (method, thread name, characters)

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def encode(self, text, *args, **kwargs):
        self.calls.append(("encode", threading.current_thread().name, len(text)))
        return self._inner.encode(text, *args, **kwargs)

    def apply_chat_template(self, messages, *args, **kwargs):
        self.calls.append(("apply_chat_template", threading.current_thread().name,
                           sum(len(m["content"]) for m in messages)))
        return self._inner.apply_chat_template(messages, *args, **kwargs)


def fresh_engine(tiny_llm, tokenizer_cls=SpyTokenizer, **kw):
    engine = LLM.sharing_runner(tiny_llm).engine
    engine.tokenizer = engine.input_processor.tokenizer = tokenizer_cls(engine.tokenizer, **kw)
    return engine


async def serve(engine, body, *, api_key=None, metrics=None):
    """Run body(target, state) against a servicer over `engine`, with the server's interceptors
    and reflection, on a loopback port."""
    state = ServerState()
    state.aengine = AsyncEngine(engine)
    state.aengine.start()
    state.phase = Phase.SERVING
    server = aio.server(interceptors=server_interceptors(api_key))
    pb_grpc.add_GenerationServicer_to_server(
        GenerationServicer(state, max_concurrent_streams=64, limits=RequestCaps(), metrics=metrics), server)
    enable_server_reflection((SERVICE_NAME,), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        return await asyncio.wait_for(body(f"127.0.0.1:{port}", state), HANG_GUARD_S)
    finally:
        await state.aengine.shutdown()
        await server.stop(1)


async def until(predicate, what):
    for _ in range(int(HANG_GUARD_S / 0.02)):
        if predicate():
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"gave up waiting for {what}")


def longest_token(tokenizer) -> int:
    return max(len(t) for t in tokenizer.get_vocab())


# -- item 3: no request's input stalls the others --------------------------------------------------

def test_a_prompt_too_long_for_max_model_len_is_refused_before_it_is_tokenized_or_scanned(tiny_llm):
    engine = fresh_engine(tiny_llm)
    m = engine.max_model_len
    limit = (m - 1) * longest_token(engine.tokenizer)
    huge = "tide " * (limit // 5 + 1000)             # more characters than any fitting prompt has

    async def body(target, state):
        async with AsyncGenerationClient(target, timeout=HANG_GUARD_S) as c:
            with pytest.raises(aio.AioRpcError) as text:
                await c.generate(huge, max_tokens=2)
            with pytest.raises(aio.AioRpcError) as ids:      # too many, and outside the vocabulary too
                await c.generate([10**6] * (m + 5), max_tokens=2)
            ok = await c.generate(PROMPT, max_tokens=2)       # still serving
            return text.value, ids.value, ok

    text, ids, ok = asyncio.run(serve(engine, body))
    assert text.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"{len(huge)} characters" in text.details() and f"max_model_len={m}" in text.details()
    assert str(limit) in text.details()
    assert [c for c in engine.tokenizer.calls if c[2] == len(huge)] == []   # never tokenized
    # the count is checked before the ids are scanned: the refusal is about the length
    assert ids.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"the prompt has {m + 5} tokens, but max_model_len is {m}" in ids.details(), ids.details()
    assert ok.completion_tokens == 2


def test_text_and_chat_prompts_are_tokenized_off_the_step_thread_and_the_event_loop(tiny_llm):
    engine = fresh_engine(tiny_llm)

    async def body(target, state):
        async with AsyncGenerationClient(target, timeout=HANG_GUARD_S) as c:
            text = await c.generate(PROMPT, max_tokens=3, temperature=0.0, ignore_eos=True)
            chat = await c.generate([{"role": "user", "content": PROMPT}], max_tokens=3)
            return text, chat, threading.current_thread().name

    text, chat, loop_thread = asyncio.run(serve(engine, body))
    assert text.completion_tokens == 3 and chat.completion_tokens == 3
    assert text.prompt_tokens == len(tiny_llm.get_tokenizer().encode(PROMPT))
    methods = {c[0] for c in engine.tokenizer.calls}
    assert methods == {"encode", "apply_chat_template"}, engine.tokenizer.calls
    threads = {c[1] for c in engine.tokenizer.calls}
    assert STEP_THREAD not in threads and loop_thread not in threads, threads


class StallingTokenizer(SpyTokenizer):
    """Encoding `slow_text` waits until the engine has run `steps_needed` more steps: possible
    only if the step thread is not the one encoding (the wait gives up after a guard)."""

    def __init__(self, inner, *, slow_text, step_count, steps_needed):
        super().__init__(inner)
        self.slow_text, self.step_count, self.steps_needed = slow_text, step_count, steps_needed
        self.started = threading.Event()
        self.steps_while_encoding: int | None = None

    def encode(self, text, *args, **kwargs):
        if text == self.slow_text:
            start = self.step_count()
            self.started.set()
            deadline = time.monotonic() + 30      # a hang guard: only a blocked step thread reaches it
            while self.step_count() < start + self.steps_needed and time.monotonic() < deadline:
                time.sleep(0.005)
            self.steps_while_encoding = self.step_count() - start
        return super().encode(text, *args, **kwargs)


def test_a_stream_keeps_getting_tokens_while_another_prompt_is_tokenized(tiny_llm):
    slow_text = "A long but legal prompt about the tide"
    steps = [0]
    engine = fresh_engine(tiny_llm, StallingTokenizer, slow_text=slow_text, step_count=lambda: steps[0],
                          steps_needed=5)
    real_step = engine.step

    def counting_step():
        out = real_step()
        steps[0] += 1
        return out

    engine.step = counting_step
    spy = engine.tokenizer

    async def body(target, state):
        async with AsyncGenerationClient(target, timeout=HANG_GUARD_S) as c:
            running = c.stream_chunks(PROMPT, max_tokens=110, temperature=0.0, ignore_eos=True)
            await running.__anext__()                    # decoding now
            slow = asyncio.ensure_future(c.generate(slow_text, max_tokens=2))
            await until(spy.started.is_set, "the slow prompt's tokenization to start")
            tokens = 0
            async for chunk in running:                  # the running stream goes on to its end
                tokens += len(chunk.token_ids)
            return await slow, tokens

    slow, tokens = asyncio.run(serve(engine, body))
    assert spy.steps_while_encoding >= 5, spy.steps_while_encoding   # steps ran while it was encoded
    assert slow.completion_tokens == 2 and tokens > 0


# -- item 5: malformed bytes ------------------------------------------------------------------------

def test_malformed_request_bytes_give_invalid_argument_in_one_line_without_a_traceback(tiny_llm, caplog):
    garbage = b"\xff\xff\xff\xff"

    async def body(target, state):
        results = {}
        async with aio.insecure_channel(target) as ch:
            calls = {
                "Generate": lambda: _drain(ch.unary_stream(f"/{SERVICE_NAME}/Generate")(garbage)),
                "GetModelInfo": lambda: ch.unary_unary(f"/{SERVICE_NAME}/GetModelInfo")(garbage),
                "reflection": lambda: _drain(ch.stream_stream(
                    "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo")(iter([garbage]))),
            }
            for name, call in calls.items():
                try:
                    await call()
                    results[name] = None
                except aio.AioRpcError as e:
                    results[name] = e
            ok = await pb_grpc.GenerationStub(ch).GetModelInfo(pb.GetModelInfoRequest())
        return results, ok

    with caplog.at_level(logging.INFO):
        results, ok = asyncio.run(serve(fresh_engine(tiny_llm), body))
    for name, e in results.items():
        assert e is not None and e.code() == grpc.StatusCode.INVALID_ARGUMENT, (name, e)
        assert "\n" not in e.details() and "<class" not in e.details(), e.details()
        assert "malformed" in e.details()
    assert ok.max_model_len > 0                                      # and the server goes on
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info], caplog.text
    assert "Traceback" not in caplog.text
    malformed = [r for r in caplog.records if "malformed request" in r.getMessage()]
    assert len(malformed) == 3 and all("\n" not in r.getMessage() for r in malformed)


async def _drain(call):
    return [r async for r in call]


# -- item 6: reflection v1 and v1alpha --------------------------------------------------------------

def test_reflection_answers_as_v1_and_v1alpha(tiny_llm):
    async def body(target, state):
        got = {}
        async with aio.insecure_channel(target) as ch:
            for version in ("v1", "v1alpha"):
                call = ch.stream_stream(f"/grpc.reflection.{version}.ServerReflection/ServerReflectionInfo",
                                        request_serializer=refl_pb.ServerReflectionRequest.SerializeToString,
                                        response_deserializer=refl_pb.ServerReflectionResponse.FromString)
                got[version] = await _drain(call(iter([
                    refl_pb.ServerReflectionRequest(list_services=""),
                    refl_pb.ServerReflectionRequest(file_containing_symbol=SERVICE_NAME),
                    refl_pb.ServerReflectionRequest(file_containing_symbol="grpc.reflection.v1.ServerReflection"),
                ])))
        return got

    got = asyncio.run(serve(fresh_engine(tiny_llm), body))
    for version, (listed, generation, v1) in got.items():
        names = {s.name for s in listed.list_services_response.service}
        assert {SERVICE_NAME, "grpc.reflection.v1.ServerReflection",
                "grpc.reflection.v1alpha.ServerReflection"} <= names, (version, names)
        files = [descriptor_pb2.FileDescriptorProto.FromString(b)
                 for b in generation.file_descriptor_response.file_descriptor_proto]
        assert any(s.name == "Generation" for f in files for s in f.service), version
        v1_file = descriptor_pb2.FileDescriptorProto.FromString(v1.file_descriptor_response.file_descriptor_proto[0])
        assert v1_file.package == "grpc.reflection.v1"
        assert v1_file.service[0].method[0].input_type == ".grpc.reflection.v1.ServerReflectionRequest"


# -- item 7: the bearer scheme is case-insensitive --------------------------------------------------

def test_the_bearer_scheme_is_case_insensitive_and_the_key_is_not(tiny_llm):
    key = "s3cret"

    async def body(target, state):
        codes = {}
        async with aio.insecure_channel(target) as ch:
            stub = pb_grpc.GenerationStub(ch)
            for value in (f"Bearer {key}", f"bearer {key}", f"BEARER {key}", f"bEaReR  {key}",
                          f"bearer {key.upper()}", f"Basic {key}", key):
                try:
                    await stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=(("authorization", value),))
                    codes[value] = grpc.StatusCode.OK
                except aio.AioRpcError as e:
                    codes[value] = e.code()
        return codes

    codes = asyncio.run(serve(fresh_engine(tiny_llm), body, api_key=key))
    ok, refused = grpc.StatusCode.OK, grpc.StatusCode.UNAUTHENTICATED
    assert codes == {f"Bearer {key}": ok, f"bearer {key}": ok, f"BEARER {key}": ok, f"bEaReR  {key}": ok,
                     f"bearer {key.upper()}": refused, f"Basic {key}": refused, key: refused}


# -- item 9: unknown chat roles, and the e2e histogram of aborted requests --------------------------

def test_a_chat_message_with_an_unknown_role_is_refused_naming_the_allowed_roles(tiny_llm):
    async def body(target, state):
        async with AsyncGenerationClient(target, timeout=HANG_GUARD_S) as c:
            with pytest.raises(aio.AioRpcError) as e:
                await c.generate([{"role": "user", "content": "hi"}, {"role": "wizard", "content": "abracadabra"}],
                                 max_tokens=2)
            ok = await c.generate([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}],
                                  max_tokens=2)
            return e.value, ok

    err, ok = asyncio.run(serve(fresh_engine(tiny_llm), body))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "chat.messages[1].role='wizard'" in err.details()
    assert "assistant, system, tool, user" in err.details()
    assert ok.completion_tokens == 2


def test_the_e2e_histogram_counts_aborted_and_cancelled_requests_not_refused_ones(tiny_llm):
    metrics = ServerMetrics(lambda: None)

    def count():
        return metrics.registry.get_sample_value(E2E_COUNT) or 0.0

    async def body(target, state):
        seen = []
        async with AsyncGenerationClient(target, timeout=HANG_GUARD_S) as c:
            await c.generate(PROMPT, max_tokens=3)                               # finished
            await until(lambda: count() == 1, "the finished request's e2e")
            seen.append(count())
            cancelled = c.stream_chunks(PROMPT, max_tokens=100, ignore_eos=True)
            await cancelled.__anext__()
            await cancelled.aclose()                                             # cancelled mid-stream
            await until(lambda: count() == 2, "the cancelled request's e2e")
            seen.append(count())
            stream = c.stream_chunks(PROMPT, request_id="abort-me", max_tokens=100, ignore_eos=True)
            await stream.__anext__()
            await c.abort(["abort-me"])                                          # aborted by the Abort RPC
            async for _ in stream:
                pass
            await until(lambda: count() == 3, "the aborted request's e2e")
            seen.append(count())
            with pytest.raises(aio.AioRpcError):
                await c.generate(PROMPT, max_tokens=0)                           # refused: never ran
            seen.append(count())      # a handler observes before its status is sent: no wait needed
            await c.generate(PROMPT, max_tokens=2)
            seen.append(count())
        return seen

    assert asyncio.run(serve(fresh_engine(tiny_llm), body, metrics=metrics)) == [1, 2, 3, 3, 4]



def test_the_message_limit_assumes_the_builders_longest_default_max_model_len():
    from jaxserve.engine.builder import MAX_DEFAULT_MODEL_LEN
    from jaxserve.server.server import DEFAULT_MAX_MODEL_LEN_BOUND

    assert DEFAULT_MAX_MODEL_LEN_BOUND == MAX_DEFAULT_MODEL_LEN
