"""The speed probe's decode batch six times: TPOT predicted, at the router, at the client and by the decode engine's own clock.
Usage: python dprobe.py WORKDIR OUT
"""
import asyncio, sys, time, urllib.request, yaml
from pathlib import Path
import numpy as np
from duet.benchmarks.placement_fidelity import serving, deployed_sim_config
from duet.benchmarks.loadgen import replay
from duet.benchmarks.speed_probe import DECODE_PROBE, simulated
from duet.cluster.placement.cluster_spec import ClusterSpec
from duet.cluster.placement.plan import Plan
W = Path(sys.argv.pop(1))  # a placement_crossval.py --workdir
OUT=Path(sys.argv[1]); OUT.mkdir(exist_ok=True)
cfg=yaml.safe_load((W/'deploy.yaml').read_text()); mport=cfg['server']['metrics_port']
cluster=ClusterSpec.load(W/'cluster-host.yaml'); plan=Plan.load(W/'plan.yaml'); sim=deployed_sim_config()
pred=simulated(cluster, plan, DECODE_PROBE, sim).tpot_s
eng=ClusterSpec.load(W/'cluster-host.yaml')
def metrics():
    out={}
    for line in urllib.request.urlopen(f'http://127.0.0.1:{mport}/metrics').read().decode().splitlines():
        if line.startswith('vllm:') and 'role="decode"' in line and ('_sum{' in line or '_count{' in line):
            k,v=line.rsplit(' ',1); out[k.split('{')[0]]=float(v)
    return out
with serving(W/'deploy.yaml', W/'plan.yaml', OUT/'serve.log') as (target, pid):
    asyncio.run(replay(target, DECODE_PROBE, seed=1))
    for i in range(6):
        time.sleep(1)
        m0=metrics(); recs=asyncio.run(replay(target, DECODE_PROBE, seed=10+i)); m1=metrics()
        d={k:m1[k]-m0.get(k,0) for k in m1}
        eng_tpot=d['vllm:request_time_per_output_token_seconds_sum']/d['vllm:request_time_per_output_token_seconds_count']
        decode_t=d['vllm:request_decode_time_seconds_sum']/d['vllm:request_decode_time_seconds_count']
        router=np.median([r.tpot_s for r in recs]); client=np.median([r.client_tpot_s for r in recs])
        print(f'pred {np.median(pred)*1000:.2f}  router {router*1000:.2f}  client {client*1000:.2f}  engine tpot {eng_tpot*1000:.2f}  engine decode_time/63 {decode_t/63*1000:.2f} ms', flush=True)
