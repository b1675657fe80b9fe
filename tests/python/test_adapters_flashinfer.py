"""gdnkit.adapters.flashinfer: FlashInfer 0.7.2's GDN signatures computed by gdnkit.

Against the fp64 recurrence of reference.py on the CPU backend everywhere and on the CUDA backend where there is
one; against FlashInfer's own functions where they load (a GPU machine with FlashInfer installed, or its
prebuilt bundle unpacked by setup.sh of ../shared/peers/flashinfer: then only on the shapes it has kernels for).
Skipped (visibly) without torch."""

import inspect
import sys
import warnings
import zlib

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed: torch tests skipped")

import gdnkit  # noqa: E402
import gdnkit.torch_ops  # noqa: E402,F401
from gdnkit.adapters import _common as C  # noqa: E402
from gdnkit.adapters import flashinfer as fi  # noqa: E402
from reference import TOLERANCES, fused_gates, rel, run_tokens  # noqa: E402
from test_adapters_common import CopyCounter, assert_signature, bits_equal, strided  # noqa: E402

HAVE_CUDA = torch.cuda.is_available() and gdnkit.cuda_compiled()
DEVICES = ["cpu"] + (["cuda"] if HAVE_CUDA else [])
H, HV, K, V = 2, 4, 64, 64  # small heads for the reference tests (GVA, r = 2)


def gen(*key):
    return torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))


def randn(g, *shape, dtype=torch.float32, device="cpu", scale=1.0):
    return (scale * torch.randn(*shape, generator=g)).to(dtype=dtype, device=device)


def f64(t):
    return t.detach().to("cpu", torch.float64).numpy()


def kl(S):
    """math state [.., K, V] <-> FlashInfer's K-last [.., V, K]."""
    return np.swapaxes(np.asarray(S, np.float64), -1, -2)


def call(fn, *args, **kwargs):
    """Run an adapter call; a request the CUDA backend does not implement skips the test."""
    try:
        out = fn(*args, **kwargs)
    except gdnkit.GdnkitNotImplementedError as e:
        pytest.skip(f"CUDA backend: {e}")
    if HAVE_CUDA:
        torch.cuda.synchronize()
    return out


def tol(kind, what, dtype):
    name = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype]
    return TOLERANCES[(kind, what, name)]


def ref_seq(S0_kl, q, k, v, g, beta, scale=None, l2=True, keep=False):
    """Tokens q, k [T, Hq, K], v [T, Hs, V], g (log-space), beta [T, Hs] from the K-last state S0_kl (None: 0).
    Returns o [T, Hs, V] and the final K-last state (and the K-last state after every token)."""
    Hs, Kd, Vd = v.shape[1], q.shape[2], v.shape[2]
    S0 = np.zeros((Hs, Kd, Vd)) if S0_kl is None else kl(S0_kl)
    sc = Kd ** -0.5 if scale is None else scale
    res = run_tokens(S0, f64(q), f64(k), f64(v), np.asarray(g, np.float64), np.asarray(beta, np.float64), sc, l2,
                     keep_states=keep)
    if keep:
        return res[0], kl(res[1]), [kl(s) for s in res[2]]
    return res[0], kl(res[1])


# ---- signatures ---------------------------------------------------------------------------------

EMPTY = inspect.Parameter.empty


def _p(*names):
    return [(n, "p", EMPTY) for n in names]


# FlashInfer 0.7.2's signatures (flashinfer/gdn_prefill.py, flashinfer/gdn_decode.py)
FI_PREFILL = _p("q", "k", "v") + [
    ("g", "p", None), ("beta", "p", None), ("scale", "p", None), ("initial_state", "p", None),
    ("output_final_state", "p", False), ("cu_seqlens", "p", None), ("use_qk_l2norm_in_kernel", "p", False),
    ("output", "p", None), ("output_state", "p", None), ("state_checkpoints", "p", None),
    ("checkpoint_cu_starts", "p", None), ("checkpoint_every_n_tokens", "p", 0), ("use_cp", "p", "auto"),
    ("state_indices", "p", None), ("_cp_chunk_len", "p", None), ("backend", "p", "auto"), ("max_seqlen", "p", None)]
FI_PRETRANSPOSE = _p("q", "k", "v", "state", "A_log", "a", "dt_bias", "b") + [
    ("scale", "p", None), ("output", "p", None), ("use_qk_l2norm", "p", True), ("initial_state", "p", None),
    ("initial_state_indices", "p", None), ("output_state_indices", "p", None),
    ("intermediate_states_buffer", "p", None), ("disable_state_update", "p", False), ("backend", "p", "auto")]
FI_MTP = _p("q", "k", "v", "initial_state", "initial_state_indices", "A_log", "a", "dt_bias", "b") + [
    ("scale", "p", None), ("output", "p", None), ("intermediate_states_buffer", "p", None),
    ("ssm_state_indices", "p", None), ("disable_state_update", "p", None), ("use_qk_l2norm", "p", True),
    ("output_state_indices", "p", None), ("cache_replayssm", "p", False), ("replayssm_rawv", "p", None),
    ("replayssm_rawk", "p", None), ("replayssm_g", "p", None), ("replayssm_beta", "p", None)]
FI_DECODE = _p("q", "k", "v", "state", "A_log", "a", "dt_bias", "b") + [
    ("scale", "p", None), ("output", "p", None), ("use_qk_l2norm", "p", True), ("backend", "p", "auto")]


