"""A worker's engine front end in a process of its own, as a front door holds one; driven by
tests/test_engine_clients.py over its standard input and output.

``python tests/engine_client_process.py CLIENT COUNT [ADDRESSES_JSON]`` listens (on free
loopback ports, or on the given addresses, as a replacement front door does), prints its
addresses as JSON, then reads a pickled vLLM config's path and a request (JSON: prompt token
ids, max_tokens) from standard input, connects to the engine core as its client ``CLIENT`` of
``COUNT``, and prints each chunk's token ids as a JSON line, then ``done`` (each line behind
:data:`PREFIX`).
"""

from __future__ import annotations

import asyncio
import json
import pickle
import sys

from duet.config import KVTransferConfig
from duet.worker_runtime.worker_api import EngineAddresses, SamplingSpec
from duet.router.engine_front_end import EngineFrontEnd, FrontEndListeners


# Marks this protocol's lines among vLLM's log lines, which go to standard output too.
PREFIX = "duet-client: "


def _say(line: str) -> None:
    print(PREFIX + line, flush=True)


async def _stream(listeners: FrontEndListeners, client: tuple[int, int]) -> None:
    with open(sys.stdin.readline().strip(), "rb") as config_file:
        vllm_config = pickle.load(config_file)
    request = json.loads(sys.stdin.readline())
    front_end = await EngineFrontEnd.connect("worker", None, vllm_config, listeners, KVTransferConfig(), client=client)
    _say("connected")
    sampling = SamplingSpec(max_tokens=request["max_tokens"], ignore_eos=True)
    async for chunk in front_end.decode(request["id"], request["prompt"], sampling, None, None, ""):
        _say(json.dumps(chunk.token_ids))
    _say("done")
    front_end.close()


def main() -> None:
    client = (int(sys.argv[1]), int(sys.argv[2]))
    if len(sys.argv) > 3:
        listeners = FrontEndListeners.rebind(EngineAddresses(**json.loads(sys.argv[3])))
    else:
        listeners = FrontEndListeners.bind("127.0.0.1")
    _say(json.dumps({"input": listeners.addresses.input, "output": listeners.addresses.output}))
    asyncio.run(_stream(listeners, client))


if __name__ == "__main__":
    main()
