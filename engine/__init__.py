"""The engine: one thread owns MLX; requests go in through ``EngineClient`` and stream back.

This is the public API the server may use. Importing it imports MLX.
"""

from apc.events import KVEventsConfig
from engine.constraints import Constraint, ConstraintError, GrammarSpec, tagged_json_lark
from engine.bench import BenchConfig, BenchReport, run_bench
from engine.chat_format import ChatFormat, OutputParser, ParsedCall, ParsedDelta
from engine.tool_grammar import MAX_FORCED_CALLS, tool_call_grammar
from engine.engine import Engine, make_engine
from engine.kv_config import ApcConfig, KVConfig
from engine.engine_client import EngineClient, EngineConfig, EngineNotReady, ModelInfo, RequestRejected
from engine.loader import BUNDLED_MODEL_DIR, DTYPES, LoadedModel, load_model
from engine.request import FinishReason, Request, RequestId, RequestOutput, SamplingParams, TokenLogprob
from engine.sampler import MAX_TOP_LOGPROBS
from engine.scheduler import SchedulerConfig
from metal import KERNELS
from metal.selector import CPU_NATIVE, REFERENCE


def attention_in_force() -> str:
    """The decode attention in force: "cuda-fused" | "metal-fused" | "cpu-native" | "reference":
    KVarN's (decided when a KVarN engine is made: ``metal.KERNELS.attention_path``, and on the CPU
    ``metal.KERNELS.cpu``, whose C++ decode kernel then attends), else on CUDA the fp16 baseline's
    (``metal.KERNELS.ragged_decode_path``, decided when an fp16 engine is made there); "undecided"
    before that, and on a server that decides neither (fp16 off CUDA, affine)."""
    paged = KERNELS.decided_attention_path()
    if paged == REFERENCE and KERNELS.decided_cpu_path() == CPU_NATIVE:
        return CPU_NATIVE
    return paged or KERNELS.decided_ragged_decode_path() or "undecided"


__all__ = [
    "ApcConfig", "attention_in_force", "BenchConfig", "BenchReport", "BUNDLED_MODEL_DIR", "ChatFormat",
    "Constraint", "ConstraintError", "DTYPES", "Engine", "EngineClient", "EngineConfig", "EngineNotReady",
    "FinishReason", "GrammarSpec", "KVConfig", "KVEventsConfig", "load_model", "LoadedModel", "make_engine", "MAX_TOP_LOGPROBS",
    "ModelInfo", "OutputParser", "ParsedCall", "ParsedDelta", "Request", "RequestId", "RequestOutput",
    "RequestRejected", "run_bench", "SamplingParams", "SchedulerConfig", "tagged_json_lark", "TokenLogprob",
    "MAX_FORCED_CALLS", "tool_call_grammar",
]
