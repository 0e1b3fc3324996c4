"""A real `jaxserve serve` process on the tiny model: health through warmup, streamed answers equal
to LLM.generate's, 32 concurrent streams, a cancel returning every block, clear INVALID_ARGUMENT
messages, reflection, and the metrics endpoint after traffic. (A passed deadline is tested in-process,
test_servicer_in_process.py, where the test can hold the step loop until the deadline has passed.)"""

import asyncio
import os
import urllib.request

import grpc
import pytest

from jaxserve import SamplingParams
from jaxserve.client import AsyncGenerationClient, GenerationClient
from jaxserve.sampling_params import OutputKind
from tests.server.server_process import ServerProcess, wait_until

PROMPTS = ["The tide comes in", "def add(a, b):", "Unicode: café", "A paged KV cache stores keys"]


@pytest.fixture(scope="module")
def started(tiny_llm, tiny_llama_dir, xla_cache_dir, tmp_path_factory):
    # tiny_llm first: it fills the compilation cache the server then loads; the warm-up waits for
    # release_warm_up(), so a test can look at the server warming up however fast it would warm up
    srv = ServerProcess(tiny_llama_dir, xla_cache_dir, tmp_path_factory.mktemp("server") / "server.log",
                        gated=True)
    yield srv
    code = srv.terminate()
    srv.kill()
    assert code == 0, srv.log()


@pytest.fixture(scope="module")
def server(started):
    started.release_warm_up()
    started.wait_serving()
    return started


@pytest.fixture
def client(server):
    with GenerationClient(server.target, timeout=120) as c:
        yield c


def reference(llm, prompts, max_tokens, *, text=False):
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
                            output_kind=OutputKind.CUMULATIVE)
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [o.outputs[0].text if text else o.outputs[0].token_ids for o in outs]


def assert_blocks_all_back(client):
    info = wait_until(lambda: (lambda i: i if i.num_requests_running == 0 and i.num_requests_waiting == 0 else None)(
        client.server_info()), "no running or waiting requests")
    assert info.num_kv_blocks_free + info.num_kv_blocks_cached == info.num_kv_blocks_total
    return info


def test_health_is_not_serving_during_warmup_then_serving(started):
    seen = []

    def status():
        assert started.proc.poll() is None, started.log()
        s = started.health()
        if s is not None and (not seen or seen[-1] != s):
            seen.append(s)
        return s

    # the warm-up is held until we release it: the server listens, NOT_SERVING, and refuses work
    assert wait_until(status, "the server to listen", guard_s=240) == "NOT_SERVING"
    with GenerationClient(started.target, timeout=30) as c:
        with pytest.raises(grpc.RpcError) as e:
            c.generate(PROMPTS[0], max_tokens=2)
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE and "warming up" in e.value.details()
    assert "jaxserve ready on" not in started.log(tail=0)

    started.release_warm_up()
    wait_until(lambda: status() == "SERVING", "SERVING", guard_s=240, every_s=0.02)
    assert seen == ["NOT_SERVING", "SERVING"]
    assert "jaxserve ready on" in started.log(tail=0)


def test_streamed_greedy_answer_equals_llm_generate(client, tiny_llm):
    want = reference(tiny_llm, PROMPTS[:1], 24)[0]
    chunks = list(client.stream(PROMPTS[0], max_tokens=24, temperature=0.0, ignore_eos=True))
    assert len(chunks) > 1                                # streamed, not delivered at the end
    assert [t for c in chunks for t in c.token_ids] == want
    done = client.generate(PROMPTS[0], max_tokens=24, temperature=0.0, ignore_eos=True)
    assert done.token_ids == want and done.finish_reason == "length" and done.completion_tokens == 24
    assert done.prompt_tokens == len(tiny_llm.get_tokenizer().encode(PROMPTS[0]))
    assert done.text == reference(tiny_llm, PROMPTS[:1], 24, text=True)[0]
    assert "".join(c.text for c in chunks) == done.text
    by_ids = client.generate(tiny_llm.get_tokenizer().encode(PROMPTS[0]), max_tokens=24, temperature=0.0,
                             ignore_eos=True)
    assert by_ids.token_ids == want
    info = client.model_info()
    assert info.checkpoint_identity == tiny_llm.checkpoint_identity
    assert info.max_model_len == tiny_llm.engine.max_model_len and info.vocab_size == tiny_llm.engine.vocab_size


def test_32_concurrent_streams_each_get_their_own_answer(server, client, tiny_llm):
    want = reference(tiny_llm, PROMPTS, 16)

    async def main():
        async with AsyncGenerationClient(server.target, timeout=180) as c:
            return await asyncio.gather(*(
                c.generate(PROMPTS[i % len(PROMPTS)], max_tokens=16, temperature=0.0, ignore_eos=True)
                for i in range(32)))

    results = asyncio.run(main())
    assert len({r.request_id for r in results}) == 32
    for i, r in enumerate(results):
        assert r.token_ids == want[i % len(PROMPTS)] and r.finish_reason == "length"
    assert_blocks_all_back(client)


