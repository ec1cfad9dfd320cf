"""The yardstick for NestQuant MoE prefill (issue #12): the same MoE block in BF16 through cuBLAS
(torch.matmul), experts grouped (each expert's tokens in one GEMM), timed with CUDA events on the
GPU machine. Prints microseconds per block and TFLOP/s for DeepSeek-V3 and GLM-5 shapes at 512
and 4096 tokens (top-8 routed uniformly + 1 shared expert), the routing drawn as nq_moe_bench
draws it. Run: python3 bench/gpu/bf16_moe_prefill.py (scripts/device/run_nq_moe.sh does)."""
import torch

dev = torch.device("cuda")
torch.backends.cuda.matmul.allow_tf32 = False


def block(hidden, inter, routed, top_k, tokens, gen):
    experts = routed + 1
    gu = [torch.randn(2 * inter, hidden, dtype=torch.bfloat16, device=dev) * 0.02 for _ in range(experts)]
    dn = [torch.randn(hidden, inter, dtype=torch.bfloat16, device=dev) * 0.02 for _ in range(experts)]
    x = torch.randn(tokens, hidden, dtype=torch.bfloat16, device=dev)
    ids = torch.stack([torch.randperm(routed, generator=gen)[:top_k] for _ in range(tokens)])
    rows = [torch.nonzero((ids == e).any(dim=1)).flatten().to(dev) for e in range(routed)]
    rows.append(torch.arange(tokens, device=dev))  # the shared expert sees every token

    def run():
        out = torch.zeros(tokens, hidden, dtype=torch.float32, device=dev)
        for e in range(experts):
            r = rows[e]
            if r.numel() == 0:
                continue
            h = x.index_select(0, r) @ gu[e].t()
            g, u = h.chunk(2, dim=-1)
            y = (torch.nn.functional.silu(g) * u) @ dn[e].t()
            out.index_add_(0, r, y.float())
        return out

    for _ in range(3):
        run()
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    iters = 10
    s.record()
    for _ in range(iters):
        run()
    e.record()
    torch.cuda.synchronize()
    t = s.elapsed_time(e) / iters * 1e-3
    flops = sum(2 * r.numel() * (2 * inter * hidden + hidden * inter) for r in rows)
    return t, flops


gen = torch.Generator().manual_seed(0)
for name, hidden, inter, routed in [("dsv3", 7168, 2048, 32), ("glm5", 6144, 2048, 256)]:
    for tokens in (512, 4096):
        t, flops = block(hidden, inter, routed, 8, tokens, gen)
        print(f"bf16 grouped MoE {name} T={tokens}: {t*1e6:.1f} us, {flops/t/1e12:.1f} TFLOP/s")
