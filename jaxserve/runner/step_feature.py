"""What a step feature is: the one contract for work that rides on the runner's step.

A feature (prompt logprobs, pooling for embeddings, expert counts, the KV connector's block
operations) may add to a step at four points, each a method with a do-nothing default:

- `step_outputs`: the extra outputs it reads from the compiled step ("hidden": every row's final
  hidden state; "routed": a mixture-of-experts step's routed tokens per layer and expert). The
  runner compiles the steps with the union of its features' outputs.
- `load(buckets)`: its own programs for those buckets, loaded or compiled through the runner's
  `programs` (runner/programs.py) and run once, after the steps.
- `pack(sched_out, bucket)` -> its host data for the step (None: nothing to do this step, the
  usual case; `bucket` is None for a step that only moves blocks and runs no forward pass). It travels in `StepInputs.features[name]`, to a multi-host follower too unless
  `mirrored` is False.
- `before_step(rows)`: device work before the forward pass (the KV connector's loads and saves).
- `run(outputs, rows)` -> what it dispatched on the step's named outputs; `read(dispatched)` ->
  its result on the host at collect, in `ModelRunnerOutput.features[name]`. A feature with
  `runs_every_step` runs (and reads) on every step, rows or not (expert counts read every step's
  routed tokens).

The runner calls them in that order and knows no feature by name: adding one is its module plus
its registration in the builder (engine/builder.py `step_features`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping


class StepFeature:
    name: str = ""                               # its key in StepInputs.features and the runner's output
    step_outputs: frozenset[str] = frozenset()   # extra outputs of the compiled step it reads
    mirrored: bool = True                        # its rows go to a multi-host follower's runner too
    runs_every_step: bool = False                # run() and read() even when pack() returned None

    def attach(self, runner) -> None:
        """Called once by the runner that carries the feature, after its steps' store exists;
        a feature keeps the runner to read its public members (programs, steps, params, shapes)."""
        self.runner = runner

    def load(self, buckets: Iterable) -> float:
        """Load (or compile) this feature's programs for these buckets and run each once; seconds."""
        return 0.0

    def loaded_on_demand(self) -> list:
        """Programs a run needed before they were loaded (each one stalled that run)."""
        return []

    def pack(self, sched_out, bucket: tuple[int, int] | None):
        return None

    def before_step(self, rows) -> None:
        pass

    def run(self, outputs: Mapping[str, object], rows):
        return None

    def read(self, dispatched):
        return None


def hidden_dtype(steps) -> object:
    """The dtype of the steps' hidden states (the model's activations): a compiled step's own
    output, so nothing is traced for it (a step loaded from the cache has it too). `steps`: the
    runner's step store; outputs are (arena, logits, hidden, ...)."""
    bucket = next((b for b in steps if steps.is_loaded(b)), min(steps))
    return steps[bucket].out_info[2].dtype


def step_rows(bucket: tuple[int, int], tile: int) -> int:
    """A step's query rows: its decode rows and its prefill tiles' rows (runner/batch.py)."""
    D, P = bucket
    return D + P * tile