def test_signatures_are_flashinfer_072():
    assert_signature(fi.chunk_gated_delta_rule, FI_PREFILL)
    assert_signature(fi.gated_delta_rule_decode_pretranspose, FI_PRETRANSPOSE)
    assert_signature(fi.gated_delta_rule_mtp, FI_MTP)
    assert_signature(fi.gated_delta_rule_decode, FI_DECODE)


# ---- prefill ------------------------------------------------------------------------------------

LENS = [70, 0, 130, 5]


def prefill_problem(g, device, heads=(H, H, HV), lens=LENS, dtype=torch.float32, unit=False):
    """FlashInfer prefill arguments; unit: q/k rows of norm 1 (for calls without the L2 norm, whose recurrence
    grows without bound on raw N(0, 1) keys)."""
    HQ, HK, HVv = heads
    HS = max(HQ, HVv)
    T = sum(lens)
    cu = torch.tensor(np.concatenate([[0], np.cumsum(lens)]), dtype=torch.int32, device=device)
    q, k = randn(g, T, HQ, K), randn(g, T, HK, K)
    if unit:
        q, k = torch.nn.functional.normalize(q, dim=-1), torch.nn.functional.normalize(k, dim=-1)
    q, k = q.to(dtype=dtype, device=device), k.to(dtype=dtype, device=device)
    v = randn(g, T, HVv, V, dtype=dtype, device=device)
    a, b = randn(g, T, HS), randn(g, T, HS)
    A_log = np.log(np.linspace(0.1, 1.0, HS))
    g_log, beta = fused_gates(f64(a), f64(b), A_log, np.zeros(HS))
    alpha = torch.tensor(np.exp(g_log), dtype=torch.float32, device=device)
    beta = torch.tensor(beta, dtype=torch.float32, device=device)
    return dict(q=q, k=k, v=v, g=alpha, beta=beta, cu_seqlens=cu), lens


def prefill_refs(p, lens, h0=None, slots=None, l2=False, scale=None):
    """Per sequence: (o rows, final K-last state, K-last states after each token); GQA expands k/v per q head."""
    q, k, v = p["q"], p["k"], p["v"]
    HQ, HVv = q.shape[1], v.shape[1]
    if HQ > HVv:
        r = HQ // HVv
        k, v = k.repeat_interleave(r, 1), v.repeat_interleave(r, 1)
    g_log = np.log(f64(p["g"]))
    beta = f64(p["beta"])
    out, off = [], 0
    for n, L in enumerate(lens):
        rows = slice(off, off + L)
        S0 = None if h0 is None else f64(h0[n if slots is None else slots[n]])
        out.append(ref_seq(S0, q[rows], k[rows], v[rows], g_log[rows], beta[rows], scale, l2, keep=True))
        off += L
    return out


def check_prefill(o, states, refs, lens, dtype=torch.float32, state_tol=None):
    off = 0
    for n, L in enumerate(lens):
        ro, rS, _ = refs[n]
        if L:
            assert rel(f64(o[off:off + L]), ro) < tol("prefill", "o", dtype), f"output of sequence {n}"
        if states is not None:
            assert rel(f64(states[n]), rS) < (state_tol or tol("prefill", "state", torch.float32)), \
                f"final state of sequence {n}"
        off += L


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("heads", ["gva", "gqa", "mha"])
@pytest.mark.parametrize("out_mode", ["none", "alloc", "given", "given_silent"])
@pytest.mark.parametrize("init", [True, False])
def test_prefill(device, heads, out_mode, init):
    hq = dict(gva=(H, H, HV), gqa=(HV, H, H), mha=(H, H, H))[heads]
    g = gen("prefill", device, heads, out_mode, init)
    l2 = heads != "mha"
    p, lens = prefill_problem(g, device, hq, unit=not l2)
    HS, N = max(hq[0], hq[2]), len(lens)
    h0 = randn(g, N, HS, V, K, device=device, scale=0.1) if init else None
    h0_before = None if h0 is None else h0.clone()
    kw = dict(initial_state=h0, use_qk_l2norm_in_kernel=l2)
    ostate = torch.full((N, HS, V, K), float("nan"), device=device) if out_mode.startswith("given") else None
    if ostate is not None:
        kw["output_state"] = ostate
    kw["output_final_state"] = out_mode in ("alloc", "given")
    res = call(fi.chunk_gated_delta_rule, **p, **kw)
    refs = prefill_refs(p, lens, h0, l2=l2)
    if kw["output_final_state"]:
        o, st = res
        assert st.shape == (N, HS, V, K) and st.dtype == torch.float32
        if ostate is not None:
            assert st is ostate
    else:
        assert isinstance(res, torch.Tensor)
        o, st = res, ostate  # FlashInfer writes a given output_state whatever output_final_state says
    assert o.shape == (sum(lens), HS, V) and o.dtype == p["q"].dtype
    check_prefill(o, st, refs, lens)
    if h0 is not None:
        assert torch.equal(h0, h0_before), "initial_state was modified"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("inplace", [True, False])
