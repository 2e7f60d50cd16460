"""Prompt lookup and the speculator's draft-length policy without a model (engine/proposers.py:
lookup; engine/speculator.py: StepCosts, choose_length, Acceptance, Speculator.plan_drafts and
observe on plain requests): the longest match wins, a contradicted continuation is cut, repeats
extend; a step drafts only where expected tokens per cost beat a plain step; costs are learned
from the steps' wall times; a row that keeps rejecting stops drafting, a strong match brings it
back, and its state goes with it."""

from __future__ import annotations

import pytest

from engine.proposers import Draft, lookup
from engine.request import Request, RequestId, SamplingParams
from engine.speculator import (COST_TRUST, MATCH_BUCKETS, Acceptance, SpecConfig, Speculator, StepCosts,
                               choose_length)
from engine.step_types import SampledToken, StepPlan, StepResult


@pytest.mark.parametrize("tokens, k, want", [
    ([1, 2, 3, 7, 8, 9, 5, 1, 2, 3, 7, 8, 6, 5, 1, 2, 3], 4, ((7, 8, 6, 5), 4)),  # "5 1 2 3" beats "1 2 3"
    ([4, 1, 2, 3, 7, 9, 4, 1, 2, 3, 7, 8, 4, 1, 2, 3], 4, ((7,), 4)),  # older "4 1 2 3" went on 7 9: cut at 8
    ([9, 9, 1, 2, 3, 1, 2, 3, 1, 2], 8, ((3, 1, 2, 3, 1, 2, 3, 1), 4)),  # a repeat of period 3, extended
    ([1, 2, 3, 4, 5], 4, ((), 0)),  # nothing seen before
    ([1, 2, 6, 2], 4, ((), 0)),  # "2" alone is under ngram_min
    ([1, 2, 6, 1, 2], 2, ((6, 1), 2)),
])
def test_lookup_takes_the_longest_match_and_cuts_contradictions(tokens, k, want):
    assert lookup(tokens, k, 2, 4) == want


def test_step_costs_use_the_prior_then_measured_ratios_never_below_one():
    costs = StepCosts()
    assert costs.ratio(1, 1) == 1.0
    assert costs.ratio(1, 5) == pytest.approx(1 + 0.2 + 0.1 * 4)
    assert costs.ratio(4, 5) == pytest.approx(1 + 0.2 + 0.1 * 4 * 2)
    for _ in range(COST_TRUST):
        costs.add(1, 1, 0.010)
        costs.add(1, 5, 0.030)
        costs.add(2, 1, 0.010)
        costs.add(2, 3, 0.005)  # a noisy measurement cheaper than a plain step
    costs.add(1, 1, 1.0)  # one slow step (a trace, a commit) among them
    assert costs.ratio(1, 5) == pytest.approx(3.0)
    assert costs.ratio(2, 3) == 1.0
    assert costs.ratio(1, 9) == pytest.approx(1 + 0.2 + 0.1 * 8)  # never measured: the prior


def test_choose_length_drafts_only_what_pays():
    costs = StepCosts()
    sizes = (1, 2, 4, 8)
    assert choose_length([0.9], [8], 1, costs, sizes) == 8
    assert choose_length([0.9], [2], 1, costs, sizes) == 2  # no size past the draft
    assert choose_length([0.1], [8], 1, costs, sizes) == 0
    # one good row in a batch of 8 does not pay for 8 rows' padded verify; 8 good rows do
    assert choose_length([0.7], [4], 8, costs, sizes) == 0
    assert choose_length([0.9] * 8, [4] * 8, 8, costs, sizes) > 0


def test_a_costly_proposer_is_asked_only_where_its_drafts_pay_for_it():
    """What asking the proposer costs counts against drafting (a draft model's forwards): drafts
    that pay for their verify alone do not pay for a proposer that costs a step and a half."""
    costs = StepCosts()
    assert costs.proposing_ratio(1) == 0.0  # nothing measured yet: no cost assumed
    for _ in range(COST_TRUST):
        costs.add(1, 1, 0.010)
        costs.add_proposing(1, 0.015)
    assert costs.proposing_ratio(1) == pytest.approx(1.5)
    assert costs.proposing_ratio(2) == 0.0  # another row bucket: not measured
    sizes = (1, 2, 4)
    assert choose_length([0.6], [4], 1, costs, sizes) > 0
    assert choose_length([0.6], [4], 1, costs, sizes, extra=costs.proposing_ratio(1)) == 0
    assert choose_length([0.99], [4], 1, costs, sizes, extra=costs.proposing_ratio(1)) == 4


