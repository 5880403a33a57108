import time, torch
cudnn = torch.ops.aten._scaled_dot_product_cudnn_attention.default
def call(C, S, causal):
    q = torch.randn(1, C, 32, 128, dtype=torch.bfloat16, device="cuda").transpose(1, 2)
    k = torch.randn(1, S, 8, 128, dtype=torch.bfloat16, device="cuda").transpose(1, 2)
    torch.cuda.synchronize(); t = time.perf_counter()
    cudnn(q, k, k, None, True, 0.0, causal, False, scale=0.1); torch.cuda.synchronize()
    return 1e3 * (time.perf_counter() - t)
call(64, 64, True)
for C, S, causal in [(8192, 8192, True), (8192, 8192, True), (8192, 16384, False), (8192, 16384, False), (8000, 16000, False),
                     (8192, 24576, False), (1000, 3000, False), (1000, 3000, False), (1000, 3001, False), (1001, 3001, False)]:
    print(C, S, causal, f"{call(C, S, causal):.1f} ms", flush=True)
