# The ordered top kernel before this session's change (one stage, int64 keys) against the new call, same inputs.
import importlib.util, sys
sys.path.insert(0, "bench")
from common import graph_ms as cuda_ms
from nanovllm.kernels import triton_quest
from nanovllm.layers.sparse_policies import quest_top_reference
spec = importlib.util.spec_from_file_location("old_triton_quest", ".models/run/old30_triton_quest.py")
old = importlib.util.module_from_spec(spec); spec.loader.exec_module(old)
import torch
for batch, context, budget in [(1, 131072, 128), (1, 131072, 256), (4, 131072, 128), (16, 32768, 128),
                               (1, 32768, 128), (1, 1048576, 128), (8, 131072, 128)]:
    cols = context // 16
    scores = torch.randn(batch, 8, cols, device="cuda")
    ends = torch.full((batch,), cols, dtype=torch.int64, device="cuda")
    call = (scores, ends, 16, budget, 16)
    want = quest_top_reference(*call)
    assert torch.equal(old.ordered_top_columns(*call), want)
    assert torch.equal(triton_quest.ordered_top_columns(*call), want)
    t_old = cuda_ms(lambda: old.ordered_top_columns(*call))
    t_new = cuda_ms(lambda: triton_quest.ordered_top_columns(*call))
    t_one = cuda_ms(lambda: triton_quest.ordered_top_columns(*call, stages=1))
    print(f"{batch}x{context} budget {budget}: old {t_old*1e3:.1f} us, new one stage (uint32 keys) {t_one*1e3:.1f} us "
          f"({t_old/t_one:.2f}x), new default {t_new*1e3:.1f} us ({t_old/t_new:.2f}x)", flush=True)
