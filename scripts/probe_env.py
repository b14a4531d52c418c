"""Check what the library relies on in this GPU environment (versions, peer
access, PDL, symmetric memory without multicast) and print one line each.

    python3 scripts/probe_env.py            # single process, all local GPUs
    torchrun --nproc-per-node 2 scripts/probe_env.py   # adds the symmetric-memory check
"""

from __future__ import annotations

import os
import subprocess

from decode_boundary.env import disable_multicast

disable_multicast()

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402


@triton.jit
def _pdl_probe_kernel(x_ptr, USE_PDL: tl.constexpr):
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    v = tl.load(x_ptr + tl.arange(0, 16), volatile=True)
    tl.store(x_ptr + tl.arange(0, 16), v + 1)


def single_process() -> None:
    print("torch", torch.__version__, "triton", triton.__version__, "cuda", torch.version.cuda)
    n = torch.cuda.device_count()
    for i in range(n):
        p = torch.cuda.get_device_properties(i)
        print(f"gpu{i}", p.name, p.multi_processor_count, "SMs", p.L2_cache_size >> 20, "MiB L2")
    for i in range(n):
        for j in range(n):
            if i != j:
                print(f"peer {i}->{j}", torch.cuda.can_device_access_peer(i, j))
    try:
        print(subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True).stdout)
    except OSError as e:
        print("nvidia-smi", e)
    x = torch.zeros(16, device="cuda", dtype=torch.int32)
    _pdl_probe_kernel[(1,)](x, USE_PDL=True, launch_pdl=True)
    _pdl_probe_kernel[(1,)](x, USE_PDL=False, enable_fp_fusion=False)
    torch.cuda.synchronize()
    print("pdl launch + gdc + volatile + enable_fp_fusion kwarg: ok", x[0].item())
    ops = getattr(torch.ops, "symm_mem", None)
    print("symm_mem one_shot_all_reduce:", ops is not None and hasattr(ops, "one_shot_all_reduce"))


def distributed() -> None:
    import torch.distributed as dist
    import torch.distributed._symmetric_memory as symm_mem

    dist.init_process_group("nccl")
    rank = dist.get_rank()
    torch.cuda.set_device(rank)
    t = symm_mem.empty(1024, dtype=torch.bfloat16, device="cuda")
    h = symm_mem.rendezvous(t, dist.group.WORLD.group_name)
    print(rank, "buffer_ptrs", [hex(p) for p in h.buffer_ptrs], "world", h.world_size)
    t.fill_(rank + 1)
    dist.barrier()
    torch.cuda.synchronize()
    peer = h.get_buffer(1 - rank, (1024,), torch.bfloat16)
    print(rank, "peer value", peer[0].item())
    y = torch.ones(4, 5120, device="cuda", dtype=torch.bfloat16)
    try:
        s = symm_mem.empty(4 * 5120, dtype=torch.bfloat16, device="cuda").view(4, 5120)
        symm_mem.rendezvous(s, dist.group.WORLD.group_name)
        s.copy_(y)
        out = torch.ops.symm_mem.one_shot_all_reduce(s, "sum", dist.group.WORLD.group_name)
        print(rank, "one_shot_all_reduce", out[0, 0].item())
    except Exception as e:  # noqa: BLE001
        print(rank, "one_shot_all_reduce failed:", repr(e)[:300])
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    if "RANK" in os.environ:
        distributed()
    else:
        single_process()
