"""Where the model runs: tensor and expert parallelism over one host's devices or several hosts'
(jax.distributed), and how expert parallelism dispatches tokens."""

from __future__ import annotations

from dataclasses import dataclass

from jaxserve.config.options import check_choice, check_positive_int, check_positive_number, choices, option


@dataclass(frozen=True, slots=True)
class ParallelConfig:
    tensor_parallel_size: int = option(
        1, "devices the model is split over (tensor parallelism: heads and MLP columns per device, one "
           "all-reduce after attention and one after the MLP per layer); must divide the query heads and the "
           "intermediate size, and divide or be a multiple of the KV heads (the error names the sizes that work)")
    expert_parallel_size: int = option(
        1, "mixture-of-experts models: device groups the experts are split over (expert parallelism; each group "
           "of tensor_parallel_size devices holds num_experts / this many experts and computes attention as "
           "tensor parallelism does, so the engine takes expert_parallel_size x tensor_parallel_size devices); "
           "must divide the number of experts (the error names the sizes that work)")
    expert_dispatch: str = option(
        "auto", "expert parallelism's token dispatch: all_gather (every device runs its experts over the "
                "replicated tokens routed to them, one all-reduce combines), all_to_all (tokens sent to their "
                "experts' devices and back), or auto (the one measured cheaper per step size: all_gather; "
                "docs/benchmarks.md, Mixture of experts)", choices=("auto", "all_gather", "all_to_all"))
    num_hosts: int = option(
        1, "processes (hosts) the mesh spans, joined by jax.distributed (or JAX_NUM_PROCESSES); rank 0 schedules and "
           "serves, the others run its steps; tensor_parallel_size must then count every host's devices")
    host_rank: int | None = option(None, "this process's rank among num_hosts (or JAX_PROCESS_ID); 0 serves")
    coordinator_address: str | None = option(
        None, "HOST:PORT of rank 0's coordination service, the same on every host (or JAX_COORDINATOR_ADDRESS)")
    host_timeout_s: float = option(30.0, "a host silent this long ends every other host with an error naming it")

    def __post_init__(self) -> None:
        check_positive_int(self, "tensor_parallel_size", "expert_parallel_size", "num_hosts")
        check_positive_number(self, "host_timeout_s")
        check_choice(self, "expert_dispatch", choices(self, "expert_dispatch"))
