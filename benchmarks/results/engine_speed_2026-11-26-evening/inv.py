"""Replay the first N requests of the development slice at RATE on the deployment of a cross-validation workdir, with speed probes before and after; print each request's measured TTFT beside the simulator's, with the profile as made and scaled to the probes.
Usage: python inv.py WORKDIR OUT RATE N
"""
import asyncio, json, re, sys, time, urllib.request
from pathlib import Path
import numpy as np, yaml
from duet.benchmarks.placement_fidelity import serving, deployed_sim_config
from duet.benchmarks.placement_crossval import capped_trace
from duet.benchmarks.loadgen import replay
from duet.benchmarks.speed_probe import probe_speed, simulated
from duet.cluster.placement.cluster_spec import ClusterSpec
from duet.cluster.placement.latency_model import LatencyModel
from duet.cluster.placement.plan import Plan
from duet.benchmarks.placement_fidelity import write_cluster

W = Path(sys.argv.pop(1))  # a placement_crossval.py --workdir
OUT = Path(sys.argv[1]); OUT.mkdir(exist_ok=True)
rate = float(sys.argv[2]); n = int(sys.argv[3])
cfg = yaml.safe_load((W/'deploy.yaml').read_text()); mport = cfg['server']['metrics_port']
cluster = ClusterSpec.load(W/'cluster-host.yaml'); plan = Plan.load(W/'plan.yaml'); sim = deployed_sim_config()
host = LatencyModel.load(W/'profile-host.yaml')
trace = capped_trace('azure-conv', 1800, 96).window(0, n).at_rate(rate)

def metrics():
    text = urllib.request.urlopen(f'http://127.0.0.1:{mport}/metrics').read().decode()
    out = {}
    for line in text.splitlines():
        if line.startswith('vllm:') and ('_sum{' in line or '_count{' in line or '_total{' in line):
            name, val = line.rsplit(' ', 1)
            out[name] = float(val)
    return out

with serving(W/'deploy.yaml', W/'plan.yaml', OUT/'serve.log') as (target, pid):
    asyncio.run(replay(target, capped_trace('azure-conv',1800,96).window(300, 30).at_rate(2.0), model=cluster.model, seed=5))
    time.sleep(3)
    seed = 100
    before = probe_speed(target, cluster.model, cluster, plan, sim, seed); seed += 2
    m0 = metrics(); t0 = time.time()
    recs = asyncio.run(replay(target, trace, model=cluster.model, seed=seed)); seed += 2
    t1 = time.time(); m1 = metrics()
    time.sleep(3)
    after = probe_speed(target, cluster.model, cluster, plan, sim, seed)
f = (before.prefill*after.prefill)**.5, (before.decode*after.decode)**.5
print('probe before', before, 'after', after, 'wall', round(t1-t0,2))
scaled = host.scaled(*f); scaled.save(OUT/'scaled.yaml'); cs = ClusterSpec.load(write_cluster(OUT/'cluster-scaled.yaml', OUT/'scaled.yaml'))
p0 = simulated(cluster, plan, trace, sim); p1 = simulated(cs, plan, trace, sim)
print('delta metrics (prefill role):')
for k in sorted(m1):
    if 'prefill' in k and (m1[k]-m0.get(k,0)) and ('_sum' in k or '_count' in k):
        print(f'  {m1[k]-m0.get(k,0):10.3f} {k}')
rows=[]
for i,r in enumerate(recs):
    rows.append(dict(i=i, arr=float(trace.arrival_s[i]), n=int(trace.input_len[i]), ttft=r.ttft_s, cttft=r.client_ttft_s, p=float(p0.ttft_s[i]), ps=float(p1.ttft_s[i]), tpot=r.tpot_s, ptpot=float(p1.tpot_s[i]), err=r.error))
    print(f"{i:3d} {trace.arrival_s[i]:6.2f} {trace.input_len[i]:5d}  meas {r.ttft_s:6.3f}  pred {p0.ttft_s[i]:6.3f} scaled {p1.ttft_s[i]:6.3f}   tpot {r.tpot_s*1000:5.1f} / {p1.tpot_s[i]*1000:5.1f}")
json.dump(dict(before=before.__dict__, after=after.__dict__, rows=rows, m0=m0, m1=m1), open(OUT/'inv.json','w'))
