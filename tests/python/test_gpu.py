"""CUDA backend through the Python package: every op vs the CPU backend on the same inputs, CUDA-graph
capture, torch.compile, side streams. The adapters vs FLA's, SGLang's and vLLM's own functions are in
test_adapters_*.py.

Skips visibly without torch, without a CUDA device, without a CUDA build, and per test where the CUDA
backend does not implement a request (GdnkitNotImplementedError)."""

import zlib

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed: GPU tests skipped")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device: GPU tests skipped", allow_module_level=True)

import gdnkit  # noqa: E402
import gdnkit.torch_ops  # noqa: E402,F401

if not gdnkit.cuda_compiled():
    pytest.skip("gdnkit was built without CUDA (GDNKIT_CUDA=OFF): GPU tests skipped", allow_module_level=True)

from reference import rel  # noqa: E402
from cuda_support import cuda_or_skip  # noqa: E402

DEV = "cuda"
H, HV, K, V = 16, 32, 128, 128  # qwen3-next


def gen(*key):
    return torch.Generator(device="cpu").manual_seed(zlib.crc32(repr(key).encode()))


def randn(g, *shape, dtype=torch.float32, device=DEV):
    return torch.randn(*shape, generator=g).to(dtype=dtype, device=device)




def f64(t):
    return t.detach().to("cpu", torch.float64).numpy()


def cpu(t):
    return None if t is None else t.detach().cpu().clone()


def tokens(g, T, dtype=torch.bfloat16):
    return dict(q=randn(g, T, H, K, dtype=dtype), k=randn(g, T, H, K, dtype=dtype), v=randn(g, T, HV, V, dtype=dtype),
                a=randn(g, T, HV, dtype=dtype), b=randn(g, T, HV, dtype=dtype),
                A_log=torch.log(torch.rand(HV, generator=g) * 15 + 1).to(DEV), dt_bias=(0.5 * randn(g, HV)))


def pool_for(g, P, layout, dtype):
    shape = (P, HV, V, K) if layout == "k_last" else (P, HV, K, V)
    return (0.1 * randn(g, *shape)).to(dtype)


def nan_untouched(pool, touched):
    for s in range(pool.shape[0]):
        if s not in touched:
            pool[s] = float("nan")


def assert_untouched(pool_gpu, before, touched):
    for s in range(before.shape[0]):
        if s not in touched:
            assert torch.equal(pool_gpu[s].cpu().view(torch.int16 if before.dtype == torch.bfloat16 else torch.int32),
                               before[s].view(torch.int16 if before.dtype == torch.bfloat16 else torch.int32)), \
                f"untouched slot {s} changed"


O_TOL = {"recurrent": 4e-3, "prefill": 5e-3}
S_TOL = {("recurrent", torch.float32): 1e-5, ("recurrent", torch.bfloat16): 8e-3,
         ("prefill", torch.float32): 5e-3, ("prefill", torch.bfloat16): 8e-3}


# ---- every op vs the CPU backend ----------------------------------------------------------------

@pytest.mark.parametrize("layout", ["k_last", "v_last"])
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_decode_vs_cpu(layout, state_dtype, dtype):
    g = gen("decode", layout, str(state_dtype), str(dtype))
    B, P = 13, 40
    t = tokens(g, B, dtype)
    slots = torch.randperm(P, generator=g)[:B].to(torch.int32)
    slots[3] = -1
    pool = pool_for(g, P, layout, state_dtype)
    nan_untouched(pool, set(slots.tolist()))
    before = pool.cpu().clone()
    pool_cpu = before.clone()
    o = torch.full_like(t["v"], float("nan"))
    cuda_or_skip(gdnkit.decode, t["q"], t["k"], t["v"], pool, slots.to(DEV), layout=layout, o=o,
                 a=t["a"], b=t["b"], A_log=t["A_log"], dt_bias=t["dt_bias"])
    o_cpu = gdnkit.decode(*(cpu(t[n]) for n in "qkv"), pool_cpu, slots, layout=layout, a=cpu(t["a"]),
                          b=cpu(t["b"]), A_log=cpu(t["A_log"]), dt_bias=cpu(t["dt_bias"]))
    assert rel(f64(o), f64(o_cpu)) < O_TOL["recurrent"]
    live = [s for s in slots.tolist() if s >= 0]
    assert rel(f64(pool[live]), f64(pool_cpu[live])) < S_TOL[("recurrent", state_dtype)]
    assert torch.all(o[3] == 0)
    assert_untouched(pool, before, set(live))


