"""The engine: one thread owns MLX; requests go in through ``EngineClient`` and stream back.

This is the public API the server may use. Importing it imports MLX.
"""

from engine.constraints import Constraint, ConstraintError, GrammarSpec, tagged_json_lark
from engine.bench import BenchConfig, BenchReport, run_bench
from engine.engine import Engine, make_engine
from engine.kv_config import ApcConfig, KVConfig
from engine.engine_client import EngineClient, EngineConfig, EngineNotReady, ModelInfo, RequestRejected
from engine.loader import BUNDLED_MODEL_DIR, DTYPES, LoadedModel, load_model
from engine.request import FinishReason, Request, RequestId, RequestOutput, SamplingParams, TokenLogprob
from engine.sampler import MAX_TOP_LOGPROBS
from engine.scheduler import SchedulerConfig
from metal import decided_attention_path


def attention_in_force() -> str:
    """The KVarN decode attention in force: "cuda-fused" | "metal-fused" | "reference" (decided when
    a KVarN engine is made: ``metal.attention_path``), or "undecided" before that (a non-KVarN
    server never decides it)."""
    return decided_attention_path() or "undecided"


__all__ = [
    "ApcConfig", "BUNDLED_MODEL_DIR", "BenchConfig", "BenchReport", "DTYPES", "Engine", "EngineClient", "EngineConfig",
    "EngineNotReady", "FinishReason", "KVConfig", "LoadedModel", "MAX_TOP_LOGPROBS", "ModelInfo", "Request", "RequestId",
    "RequestOutput", "RequestRejected", "SamplingParams", "SchedulerConfig", "TokenLogprob", "attention_in_force", "load_model", "make_engine", "run_bench",
    "tagged_json_lark", "Constraint", "ConstraintError", "GrammarSpec",
]
