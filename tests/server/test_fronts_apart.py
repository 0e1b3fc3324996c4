"""The HTTP front and the server process with `--no-grpc` load nothing of the gRPC front: not
grpc, not protobuf, not the servicer, the proto converter or the generated stubs. Checked in a
fresh interpreter whose import system refuses those modules outright, so any import of them, however
indirect, fails the test."""

import subprocess
import sys
import textwrap

CHILD = textwrap.dedent("""
    import asyncio, importlib, pkgutil, sys

    FORBIDDEN = ("grpc", "grpc_health", "grpc_reflection", "google.protobuf", "jaxserve.proto", "jaxserve.disagg.proto",
                 "jaxserve.server.servicer", "jaxserve.server.convert", "jaxserve.server.grpc_front",
                 "jaxserve.server.auth")

    class Refuse:
        def find_spec(self, name, path=None, target=None):
            if any(name == f or name.startswith(f + ".") for f in FORBIDDEN):
                raise ImportError(f"the HTTP-only path imported {name}")
            return None

    sys.meta_path.insert(0, Refuse())
    import jaxserve.server.http as http
    for m in pkgutil.iter_modules(http.__path__):
        importlib.import_module(f"jaxserve.server.http.{m.name}")
    from jaxserve.engine_args import engine_config
    from jaxserve.server.server import ServerConfig, run_server

    def build_engine(config, progress=False):   # the HTTP listener is up by now; stop here
        raise RuntimeError("no engine in this test")

    rc = asyncio.run(run_server(ServerConfig(grpc=False, http_port=0), engine_config(model="unused"),
                                build_engine=build_engine))
    print("rc", rc)
""")


def test_the_http_only_server_imports_nothing_of_grpc():
    done = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "rc 1" in done.stdout          # run_server reached the build (and its failure) with HTTP alone
    assert "imported" not in done.stderr