@pytest.mark.parametrize("layout", ["k_last", "v_last"])
@pytest.mark.parametrize("tree", [False, True])
def test_verify_commit_vs_cpu(layout, tree):
    g = gen("verify", layout, tree)
    B, T, P = 6, 4, 20
    t = tokens(g, B * T)
    slots = torch.randperm(P, generator=g)[:B].to(torch.int32)
    islots = torch.randperm(B, generator=g).to(torch.int32)
    parent = None
    if tree:
        parent = torch.tensor([[-1, 0, 0, 1]] * B, dtype=torch.int32)
    pool = pool_for(g, P, layout, torch.float32)
    pool_cpu = pool.cpu().clone()
    inter = torch.full((B, T) + pool.shape[1:], float("nan"), device=DEV)
    inter_cpu = inter.cpu().clone()
    gates = dict(a=t["a"], b=t["b"], A_log=t["A_log"], dt_bias=t["dt_bias"])
    gates_cpu = {n: cpu(x) for n, x in gates.items()}
    dev = dict(layout=layout, parent=None if parent is None else parent.to(DEV), intermediate=inter,
               intermediate_indices=islots.to(DEV))
    o = cuda_or_skip(gdnkit.verify, t["q"], t["k"], t["v"], pool, slots.to(DEV), **dev, **gates)
    o_cpu = gdnkit.verify(*(cpu(t[n]) for n in "qkv"), pool_cpu, slots, layout=layout, parent=parent,
                          intermediate=inter_cpu, intermediate_indices=islots, **gates_cpu)
    assert rel(f64(o), f64(o_cpu)) < O_TOL["recurrent"]
    assert rel(f64(inter), f64(inter_cpu)) < S_TOL[("recurrent", torch.float32)]
    accepted = torch.tensor([0, 1, 2, 3, 3, 1], dtype=torch.int32)
    path = torch.tensor([[0, 1, 3, -1]] * B, dtype=torch.int32) if tree else None
    for source in ["cache", "recompute"]:
        p_gpu, p_cpu = pool.clone(), pool_cpu.clone()
        cuda_or_skip(gdnkit.commit, t["k"], t["v"], p_gpu, slots.to(DEV), accepted.to(DEV), source=source,
                     accepted_path=None if path is None else path.to(DEV), **dev, **gates)
        gdnkit.commit(cpu(t["k"]), cpu(t["v"]), p_cpu, slots, accepted, source=source, layout=layout, parent=parent,
                      intermediate=inter_cpu, intermediate_indices=islots, accepted_path=path, **gates_cpu)
        assert rel(f64(p_gpu), f64(p_cpu)) < S_TOL[("recurrent", torch.float32)], source