def test_acceptance_evidence_per_match_length_and_row_fading():
    acceptance = Acceptance()
    row = acceptance.row(RequestId("a"), step=1)
    row.bucket = 6
    for _ in range(10):
        acceptance.observe(row, 4, 4)
    strong = acceptance.rate(row, 6)
    assert strong > 0.9 and acceptance.rate(row, 2) < strong
    other = acceptance.row(RequestId("b"), step=1)
    assert acceptance.rate(other, 6) > acceptance.rate(other, 2)  # shared evidence
    other.bucket = 2
    for _ in range(6):
        acceptance.observe(other, 0, 4)
    low = acceptance.rate(other, 2)
    assert acceptance.rate(acceptance.row(RequestId("b"), step=40), 2) > low  # the row's evidence fades
    assert acceptance.best_rate(other) >= acceptance.rate(other, MATCH_BUCKETS)


class Scripted:
    """A proposer drafting ``tokens`` for every row, with the matched length ``match``."""

    name = "scripted"

    def __init__(self, tokens: tuple[int, ...], match: int) -> None:
        self.tokens, self.match, self.forgotten = tokens, match, []

    def propose(self, asks):
        return {a.request.request_id: Draft(self.tokens[: a.k], match=self.match) for a in asks}

    def feedback(self, request_id, num_accepted):
        pass

    def forget(self, request_id):
        self.forgotten.append(request_id)


def run_steps(speculator: Speculator, request: Request, steps: int, accept: bool) -> list[int]:
    """Plan and observe ``steps`` decode steps of one row (each step 10 ms plus 2 ms a draft token);
    the drafts all kept (``accept``) or all rejected. Returns each step's draft length."""
    now = [0.0]
    speculator.clock = lambda: now[0]
    lengths = []
    for _ in range(steps):
        plan = speculator.plan_drafts(StepPlan(decodes=(request.request_id,)), {request.request_id: request},
                                      lambda _: 1000)
        drafts = plan.drafts.get(request.request_id, ())
        lengths.append(len(drafts))
        now[0] += 0.010 + 0.002 * len(drafts)
        kept = drafts if accept else ()
        result = StepResult(sampled={request.request_id: SampledToken(request.request_id, 3, None)},
                            accepted={request.request_id: tuple(kept)} if kept else {})
        speculator.observe(plan, result)
        request.output_ids += [*kept, 3]
    return lengths


def test_a_rejecting_row_stops_and_a_strong_match_brings_drafts_back():
    proposer = Scripted(tuple(range(10, 18)), match=2)
    speculator = Speculator(SpecConfig(num_tokens=8, proposer=proposer), proposer, 100_000, 8192)
    request = Request(RequestId("r"), [1, 2, 3], SamplingParams(max_tokens=10_000, temperature=0.0))
    request.output_ids.append(3)
    lengths = run_steps(speculator, request, 40, accept=False)
    assert lengths[0] > 0 and sum(n > 0 for n in lengths[20:]) <= 3  # weak matches that fail: drafts stop
    proposer.match = MATCH_BUCKETS
    lengths = run_steps(speculator, request, 40, accept=True)
    assert lengths[-1] == 8 and set(lengths) <= {0, 1, 2, 4, 8}  # a strong match that holds: full drafts
    assert speculator.costs.ratio(1, 9) == pytest.approx(1 + 0.016 / 0.010, rel=0.05)  # learned: 26 ms vs 10
    speculator.forget(request.request_id)
    assert speculator.acceptance.rows == {} and proposer.forgotten == [request.request_id]


def test_without_adaptive_every_proposal_is_verified_whole():
    proposer = Scripted((5, 6, 7), match=2)
    speculator = Speculator(SpecConfig(adaptive=False, proposer=proposer), proposer, 100_000, 8192)
    request = Request(RequestId("r"), [1, 2], SamplingParams(max_tokens=1000, temperature=0.0))
    request.output_ids.append(3)
    assert run_steps(speculator, request, 12, accept=False) == [3] * 12