def test_prefill_state_indices_pool(device, state_dtype, inplace):
    g = gen("prefill-pool", device, str(state_dtype), inplace)
    p, lens = prefill_problem(g, device)
    P, N = 9, len(lens)
    slots = [6, 1, 3, 8]
    pool = torch.full((P, HV, V, K), float("nan"), device=device, dtype=state_dtype)
    for s in slots:
        pool[s] = randn(g, HV, V, K, device=device, scale=0.1).to(state_dtype)
    before = pool.clone()
    out_pool = pool if inplace else torch.full_like(pool, float("nan"))
    sidx = torch.tensor(slots, dtype=torch.int64, device=device)
    o, st = call(fi.chunk_gated_delta_rule, **p, initial_state=pool, output_final_state=True, output_state=out_pool,
                 state_indices=sidx, use_qk_l2norm_in_kernel=True)
    assert st is out_pool
    refs = prefill_refs(p, lens, before, slots, l2=True)
    s_tol = tol("prefill", "state", torch.float32) if state_dtype == torch.float32 else 8e-3
    check_prefill(o, [st[s] for s in slots], refs, lens, state_tol=s_tol)
    for s in range(P):
        if s not in slots:
            assert torch.isnan(st[s].float()).all(), f"slot {s} written"
    if not inplace:
        assert torch.equal(pool.float().nan_to_num(7.0), before.float().nan_to_num(7.0)), "initial pool modified"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("state_dtype", ["float16", "float8_e4m3fn"])
def test_prefill_other_state_dtypes(device, state_dtype):
    dt = getattr(torch, state_dtype, None)
    if dt is None:
        pytest.skip(f"torch has no {state_dtype}")
    g = gen("prefill-dtypes", device, state_dtype)
    p, lens = prefill_problem(g, device, unit=True)
    N = len(lens)
    h0 = randn(g, N, HV, V, K, device=device, scale=0.1).to(dt)
    ostate = torch.zeros(N, HV, V, K, device=device, dtype=dt)
    o, st = call(fi.chunk_gated_delta_rule, **p, initial_state=h0, output_final_state=True, output_state=ostate)
    assert st is ostate and st.dtype == dt
    refs = prefill_refs(p, lens, h0.float(), l2=False)
    # the final state is rounded to the pool's dtype: 2^-11 (fp16), 2^-4 (e4m3) relative per element
    check_prefill(o, st.float(), refs, lens, state_tol=5e-3 if dt == torch.float16 else 8e-2)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("ck_dtype", [torch.float32, torch.bfloat16])
