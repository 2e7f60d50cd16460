"""Test order for the suite's workers (scheduling only: no test is skipped, changed or repeated).

The suite runs on every core through pytest-xdist with ``--dist worksteal`` (pyproject's
addopts): each worker starts on its share of the collection and an idle worker takes half of
another's queue. What is left is the run's tail: a worker still on a test of a minute or more
while the other has nothing to take. So the files with the longest tests run first, their
longest tests first within them, and the suite ends on short tests. Measured on the 2-core CI
machine (``--durations 0``): in collection order one worker sat idle for the last ~8 minutes,
the slow files (``test_cli.py`` last of all) being at the end.

Files keep their tests together (module fixtures are made once a worker), so only whole files
move, and within a file only its listed tests.
"""

from __future__ import annotations

import pytest

# the slowest files on the CI machine, slowest first (seconds of test time in one run, roughly)
SLOW_FILES = (
    "tests/engine/test_prefix_cache.py",  # ~940
    "tests/engine/test_window.py",  # ~400
    "tests/test_cli.py",  # ~240
    "tests/engine/test_batching.py",  # ~200
    "tests/server/test_prefix_cache.py",  # ~190
    "tests/metal/test_commit.py",
    "tests/kvarn/test_batch.py",
    "tests/server/test_lm_eval.py",
    "tests/kvarn/test_models.py",
    "tests/kvarn/test_slots.py",
    "tests/e2e/test_stress_runner.py",
)
# tests of a minute or more, first in their file
SLOW_TESTS = (
    "tests/engine/test_prefix_cache.py::test_multi_turn_reuses_the_previous_prompt_and_its_generated_blocks",
    "tests/engine/test_prefix_cache.py::test_memory_stays_within_the_budget_under_a_200_request_mixed_load",
    "tests/engine/test_prefix_cache.py::test_requests_sharing_a_3k_prefix_hold_its_blocks_once",
    "tests/engine/test_window.py::test_windowed_rows_in_a_batch_match_their_runs_alone",
    "tests/engine/test_window.py::test_fp16_window_greedy_tokens_equal_mlx_lms_generate_with_max_kv_size",
    "tests/test_cli.py::test_kld_reports_window_arms",
    "tests/test_cli.py::test_kv_layout_auto_uses_stored_advice_measures_once_per_model_and_reports_it",
    "tests/engine/test_batching.py::test_rows_in_a_batch_match_their_runs_alone",
    "tests/kvarn/test_slots.py::test_bundled_model_batched_decode_matches_rows_alone",
)


def _rank(nodeid: str) -> tuple[int, int]:
    path = nodeid.split("::", 1)[0]
    file_rank = SLOW_FILES.index(path) if path in SLOW_FILES else len(SLOW_FILES)
    test_rank = next((k for k, prefix in enumerate(SLOW_TESTS) if nodeid.startswith(prefix)), len(SLOW_TESTS))
    return file_rank, test_rank


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    order = {id(item): k for k, item in enumerate(items)}
    items.sort(key=lambda item: (*_rank(item.nodeid), order[id(item)]))
