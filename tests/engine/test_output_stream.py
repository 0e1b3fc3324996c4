"""OutputStream: outputs that arrive while the one before is unread are merged (a DELTA stream's
pieces appended, whole outputs replaced), markers keep their place, and a reader that keeps up
gets every output as it was sent."""

import asyncio

from jaxserve.engine.output_stream import OutputStream
from jaxserve.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput


def _out(tokens, text, *, finished=False, logprobs=None, prompt_logprobs=None, t=0.0):
    c = CompletionOutput(0, text, list(tokens), "length" if finished else None,
                         logprobs=logprobs, cumulative_logprob=-float(len(tokens)))
    return RequestOutput("r", None, [1, 2], [c], finished, 0, RequestMetrics(t), prompt_logprobs=prompt_logprobs)


def _drain(stream):
    async def main():
        got = []
        while stream._items:
            got.append(await stream.get())
        return got
    return asyncio.run(main())


def test_unread_delta_outputs_merge_into_one_saying_the_same():
    s = OutputStream(appends=True)
    lp = [{5: Logprob(-0.1)}], [{6: Logprob(-0.2)}, {7: Logprob(-0.3)}]
    s.put(_out([5], "a", logprobs=lp[0], prompt_logprobs=[None, {2: Logprob(-1.0)}]))
    s.put(_out([6, 7], "bc", logprobs=lp[1], t=1.0))
    s.put(_out([8], "d", finished=True, logprobs=[{8: Logprob(-0.4)}], t=2.0))
    [one] = _drain(s)
    c = one.outputs[0]
    assert (c.token_ids, c.text, c.finish_reason, one.finished) == ([5, 6, 7, 8], "abcd", "length", True)
    assert [list(e) for e in c.logprobs] == [[5], [6], [7], [8]]
    assert one.prompt_logprobs == [None, {2: Logprob(-1.0)}]     # sent once, kept
    assert one.metrics.arrival_time == 2.0 and c.cumulative_logprob == -1.0   # the latest's


def test_whole_outputs_replace_the_unread_one_and_markers_keep_their_place():
    s = OutputStream(appends=False)             # cumulative, final only, n > 1
    s.put(_out([5], "a"))
    s.put(_out([5, 6], "ab"))
    marker, err = object(), RuntimeError("boom")
    s.put(marker)
    s.put(_out([5, 6, 7], "abc"))
    s.put(err)
    got = _drain(s)
    assert got[0].outputs[0].token_ids == [5, 6] and got[1] is marker
    assert got[2].outputs[0].token_ids == [5, 6, 7] and got[3] is err


def test_a_replaced_output_keeps_the_prompt_logprobs_a_delta_request_sends_once():
    # n > 1 with DELTA: completions are whole each time, prompt logprobs come in one output only
    s = OutputStream(appends=False)
    s.put(_out([5], "a", prompt_logprobs=[None, {2: Logprob(-1.0)}]))
    s.put(_out([5, 6], "ab", finished=True))
    [one] = _drain(s)
    assert one.outputs[0].token_ids == [5, 6] and one.prompt_logprobs == [None, {2: Logprob(-1.0)}]


def test_a_reader_that_keeps_up_gets_each_output_and_nothing_merges_after_the_end():
    async def main():
        s = OutputStream(appends=True)
        got = []

        async def read():
            while len(got) < 3:
                got.append(await s.get())

        reader = asyncio.create_task(read())
        for i in range(2):
            await asyncio.sleep(0)
            s.put(_out([i], str(i)))
            await asyncio.sleep(0)            # the reader runs before the next put
        s.put(_out([9], "9", finished=True))
        s.put(_out([10], "x"))                # after the end: not merged into it
        await reader
        return got, s._items

    got, left = asyncio.run(main())
    assert [o.outputs[0].token_ids for o in got] == [[0], [1], [9]]
    assert len(left) == 1
