import os, sys, time, torch, numpy as np
sys.path.insert(0, ".")
from capsule_ros.runtime.hybrid import HybridConfig, HybridPolicy
from capsule_ros.runtime.arena import BufferSpec, BufferKind
from capsule_ros.runtime.engine import PolicyRuntime, RuntimeConfig
from torch.profiler import profile, ProfilerActivity
torch.manual_seed(0)
inputs=[BufferSpec("joints",(4,),torch.float32,BufferKind.INPUT),BufferSpec("goal",(2,),torch.float32,BufferKind.INPUT)]
cfg=HybridConfig(d_model=1536, layers="RRRA"*6, n_heads=16, n_kv_heads=8, head_dim=128, max_context=16384, rec_heads=24, rec_head_dim=64, d_state=128, mlp_ratio=3.0, vocab_size=32000, dtype="bfloat16", scan_chunk=128)
pol=HybridPolicy(cfg, inputs)
rt=PolicyRuntime(pol, RuntimeConfig(device="cuda"))
s=torch.cuda.Event(enable_timing=True); e=torch.cuda.Event(enable_timing=True)
def time_step(n=30):
    ts=[]
    for i in range(n):
        rt.synchronize(); s.record(rt.stream); rt.step(); e.record(rt.stream); e.synchronize(); ts.append(s.elapsed_time(e))
    return np.median(ts)
print("step graph ms p50", time_step())
with torch.no_grad():
    for _ in range(2): pol.step(rt.arena.views)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        pol.step(rt.arena.views); torch.cuda.synchronize()
ka=prof.key_averages(); print("kernels per step", sum(k.count for k in ka if k.device_type.name=="CUDA"))
print(ka.table(sort_by="cuda_time_total", row_limit=12, max_name_column_width=60))
for P in (2048, 16384):
    tok=torch.randint(0,32000,(P,))
    rt.reset(0); rt.prefill(tok); rt.synchronize()
    ts=[]
    for i in range(3):
        rt.reset(0); s.record(rt.stream); rt.prefill(tok); e.record(rt.stream); e.synchronize(); ts.append(s.elapsed_time(e))
    print("prefill", P, "ms", np.median(ts))
with torch.no_grad():
    tok=torch.randint(0,32000,(2048,),device="cuda")
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        pol.prefill(rt.arena.views, tok); torch.cuda.synchronize()
print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=15, max_name_column_width=60))
