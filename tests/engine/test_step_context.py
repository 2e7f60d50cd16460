"""The per-forward context (``kvarn/attention.py``: ``StepContext``) through the real engine on the bundled model: what
every layer of a forward shares is made once per forward (not once per layer, and not carried
from one step into the next), a cache used outside a forward gets a fresh context, and no
product module keeps per-step state of its own."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import engine.model_runner as model_runner
import kvarn.attention as attention
import kvarn.decode_graph as decode_graph
import kvarn.rows as kvarn_rows
import kvarn.slot_step as slot_step
from engine.engine import make_engine
from engine.kv_config import ApcConfig, KVConfig
from engine.request import Request, RequestId, SamplingParams
from engine.scheduler import SchedulerConfig
from kvarn.step_context import StepContext, forward_context, step_of

ROOT = Path(__file__).resolve().parents[2]
CONFIG = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=1024, prefill_chunk_size=256)


class Counter:
    """Wraps a module function and counts its calls."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, module: object, name: str) -> None:
        self.calls = 0
        original = getattr(module, name)

        def counted(*args, **kwargs):
            self.calls += 1
            return original(*args, **kwargs)

        monkeypatch.setattr(module, name, counted)


@pytest.mark.parametrize("planned", [True, False], ids=["planned", "host"])
@pytest.mark.parametrize("arm", ["kvarn-k4v2", "fp16"])
def test_a_decode_forward_makes_its_shared_arrays_once(loaded, monkeypatch, arm, planned):
    """Every layer of a decode forward reads one planned step (KVarN) or one set of slot write rows,
    mask and offsets (fp16): one per forward, whatever the number of layers, whether the step is
    planned for every layer before the forward (``kvarn/decode_graph.py``, ``kvarn/slot_step.py``)
    or its first layer plans it inside a forward run through the batch caches."""
    kv = KVConfig("kvarn", 4, 2) if arm == "kvarn-k4v2" else KVConfig("fp16")
    if not planned:
        monkeypatch.setattr(model_runner, "plan_decode", lambda caches, **kw: None)
    engine = make_engine(loaded, CONFIG, kv, ApcConfig(enabled=False))
    prompts = [[(7 * i + j) % 4000 + 16 for j in range(n)] for i, n in enumerate((40, 90, 150))]
    for i, prompt in enumerate(prompts):
        engine.add_request(Request(RequestId(f"r{i}"), prompt, SamplingParams(max_tokens=8, temperature=0.0,
                                                                             ignore_eos=True)))
    engine.step()  # the prompts, in one step
    if planned:
        made = Counter(monkeypatch, decode_graph, "plan_paged") if arm == "kvarn-k4v2" \
            else Counter(monkeypatch, kvarn_rows, "slot_plan")
    else:
        made = Counter(monkeypatch, decode_graph, "plan_paged") if arm == "kvarn-k4v2" \
            else Counter(monkeypatch, slot_step, "_inputs")
    forwards = 3
    for _ in range(forwards):
        engine.step()  # one decode forward of the three rows each
    assert loaded.model.layers and len(loaded.model.layers) > 1
    assert made.calls == forwards


def test_a_prompt_chunk_builds_its_mask_once_for_all_layers(loaded, monkeypatch):
    """A KVarN prompt chunk's attention mask is made once a forward and shared by the layers (two
    rows' chunks at different positions in one forward get one each)."""
    engine = make_engine(loaded, CONFIG, KVConfig("kvarn", 4, 2), ApcConfig(enabled=False))
    masks = Counter(monkeypatch, attention, "chunk_view_mask")
    engine.add_request(Request(RequestId("a"), list(range(16, 216)), SamplingParams(max_tokens=1)))
    engine.add_request(Request(RequestId("b"), list(range(300, 480)), SamplingParams(max_tokens=1)))
    engine.step()
    assert engine.runner.prefill_forwards == 1 and engine.runner.prefill_chunks == 2
    assert masks.calls == 2  # one per row's chunk, not one per row and layer


def test_the_context_is_attached_for_one_forward_only():
    class Row:
        step = None

    class Batch:
        step = None

        def __init__(self) -> None:
            self.rows = [Row(), Row()]

    batch, lone = Batch(), Row()
    with forward_context([batch, lone]) as step:
        assert batch.step is step and lone.step is step and all(r.step is step for r in batch.rows)
        assert step_of(batch) is step
        assert step.get("x", lambda: [1]) is step.get("x", lambda: [2])
    assert batch.step is None and lone.step is None and all(r.step is None for r in batch.rows)
    with pytest.raises(RuntimeError), forward_context([batch]):
        raise RuntimeError("a forward that fails")
    assert batch.step is None  # detached all the same
    outside = step_of(lone)
    assert isinstance(outside, StepContext) and step_of(lone) is not outside  # a fresh one on every ask


def test_no_product_module_writes_module_state_through_global():
    """Per-step state lives in the forward's context, never in a module global rebound per step."""
    offenders = []
    for package in ("server", "engine", "kvarn", "apc", "metal"):
        for path in sorted((ROOT / package).glob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Global):
                    offenders.append(f"{path.relative_to(ROOT)}:{node.lineno} global {', '.join(node.names)}")
    assert offenders == []
