"""One rank of gdnkit.distributed.prefill over NCCL, run by test_gpu.py under torchrun: every rank draws the same
problem, runs the whole prefill on its GPU alone and its piece of the split one, and checks its rows of o (and the
last rank the final states) against the whole prefill's."""

import os
import sys

import torch
import torch.distributed as dist

import gdnkit
import gdnkit.distributed

from reference import rel


def main() -> int:
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(rank % torch.cuda.device_count())
    dev = torch.device("cuda", torch.cuda.current_device())
    g = torch.Generator(device="cpu").manual_seed(1234)
    lens = [9000, 700]
    H, HV, K, V = 2, 8, 128, 128
    T = sum(lens)
    cu = torch.tensor([0, lens[0], T], dtype=torch.int32)

    def randn(*shape):
        return torch.randn(*shape, generator=g).to(torch.bfloat16).to(dev)

    q, k, v, a, b = randn(T, H, K), randn(T, H, K), randn(T, HV, V), randn(T, HV), randn(T, HV)
    A_log = torch.log(torch.rand(HV, generator=g) * 15 + 1).to(dev)
    dt_bias = (0.5 * torch.randn(HV, generator=g)).to(dev)
    pool = (0.1 * torch.randn(3, HV, V, K, generator=g)).to(dev)
    slots = torch.tensor([0, 2], dtype=torch.int32, device=dev)
    whole = pool.clone()
    ref = gdnkit.prefill(q, k, v, cu.to(dev), state=whole, initial_indices=slots, final_indices=slots,
                         a=a, b=b, A_log=A_log, dt_bias=dt_bias)
    # rank r holds tokens [cuts[r], cuts[r+1]) of the packed batch: the long sequence split, the short one whole on
    # the last rank
    cuts = [lens[0] * r // world // 64 * 64 for r in range(world)] + [T]
    t0, t1 = cuts[rank], cuts[rank + 1]
    local_cu = (cu.clamp(t0, t1) - t0).to(torch.int32)
    offsets = (torch.clamp(torch.tensor(t0), cu[:-1], cu[1:]) - cu[:-1]).to(torch.int64)
    mine = pool.clone()
    o = gdnkit.distributed.prefill(q[t0:t1], k[t0:t1], v[t0:t1], local_cu.to(dev), state=mine, initial_indices=slots,
                                   final_indices=slots, a=a[t0:t1], b=b[t0:t1], A_log=A_log, dt_bias=dt_bias,
                                   piece_offsets=offsets.to(dev), final_on_every_rank=True)
    torch.cuda.synchronize()
    err_o = rel(o.float().cpu().numpy(), ref[t0:t1].float().cpu().numpy())
    err_s = rel(mine.cpu().numpy(), whole.cpu().numpy())
    print(f"rank {rank}/{world}: tokens {t0}..{t1} o {err_o:.2e} final states {err_s:.2e}", flush=True)
    ok = err_o < 5e-3 and err_s < 5e-3
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(__file__))
    sys.exit(main())
