import torch, transformer_engine.pytorch as te
torch.manual_seed(0)
m = te.ops.Sequential(te.ops.GroupedLinear(4, 256, 128, bias=False, device="cuda", dtype=torch.bfloat16))
x = torch.randn(256, 256, device="cuda", dtype=torch.bfloat16)
for routing in ([64, 64, 64, 64], [0, 256, 0, 0]):
    for p in m.parameters(): p.grad = None
    m(x, torch.tensor(routing, device="cuda")).float().square().sum().backward()
    print("TE alone, routing", routing, "nonzeros in weight0.grad:", torch.count_nonzero(m[0].weight0.grad).item())
