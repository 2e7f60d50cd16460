"""Datasets of the kvarn_* lm-eval tasks: jsonl files beside this module, read with no download
(``custom_dataset: !function kvarn_lm_eval.<loader>`` in the task YAMLs)."""

import json
from pathlib import Path

import datasets

HERE = Path(__file__).resolve().parent


def _rows(name: str) -> list[dict]:
    with open(HERE / name, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def _split(kind: str) -> datasets.DatasetDict:
    rows = [r for r in _rows("kvarn_lm_eval.jsonl") if r["kind"] == kind]
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})


def load_mc(**kwargs) -> datasets.DatasetDict:
    return _split("mc")


def load_text(**kwargs) -> datasets.DatasetDict:
    return _split("text")


def load_gen(**kwargs) -> datasets.DatasetDict:
    return _split("gen")