# Lengths around the chunk (both CUDA paths: the short sequences on the recurrent kernels), and only short
# sequences (the short-sequence path alone).
@pytest.mark.parametrize("lens", [[1, 63, 64, 65, 300, 0, 130], [3, 8, 0, 7, 6, 1, 2]], ids=["mixed", "short"])
@pytest.mark.parametrize("layout", ["k_last", "v_last"])
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
def test_prefill_vs_cpu(layout, state_dtype, lens):
    g = gen("prefill", layout, str(state_dtype), str(lens))
    N, P = len(lens), 12
    cu = torch.tensor(np.concatenate([[0], np.cumsum(lens)]), dtype=torch.int32)
    t = tokens(g, int(cu[-1]))
    pool = pool_for(g, P, layout, state_dtype)
    initial = torch.tensor([0, -1, 2, 3, 4, 5, 6], dtype=torch.int32)
    final = torch.tensor([0, 7, 8, -1, 4, 9, 10], dtype=torch.int32)
    nan_untouched(pool, set(initial.tolist()) | set(final.tolist()))
    before = pool.cpu().clone()
    pool_cpu = before.clone()
    ck = torch.full((N, 4) + pool.shape[1:], float("nan"), device=DEV, dtype=state_dtype)
    ck_cpu = ck.cpu().clone()
    ck_idx = torch.arange(N, dtype=torch.int32)
    gates = dict(a=t["a"], b=t["b"], A_log=t["A_log"], dt_bias=t["dt_bias"])
    o = cuda_or_skip(gdnkit.prefill, t["q"], t["k"], t["v"], cu.to(DEV), state=pool, initial_indices=initial.to(DEV),
                     final_indices=final.to(DEV), layout=layout, checkpoints=ck, checkpoint_interval=64,
                     checkpoint_indices=ck_idx.to(DEV), cu_seqlens_cpu=cu, **gates)
    o_cpu = gdnkit.prefill(*(cpu(t[n]) for n in "qkv"), cu, state=pool_cpu, initial_indices=initial,
                           final_indices=final, layout=layout, checkpoints=ck_cpu, checkpoint_interval=64,
                           checkpoint_indices=ck_idx, **{n: cpu(x) for n, x in gates.items()})
    assert rel(f64(o), f64(o_cpu)) < O_TOL["prefill"]
    stored = [s for s in final.tolist() if s >= 0]
    assert rel(f64(pool[stored]), f64(pool_cpu[stored])) < S_TOL[("prefill", state_dtype)]
    written = ~torch.isnan(ck_cpu.float())
    assert torch.equal(~torch.isnan(ck.cpu().float()), written), "checkpoints written at other places than on CPU"
    if written.any():
        assert rel(f64(ck.cpu()[written]), f64(ck_cpu[written])) < S_TOL[("prefill", state_dtype)]
    assert_untouched(pool, before, set(stored))


@pytest.mark.parametrize("src_layout", ["k_last", "v_last"])
def test_convert_layout_vs_cpu(src_layout):
    g = gen("layout", src_layout)
    src = (0.1 * randn(g, 5, 4, 64, 128))
    dst = cuda_or_skip(gdnkit.convert_layout, src, src_layout=src_layout)
    assert torch.equal(dst.cpu(), gdnkit.convert_layout(src.cpu(), src_layout=src_layout))


# ---- capture, compile, streams ------------------------------------------------------------------

def decode_inputs(g, B, P):
    t = tokens(g, B)
    t["state"] = pool_for(g, P, "k_last", torch.float32)
    t["slots"] = torch.randperm(P, generator=g)[:B].to(torch.int32).to(DEV)
    return t


def run_decode(t, o=None):
    return gdnkit.decode(t["q"], t["k"], t["v"], t["state"], t["slots"], a=t["a"], b=t["b"], A_log=t["A_log"],
                         dt_bias=t["dt_bias"], o=o)


def test_cuda_graph_capture():
    g = gen("graph")
    static = decode_inputs(g, 8, 16)
    cuda_or_skip(run_decode, static)  # eager call first (kernel loading)
    start = static["state"].clone()
    o_static = torch.empty_like(static["v"])
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run_decode(static, o_static)
    static["state"].copy_(start)
    fresh = decode_inputs(gen("graph-2"), 8, 16)
    for n in ("q", "k", "v", "a", "b"):
        static[n].copy_(fresh[n])
    graph.replay()
    torch.cuda.synchronize()
    fresh["state"] = start.clone()
    fresh["slots"] = static["slots"]
    fresh["A_log"], fresh["dt_bias"] = static["A_log"], static["dt_bias"]
    o_eager = run_decode(fresh)
    torch.cuda.synchronize()
    assert torch.equal(o_static, o_eager)
    assert torch.equal(static["state"], fresh["state"])


def test_side_stream():
    g = gen("stream")
    t = decode_inputs(g, 8, 16)
    t2 = {n: (x.clone() if isinstance(x, torch.Tensor) else x) for n, x in t.items()}
    ref = cuda_or_skip(run_decode, t2)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        o = run_decode(t)
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    assert torch.equal(o, ref) and torch.equal(t["state"], t2["state"])


