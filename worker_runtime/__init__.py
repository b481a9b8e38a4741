"""What runs inside a worker: the vLLM engine core's host and duet's patches to it.

Prefill and decode workers (prefill_worker/, decode_worker/) are Ray actors; each starts a
vLLM engine core process through :mod:`engine_host` (or a SIMULATED engine through
:mod:`simulated_host`, for control-plane scale tests and what-if planning only), and
duet's vLLM plugin (kv_transfer/vllm_plugin.py) installs :mod:`engine_clients` and
:mod:`engine_output` inside that engine core. :mod:`worker_api` is the vocabulary the
serving path (router/) and the control plane (cluster/) share with the workers.
"""
