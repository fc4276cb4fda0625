import os, sys, time, json, torch, numpy as np
sys.path.insert(0, ".")
from capsule_ros.runtime.hybrid import HybridConfig, HybridPolicy
from capsule_ros.runtime.arena import BufferSpec, BufferKind
from capsule_ros.runtime.engine import PolicyRuntime, RuntimeConfig
from capsule_ros.capsules.store import CapsuleStore, CapsuleStoreConfig, Tier
print(torch.__version__, torch.cuda.get_device_name())
torch.manual_seed(0)
inputs=[BufferSpec("joints",(4,),torch.float32,BufferKind.INPUT),BufferSpec("goal",(2,),torch.float32,BufferKind.INPUT)]
for cfg in [HybridConfig(vocab_size=100), HybridConfig(d_model=1536, layers="RRRA"*6, n_heads=16, n_kv_heads=8, head_dim=128, max_context=2048, rec_heads=24, rec_head_dim=64, d_state=128, mlp_ratio=3.0, vocab_size=32000, dtype="bfloat16", scan_chunk=128)]:
    pol=HybridPolicy(cfg, inputs)
    print("params", sum(p.numel() for p in pol.parameters())/1e6, "M")
    t=time.time(); rt=PolicyRuntime(pol, RuntimeConfig(device="cuda", debug_checks=True)); print("init s", time.time()-t, "captured", rt.plan.captured, "nbytes", rt.layout.nbytes/2**20)
    store=CapsuleStore(rt.layout.nbytes, rt.fingerprint, rt.device, CapsuleStoreConfig(device_budget_mb=2048, host_budget_mb=1024))
    rng=np.random.default_rng(0); obs=rng.normal(size=(300,6)).astype(np.float32)
    def run(a,b):
        out=[]
        for i in range(a,b):
            rt.staging["joints"][:]=obs[i,:4]; rt.staging["goal"][:]=obs[i,4:]; rt.load_inputs(); rt.step(); out.append(rt.read_outputs().action)
        return np.array(out)
    t=time.time(); tok=torch.randint(0,cfg.vocab_size,(1024,)); rt.prefill(tok); rt.synchronize(); print("prefill first (capture) s", time.time()-t)
    run(0,20)
    c=store.snapshot(rt, episode_id=0, step=20)
    ref=run(20,120)
    store.restore(c.id, rt)
    again=run(20,120)
    print("identical", np.array_equal(ref.view(np.uint32), again.view(np.uint32)))
    h=store.move(c.id, Tier.HOST); store.restore(c.id, rt); again2=run(20,120); print("identical via host", np.array_equal(ref.view(np.uint32), again2.view(np.uint32)))
    # timing
    s=torch.cuda.Event(enable_timing=True); e=torch.cuda.Event(enable_timing=True)
    times=[]
    for i in range(50):
        rt.synchronize(); s.record(rt.stream); rt.step(); e.record(rt.stream); e.synchronize(); times.append(s.elapsed_time(e))
    print("step graph ms p50", np.median(times))
    store.move(c.id, Tier.DEVICE)
    for i in range(30): store.restore(c.id, rt)
    torch.cuda.synchronize(); store.flush_timings(); print("restore ms", store.restore_latency.percentiles_ms(50,99))
    dst=torch.empty_like(rt.arena.storage); ts=[]
    for i in range(30):
        s.record(); dst.copy_(rt.arena.storage); e.record(); e.synchronize(); ts.append(s.elapsed_time(e))
    print("plain copy ms", np.median(ts))
    del rt, store, pol; torch.cuda.empty_cache()
