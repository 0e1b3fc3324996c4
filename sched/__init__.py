"""jaxserve.sched: the host-side scheduler (pure Python + numpy; never imports jax).

Requests, the KV block pool, the prefix cache (radix tree), and the scheduler that decides every
step which requests run and how many of their tokens.
"""

from jaxserve.sched.block_pool import BlockPool, OutOfBlocksError
from jaxserve.sched.chunking import max_chunk_for_itl
from jaxserve.sched.errors import Overloaded
from jaxserve.sched.request import Request, RequestStatus
from jaxserve.sched.scheduler import Scheduler
from jaxserve.sched.scheduler_config import SchedulerConfig
from jaxserve.sched.scheduler_output import RequestUpdate, ScheduledRequest, SchedulerOutput, TokenHistory

__all__ = [
    "BlockPool",
    "OutOfBlocksError",
    "Overloaded",
    "Request",
    "RequestStatus",
    "RequestUpdate",
    "ScheduledRequest",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerOutput",
    "TokenHistory",
    "max_chunk_for_itl",
]
