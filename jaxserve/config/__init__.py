"""The engine's configuration: EngineConfig and its sections (one module each). The flat
keyword and flag spelling of its fields is jaxserve/engine_args.py."""

from jaxserve.config.cache import CacheConfig
from jaxserve.config.chunking import ChunkingConfig
from jaxserve.config.compilation import CompilationConfig
from jaxserve.config.disagg import DisaggConfig
from jaxserve.config.engine_config import EngineConfig
from jaxserve.config.lora import LoRAConfig
from jaxserve.config.model import ServedModelConfig
from jaxserve.config.parallel import ParallelConfig
from jaxserve.config.rl import RLConfig
from jaxserve.sched.scheduler_config import SchedulerOptions
from jaxserve.sched.speculation import SpeculativeConfig

__all__ = ["CacheConfig", "ChunkingConfig", "CompilationConfig", "DisaggConfig", "EngineConfig", "LoRAConfig",
           "ParallelConfig", "RLConfig", "SchedulerOptions", "ServedModelConfig", "SpeculativeConfig"]
