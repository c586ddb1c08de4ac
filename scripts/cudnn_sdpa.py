# The peer of kvq's bf16 decode at B=64 L=16k (Llama-3-8B heads): torch's cuDNN SDPA, dense, q_len 1.
# Prints its median time (256 MiB flush between runs, CUDA events) and ends with one call inside an
# NVTX range "prof", so that ncu can profile that call alone (docs/PERFORMANCE.md, v11):
#   ncu --set full --nvtx --nvtx-include "prof/" -o cudnn python3 scripts/cudnn_sdpa.py
import sys, torch, torch.nn.functional as F
from torch.nn.attention import sdpa_kernel, SDPBackend
B, HQ, HKV, L, D = 64, 32, 8, 16384, 128
dev = "cuda"
q = torch.randn(B, HQ, 1, D, device=dev, dtype=torch.bfloat16)
k = torch.randn(B, HKV, L, D, device=dev, dtype=torch.bfloat16)
v = torch.randn(B, HKV, L, D, device=dev, dtype=torch.bfloat16)
flush = torch.empty(256 << 20, device=dev, dtype=torch.uint8)
def run():
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
try:
    run(); torch.cuda.synchronize()
except Exception as e:  # no GQA in this backend: 32 KV heads at B=16 read the same bytes
    print("GQA failed:", e, file=sys.stderr)
    B, HKV = 16, 32
    q = torch.randn(B, HQ, 1, D, device=dev, dtype=torch.bfloat16)
    k = torch.randn(B, HKV, L, D, device=dev, dtype=torch.bfloat16)
    v = torch.randn(B, HKV, L, D, device=dev, dtype=torch.bfloat16)
    run(); torch.cuda.synchronize()
ts = []
for i in range(12):
    flush.zero_(); e0 = torch.cuda.Event(enable_timing=True); e1 = torch.cuda.Event(enable_timing=True)
    e0.record(); run(); e1.record(); torch.cuda.synchronize(); ts.append(e0.elapsed_time(e1) * 1e3)
ts.sort()
print(f"cudnn sdpa B={B} HKV={HKV} L={L}: median {ts[len(ts)//2]:.1f} us, {2*B*HKV*L*D*2/ts[len(ts)//2]/1e3:.0f} GB/s")
torch.cuda.nvtx.range_push("prof"); flush.zero_(); run(); torch.cuda.synchronize(); torch.cuda.nvtx.range_pop()
