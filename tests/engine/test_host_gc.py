"""The collector's pace (engine/host_gc.py): raised to the engine's threshold, never lowered, left
alone with None; the knob is validated like the others."""

import gc

import pytest

from jaxserve.engine_args import engine_config
from jaxserve.engine.host_gc import pace_collector


@pytest.fixture
def restore_threshold():
    saved = gc.get_threshold()
    yield
    gc.set_threshold(*saved)


def test_the_threshold_is_raised_never_lowered_and_none_leaves_it(restore_threshold):
    gc.set_threshold(700, 10, 10)
    pace_collector(None)
    assert gc.get_threshold() == (700, 10, 10)
    pace_collector(20_000)
    assert gc.get_threshold() == (20_000, 10, 10)
    pace_collector(5_000)
    assert gc.get_threshold() == (20_000, 10, 10)


def test_the_knob_is_validated():
    assert engine_config().python_gc_threshold == 20_000
    assert engine_config(python_gc_threshold=None).python_gc_threshold is None
    with pytest.raises(ValueError, match="python_gc_threshold=0 must be a positive integer or None"):
        engine_config(python_gc_threshold=0)
