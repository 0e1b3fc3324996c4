"""Loopback bandwidth of the two KV transports considered for disaggregated serving, on this
machine's CPU backend: `jax.experimental.transfer` (await_pull / connect().pull, polled with
is_ready against our own clock) and a gRPC stream of 1 MiB byte messages reassembled into a numpy
array (what PullKV does). Both ends in one process; best of 3 per size.

    .venv/bin/python scripts/kv_transport_microbench.py
"""

from __future__ import annotations

import time
from concurrent import futures

import grpc
import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import transfer

SIZES_MIB = (4, 32, 128)
CHUNK = 1 << 20


def jax_transfer() -> None:
    srv = transfer.start_transfer_server(jax.devices()[0].client, "127.0.0.1:0", ["127.0.0.1:0"])
    conn = srv.connect(srv.address())
    for mb in SIZES_MIB:
        x = jnp.arange(mb * (1 << 20) // 4, dtype=jnp.float32).block_until_ready()
        spec = jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
        best = float("inf")
        for i in range(3):
            uid = 1000 * mb + i
            srv.await_pull(uid, [x])
            t = time.perf_counter()
            (y,) = conn.pull(uid, [spec])
            deadline = t + 60
            while not y.is_ready():   # never block on it: the library's timeout was seen not to fire
                if time.perf_counter() > deadline:
                    raise TimeoutError("pull not ready after 60 s")
                time.sleep(0.0002)
            best = min(best, time.perf_counter() - t)
        assert bool((y == x).all())
        print(f"jax.experimental.transfer   {mb:4d} MiB: {best * 1e3:7.1f} ms = {mb / best / 1024:.2f} GiB/s")


def grpc_stream() -> None:
    arrays: dict[bytes, np.ndarray] = {}

    def pull(request, context):
        b = arrays[request].tobytes()
        for i in range(0, len(b), CHUNK):
            yield b[i:i + CHUNK]

    handler = grpc.method_handlers_generic_handler("bench.T", {"Pull": grpc.unary_stream_rpc_method_handler(
        pull, request_deserializer=lambda b: b, response_serializer=lambda b: b)})
    server = grpc.server(futures.ThreadPoolExecutor(4))
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    call = grpc.insecure_channel(f"127.0.0.1:{port}").unary_stream(
        "/bench.T/Pull", request_serializer=lambda b: b, response_deserializer=lambda b: b)
    for mb in SIZES_MIB:
        x = np.arange(mb * (1 << 20) // 4, dtype=np.float32)
        arrays[b"k"] = x
        best = float("inf")
        for _ in range(3):
            t = time.perf_counter()
            out = np.empty_like(x)
            view, o = out.view(np.uint8), 0
            for chunk in call(b"k", timeout=60):
                view[o:o + len(chunk)] = np.frombuffer(chunk, np.uint8)
                o += len(chunk)
            best = min(best, time.perf_counter() - t)
        assert (out == x).all()
        print(f"gRPC stream, 1 MiB messages {mb:4d} MiB: {best * 1e3:7.1f} ms = {mb / best / 1024:.2f} GiB/s")
    server.stop(0)


if __name__ == "__main__":
    jax_transfer()
    grpc_stream()
