"""A thinking variant of the bundled model, built in a temp folder for tests (nothing downloaded).

The bundled tokenizer's reserved special tokens 4 and 5 become ``<think>`` and ``</think>`` (same
ids, so the weights still fit; added tokens that are not special, as in Qwen3's tokenizer), and
the chat template opens a think block in the generation
prompt when ``enable_thinking`` is on (mlx-lm passes ``enable_thinking=True`` to templates of
models with think tokens), as Qwen3's does. The weights are a symlink to the bundled ones.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

BUNDLED = Path(__file__).resolve().parents[1] / "engine" / "bundled" / "fixture-chat-29m-q8"
THINK_START_ID, THINK_END_ID = 4, 5
_RENAMES = {"<|reserved_0|>": "<think>", "<|reserved_1|>": "</think>"}
_TEMPLATE = (
    "{%- for message in messages %}{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
    "'<|im_end|>\\n' }}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking %}{{- '<think>\\n' }}{%- endif %}{%- endif %}")


def make_think_model(folder: Path) -> Path:
    """Write the thinking variant into ``folder`` (created) and return it."""
    folder.mkdir(parents=True, exist_ok=True)
    for name in ("config.json", "generation_config.json", "tokenizer_config.json", "model.safetensors.index.json"):
        shutil.copy(BUNDLED / name, folder / name)
    (folder / "model.safetensors").symlink_to(BUNDLED / "model.safetensors")
    tokenizer = json.loads((BUNDLED / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    for old, new in _RENAMES.items():
        vocab[new] = vocab.pop(old)
    for token in tokenizer["added_tokens"]:
        if token["content"] in _RENAMES:  # added but not special, as Qwen3's think tokens are
            token["content"], token["special"] = _RENAMES[token["content"]], False
    (folder / "tokenizer.json").write_text(json.dumps(tokenizer, ensure_ascii=False))
    (folder / "chat_template.jinja").write_text(_TEMPLATE)
    return folder
