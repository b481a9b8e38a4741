"""A request that continues where an earlier round of it stopped keeps its sampling state.

duet continues a request on another engine when its worker dies, its front door dies (the
client resumes with ``resume_after``), or it moves by live migration: the new round's prompt is
the request's prompt followed by the tokens already streamed (router/lifecycle.py). To vLLM
those tokens would be prompt, which silently changes what depends on the generated tokens:

- presence and frequency penalties count generated tokens only, and ``bad_words`` matches
  against them;
- ``min_tokens`` counts them (the router sends what is left, the logits processor counts here);
- a structured-output grammar must have consumed them before it constrains the next token;
- a seeded request's random stream has drawn once per generated token.

The router marks such a round with ``extra_args["duet_resumed_tokens"] = k``: the last ``k``
prompt tokens were generated. In the engine process this module makes the round's state what a
single unbroken engine's would be:

- the model runner's copy of the request holds them as output, with ``min_tokens`` restored to
  the request's own (the scheduler's copy, which only counts new tokens against what is left of
  ``max_tokens``, keeps them as prompt, so vLLM's own checks of length and stop tokens hold; the
  runner's per-step alignment to the scheduler's count is told of them);
- its seeded generator draws ``k`` times through the runner's own sampler before its first
  token, as it would have while generating them;
- its grammar accepts them as soon as it is compiled, before its first bitmask.

Installed by duet's vLLM plugin in every duet engine process (kv_transfer/vllm_plugin.py).
"""

from __future__ import annotations

import copy
import logging
from typing import Any

logger = logging.getLogger(__name__)

RESUMED_TOKENS = "duet_resumed_tokens"


def resumed_tokens(sampling_params: Any) -> int:
    """How many of the request's last prompt tokens an earlier round generated (0: none)."""
    extra = getattr(sampling_params, "extra_args", None) or {}
    return int(extra.get(RESUMED_TOKENS, 0))


def _split_resumed_state(state: Any) -> None:
    """The runner's state of a resumed round: its last ``k`` prompt tokens as output (penalties,
    bad words and ``min_tokens`` count them), ``min_tokens`` the request's own (the router
    sent what was left of it), and ``k`` generator draws owed."""
    k = resumed_tokens(state.sampling_params)
    if k <= 0 or state.output_token_ids or state.prompt_token_ids is None:
        return
    prompt = state.prompt_token_ids
    state.prompt_token_ids, state.output_token_ids = prompt[:-k], list(prompt[-k:])
    state.num_prompt_tokens -= k
    # A copy: with the one-process executor the scheduler's request holds the same object.
    state.sampling_params = copy.copy(state.sampling_params)
    state.sampling_params.min_tokens += k
    state.duet_draws_owed = k if state.generator is not None else 0
    state.duet_resumed = k


def _pay_draws(runner: Any, state: Any) -> None:
    """Advance a resumed round's generator as ``k`` sampling steps would have, through the
    runner's own sampler (CPU and GPU samplers draw differently)."""
    owed = getattr(state, "duet_draws_owed", 0)
    if not owed:
        return
    import torch

    logits = torch.zeros((1, runner.input_batch.vocab_size), dtype=torch.float32, device=runner.device)
    for _ in range(owed):
        runner.sampler.topk_topp_sampler(logits.clone(), {0: state.generator}, None, None)
    state.duet_draws_owed = 0


def _grammar_catch_up(structured: Any) -> None:
    """Feed a resumed round's generated tokens to its grammar once compiled."""
    pending = getattr(structured, "duet_resumed", None)
    grammar = structured._grammar
    if not pending or grammar is None or isinstance(grammar, Exception):
        return
    request_id, tokens = pending
    structured.duet_resumed = None
    if not grammar.accept_tokens(request_id, tokens):
        logger.warning("request %s: its %d resumed tokens do not fit its grammar", request_id, len(tokens))
        structured._grammar = ValueError("the tokens already generated do not fit the request's grammar")


def install() -> None:
    """Patch vLLM's model runner state, request and structured-output request (idempotent)."""
    from vllm.v1.request import Request
    from vllm.v1.structured_output.request import StructuredOutputRequest
    from vllm.v1.worker.gpu_input_batch import CachedRequestState
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    if getattr(CachedRequestState, "_duet_resumed", False):
        return
    CachedRequestState._duet_resumed = True  # type: ignore[attr-defined]

    post_init = CachedRequestState.__post_init__

    def post_init_resumed(self: Any) -> None:
        post_init(self)
        _split_resumed_state(self)

    CachedRequestState.__post_init__ = post_init_resumed  # type: ignore[method-assign]

    update_states = GPUModelRunner._update_states

    def update_states_paying_draws(self: Any, scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
        # The scheduler counts a resumed round's output from its start; the runner aligns its
        # output list to that count every step, which would drop the resumed tokens.
        cached = scheduler_output.scheduled_cached_reqs
        resumed = [
            (index, k) for index, request_id in enumerate(cached.req_ids)
            if (k := getattr(self.requests.get(request_id), "duet_resumed", 0))
        ]
        for index, k in resumed:
            cached.num_output_tokens[index] += k
        try:
            result = update_states(self, scheduler_output, *args, **kwargs)
        finally:
            for index, k in resumed:
                cached.num_output_tokens[index] -= k
            cached.__dict__.pop("_req_id_to_num_output_tokens", None)  # a cache of the counts
        for new_request in scheduler_output.scheduled_new_reqs:
            state = self.requests.get(new_request.req_id)
            if state is not None:
                _pay_draws(self, state)
        return result

    GPUModelRunner._update_states = update_states_paying_draws  # type: ignore[method-assign]

    request_init = Request.__init__

    def request_init_resumed(self: Any, *args: Any, **kwargs: Any) -> None:
        request_init(self, *args, **kwargs)
        k = resumed_tokens(self.sampling_params)
        if k > 0 and self.structured_output_request is not None:
            self.structured_output_request.duet_resumed = (self.request_id, list(self.prompt_token_ids[-k:]))

    Request.__init__ = request_init_resumed  # type: ignore[method-assign]

    check_completion = StructuredOutputRequest._check_grammar_completion

    def check_completion_catching_up(self: Any) -> bool:
        ready = check_completion(self)
        if ready:
            _grammar_catch_up(self)
        return ready

    StructuredOutputRequest._check_grammar_completion = check_completion_catching_up  # type: ignore[method-assign]
