"""The packing oracle: a step packed from nothing in runner/batch.py's layout, the plain way.

The runner packs through runner/persistent_batch.py, which keeps each request's rows between
steps and rewrites only what changed; tests compare its packs with this function's over random
step sequences (tests/runner/test_persistent_batch.py) and read row layouts from it.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from jaxserve.runner.batch import PackedStep, bucket_for, num_tiles, sample_rows_bucket
from jaxserve.runner.buckets import RunnerShapes
from jaxserve.runner.sampler import sampling_arrays
from jaxserve.sched.scheduler_output import PLACEHOLDER_TOKEN


def pack_step(sched_out, shapes: RunnerShapes, prev_rows: Mapping[str, int] | None = None, *,
              mask_words: int = 1, tokens: Mapping[str, tuple] | None = None) -> PackedStep:
    """prev_rows: request id -> its logits row in the previous step, for resolving placeholders.
    tokens: request id -> (prompt, the outputs the host knows) of each request whose penalties
    read them, whole (the runner builds them from the scheduler's deltas)."""
    D, P = bucket_for(sched_out, shapes)
    block_size, tile, table_width = shapes.block_size, shapes.prefill_tile, shapes.table_width
    T = D + P * tile
    R = sample_rows_bucket(D, P)
    input_ids = np.zeros(T, np.int32)
    token_src = np.full(T, -1, np.int32)
    positions = np.zeros(T, np.int32)
    slots = np.zeros(T, np.int32)          # 0 = first slot of the null block
    dec_lens = np.zeros(D, np.int32)
    dec_tables = np.zeros((D, table_width), np.int32)
    pre_lens = np.zeros(P, np.int32)
    pre_tables = np.zeros((P, table_width), np.int32)
    logits_rows = np.zeros(R, np.int32)
    lora_slots = np.zeros(T, np.int32)     # each row's LoRA slot (models/lora_delta.py); 0: none
    row_sampling: list = [None] * R
    histories: dict[int, tuple] = {}     # logits row -> (its known tokens, prompt length)

    def known(r: int, req) -> None:
        if req.sampling.reads_tokens:
            prompt, outputs = tokens[req.request_id]
            histories[r] = (list(prompt) + list(outputs), len(prompt))
    sample_rows = []
    drafts = {}
    d = 0
    p = 0
    r = 0

    for req in sched_out.requests:
        n = len(req.token_ids)
        start = req.num_computed_tokens
        table = np.asarray(req.block_ids, np.int32)
        pos = np.arange(start, start + n, dtype=np.int32)
        token_slots = table[pos // block_size] * block_size + pos % block_size
        ids = np.asarray(req.token_ids, np.int32)
        holes = ids == PLACEHOLDER_TOKEN
        if holes.any():
            if prev_rows is None or req.request_id not in prev_rows or holes.sum() != 1 or not holes[-1]:
                raise ValueError(f"request {req.request_id!r}: a placeholder token the previous step did not sample")
            ids = np.where(holes, 0, ids)
        if req.num_draft_tokens:
            # one decode row per token, each seeing the context through its own position
            rows = np.arange(d, d + n)
            input_ids[rows] = ids
            lora_slots[rows] = req.lora_slot
            positions[rows] = pos
            slots[rows] = token_slots
            dec_lens[rows] = pos + 1
            dec_tables[rows, :len(table)] = table
            for j in range(n):
                logits_rows[r + j] = d + j
                row_sampling[r + j] = (req.sampling, req.num_output_tokens + j, -1)
                known(r + j, req)
            sample_rows.append((req.request_id, r))
            drafts[req.request_id] = req.draft_token_ids
            d += n
            r += n
            continue
        if n == 1:
            row = d
            input_ids[row] = ids[0]
            lora_slots[row] = req.lora_slot
            if holes[0]:
                token_src[row] = prev_rows[req.request_id]
            positions[row] = start
            slots[row] = token_slots[0]
            dec_lens[d] = start + 1
            dec_tables[d, :len(table)] = table
            last_row = row
            d += 1
        else:
            base = D + p * tile
            input_ids[base:base + n] = ids
            lora_slots[base:base + n] = req.lora_slot
            if holes[-1]:
                token_src[base + n - 1] = prev_rows[req.request_id]
            tiles = num_tiles(n, tile)
            # padding rows of the last tile continue the positions (their outputs are discarded)
            positions[base:base + tiles * tile] = np.arange(start, start + tiles * tile, dtype=np.int32)
            slots[base:base + n] = token_slots
            for j in range(tiles):
                pre_lens[p + j] = start + (j + 1) * tile
                pre_tables[p + j, :len(table)] = table
            last_row = base + n - 1
            p += tiles
        if req.sample:
            logits_rows[r] = last_row
            # the penalties find an in-flight last token where the step finds its placeholder
            row_sampling[r] = (req.sampling, req.num_output_tokens, int(token_src[last_row]))
            known(r, req)
            sample_rows.append((req.request_id, r))
            r += 1

    arrays = dict(
        input_ids=input_ids, token_src=token_src, positions=positions, slot_mapping=slots,
        dec_kv_lens=dec_lens, dec_tables=dec_tables, dec_num=np.array([d], np.int32),
        pre_kv_lens=pre_lens, pre_tables=pre_tables, pre_num=np.array([p], np.int32),
        logits_rows=logits_rows, lora_slots=lora_slots,
    )
    return PackedStep((D, P), arrays, sampling_arrays(row_sampling, R, history_len=shapes.max_model_len,
                                                      mask_words=mask_words, histories=histories),
                      tuple(sample_rows), drafts)
