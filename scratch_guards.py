import logging, time, torch, fp8func as f8
from torch import nn
from fp8func.bench._linear import torchao_linear, _fwd_bwd
torch._logging.set_logs(guards=True)
m,k,n=4096,1024,1024
x=torch.randn(m,k,device="cuda",dtype=torch.bfloat16,requires_grad=True); dy=torch.randn(m,n,device="cuda",dtype=torch.bfloat16)
def lin(): torch.manual_seed(0); return nn.Linear(k,n,bias=False,device="cuda",dtype=torch.bfloat16)
for name, mod in {"torchao": torch.compile(torchao_linear(lin(),"tensorwise")),
 "fp8func": torch.compile(f8.nn.Fp8Linear.from_linear(lin(), f8.Recipe.from_name("tensorwise"), fsdp_fp8_all_gather=False), fullgraph=True)}.items():
    print("=====", name, flush=True)
    step=_fwd_bwd(mod,x,dy)
    for _ in range(3): step()
    torch.cuda.synchronize()
