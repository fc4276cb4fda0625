import os, sys, time, torch, numpy as np
sys.path.insert(0, ".")
from capsule_ros.runtime.hybrid import HybridConfig, HybridPolicy
from capsule_ros.runtime.arena import BufferSpec, BufferKind
from capsule_ros.runtime.engine import PolicyRuntime, RuntimeConfig
det = sys.argv[1] == "1"
torch.manual_seed(0)
inputs=[BufferSpec("joints",(4,),torch.float32,BufferKind.INPUT),BufferSpec("goal",(2,),torch.float32,BufferKind.INPUT)]
cfg=HybridConfig(d_model=1536, layers="RRRA"*6, n_heads=16, n_kv_heads=8, head_dim=128, max_context=2048, rec_heads=24, rec_head_dim=64, d_state=128, mlp_ratio=3.0, vocab_size=32000, dtype="bfloat16", scan_chunk=128)
pol=HybridPolicy(cfg, inputs)
rt=PolicyRuntime(pol, RuntimeConfig(device="cuda", deterministic=det))
s=torch.cuda.Event(enable_timing=True); e=torch.cuda.Event(enable_timing=True)
times=[]
for i in range(30):
    rt.synchronize(); s.record(rt.stream); rt.step(); e.record(rt.stream); e.synchronize(); times.append(s.elapsed_time(e))
print("det", det, "step graph ms p50", np.median(times))
if det:
    from torch.profiler import profile, ProfilerActivity
    with torch.no_grad():
        for _ in range(3): pol.step(rt.arena.views)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            pol.step(rt.arena.views); torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=18, max_name_column_width=70))
    # prefill timing at 2048
    tok=torch.randint(0,32000,(2048,))
    rt.prefill(tok); rt.synchronize()
    ts=[]
    for i in range(5):
        rt.reset(0); s.record(rt.stream); rt.prefill(tok); e.record(rt.stream); e.synchronize(); ts.append(s.elapsed_time(e))
    print("prefill 2048 ms", np.median(ts))