class TinyGDN(torch.nn.Module):
    """A minimal GDN decode layer: fused projection -> views -> gdnkit decode -> output projection."""

    def __init__(self, hidden=256):
        super().__init__()
        self.proj = torch.nn.Linear(hidden, 2 * H * K + HV * V + 2 * HV, bias=False)
        self.out = torch.nn.Linear(HV * V, hidden, bias=False)
        self.A_log = torch.nn.Parameter(torch.log(torch.rand(HV) * 15 + 1))
        self.dt_bias = torch.nn.Parameter(0.5 * torch.randn(HV))

    def forward(self, x, state, slots):
        y = self.proj(x)
        q = y[:, :H * K].view(-1, H, K)
        k = y[:, H * K:2 * H * K].view(-1, H, K)
        v = y[:, 2 * H * K:2 * H * K + HV * V].view(-1, HV, V)
        a, b = y[:, -2 * HV:-HV], y[:, -HV:]
        o = torch.ops.gdnkit.decode(q, k, v, state, slots, None, a=a, b=b, A_log=self.A_log, dt_bias=self.dt_bias)
        return self.out(o.reshape(o.shape[0], -1))


def test_torch_compile_layer():
    torch.manual_seed(0)
    layer = TinyGDN().to(DEV, torch.bfloat16)
    layer.A_log.data = layer.A_log.data.float()
    layer.dt_bias.data = layer.dt_bias.data.float()
    x = torch.randn(8, 256, device=DEV, dtype=torch.bfloat16)
    slots = torch.randperm(16, device=DEV)[:8].to(torch.int32)
    state = 0.1 * torch.randn(16, HV, V, K, device=DEV)
    s_eager, s_comp = state.clone(), state.clone()
    with torch.no_grad():
        ref = cuda_or_skip(layer, x, s_eager, slots)
        out = torch.compile(layer, fullgraph=True)(x, s_comp, slots)
    torch.cuda.synchronize()
    assert rel(f64(out), f64(ref)) < 1e-2
    assert rel(f64(s_comp), f64(s_eager)) < 1e-5


# ---- float8_e4m3fn pools through the binding: CUDA against the CPU backend --------------------------------

