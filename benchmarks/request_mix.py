"""Request mixes for ``duet bench serve --mix``: what each replayed request asks for beyond a
greedy completion, as an OpenAI body's fields and as the gRPC request's.

- ``plain``: greedy completions only (the default, as before);
- ``features``: a third each of logprobs with two alternatives, presence/frequency/repetition
  penalties, and a structured-output regex: the request kinds applications send that make the
  serving path do more work per token (rendering logprobs, compiling and applying a grammar),
  for comparing CPU per streamed token with vLLM's server on the same requests.

The regex never finishes before ``max_tokens``, so every request streams the trace's output
length, as ``ignore_eos`` makes the plain ones do.
"""

from __future__ import annotations

from typing import Any

from duet.router.proto import duet_api_pb2 as pb

_LONG_TEXT = "[a-z ]{1,100000}"
MIXES: dict[str, list[dict[str, Any]]] = {
    "plain": [{}],
    "features": [
        {"logprobs": 2},
        {"presence_penalty": 0.5, "frequency_penalty": 0.5, "repetition_penalty": 1.1},
        {"structured_outputs": {"regex": _LONG_TEXT}},
    ],
}


def openai_fields(mix: str, index: int) -> dict[str, Any]:
    """The OpenAI body fields of request ``index`` of a replay with ``mix``."""
    kinds = MIXES[mix]
    return dict(kinds[index % len(kinds)])


def grpc_fields(mix: str, index: int) -> dict[str, Any]:
    """The same request's ``build_request`` keywords for duet's gRPC API."""
    fields = openai_fields(mix, index)
    structured = fields.pop("structured_outputs", None)
    if structured is not None:
        fields["structured_output"] = pb.StructuredOutput(regex=structured["regex"])
    return fields
