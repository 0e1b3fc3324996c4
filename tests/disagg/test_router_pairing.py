"""The router's side of disaggregation without processes: which requests take the prefill hop,
what the prefill engine is asked, and the flags refused with their names."""

import pytest

from jaxserve.cli import main
from jaxserve.router.disagg import prefill_request, wants_prefill_hop
from jaxserve.proto import generation_pb2 as pb


def _req(ids, **sp):
    return pb.GenerateRequest(request_id="r", token_ids=pb.TokenIds(ids=ids), sampling_params=pb.SamplingParams(**sp))


def test_short_prompts_n_above_one_and_chats_skip_the_prefill_engine():
    assert wants_prefill_hop(_req(list(range(8))), list(range(8)), threshold=8)
    assert not wants_prefill_hop(_req(list(range(7))), list(range(7)), threshold=8)
    assert not wants_prefill_hop(_req(list(range(9)), n=2), list(range(9)), threshold=8)
    # prompt logprobs need the prompt's rows computed where they are asked
    assert not wants_prefill_hop(_req(list(range(9)), prompt_logprobs=0), list(range(9)), threshold=8)
    chat = pb.GenerateRequest(chat=pb.Chat(messages=[pb.ChatMessage(role="user", content="hi")]))
    assert not wants_prefill_hop(chat, list(range(20)), threshold=0)
    assert not wants_prefill_hop(_req([]), [], threshold=0)


def test_the_prefill_engine_computes_one_token_and_holds_the_kv():
    fwd = _req([1, 2, 3], max_tokens=50, min_tokens=10, temperature=0.7, seed=3, stop=["x"],
               structured_outputs=pb.StructuredOutputs(regex="a+"))
    pre = prefill_request(fwd)
    sp = pre.sampling_params
    assert sp.max_tokens == 1 and not sp.HasField("min_tokens") and not sp.stop
    assert not sp.HasField("structured_outputs") and sp.seed == 3 and sp.temperature == 0.7
    assert pre.kv_transfer.send and list(pre.token_ids.ids) == [1, 2, 3] and pre.request_id == "r"
    assert fwd.sampling_params.max_tokens == 50          # the decode engine's request is untouched


@pytest.mark.parametrize("argv, message", [
    (["router", "--prefill", "a:1"], "--prefill needs at least one --decode"),
    (["router", "--prefill", "a:1", "--decode", "a:1"], "a replica is given twice"),
    (["router", "--prefill", "a:1", "--decode", "b:1", "--prefill-threshold-tokens", "-1"],
     "--prefill-threshold-tokens -1 must be >= 0"),
])
def test_bad_pairing_flags_are_refused_with_their_names(argv, message, capsys):
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_bad_role_settings_are_refused(capsys):
    from jaxserve.engine_args import engine_config

    with pytest.raises(SystemExit):
        main(["serve", "--role", "middle"])
    assert "invalid choice: 'middle'" in capsys.readouterr().err
    with pytest.raises(ValueError, match="kv_lease_s=0 must be a finite number > 0"):
        engine_config(kv_lease_s=0)
    with pytest.raises(ValueError, match="kv_load_failure_policy='retry' must be one of"):
        engine_config(kv_load_failure_policy="retry")
