"""Serving many requests (chapter 13): chat-like workloads, the scheduler (static, dynamic,
continuous batching, chunked prefill, preemption) and the engine that runs its steps on paged KV;
the async engine that runs that loop for many concurrent callers, and the OpenAI-compatible HTTP
server on it (``http``; its web framework is imported only when a server is made); prefill/decode
disaggregation over worker processes (``disagg``), and N whole replicas behind a router
(``replicas``, chapter 15's data parallelism); ``LLM``, offline batch generation on the engine.
``EngineOptions`` (``options``) composes the techniques the engine serves with: quantized or
compiled (``compiled_step``), tensor-parallel ranks (``tensor_parallel``), speculative decoding
or prompt lookup (``speculative``).
"""

from .async_engine import AsyncEngine
from .engine import Engine, EngineConfig, RequestOutput
from .llm import LLM, Completion
from .options import EngineOptions, build_engine
from .scheduler import SchedulerConfig
from .workload import Request

__all__ = [
    "LLM",
    "AsyncEngine",
    "Completion",
    "Engine",
    "EngineConfig",
    "EngineOptions",
    "Request",
    "RequestOutput",
    "SchedulerConfig",
    "build_engine",
]
