"""Every repository file the docs name exists: a module merged away or a result file renamed
must take its mentions in docs/ and the README with it."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = sorted(ROOT.glob("docs/*.md")) + [ROOT / "README.md"]
# a path into one of the repository's folders, e.g. kvarn/attention.py or bench/results/x.json
NAMED = re.compile(r"(?<![\w/.-])((?:server|engine|kvarn|apc|metal|bench|tests|e2e)/[\w/.-]+\.(?:py|sh|json|md))")


def named_paths(text: str) -> set[str]:
    return set(NAMED.findall(text))


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_file_a_doc_names_exists(doc):
    missing = sorted(p for p in named_paths(doc.read_text()) if not (ROOT / p).exists())
    assert not missing, f"{doc.name} names files that do not exist: {missing}"


def test_the_check_sees_a_missing_file():
    assert named_paths("see `kvarn/step.py` and kvarn/attention.py.") == {"kvarn/step.py", "kvarn/attention.py"}
    assert not (ROOT / "kvarn/step.py").exists()
