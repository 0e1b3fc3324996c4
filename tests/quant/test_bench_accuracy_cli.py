"""`jaxserve bench accuracy` is mounted on the CLI with its options (the measurement itself is
tests/quant/test_accuracy_embedded.py's)."""

from jaxserve.bench import cmd_accuracy
from jaxserve.cli import build_parser


def test_bench_accuracy_parses_its_options():
    args = build_parser().parse_args(["bench", "accuracy", "--modes", "int8,kv_int8", "--heldout", "t.txt",
                                      "--calibration-data", "c.txt", "--output-json", "o.json"])
    assert args.func is cmd_accuracy.run and args.bench_run is cmd_accuracy.bench_run
    assert (args.modes, args.heldout, args.calibration_data, args.output_json) == (
        "int8,kv_int8", "t.txt", "c.txt", "o.json")
    assert build_parser().parse_args(["bench", "accuracy"]).model is None     # the embedded model
