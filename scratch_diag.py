import sys, gc, warnings
sys.path.insert(0, "tests")
import torch, memcompile
from memcompile import zoo
from helpers import train
torch.cuda.memory._record_memory_history(max_entries=100000)
def active():
    snap = torch.cuda.memory._snapshot()
    out = {}
    for seg in snap["segments"]:
        for b in seg["blocks"]:
            if b["state"] == "active_allocated":
                out[b["address"]] = b
    return out
eager = zoo.build("gpt_manual", size="tiny").to("cuda"); train(eager, eager.model, "sgd", 3)
wl = zoo.build("gpt_manual", size="tiny").to("cuda")
c = memcompile.compile(wl.model); wl.loss(c, 0).backward()
rep = memcompile.report(c)
budget = int(rep.resident_bytes + 0.9 * (rep.predicted_peak - rep.resident_bytes))
print("after first compiled step", torch.cuda.memory_allocated()); del c, wl; torch._dynamo.reset(); gc.collect(); print("after del", torch.cuda.memory_allocated())
for a, b in active().items():
    if b["size"] >= 500000: print("  live", b["size"], [f"{f['filename'].split('/')[-1]}:{f['line']}:{f['name']}" for f in b.get("frames", [])][:30])
comp = zoo.build("gpt_manual", size="tiny").to("cuda")
compiled = memcompile.compile(comp.model)
opt = torch.optim.SGD(comp.model.parameters(), lr=0.1)
warnings.simplefilter("always")
before = None
for step in range(3):
    opt.zero_grad(set_to_none=True)
    now = active()
    if before is not None:
        new = [b for a, b in now.items() if a not in before]
        print("step", step, "allocated", torch.cuda.memory_allocated(), "new blocks", len(new), sum(b["size"] for b in new))
        for b in sorted(new, key=lambda b: -b["size"])[:6]:
            fr = [f"{f['filename'].split('/')[-1]}:{f['line']}:{f['name']}" for f in b.get("frames", [])][:40]
            print("  ", b["size"], fr)
    before = now
    loss = comp.loss(compiled, step); loss.backward(); opt.step()
print("plan resident", memcompile.report(compiled).plan.fragments[0].resident_bytes)
