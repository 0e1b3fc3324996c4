"""A small Python client of the jaxserve gRPC service, sync and async.

    with GenerationClient("127.0.0.1:50051") as c:
        for chunk in c.stream("Tell me about tides.", max_tokens=64, temperature=0):
            print(chunk.text, end="", flush=True)

    async with AsyncGenerationClient("127.0.0.1:50051") as c:
        result = await c.generate([1, 2, 3], max_tokens=8)

A prompt is a string (sent as text), a list of ints (token ids) or a list of {"role", "content"}
dicts (rendered by the server's chat template). Sampling arguments are SamplingParams' field
names; unset ones keep the server's defaults. Errors arrive as grpc.RpcError / grpc.aio.AioRpcError
with the server's status code.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Iterator, Sequence

import grpc
from grpc import aio

from jaxserve.proto import generation_pb2 as pb
from jaxserve.proto import generation_pb2_grpc as pb_grpc

_SCALARS = ("n", "temperature", "top_p", "top_k", "min_p", "seed", "max_tokens", "min_tokens", "ignore_eos",
            "skip_special_tokens", "include_stop_str_in_output",
            "presence_penalty", "frequency_penalty", "repetition_penalty", "prompt_logprobs")


@dataclass(frozen=True, slots=True)
class Chunk:
    token_ids: list[int]
    text: str
    time: float                  # time.perf_counter() when it arrived
    index: int = 0               # which sample (n > 1)


@dataclass(slots=True)
class Completion:
    """A finished answer; with n > 1 the fields describe sample 0 and `samples` holds the others
    by index (1, 2, ...)."""

    request_id: str = ""
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str = ""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    index: int = 0
    samples: dict[int, "Completion"] = field(default_factory=dict)
    # prompt_logprobs=k: one pb.PromptLogprob per prompt token after the first (token_id, logprob,
    # rank, top), on the whole request (sample 0's Completion)
    prompt_logprobs: list = field(default_factory=list)


def build_request(prompt: Any, *, request_id: str = "", priority: int = 0, cache_salt: str | None = None,
                  lora_name: str | None = None, **sampling: Any) -> pb.GenerateRequest:
    unknown = set(sampling) - set(_SCALARS) - {"stop", "stop_token_ids", "logit_bias", "structured_outputs"}
    if unknown:
        raise ValueError(f"unknown sampling argument(s) {sorted(unknown)}")
    sp = pb.SamplingParams(**{k: v for k, v in sampling.items() if k in _SCALARS and v is not None})
    stop = sampling.get("stop")
    if stop:
        sp.stop.extend([stop] if isinstance(stop, str) else list(stop))
    if sampling.get("stop_token_ids"):
        sp.stop_token_ids.extend(sampling["stop_token_ids"])
    if sampling.get("logit_bias"):
        sp.logit_bias.update({int(t): float(b) for t, b in sampling["logit_bias"].items()})
    so = sampling.get("structured_outputs")
    if so:   # {"json_schema": "...", "json_object": True, "regex": "...", "choice": [...], "grammar": "..."}
        for kind, value in so.items():
            if kind == "choice":
                sp.structured_outputs.choice.choices.extend(value)
            else:
                setattr(sp.structured_outputs, kind, value)
    req = pb.GenerateRequest(request_id=request_id, sampling_params=sp, priority=priority)
    if cache_salt is not None:
        req.cache_salt = cache_salt
    if lora_name is not None:      # a LoRA adapter the server has loaded (None: the base model)
        req.lora_name = lora_name
    if isinstance(prompt, str):
        req.text = prompt
    elif isinstance(prompt, Sequence) and prompt and all(isinstance(m, dict) for m in prompt):
        req.chat.messages.extend(pb.ChatMessage(role=m["role"], content=m["content"]) for m in prompt)
    elif isinstance(prompt, Sequence):
        req.token_ids.ids.extend(int(t) for t in prompt)
    else:
        raise ValueError(f"a prompt is a string, token ids or chat messages, not {type(prompt).__name__}")
    return req


def build_embed_request(inputs: Any, *, pooling: str = "", normalize: bool | None = None, request_id: str = "",
                        priority: int = 0) -> pb.EmbedRequest:
    """inputs: a string, token ids, or a list of strings / token-id lists (one embedding each)."""
    if isinstance(inputs, str) or (isinstance(inputs, Sequence) and inputs and isinstance(inputs[0], int)):
        inputs = [inputs]
    req = pb.EmbedRequest(request_id=request_id, pooling=pooling, priority=priority)
    if normalize is not None:
        req.normalize = normalize
    for item in inputs:
        req.inputs.append(pb.EmbedInput(text=item) if isinstance(item, str) else
                          pb.EmbedInput(token_ids=pb.TokenIds(ids=[int(t) for t in item])))
    return req


def _metadata(api_key: str | None):
    return (("authorization", f"Bearer {api_key}"),) if api_key else None


def _credentials(tls_root_cert: str | bytes | None):
    if tls_root_cert is None:
        return None
    if isinstance(tls_root_cert, str):
        with open(tls_root_cert, "rb") as f:
            tls_root_cert = f.read()
    return grpc.ssl_channel_credentials(root_certificates=tls_root_cert)


def _fold(result: Completion, msg: pb.GenerateResponse) -> Chunk | None:
    result.request_id = msg.request_id
    which = msg.chunk if msg.HasField("chunk") else msg.complete
    sample = result if which.index == 0 else result.samples.setdefault(which.index, Completion(index=which.index))
    sample.request_id = msg.request_id
    if msg.HasField("chunk"):
        sample.token_ids.extend(msg.chunk.token_ids)
        sample.text += msg.chunk.text
        result.prompt_logprobs.extend(msg.chunk.prompt_logprobs)
        return Chunk(list(msg.chunk.token_ids), msg.chunk.text, time.perf_counter(), msg.chunk.index)
    c = msg.complete
    sample.finish_reason, sample.stop_reason = c.finish_reason, c.stop_reason
    sample.prompt_tokens, sample.completion_tokens, sample.cached_tokens = (
        c.prompt_tokens, c.completion_tokens, c.cached_tokens)
    return None


class GenerationClient:
    """Blocking client. `timeout` (seconds) becomes each call's deadline."""

    def __init__(self, target: str = "127.0.0.1:50051", *, api_key: str | None = None,
                 tls_root_cert: str | bytes | None = None, timeout: float | None = None):
        creds = _credentials(tls_root_cert)
        self._channel = grpc.secure_channel(target, creds) if creds else grpc.insecure_channel(target)
        self._stub = pb_grpc.GenerationStub(self._channel)
        self._md = _metadata(api_key)
        self.timeout = timeout

    def stream(self, prompt: Any, *, completion: Completion | None = None, **kw: Any) -> Iterator[Chunk]:
        """Yield chunks as they arrive; pass `completion` to receive the finish details. Closing
        the iterator early cancels the call (and the server aborts the request)."""
        call = self._stub.Generate(build_request(prompt, **kw), timeout=self.timeout,
                                   metadata=self._md)
        result = completion if completion is not None else Completion()
        try:
            for msg in call:
                chunk = _fold(result, msg)
                if chunk is not None:
                    yield chunk
        finally:
            call.cancel()    # no-op after a normal end; otherwise tells the server to abort

    def generate(self, prompt: Any, **kw: Any) -> Completion:
        result = Completion()
        for _ in self.stream(prompt, completion=result, **kw):
            pass
        return result

    def embed(self, inputs: Any, **kw: Any) -> list[list[float]]:
        """Embeddings of a text, token ids or a list of them (build_embed_request's arguments):
        one list of floats per input."""
        reply = self._stub.Embed(build_embed_request(inputs, **kw), timeout=self.timeout, metadata=self._md)
        return [list(e.values) for e in reply.embeddings]

    def abort(self, request_ids: Sequence[str]) -> None:
        self._stub.Abort(pb.AbortRequest(request_ids=list(request_ids)), timeout=self.timeout, metadata=self._md)

    def model_info(self) -> pb.ModelInfo:
        return self._stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=self.timeout, metadata=self._md)

    def server_info(self) -> pb.ServerInfo:
        return self._stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=self.timeout, metadata=self._md)

    # a trainer's control calls (docs/rl.md)
    def pause(self, mode: str = "abort") -> list[str]:
        """Pause generation ("abort", "wait" or "keep"); returns the request ids aborted."""
        return list(self._stub.Pause(pb.PauseRequest(mode=mode), timeout=self.timeout, metadata=self._md).aborted)

    def resume(self) -> None:
        self._stub.Resume(pb.ResumeRequest(), timeout=self.timeout, metadata=self._md)

    def update_weights(self, model_path: str, *, version: str | None = None) -> pb.UpdateWeightsReply:
        """New weights from a checkpoint on the server's disk (an HF directory, GGUF, converted)."""
        return self._stub.UpdateWeights(pb.UpdateWeightsRequest(model_path=model_path, version=version),
                                        timeout=self.timeout, metadata=self._md)

    # LoRA adapters (a server with --enable-lora): load a PEFT directory on the server's disk
    # under a name, drop one, list them
    def load_lora_adapter(self, lora_name: str, lora_path: str) -> None:
        self._stub.LoadLoRAAdapter(pb.LoadLoRAAdapterRequest(lora_name=lora_name, lora_path=lora_path),
                                   timeout=self.timeout, metadata=self._md)

    def unload_lora_adapter(self, lora_name: str) -> None:
        self._stub.UnloadLoRAAdapter(pb.UnloadLoRAAdapterRequest(lora_name=lora_name), timeout=self.timeout,
                                     metadata=self._md)

    def list_lora_adapters(self) -> list[pb.LoRAAdapter]:
        return list(self._stub.ListLoRAAdapters(pb.ListLoRAAdaptersRequest(), timeout=self.timeout,
                                                metadata=self._md).adapters)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> "GenerationClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class AsyncGenerationClient:
    """asyncio client (grpc.aio); create it inside the event loop that uses it."""

    def __init__(self, target: str = "127.0.0.1:50051", *, api_key: str | None = None,
                 tls_root_cert: str | bytes | None = None, timeout: float | None = None):
        creds = _credentials(tls_root_cert)
        self._channel = aio.secure_channel(target, creds) if creds else aio.insecure_channel(target)
        self._stub = pb_grpc.GenerationStub(self._channel)
        self._md = _metadata(api_key)
        self.timeout = timeout

    async def stream_chunks(self, prompt: Any, *, completion: Completion | None = None,
                            **kw: Any) -> AsyncIterator[Chunk]:
        call = self._stub.Generate(build_request(prompt, **kw), timeout=self.timeout,
                                   metadata=self._md)
        result = completion if completion is not None else Completion()
        try:
            async for msg in call:
                chunk = _fold(result, msg)
                if chunk is not None:
                    yield chunk
        finally:
            call.cancel()   # leaving `async for` alone does not cancel a grpc.aio stream

    async def stream(self, prompt_token_ids: list[int],
                     params: dict[str, Any]) -> AsyncIterator[tuple[list[int], float]]:
        """The benchmark's adapter: (new token ids, time.perf_counter() on arrival) per chunk."""
        async for chunk in self.stream_chunks(list(prompt_token_ids), **params):
            if chunk.token_ids:
                yield chunk.token_ids, chunk.time

    async def generate(self, prompt: Any, **kw: Any) -> Completion:
        result = Completion()
        async for _ in self.stream_chunks(prompt, completion=result, **kw):
            pass
        return result

    async def embed(self, inputs: Any, **kw: Any) -> list[list[float]]:
        reply = await self._stub.Embed(build_embed_request(inputs, **kw), timeout=self.timeout, metadata=self._md)
        return [list(e.values) for e in reply.embeddings]

    async def abort(self, request_ids: Sequence[str]) -> None:
        await self._stub.Abort(pb.AbortRequest(request_ids=list(request_ids)), timeout=self.timeout,
                               metadata=self._md)

    async def model_info(self) -> pb.ModelInfo:
        return await self._stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=self.timeout, metadata=self._md)

    async def server_info(self) -> pb.ServerInfo:
        return await self._stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=self.timeout, metadata=self._md)

    # a trainer's control calls (docs/rl.md): as GenerationClient's
    async def pause(self, mode: str = "abort") -> list[str]:
        reply = await self._stub.Pause(pb.PauseRequest(mode=mode), timeout=self.timeout, metadata=self._md)
        return list(reply.aborted)

    async def resume(self) -> None:
        await self._stub.Resume(pb.ResumeRequest(), timeout=self.timeout, metadata=self._md)

    async def update_weights(self, model_path: str, *, version: str | None = None) -> pb.UpdateWeightsReply:
        return await self._stub.UpdateWeights(pb.UpdateWeightsRequest(model_path=model_path, version=version),
                                              timeout=self.timeout, metadata=self._md)

    async def load_lora_adapter(self, lora_name: str, lora_path: str) -> None:
        await self._stub.LoadLoRAAdapter(pb.LoadLoRAAdapterRequest(lora_name=lora_name, lora_path=lora_path),
                                         timeout=self.timeout, metadata=self._md)

    async def unload_lora_adapter(self, lora_name: str) -> None:
        await self._stub.UnloadLoRAAdapter(pb.UnloadLoRAAdapterRequest(lora_name=lora_name), timeout=self.timeout,
                                           metadata=self._md)

    async def list_lora_adapters(self) -> list[pb.LoRAAdapter]:
        reply = await self._stub.ListLoRAAdapters(pb.ListLoRAAdaptersRequest(), timeout=self.timeout,
                                                  metadata=self._md)
        return list(reply.adapters)

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> "AsyncGenerationClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()


def bench_stream(target: str, api_key: str | None = None):
    """For `jaxserve bench serve`: (async stream(prompt_token_ids, params), checkpoint identity).
    The stream opens one channel per event loop on first use (the bench runs one loop per rate)."""
    with GenerationClient(target, api_key=api_key, timeout=30) as c:
        identity = c.model_info().checkpoint_identity
    clients: dict[asyncio.AbstractEventLoop, AsyncGenerationClient] = {}

    async def stream(prompt_token_ids: list[int], params: dict[str, Any]):
        loop = asyncio.get_running_loop()
        client = clients.get(loop)
        if client is None:
            for old in [lp for lp in clients if lp.is_closed()]:
                del clients[old]
            client = clients[loop] = AsyncGenerationClient(target, api_key=api_key)
        async for item in client.stream(prompt_token_ids, params):
            yield item

    return stream, identity