def test_cancelling_mid_stream_returns_every_block(client):
    before = client.server_info().num_requests_finished
    stream = client.stream(PROMPTS[2], max_tokens=120, temperature=0.0, ignore_eos=True)
    got = [next(stream), next(stream)]
    assert all(c.token_ids for c in got)
    stream.close()                                        # cancels the call
    info = assert_blocks_all_back(client)
    assert info.num_requests_finished == before + 1       # counted once, as an abort


@pytest.mark.parametrize("sampling, field", [
    (dict(temperature=-1.0), "temperature"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_k=-3), "top_k"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(max_tokens=10_000), "max_tokens"),
    (dict(min_tokens=9, max_tokens=4), "min_tokens"),
    (dict(n=2), "n"),
])
def test_bad_sampling_values_give_invalid_argument_naming_the_field(client, sampling, field):
    with pytest.raises(grpc.RpcError) as e:
        client.generate(PROMPTS[0], **sampling)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in e.value.details()


def test_bad_prompts_give_invalid_argument(client):
    for prompt, words in (("", "empty"), ([1, 10**6], "vocabulary"), ([], "empty")):
        with pytest.raises(grpc.RpcError) as e:
            client.generate(prompt, max_tokens=4)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, prompt
        assert words in e.value.details()
    assert client.generate(PROMPTS[0], max_tokens=2).finish_reason is not None   # still serving


def test_chat_input_uses_the_models_chat_template(client, tiny_llm):
    messages = [{"role": "user", "content": "hello"}]
    ids = tiny_llm.get_tokenizer().apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    got = client.generate(messages, max_tokens=6, temperature=0.0, ignore_eos=True)
    assert got.prompt_tokens == len(ids)
    assert got.token_ids == client.generate(list(ids), max_tokens=6, temperature=0.0, ignore_eos=True).token_ids


def test_reflection_lists_the_generation_service(server):
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

    with grpc.insecure_channel(server.target) as ch:
        services = set(ProtoReflectionDescriptorDatabase(ch).get_services())
    assert "jaxserve.v1.Generation" in services and "grpc.health.v1.Health" in services


def test_metrics_endpoint_shows_the_histograms_after_traffic(server, client):
    client.generate(PROMPTS[1], max_tokens=8, temperature=0.0, ignore_eos=True)
    text = urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=30).read().decode()
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            samples[name] = float(value)
    for hist in ("time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds",
                 "request_queue_time_seconds"):
        assert samples[f"jaxserve_{hist}_count"] >= 1, hist
        assert samples[f'jaxserve_{hist}_bucket{{le="+Inf"}}'] == samples[f"jaxserve_{hist}_count"]
    assert samples["jaxserve_generation_tokens_total"] >= 8
    assert samples['jaxserve_request_success_total{finished_reason="length"}'] >= 1
    assert samples["jaxserve_compilations_after_warmup"] == 0
    assert samples["jaxserve_spec_draft_tokens_total"] == samples["jaxserve_spec_accepted_tokens_total"] == 0
    for gauge in ("num_requests_running", "num_requests_waiting", "kv_cache_usage", "prefix_cache_hit_rate"):
        assert f"jaxserve_{gauge}" in samples
    # the host's share per step: 8 tokens took at least 8 steps, each with some host time
    assert samples["jaxserve_engine_steps_total"] >= 8
    assert samples["jaxserve_engine_host_seconds_total"] > 0
    assert 0 <= samples["jaxserve_device_idle_fraction"] <= 1


def test_jaxserve_client_streams_the_answer_in_the_terminal(server, tiny_llm, tmp_path):
    import subprocess
    import sys

    want = reference(tiny_llm, PROMPTS[:1], 8, text=True)[0]
    run = subprocess.run([sys.executable, "-c", "import sys; from jaxserve.cli import main; sys.exit(main())",
                          "client", PROMPTS[0], "--raw", "--max-tokens", "8", "--target", server.target],
                         cwd=tmp_path, capture_output=True, timeout=120,
                         env={**os.environ, "PYTHONIOENCODING": "utf-8"})
    assert run.returncode == 0, run.stderr
    assert run.stdout.decode("utf-8") == want + "\n"     # bytes: no newline translation of the random text
    assert b"8 tokens" in run.stderr


def test_the_abort_rpc_ends_a_stream_with_finish_reason_abort(server, client):
    from jaxserve.client import Completion

    done = Completion()
    with server.steps_held():                               # it cannot finish before the abort
        stream = client.stream(PROMPTS[3], completion=done, request_id="abort-me", max_tokens=100,
                               temperature=0.0, ignore_eos=True)
        tokens = list(next(stream).token_ids)
        client.abort(["abort-me", "no-such-request"])      # unknown ids are ignored
        tokens += [t for c in stream for t in c.token_ids]
    assert done.finish_reason == "abort" and done.request_id == "abort-me"
    assert 0 < len(tokens) < 100 and done.completion_tokens == len(tokens)
    assert_blocks_all_back(client)