def fp8_pool(g, P):
    x = (0.5 * randn(g, P, HV, V, K, device="cpu")).to(torch.float8_e4m3fn)
    scales = torch.randint(118, 126, (P, HV * V * K // 32), generator=g, dtype=torch.uint8)
    return x, scales


@pytest.mark.parametrize("op", ["decode", "verify_update"])
def test_fp8_pool_cuda_matches_cpu(op):
    g = gen("fp8-gpu", op)
    B, T, P = 6, 1 if op == "decode" else 4, 9
    pool, scales = fp8_pool(g, P)
    tok = {n: t.to(DEV) for n, t in tokens(g, B * T).items()}
    slots = torch.tensor([8, 0, -1, 3, 5, 1], dtype=torch.int32)
    gates = dict(a=tok["a"], b=tok["b"], A_log=tok["A_log"], dt_bias=tok["dt_bias"])
    results = {}
    for dev in ("cpu", DEV):
        p, s = pool.clone().to(dev), scales.clone().to(dev)
        args = [tok[n].to(dev) for n in ("q", "k", "v")]
        kw = {n: t.to(dev) for n, t in gates.items()}
        if op == "decode":
            o = cuda_or_skip(lambda: gdnkit.decode(*args, p, slots.to(dev), state_scales=s, **kw))
        else:
            o = cuda_or_skip(lambda: gdnkit.verify(*args, p, slots.to(dev), state_scales=s, update_state=True, **kw))
        if dev == DEV:
            torch.cuda.synchronize()
        results[dev] = (cpu(o), cpu(p), cpu(s))
    (o0, p0, s0), (o1, p1, s1) = results["cpu"], results[DEV]
    assert rel(f64(o1), f64(o0)) < 4e-3
    sc = lambda x, y: (x.to(torch.float32).reshape(P, -1, 32) * torch.pow(2.0, y.to(torch.float32) - 127)[..., None])
    assert rel(f64(sc(p1, s1)), f64(sc(p0, s0))) < 1e-2
    for untouched in (2, 4, 6, 7):
        assert torch.equal(p1[untouched].view(torch.uint8), pool[untouched].view(torch.uint8))
        assert torch.equal(s1[untouched], scales[untouched])


@pytest.mark.parametrize("layout", ["k_last", "v_last"])
def test_fp8_pool_prefill_cuda_matches_cpu(layout):
    """Prefill on float8_e4m3fn pools with float8_e4m3fn checkpoints (V-last: on the CUDA backend's staged K-last fp32
    copies), varlen, initial and final slots, a sequence from zero; untouched slots keep their bytes."""
    g = gen("fp8-prefill-gpu", layout)
    P, lens, C = 9, [130, 64, 1, 200], 64
    x = (0.5 * randn(g, P, HV, V, K, device="cpu")).to(torch.float8_e4m3fn)
    pool = x if layout == "k_last" else x.transpose(2, 3).contiguous()
    scales = torch.randint(118, 126, (P, HV * V * K // 32), generator=g, dtype=torch.uint8)
    T = sum(lens)
    tok = tokens(g, T)
    cu = torch.tensor(np.cumsum([0] + lens), dtype=torch.int32)
    init = torch.tensor([3, -1, 5, 0], dtype=torch.int32)
    fin = torch.tensor([8, 1, 5, 2], dtype=torch.int32)
    steps = max(lens) // C
    ck_shape = (len(lens), steps, HV, V, K) if layout == "k_last" else (len(lens), steps, HV, K, V)
    ck0 = torch.zeros(ck_shape, dtype=torch.float8_e4m3fn)
    cks0 = torch.zeros((len(lens) * steps, HV * V * K // 32), dtype=torch.uint8)
    cki = torch.tensor([0, 1, -1, 3], dtype=torch.int32)
    results = {}
    for dev in ("cpu", DEV):
        p, s, ck, cks = pool.clone().to(dev), scales.clone().to(dev), ck0.clone().to(dev), cks0.clone().to(dev)
        kw = {n: tok[n].to(dev) for n in ("a", "b", "A_log", "dt_bias")}
        o = cuda_or_skip(lambda: gdnkit.prefill(
            tok["q"].to(dev), tok["k"].to(dev), tok["v"].to(dev), cu.to(dev), state=p, initial_indices=init.to(dev),
            final_indices=fin.to(dev), layout=layout, state_scales=s, checkpoints=ck, checkpoint_scales=cks,
            checkpoint_interval=C, checkpoint_indices=cki.to(dev), **kw))
        if dev == DEV:
            torch.cuda.synchronize()
        results[dev] = (cpu(o), cpu(p), cpu(s), cpu(ck), cpu(cks))
    (o0, p0, s0, c0, cs0), (o1, p1, s1, c1, cs1) = results["cpu"], results[DEV]
    assert rel(f64(o1), f64(o0)) < 1e-2
    sc = lambda x, y: x.to(torch.float32).reshape(*y.shape, 32) * torch.pow(2.0, y.to(torch.float32) - 127)[..., None]
    # the prefill's float8_e4m3 state tolerance (tests/support/compare.h): chunked against the recurrence, each
    # rounded to e4m3 codes
    w, cw = [8, 1, 5, 2], [0, 1, 3]  # the final slots, the checkpoint slots written
    assert rel(f64(sc(p1[w], s1[w])), f64(sc(p0[w], s0[w]))) < 2e-2
    cs1, cs0 = cs1.reshape(len(lens), steps, -1), cs0.reshape(len(lens), steps, -1)
    assert rel(f64(sc(c1[cw], cs1[cw])), f64(sc(c0[cw], cs0[cw]))) < 2e-2
    for untouched in (3, 4, 6, 7):
        assert torch.equal(p1[untouched].view(torch.uint8), pool[untouched].view(torch.uint8))
        assert torch.equal(s1[untouched], scales[untouched])
    assert torch.equal(c1[2].view(torch.uint8), ck0[2].view(torch.uint8))  # a slot no sequence names


def test_distributed_prefill_over_nccl():
    """gdnkit.distributed.prefill over every GPU of the machine (torchrun, one process a GPU) against the whole
    prefill on one GPU: each rank's rows of o and every rank's final states."""
    import os
    import subprocess
    import sys

    n = torch.cuda.device_count()
    if n < 2:
        pytest.skip(f"needs 2 or more GPUs (found {n})")
    here = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([here] + sys.path))
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={n}",
                          os.path.join(here, "split_worker.py")], env=env, capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    assert run.stdout.count(" o ") == n, run.stdout
