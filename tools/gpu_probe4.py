import os, sys, time, torch, numpy as np
sys.path.insert(0, ".")
from capsule_ros.runtime.hybrid import HybridConfig, HybridPolicy
from capsule_ros.runtime.arena import BufferSpec, BufferKind
from capsule_ros.runtime.engine import PolicyRuntime, RuntimeConfig
from capsule_ros.capsules.store import CapsuleStore, CapsuleStoreConfig
mode = sys.argv[1]
torch.manual_seed(0)
inputs=[BufferSpec("joints",(4,),torch.float32,BufferKind.INPUT),BufferSpec("goal",(2,),torch.float32,BufferKind.INPUT)]
cfg=HybridConfig(d_model=1536, layers="RRRA"*6, n_heads=16, n_kv_heads=8, head_dim=128, max_context=16384, rec_heads=24, rec_head_dim=64, d_state=128, mlp_ratio=3.0, vocab_size=32000, dtype="bfloat16", scan_chunk=128)
pol=HybridPolicy(cfg, inputs)
t0=time.time(); rt=PolicyRuntime(pol, RuntimeConfig(device="cuda", compile=mode)); print(mode, "init s", round(time.time()-t0,1), flush=True)
s=torch.cuda.Event(enable_timing=True); e=torch.cuda.Event(enable_timing=True)
def time_step(n=30):
    ts=[]
    for i in range(n):
        rt.synchronize(); s.record(rt.stream); rt.step(); e.record(rt.stream); e.synchronize(); ts.append(s.elapsed_time(e))
    return np.median(ts)
print(mode, "step@pos small ms", time_step())
for P in (2048, 16384):
    tok=torch.randint(0,32000,(P,))
    t0=time.time(); rt.reset(0); rt.prefill(tok); rt.synchronize(); print(mode, "first prefill", P, "s", round(time.time()-t0,1), flush=True)
    ts=[]
    for i in range(3):
        rt.reset(0); s.record(rt.stream); rt.prefill(tok); e.record(rt.stream); e.synchronize(); ts.append(s.elapsed_time(e))
    print(mode, "prefill", P, "ms", np.median(ts), "step after ms", time_step(10), flush=True)
store=CapsuleStore(rt.layout.nbytes, rt.fingerprint, rt.device, CapsuleStoreConfig(device_budget_mb=2048, host_budget_mb=0))
rng=np.random.default_rng(0); obs=rng.normal(size=(300,6)).astype(np.float32)
def run(a,b):
    out=[]
    for i in range(a,b):
        rt.staging["joints"][:]=obs[i,:4]; rt.staging["goal"][:]=obs[i,4:]; rt.load_inputs(); rt.step(); out.append(rt.read_outputs().action)
    return np.array(out)
rt.reset(0); rt.prefill(torch.arange(2048)%32000); run(0,5); c=store.snapshot(rt, episode_id=0, step=5); ref=run(5,60); store.restore(c.id, rt); again=run(5,60)
print(mode, "identical after restore", np.array_equal(ref.view(np.uint32), again.view(np.uint32)), ref[-1])
