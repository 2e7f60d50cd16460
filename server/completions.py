"""``/v1/completions``: one job per prompt, with its echo and, with ``echo`` and ``logprobs``, its
prompt's log-probabilities.

``prompt`` may be one prompt (a string or a list of token ids) or a list of them; prompt k's
``n`` choices are indexed ``k*n .. k*n + n - 1`` (OpenAI's order), each prompt runs as its own
engine request, and usage sums over the prompts. With ``echo`` and ``logprobs`` the engine
scores every prompt token (``SamplingParams.prompt_logprobs``): the choice's logprobs then start
with the prompt's tokens, the first with ``null`` (nothing predicts it), as OpenAI and vLLM
report them, and ``max_tokens`` may be 0 (the prompt scored, nothing generated). Such requests
are not served from the prefix cache (a cached prefix has no logits): their prompt is computed
in full, and its blocks are cached for others.
"""

from __future__ import annotations

from dataclasses import replace

from engine import EngineClient, ModelInfo
from server.chat import sampling_params
from server.protocol import CompletionRequest
from server.streaming import Job
from server.tools import structured_params


def prompt_texts(body: CompletionRequest) -> list[str | None]:
    """Each prompt's own text (None for a prompt of token ids), in ``completion_prompts``' order."""
    prompt = body.prompt
    if isinstance(prompt, str):
        return [prompt]
    if prompt and isinstance(prompt[0], (str, list)):
        return [p if isinstance(p, str) else None for p in prompt]
    return [None]


async def completion_jobs(body: CompletionRequest, client: EngineClient, info: ModelInfo, prompts: list[list[int]],
                          system_fingerprint: str) -> list[Job]:
    """The jobs of a completions request, one per prompt (``server.chat.completion_prompts``).
    A prompt's ``SamplingParams`` differ only where its length does (the context check, the
    default ``max_tokens``); a response_format or guided_* constraint is compiled once."""
    scored = body.logprobs if body.echo and body.logprobs is not None else None
    params = [sampling_params(body, len(ids), info, default_max_tokens=16, logprobs=body.logprobs is not None,
                              top_logprobs=body.logprobs or 0, max_tokens=body.max_tokens, prompt_logprobs=scored)
              for ids in prompts]
    first = await structured_params(body, client, params[0])
    params = [first, *(replace(p, constraint=first.constraint) for p in params[1:])]
    base = Job("completion", info.model_id, prompts[0], first, system_fingerprint,
               include_usage=bool(body.stream_options and body.stream_options.include_usage), n=body.n,
               cache_salt=body.salt())
    jobs = []
    for k, (ids, text, p) in enumerate(zip(prompts, prompt_texts(body), params)):
        echo = (text if text is not None else client.text_of(ids)) if body.echo else ""
        jobs.append(replace(base, prompt_ids=ids, params=p, echo_text=echo, prompt_index=k))
    return jobs
