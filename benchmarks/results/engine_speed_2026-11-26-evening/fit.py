"""For inv.py's output: the simulator's TTFT for those requests with the prefill profile scaled by 0.7-1.2, with and without the serving path (which speed would explain the replay).
Usage: python fit.py WORKDIR OUT RATE N
"""
import json, sys, numpy as np
from pathlib import Path
from duet.benchmarks.placement_fidelity import deployed_sim_config, write_cluster
from duet.benchmarks.placement_crossval import capped_trace
from duet.benchmarks.speed_probe import simulated
from duet.cluster.placement.cluster_spec import ClusterSpec
from duet.cluster.placement.latency_model import LatencyModel, ServingPathCost
from duet.cluster.placement.plan import Plan
import dataclasses
W = Path(sys.argv.pop(1))  # a placement_crossval.py --workdir
R=Path(sys.argv[1]); rate=float(sys.argv[2]); n=int(sys.argv[3])
d=json.load(open(R/'inv.json')); rows=d['rows']
meas=np.array([r['ttft'] for r in rows])
plan=Plan.load(W/'plan.yaml'); sim=deployed_sim_config()
host=LatencyModel.load(W/'profile-host.yaml')
print('serving path', host.serving_path)
trace=capped_trace('azure-conv',1800,96).window(0,n).at_rate(rate)
def run(model, tag):
    model.save(R/f'{tag}.yaml'); cs=ClusterSpec.load(write_cluster(R/f'c-{tag}.yaml', R/f'{tag}.yaml'))
    return simulated(cs, plan, trace, sim)
for label, base in (('as shipped', host), ('engine only', dataclasses.replace(host, serving_path=ServingPathCost()))):
    for f in (0.7,0.8,0.9,1.0,1.1,1.2):
        p=run(base.scaled(f,1.0),'x').ttft_s
        e=np.log(p/meas)
        print(f'{label:11s} f={f:.1f} median log err {np.median(e):+.3f} mean abs {np.mean(abs(e)):.3f}  p50 {np.median(p):.3f} vs {np.median(meas):.3f}  p90 {np.percentile(p,90):.3f} vs {np.percentile(meas,90):.3f}')
