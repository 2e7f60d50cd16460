"""A long-context variant of the bundled model, built in a temp folder (nothing downloaded, no
weights copied).

Agent CLIs send system prompts of tens of thousands of tokens, past the bundled model's 4,096.
This variant declares a context of ``LONG_CONTEXT`` tokens: ``max_position_embeddings`` in
config.json (what ``engine.loader.context_length_of`` reads first) and the tokenizer's
``model_max_length`` (its fallback), so both say the same. The weights are a symlink to the
bundled ones and RoPE needs no change, so it loads and runs at any length; its answers past the
trained 4k are noise, which is fine for testing protocols.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

BUNDLED = Path(__file__).resolve().parents[1] / "engine" / "bundled" / "fixture-chat-29m-q8"
LONG_CONTEXT = 65_536
_COPIED = ("generation_config.json", "model.safetensors.index.json", "tokenizer.json", "chat_template.jinja")


def make_long_context_model(folder: Path, context_length: int = LONG_CONTEXT) -> Path:
    """Write the variant with a context of ``context_length`` into ``folder`` (created) and return it."""
    folder.mkdir(parents=True, exist_ok=True)
    for name in _COPIED:
        shutil.copy(BUNDLED / name, folder / name)
    (folder / "model.safetensors").symlink_to(BUNDLED / "model.safetensors")
    config = json.loads((BUNDLED / "config.json").read_text())
    config["max_position_embeddings"] = context_length
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    tokenizer_config = json.loads((BUNDLED / "tokenizer_config.json").read_text())
    tokenizer_config["model_max_length"] = context_length
    (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
    return folder