def test_prefill_checkpoints(device, ck_dtype):
    g = gen("prefill-ckpt", device, str(ck_dtype))
    lens = [130, 0, 200, 64]
    p, _ = prefill_problem(g, device, lens=lens)
    N, n = len(lens), 64
    counts = [L // n for L in lens]
    starts = np.concatenate([[0], np.cumsum(counts)])
    total = int(starts[-1])
    ck = torch.full((total + 2, HV, V, K), float("nan"), device=device, dtype=ck_dtype)
    cks = torch.tensor(starts, dtype=torch.int32, device=device)
    h0 = randn(g, N, HV, V, K, device=device, scale=0.1)
    o, st = call(fi.chunk_gated_delta_rule, **p, initial_state=h0, output_final_state=True, state_checkpoints=ck,
                 checkpoint_cu_starts=cks, checkpoint_every_n_tokens=n, use_qk_l2norm_in_kernel=True)
    refs = prefill_refs(p, lens, h0, l2=True)
    check_prefill(o, st, refs, lens)
    s_tol = tol("prefill", "state", torch.float32) if ck_dtype == torch.float32 else 8e-3
    for i, c in enumerate(counts):
        for j in range(c):
            assert rel(f64(ck[starts[i] + j]), refs[i][2][(j + 1) * n - 1]) < s_tol, f"checkpoint {j} of {i}"
    assert torch.isnan(ck[total:].float()).all(), "written past the last checkpoint"
    with pytest.raises(gdnkit.GdnkitError, match="does not match cu_seqlens"):
        fi.chunk_gated_delta_rule(**p, state_checkpoints=ck, checkpoint_cu_starts=cks.flip(0),
                                  checkpoint_every_n_tokens=n)


@pytest.mark.parametrize("device", DEVICES)
def test_prefill_defaults_and_output_buffer(device):
    """g, beta None (ones), scale 0 (FlashInfer: 1/sqrt(K)), output written in place and returned."""
    g = gen("prefill-defaults", device)
    p, lens = prefill_problem(g, device)
    T = sum(lens)
    out = torch.full((T, HV, V), float("nan"), device=device)
    o = call(fi.chunk_gated_delta_rule, p["q"], p["k"], p["v"], scale=0.0, cu_seqlens=p["cu_seqlens"].long(),
             output=out, use_qk_l2norm_in_kernel=True)
    assert o is out
    ones = dict(p, g=torch.ones(T, HV), beta=torch.ones(T, HV))
    check_prefill(o, None, prefill_refs(ones, lens, l2=True), lens)


@pytest.mark.parametrize("device", DEVICES)
def test_prefill_bf16_inputs(device):
    g = gen("prefill-bf16", device)
    p, lens = prefill_problem(g, device, dtype=torch.bfloat16)
    h0 = randn(g, len(lens), HV, V, K, device=device, scale=0.1)
    o, st = call(fi.chunk_gated_delta_rule, **p, initial_state=h0, output_final_state=True,
                 use_qk_l2norm_in_kernel=True, max_seqlen=max(lens))
    assert o.dtype == torch.bfloat16
    check_prefill(o, st, prefill_refs(p, lens, h0, l2=True), lens, dtype=torch.bfloat16,
                  state_tol=tol("prefill", "state", torch.bfloat16))


def test_prefill_errors():
    g = gen("prefill-errors")
    p, lens = prefill_problem(g, "cpu")
    T = sum(lens)
    with pytest.raises(TypeError, match="use_gate_in_kernel"):
        fi.chunk_gated_delta_rule(**p, use_gate_in_kernel=True)
    with pytest.raises(gdnkit.GdnkitError, match="cu_seqlens is required"):
        fi.chunk_gated_delta_rule(**dict(p, cu_seqlens=None))
    with pytest.raises(gdnkit.GdnkitError, match="integer dtype"):
        fi.chunk_gated_delta_rule(**dict(p, cu_seqlens=p["cu_seqlens"].float()))
    with pytest.raises(gdnkit.GdnkitError, match="multiple of the chunk size"):
        fi.chunk_gated_delta_rule(**p, checkpoint_every_n_tokens=32)
    with pytest.raises(gdnkit.GdnkitError, match="must both be provided"):
        fi.chunk_gated_delta_rule(**p, checkpoint_every_n_tokens=64)
    with pytest.raises(gdnkit.GdnkitError, match="must be None when"):
        fi.chunk_gated_delta_rule(**p, state_checkpoints=torch.zeros(1, HV, V, K))
    with pytest.raises(gdnkit.GdnkitError, match="explicit output_state"):
        fi.chunk_gated_delta_rule(**p, output_final_state=True, state_indices=torch.arange(len(lens)))
    with pytest.raises(gdnkit.GdnkitError, match="unsupported GDN backend"):
        fi.chunk_gated_delta_rule(**p, backend="triton")
    with pytest.raises(gdnkit.GdnkitError, match="use_cp"):
        fi.chunk_gated_delta_rule(**p, use_cp="yes")
    with pytest.raises(gdnkit.GdnkitError, match="max_seqlen cannot exceed"):
        fi.chunk_gated_delta_rule(**p, max_seqlen=T + 1)
    with pytest.raises(gdnkit.GdnkitError, match="neither GVA"):
        fi.chunk_gated_delta_rule(**dict(p, v=torch.zeros(T, 3, V), g=None, beta=None))
    with pytest.raises(gdnkit.GdnkitError, match=r"g must have shape \[205, 4\]"):
        fi.chunk_gated_delta_rule(**dict(p, g=p["g"][:, :2]))
    with pytest.raises(gdnkit.GdnkitError, match="initial_state must have shape"):
        fi.chunk_gated_delta_rule(**p, initial_state=torch.zeros(len(lens), HV, K, V + 1))
    with pytest.raises(NotImplementedError, match="cudnn"):
        fi.chunk_gated_delta_rule(**p, backend="cudnn", state_indices=torch.arange(len(lens)),
                                  output_state=torch.zeros(len(lens), HV, V, K))
    with pytest.raises(NotImplementedError, match="autograd"):
        fi.chunk_gated_delta_rule(**dict(p, q=p["q"].clone().requires_grad_()))


# ---- decode, MTP -------------------------------------------------------------------------------

def decode_problem(g, device, B, T, P, state_dtype=torch.float32, dtype=torch.float32, nan_pool=True):
    q, k = randn(g, B, T, H, K, dtype=dtype, device=device), randn(g, B, T, H, K, dtype=dtype, device=device)
    v = randn(g, B, T, HV, V, dtype=dtype, device=device)
    a, b = randn(g, B, T, HV, dtype=dtype, device=device), randn(g, B, T, HV, dtype=dtype, device=device)
    A_log = torch.log(torch.linspace(0.1, 1.0, HV)).to(device)
    dt_bias = randn(g, HV, device=device, scale=0.5)
    pool = randn(g, P, HV, V, K, device=device, scale=0.1).to(state_dtype)
    if nan_pool:
        pool[:] = float("nan")
    return dict(q=q, k=k, v=v, A_log=A_log, a=a, dt_bias=dt_bias, b=b), pool


def decode_refs(p, pool_before, idx):
    """Per row b with idx[b] >= 0: (o [T, HV, V], final K-last state, K-last states after each token)."""
    gg, bb = [], []
    for b in range(p["q"].shape[0]):
        g1, b1 = fused_gates(f64(p["a"][b]), f64(p["b"][b]), f64(p["A_log"]), f64(p["dt_bias"]))
        gg.append(g1)
        bb.append(b1)
    out = {}
    for b, s in enumerate(idx):
        if s >= 0:
            out[b] = ref_seq(f64(pool_before[s].float()), p["q"][b], p["k"][b], p["v"][b], gg[b], bb[b], keep=True)
    return out


def fill_slots(g, pool, slots):
    for s in slots:
        if s >= 0:
            pool[s] = randn(g, *pool.shape[1:], device=pool.device, scale=0.1).to(pool.dtype)


def same_bits(x, y):
    return torch.equal(x.float().nan_to_num(7.0), y.float().nan_to_num(7.0))


def o_tol(dtype):
    return tol("recurrent", "o", dtype)


def s_tol(state_dtype):
    return 1e-5 if state_dtype == torch.float32 else 8e-3


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_output", [False, True])
def test_decode_pretranspose_pool(device, state_dtype, with_output):
    g = gen("decode-pool", device, str(state_dtype), with_output)
    B, P = 4, 9
    p, pool = decode_problem(g, device, B, 1, P, state_dtype)
    idx = [7, -1, 2, 5]
    fill_slots(g, pool, idx)
    before = pool.clone()
    out = torch.full((B, 1, HV, V), 3.0, device=device, dtype=torch.float64) if with_output else None
    o, st = call(fi.gated_delta_rule_decode_pretranspose, p["q"], p["k"], p["v"], None, p["A_log"], p["a"],
                 p["dt_bias"], p["b"], output=out, initial_state=pool,
                 initial_state_indices=torch.tensor(idx, dtype=torch.int32, device=device))
    assert st is pool and o.shape == (B, 1, HV, V)
    if with_output:
        assert o is out
    refs = decode_refs(p, before, idx)
    for b, (ro, rS, _) in refs.items():
        assert rel(f64(o[b]), ro) < o_tol(torch.float32)
        assert rel(f64(pool[idx[b]]), rS) < s_tol(state_dtype)
    assert (o[1] == 0).all(), "padding row output"
    for s in range(P):
        if s not in idx:
            assert same_bits(pool[s], before[s]), f"slot {s} changed"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T", [1, 2])
def test_decode_pretranspose_state_mode(device, state_dtype, T):
    g = gen("decode-state", device, str(state_dtype), T)
    B = 3
    p, state = decode_problem(g, device, B, T, B, state_dtype, dtype=torch.bfloat16, nan_pool=False)
    before = state.clone()
    o, st = call(fi.gated_delta_rule_decode_pretranspose, **p, state=state)
    assert st is state and o.dtype == torch.bfloat16 and o.shape == (B, T, HV, V)
    for b, (ro, rS, _) in decode_refs(p, before, list(range(B))).items():
        assert rel(f64(o[b]), ro) < o_tol(torch.bfloat16)
        assert rel(f64(state[b]), rS) < s_tol(state_dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("T", [1, 3])
def test_decode_output_state_indices(device, T):
    g = gen("decode-out-idx", device, T)
    B, P = 4, 9
    p, pool = decode_problem(g, device, B, T, P)
    idx, out_idx = [7, -1, 2, 5], [1, 3, -1, 6]
    fill_slots(g, pool, idx)
    before = pool.clone()
    o, _ = call(fi.gated_delta_rule_decode_pretranspose, p["q"], p["k"], p["v"], None, p["A_log"], p["a"],
                p["dt_bias"], p["b"], initial_state=pool,
                initial_state_indices=torch.tensor(idx, device=device),
                output_state_indices=torch.tensor(out_idx, dtype=torch.int32, device=device))
    refs = decode_refs(p, before, idx)
    for b, (ro, rS, _) in refs.items():
        assert rel(f64(o[b]), ro) < o_tol(torch.float32)
        if out_idx[b] >= 0:
            assert rel(f64(pool[out_idx[b]]), rS) < s_tol(torch.float32)
    written = {1, 6}
    for s in range(P):
        if s not in written:
            assert same_bits(pool[s], before[s]), f"slot {s} changed"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mode", ["cache", "update", "update+cache"])
def test_mtp(device, state_dtype, mode):
    g = gen("mtp", device, str(state_dtype), mode)
    B, T, P = 3, 4, 8
    p, pool = decode_problem(g, device, B, T, P, state_dtype)
    idx = [6, -1, 3]
    fill_slots(g, pool, idx)
    before = pool.clone()
    inter = torch.full((B + 1, T + 1, HV, V, K), float("nan"), device=device, dtype=state_dtype) \
        if "cache" in mode else None
    out = torch.full((B, T, HV, V), 5.0, device=device)
    o, st = call(fi.gated_delta_rule_mtp, **{k_: p[k_] for k_ in ("q", "k", "v")}, initial_state=pool,
                 initial_state_indices=torch.tensor(idx, dtype=torch.int32, device=device), A_log=p["A_log"],
                 a=p["a"], dt_bias=p["dt_bias"], b=p["b"], output=out, intermediate_states_buffer=inter,
                 disable_state_update=mode == "cache")
    assert o is out and st is pool
    assert (o[1] == 5.0).all(), "padding row of output was written"
    refs = decode_refs(p, before, idx)
    for b, (ro, rS, states) in refs.items():
        assert rel(f64(o[b]), ro) < o_tol(torch.float32)
        if mode == "cache":
            assert same_bits(pool[idx[b]], before[idx[b]])
        else:
            assert rel(f64(pool[idx[b]]), rS) < s_tol(state_dtype)
        if inter is not None:
            for t in range(T):
                assert rel(f64(inter[b, t]), states[t]) < s_tol(state_dtype), f"cache {b}, {t}"
            assert torch.isnan(inter[b, T].float()).all()
    if inter is not None:
        assert torch.isnan(inter[1].float()).all() and torch.isnan(inter[B].float()).all()
    for s in range(P):
        if s not in idx:
            assert same_bits(pool[s], before[s])


@pytest.mark.parametrize("device", DEVICES)
def test_mtp_default_is_no_update(device):
    g = gen("mtp-default", device)
    p, pool = decode_problem(g, device, 2, 2, 3, nan_pool=False)
    before = pool.clone()
    fi._mtp_default_warned = False
    with pytest.warns(FutureWarning, match="disable_state_update"):
        call(fi.gated_delta_rule_mtp, p["q"], p["k"], p["v"], pool, torch.tensor([2, 0], device=device),
             p["A_log"], p["a"], p["dt_bias"], p["b"])
    assert torch.equal(pool, before)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warned once per process, as FlashInfer's warning_once
        call(fi.gated_delta_rule_mtp, p["q"], p["k"], p["v"], pool, torch.tensor([2, 0], device=device),
             p["A_log"], p["a"], p["dt_bias"], p["b"])


@pytest.mark.parametrize("device", DEVICES)
def test_mtp_ssm_state_indices(device):
    g = gen("mtp-ssm", device)
    B, T, P = 3, 3, 12
    p, pool = decode_problem(g, device, B, T, P)
    idx = [0, 7, -1]
    ssm = [[1, 2, 3], [4, 5, 6], [8, 9, -1]]
    fill_slots(g, pool, idx)
    before = pool.clone()
    o, _ = call(fi.gated_delta_rule_mtp, p["q"], p["k"], p["v"], pool, torch.tensor(idx, device=device),
                p["A_log"], p["a"], p["dt_bias"], p["b"],
                ssm_state_indices=torch.tensor(ssm, dtype=torch.int32, device=device), disable_state_update=False)
    refs = decode_refs(p, before, idx)
    written = set()
    for b, (ro, _, states) in refs.items():
        assert rel(f64(o[b]), ro) < o_tol(torch.float32)
        for t in range(T):
            assert rel(f64(pool[ssm[b][t]]), states[t]) < s_tol(torch.float32), f"token {t} of {b}"
            written.add(ssm[b][t])
    for s in range(P):
        if s not in written:
            assert same_bits(pool[s], before[s]), f"slot {s} changed"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("T", [1, 3])
def test_decode_views_are_not_copied(device, T, monkeypatch):
    """q/k/v split from one fused projection and a/b from another reach the kernels as they are (no copy);
    the output buffer passed is the one returned."""
    g = gen("decode-views", device, T)
    B, P = 3, 6
    p, pool = decode_problem(g, device, B, T, P, nan_pool=False)
    q, k, v = strided("projection", p["q"], p["k"], p["v"])
    ba = torch.cat([p["b"], p["a"]], dim=-1)
    a, b = ba[..., HV:], ba[..., :HV]
    idx = [4, 0, 2]
    before = pool.clone()
    out = torch.empty(B, T, HV, V, device=device)
    counter = CopyCounter(monkeypatch)
    written = []  # the o the decode kernel wrote
    real = C._ops.decode
    monkeypatch.setattr(C._ops, "decode", lambda *a_, **k_: (written.append(k_.get("o")), real(*a_, **k_))[1])
    o, _ = call(fi.gated_delta_rule_decode_pretranspose, q, k, v, None, p["A_log"], a, p["dt_bias"], b, output=out,
                initial_state=pool, initial_state_indices=torch.tensor(idx, dtype=torch.int32, device=device))
    assert counter.count == 0 and o is out
    if T == 1:
        assert len(written) == 1 and written[0] is out, "decode did not write the caller's output buffer"
    for bb, (ro, rS, _) in decode_refs(p, before, idx).items():
        assert rel(f64(o[bb]), ro) < o_tol(torch.float32)
        assert rel(f64(pool[idx[bb]]), rS) < s_tol(torch.float32)


@pytest.mark.parametrize("device", DEVICES)
def test_decode_kmajor(device):
    g = gen("decode-kmajor", device)
    B = 3
    p, _ = decode_problem(g, device, B, 1, 1)
    state = randn(g, B, HV, K, V, device=device, scale=0.1)  # [B, HV, K, V]: V-last
    before = state.clone()
    o, st = call(fi.gated_delta_rule_decode, **p, state=state)
    assert st is state
    for b in range(B):
        g1, b1 = fused_gates(f64(p["a"][b]), f64(p["b"][b]), f64(p["A_log"]), f64(p["dt_bias"]))
        ro, rS = ref_seq(kl(f64(before[b])), p["q"][b], p["k"][b], p["v"][b], g1, b1)
        assert rel(f64(o[b]), ro) < o_tol(torch.float32)
        assert rel(f64(state[b]), kl(rS)) < s_tol(torch.float32)


def test_decode_errors():
    g = gen("decode-errors")
    p, pool = decode_problem(g, "cpu", 2, 1, 4, nan_pool=False)
    before = pool.clone()
    idx = torch.tensor([0, 1], dtype=torch.int32)
    d = fi.gated_delta_rule_decode_pretranspose
    with pytest.raises(TypeError, match="use_gate_in_kernel"):
        d(**p, state=pool[:2], use_gate_in_kernel=True)
    with pytest.raises(gdnkit.GdnkitError, match="only for T > 1"):
        d(**p, state=None, initial_state=pool, initial_state_indices=idx,
          intermediate_states_buffer=torch.zeros(2, 1, HV, V, K))
    with pytest.raises(gdnkit.GdnkitError, match="only for T > 1"):
        d(**p, state=pool[:2], disable_state_update=True)
    with pytest.raises(gdnkit.GdnkitError, match="provided together"):
        d(**p, state=None, initial_state=pool)
    with pytest.raises(gdnkit.GdnkitError, match="pool mode"):
        d(**p, state=pool[:2], output_state_indices=idx)
    with pytest.raises(gdnkit.GdnkitError, match="Either state or initial_state"):
        d(**p, state=None)
    with pytest.raises(gdnkit.GdnkitError, match="unsupported GDN backend"):
        d(**p, state=pool[:2], backend="triton")
    with pytest.raises(NotImplementedError, match="uGPU"):
        d(**p, state=None, initial_state=pool.view(4, HV, 2, V // 2, K), initial_state_indices=idx)
    assert bits_equal(pool, before), "the pool written by a refused call"
    p2, pool2 = decode_problem(g, "cpu", 2, 2, 4, nan_pool=False)
    before2 = pool2.clone()
    m = fi.gated_delta_rule_mtp
    args = (p2["q"], p2["k"], p2["v"], pool2, idx, p2["A_log"], p2["a"], p2["dt_bias"], p2["b"])
    with pytest.raises(NotImplementedError, match="cache_replayssm"):
        m(*args, cache_replayssm=True, disable_state_update=True)
    with pytest.raises(NotImplementedError, match="replayssm"):
        m(*args, replayssm_g=torch.zeros(4, HV, 2), disable_state_update=True)
    ssm = torch.zeros(2, 2, dtype=torch.int32)
    with pytest.raises(gdnkit.GdnkitError, match="disable_state_update must be False"):
        m(*args, ssm_state_indices=ssm, disable_state_update=True)
    with pytest.raises(gdnkit.GdnkitError, match="mutually exclusive"):
        m(*args, ssm_state_indices=ssm, intermediate_states_buffer=torch.zeros(2, 2, HV, V, K),
          disable_state_update=False)
    with pytest.raises(gdnkit.GdnkitError, match="intermediate_states_buffer must have"):
        m(*args, intermediate_states_buffer=torch.zeros(2, 1, HV, V, K), disable_state_update=True)
    with pytest.raises(gdnkit.GdnkitError, match="Decode only supports T=1"):
        fi.gated_delta_rule_decode(**p2, state=torch.zeros(2, HV, K, V))
    with pytest.raises(NotImplementedError, match="autograd"):
        d(**dict(p, q=p["q"].clone().requires_grad_()), state=pool[:2])
    assert bits_equal(pool, before) and bits_equal(pool2, before2), "a pool written by a refused call"


# ---- against FlashInfer itself (GPU machine, where it loads) ------------------------------------

@pytest.fixture(scope="module")
def flashinfer():
    if not HAVE_CUDA:
        pytest.skip("needs a CUDA device and a CUDA build of gdnkit")
    from gdnkit.bench import load_flashinfer

    peer, why = load_flashinfer()
    if peer is None:
        pytest.skip(f"FlashInfer does not load ({why}); on the GPU machine run .peers/flashinfer/setup.sh first")
    yield peer
    # the prebuilt bundle answers every `import cutlass` with a stub: take it out of the import system again,
    # so that later tests of this process (torch.compile's backends) see no cutlass
    sys.meta_path[:] = [f for f in sys.meta_path if type(f).__name__ != "_StubFinder"]
    for name in [m for m in sys.modules if m == "cutlass" or m.startswith("cutlass.")]:
        if type(sys.modules[name]).__name__ == "StubModule":
            del sys.modules[name]
    aot = sys.modules.get("fi_aot")
    if aot is not None:
        aot._gdnkit_installed = False


def _fi_checks():
    """Shapes FlashInfer's prebuilt bundle has kernels for (its own correctness checks): prefill (H, HV, lens),
    decode B, verify T, with H=16, HV=32, K=V=128; the same shapes with an installed FlashInfer."""
    aot = sys.modules.get("fi_aot")
    if aot is not None:
        return list(aot.PREFILL_CHECKS), aot.DECODE_CHECK_B, aot.VERIFY_CHECK_T
    return [(16, 32, (200,)), (2, 8, (130,)), (16, 32, (70, 5, 64, 129, 70, 5, 64, 129))], 3, 4


def _fi_run(peer, fn, *args, **kwargs):
    try:
        out = fn(*args, **kwargs)
        torch.cuda.synchronize()
        return out
    except Exception as e:  # noqa: BLE001
        if peer.is_missing_kernel(e):
            pytest.skip(f"FlashInfer: not prebuilt ({e})")
        raise


def test_signatures_match_flashinfer(flashinfer):
    import flashinfer.gdn_decode as fd
    import flashinfer.gdn_prefill as fp

    for ours, theirs in ((fi.chunk_gated_delta_rule, fp.chunk_gated_delta_rule),
                         (fi.gated_delta_rule_decode_pretranspose, fd.gated_delta_rule_decode_pretranspose),
                         (fi.gated_delta_rule_mtp, fd.gated_delta_rule_mtp),
                         (fi.gated_delta_rule_decode, fd.gated_delta_rule_decode)):
        a = [(x.name, x.kind, x.default) for x in inspect.signature(ours).parameters.values()]
        b = [(x.name, x.kind, x.default) for x in inspect.signature(inspect.unwrap(theirs)).parameters.values()]
        assert a == b, ours.__name__


@pytest.mark.parametrize("case", [0, 1, 2])
@pytest.mark.parametrize("l2", [False, True])
def test_prefill_vs_flashinfer(flashinfer, case, l2):
    checks, _, _ = _fi_checks()
    if case >= len(checks):
        pytest.skip("no such check shape")
    Hq, Hv, lens = checks[case]
    lens = list(lens)
    Kd = 128
    g = gen("fi-prefill", case, l2)
    T, N = sum(lens), len(lens)
    q, k = randn(g, T, Hq, Kd, device="cuda"), randn(g, T, Hq, Kd, device="cuda")
    if not l2:  # FlashInfer's kernel alone expects normalized q/k
        q, k = torch.nn.functional.normalize(q, dim=-1), torch.nn.functional.normalize(k, dim=-1)
    q, k = q.to(torch.bfloat16), k.to(torch.bfloat16)
    v = randn(g, T, Hv, Kd, dtype=torch.bfloat16, device="cuda")
    A_log = torch.log(torch.linspace(0.02, 0.3, Hv)).cuda()
    a, b = randn(g, T, Hv, device="cuda"), randn(g, T, Hv, device="cuda")
    alpha = torch.exp(-torch.exp(A_log) * torch.nn.functional.softplus(a + 0.5)).contiguous()
    beta = torch.sigmoid(b).contiguous()
    cu = torch.tensor(np.concatenate([[0], np.cumsum(lens)]), dtype=torch.int32, device="cuda")
    h0 = randn(g, N, Hv, Kd, Kd, device="cuda", scale=0.5)
    res = {}
    for name, fn in (("flashinfer", flashinfer.prefill), ("gdnkit", fi.chunk_gated_delta_rule)):
        o = torch.empty(T, Hv, Kd, dtype=torch.bfloat16, device="cuda")
        st = torch.empty(N, Hv, Kd, Kd, device="cuda")
        run = _fi_run if name == "flashinfer" else (lambda _p, f, *a_, **k_: call(f, *a_, **k_))
        res[name] = run(flashinfer, fn, q, k, v, g=alpha, beta=beta, scale=None, initial_state=h0,
                        output_final_state=True, cu_seqlens=cu, use_qk_l2norm_in_kernel=l2, output=o,
                        output_state=st, max_seqlen=max(lens))
    (o_ref, s_ref), (o, s) = res["flashinfer"], res["gdnkit"]
    assert o.shape == o_ref.shape and s.shape == s_ref.shape and o.dtype == o_ref.dtype
    assert rel(f64(o), f64(o_ref)) < 1e-2
    assert rel(f64(s), f64(s_ref)) < 1e-2


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("verify", [False, True])
def test_decode_vs_flashinfer(flashinfer, state_dtype, verify):
    _, B, Tv = _fi_checks()
    T = Tv if verify else 1
    Hq, Hv, Kd = 16, 32, 128
    g = gen("fi-decode", str(state_dtype), verify)
    q, k = randn(g, B, T, Hq, Kd, dtype=torch.bfloat16, device="cuda"), randn(g, B, T, Hq, Kd,
                                                                             dtype=torch.bfloat16, device="cuda")
    v = randn(g, B, T, Hv, Kd, dtype=torch.bfloat16, device="cuda")
    a, b = randn(g, B, T, Hv, dtype=torch.bfloat16, device="cuda"), randn(g, B, T, Hv, dtype=torch.bfloat16,
                                                                          device="cuda")
    A_log = torch.log(torch.linspace(0.02, 0.3, Hv)).cuda()
    dt_bias = randn(g, Hv, device="cuda", scale=0.5)
    pool0 = randn(g, 17, Hv, Kd, Kd, device="cuda", scale=0.5).to(state_dtype)
    idx = torch.tensor([5, 2, 9][:B] + list(range(10, 10 + max(0, B - 3))), dtype=torch.int32, device="cuda")
    res = {}
    for name, fn in (("flashinfer", flashinfer.decode), ("gdnkit", fi.gated_delta_rule_decode_pretranspose)):
        pool = pool0.clone()
        inter = torch.empty(B, T, Hv, Kd, Kd, device="cuda", dtype=state_dtype) if verify else None
        kw = dict(scale=None, output=torch.empty(B, T, Hv, Kd, dtype=torch.bfloat16, device="cuda"),
                  use_qk_l2norm=True, initial_state=pool, initial_state_indices=idx)
        if verify:
            kw.update(intermediate_states_buffer=inter, disable_state_update=True)
        if name == "flashinfer":
            o, _ = _fi_run(flashinfer, fn, q, k, v, None, A_log, a, dt_bias, b, backend="flashinfer", **kw)
        else:
            o, _ = call(fn, q, k, v, None, A_log, a, dt_bias, b, **kw)
        res[name] = (o, pool, inter)
    (o_ref, p_ref, i_ref), (o, p, i) = res["flashinfer"], res["gdnkit"]
    tol_ = 3e-2 if state_dtype == torch.bfloat16 else 1e-2
    assert rel(f64(o), f64(o_ref)) < tol_
    sl = idx.long()
    if verify:
        assert rel(f64(i), f64(i_ref)) < tol_
        assert torch.equal(p, pool0), "gdnkit changed the pool with disable_state_update"
    else:
        assert rel(f64(p[sl]), f64(p_ref[sl])) < tol_
