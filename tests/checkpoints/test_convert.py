"""convert(): a converted checkpoint loads back with the same tensors, config, tokenizer and identity."""

import os
import time

import numpy as np
import pytest
from ckpt_testkit import tiny_config, tiny_tensors, write_gguf, write_hf_dir
from gguf import GGMLQuantizationType as Q

from jaxserve.checkpoints import Checkpoint, convert, load_checkpoint, save_converted

from test_embedded import CHATS, TEXTS


def assert_same_checkpoint(converted: Checkpoint, source: Checkpoint) -> None:
    assert converted.format == "jaxserve"
    assert converted.identity == source.identity
    assert converted.config == source.config
    assert set(converted.tensors) == set(source.tensors)
    for name, want in source.tensors.items():
        got = converted.tensors[name]
        assert got.dtype == want.dtype, name
        np.testing.assert_array_equal(got, want, err_msg=name)


def test_hf_round_trip_keeps_dtypes_and_tokenizer(tmp_path):
    import ml_dtypes

    config = tiny_config("qwen2", tied=False)
    tensors = tiny_tensors(config, dtype=ml_dtypes.bfloat16)
    source = load_checkpoint(write_hf_dir(tmp_path / "hf", config, tensors, shards=2))
    assert convert(tmp_path / "hf", tmp_path / "out") == str(tmp_path / "out")
    converted = load_checkpoint(tmp_path / "out")
    assert_same_checkpoint(converted, source)
    text = "the hello <|im_end|> world"
    assert converted.tokenizer(text).input_ids == source.tokenizer(text).input_ids
    assert converted.tokenizer.chat_template == source.tokenizer.chat_template


def test_gguf_round_trip_keeps_dequantized_values(tmp_path):
    config = tiny_config("llama")
    path = write_gguf(tmp_path / "m.gguf", "llama", config, tiny_tensors(config),
                      types=lambda n: Q.Q4_1 if "proj" in n else Q.F16)
    source = load_checkpoint(path)
    converted = load_checkpoint(convert(path, tmp_path / "out"))
    assert_same_checkpoint(converted, source)
    assert converted.tensors["model.norm.weight"].dtype == np.float16


def test_convert_refuses_a_non_empty_destination_unless_told(tmp_path):
    config = tiny_config("llama")
    src = write_hf_dir(tmp_path / "hf", config, tiny_tensors(config))
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("x")
    with pytest.raises(FileExistsError):
        convert(src, tmp_path / "out")
    convert(src, tmp_path / "out", overwrite=True)
    assert load_checkpoint(tmp_path / "out").format == "jaxserve"
    assert not os.path.exists(tmp_path / "out.partial")


def test_embedded_round_trip_is_identical(embedded, tmp_path):
    # save_converted is convert's second half; the embedded model is already loaded by the fixture
    out = save_converted(embedded, tmp_path / "smollm2")
    start = time.perf_counter()
    converted = load_checkpoint(out)
    seconds = time.perf_counter() - start
    assert_same_checkpoint(converted, embedded)
    for text in TEXTS:
        assert converted.tokenizer(text).input_ids == embedded.tokenizer(text).input_ids, text
    for chat in CHATS:
        assert (converted.tokenizer.apply_chat_template(chat, tokenize=True, add_generation_prompt=True)
                == embedded.tokenizer.apply_chat_template(chat, tokenize=True, add_generation_prompt=True))
    assert (converted.tokenizer.bos_token_id, converted.tokenizer.eos_token_id) == (1, 2)
    # reported, not asserted (timings on a shared CI machine are noise): see the README's numbers
    print(f"converted embedded checkpoint loaded in {seconds:.2f} s")
