"""duet's point-to-point KV transport: a vLLM KV connector on torch.distributed send/recv.

NCCL between GPUs, gloo between CPU processes, over pairwise process groups that are set up on
demand between one prefill worker and one decode worker. Enable it with the kv_transfer_config
that :func:`duet.kv_transfer.p2p.params.kv_transfer_config` builds.
"""
