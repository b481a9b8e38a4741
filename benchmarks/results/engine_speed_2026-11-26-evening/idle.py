"""One prompt of N tokens (max_tokens 1) at a time, after idle gaps of 0-2 s, five rounds: does an engine that was idle prefill slower? (It does not; the times fall in two modes 1.4x apart.)
Usage: python idle.py WORKDIR OUT N
"""
import asyncio, sys, time, json, statistics
from pathlib import Path
import numpy as np
from duet.benchmarks.placement_fidelity import serving
from duet.benchmarks.loadgen import replay
from duet.cluster.placement.trace import Trace
W = Path(sys.argv.pop(1))  # a placement_crossval.py --workdir
OUT=Path(sys.argv[1]); OUT.mkdir(exist_ok=True)
one=Trace('one', np.zeros(1), np.array([int(sys.argv[2])]), np.ones(1, dtype=np.int64))
gaps=[0.0, 0.05, 0.2, 0.8, 2.0]
res={g:[] for g in gaps}
with serving(W/'deploy.yaml', W/'plan.yaml', OUT/'serve.log') as (target, pid):
    seed=1
    for _ in range(3): asyncio.run(replay(target, one, seed=seed)); seed+=1
    for rnd in range(5):
        for g in gaps:
            for k in range(4):
                time.sleep(g)
                r=asyncio.run(replay(target, one, seed=seed))[0]; seed+=1
                res[g].append(r.ttft_s)
        print(rnd, {g: round(1000*statistics.median(v[-4:]),1) for g,v in res.items()}, flush=True)
print('median ms by idle gap before the request:', {g: round(1000*statistics.median(v),1) for g,v in res.items()})
json.dump({str(g):v for g,v in res.items()}, open(OUT/'idle.json','w'))
