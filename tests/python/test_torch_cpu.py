"""PyTorch on the CPU backend: DLPack round trips (bf16 included), the torch.library custom ops, and the
FLA / SGLang adapters' argument handling vs the fp64 recurrence. Skipped (visibly) without torch."""

import zlib

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed: torch tests skipped")

import gdnkit  # noqa: E402
import gdnkit.torch_ops  # noqa: E402,F401
from gdnkit.adapters import fla as fla_adapter  # noqa: E402
from gdnkit.adapters import sglang as sglang_adapter  # noqa: E402
from reference import fused_gates, rel, run_tokens, sigmoid  # noqa: E402


def gen(*key):
    g = torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))
    return g


def randn(g, *shape, dtype=torch.float32):
    return torch.randn(*shape, generator=g).to(dtype)


def f64(t):
    return t.detach().to(torch.float64).numpy()


def ref_seq(S0, q, k, v, g, beta, scale=None, l2norm=True):
    """q, k [T, H, K], v [T, HV, V], g, beta [T, HV] (torch) from S0 [HV, K, V] (numpy)."""
    K = q.shape[-1]
    return run_tokens(S0, f64(q), f64(k), f64(v), np.asarray(g, np.float64), np.asarray(beta, np.float64),
                      K ** -0.5 if scale is None else scale, l2norm)


# ---- DLPack round trips -----------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
def test_decode_torch_dtypes(dtype, state_dtype):
    g = gen("decode-torch", str(dtype), str(state_dtype))
    B, H, HV, K, V, P = 4, 2, 4, 64, 128, 6
    q, k = randn(g, B, H, K, dtype=dtype), randn(g, B, H, K, dtype=dtype)
    v = randn(g, B, HV, V, dtype=dtype)
    a, b = randn(g, B, HV, dtype=dtype), randn(g, B, HV, dtype=dtype)
    A_log = torch.log(torch.rand(HV, generator=g) * 15 + 1)
    dt_bias = 0.5 * randn(g, HV)
    pool = (0.1 * randn(g, P, HV, V, K)).to(state_dtype)
    before = pool.clone()
    slots = torch.tensor([5, 0, 3, 2], dtype=torch.int32)
    o = gdnkit.decode(q, k, v, pool, slots, layout="k_last", a=a, b=b, A_log=A_log, dt_bias=dt_bias)
    assert isinstance(o, torch.Tensor) and o.dtype == dtype and o.shape == v.shape
    gg, bb = fused_gates(f64(a), f64(b), f64(A_log), f64(dt_bias))
    dt_name = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}[dtype]
    o_tol = {"bf16": 4e-3, "fp16": 4e-3, "fp32": 5e-5}[dt_name]
    s_tol = 1e-5 if state_dtype == torch.float32 else 8e-3
    for i, s in enumerate(slots.tolist()):
        S0 = np.swapaxes(f64(before[s]), -1, -2)
        ref_o, ref_S = ref_seq(S0, q[i:i + 1], k[i:i + 1], v[i:i + 1], gg[i:i + 1], bb[i:i + 1])
        assert rel(f64(o[i]), ref_o[0]) < o_tol
        assert rel(np.swapaxes(f64(pool[s]), -1, -2), ref_S) < s_tol
    assert torch.equal(pool[1], before[1]) and torch.equal(pool[4], before[4])


def test_torch_and_numpy_agree_and_views():
    """The same fp32 problem through torch views of one fused projection and through NumPy copies."""
    g = gen("views")
    T, H, HV, K, V = 5, 1, 2, 64, 64
    proj = randn(g, T, 2 * H * K + HV * V + 2 * HV)
    q = proj[:, :H * K].view(T, H, K)
    k = proj[:, H * K:2 * H * K].view(T, H, K)
    v = proj[:, 2 * H * K:2 * H * K + HV * V].view(T, HV, V)
    gate = proj[:, -2 * HV:]
    a, b = gate[:, :HV], gate[:, HV:]  # strided per-head scalars
    A_log, dt_bias = torch.zeros(HV), torch.zeros(HV)
    pool_t = 0.1 * randn(g, T, HV, V, K)
    pool_n = pool_t.numpy().copy()
    slots = torch.arange(T, dtype=torch.int32)
    o_t = gdnkit.decode(q, k, v, pool_t, slots, a=a, b=b, A_log=A_log, dt_bias=dt_bias)
    o_n = gdnkit.decode(q.contiguous().numpy(), k.contiguous().numpy(), v.contiguous().numpy(), pool_n,
                        slots.numpy(), a=a.contiguous().numpy(), b=b.contiguous().numpy(), A_log=A_log.numpy(),
                        dt_bias=dt_bias.numpy())
    assert np.array_equal(o_t.numpy(), o_n)
    assert np.array_equal(pool_t.numpy(), pool_n)


def test_requires_grad_inputs_are_read():
    g = gen("grad")
    q = randn(g, 2, 1, 64).requires_grad_()
    k, v = randn(g, 2, 1, 64), randn(g, 2, 1, 64)
    pool = torch.zeros(2, 1, 64, 64)
    o = gdnkit.decode(q, k, v, pool, torch.tensor([0, 1], dtype=torch.int32), g=torch.zeros(2, 1),
                      beta=torch.ones(2, 1))
    assert torch.isfinite(o).all() and not o.requires_grad


def test_cuda_tensor_mixed_with_cpu_is_named():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device to build a mixed-device call")
    q = torch.randn(2, 1, 64)
    with pytest.raises(gdnkit.GdnkitError, match=r"^v: is on cuda:0 but q is on cpu"):
        gdnkit.decode(q, q, q.cuda(), torch.zeros(2, 1, 64, 64), torch.zeros(2, dtype=torch.int32),
                      g=torch.zeros(2, 1), beta=torch.ones(2, 1))


# ---- custom ops -------------------------------------------------------------------------------

def small_decode_args(g, B=3, P=5):
    H, HV, K, V = 1, 2, 64, 64
    return dict(q=randn(g, B, H, K), k=randn(g, B, H, K), v=randn(g, B, HV, V),
                state=0.1 * randn(g, P, HV, V, K), state_indices=torch.tensor([4, 0, 2], dtype=torch.int32)[:B],
                error_flag=None, a=randn(g, B, HV), b=randn(g, B, HV), A_log=torch.zeros(HV), dt_bias=torch.zeros(HV))


def test_custom_op_matches_ops():
    g = gen("custom-op")
    args = small_decode_args(g)
    args2 = {n: (t.clone() if t is not None else None) for n, t in args.items()}
    o1 = torch.ops.gdnkit.decode(**args)
    o2 = gdnkit.decode(args2.pop("q"), args2.pop("k"), args2.pop("v"), args2.pop("state"),
                       args2.pop("state_indices"), **args2)
    assert torch.equal(o1, o2)


@pytest.mark.parametrize("flag", [False, True])
def test_custom_op_opcheck(flag):
    g = gen("opcheck", flag)
    args = small_decode_args(g)
    if flag:
        args["error_flag"] = torch.zeros(1, dtype=torch.int32)
    torch.library.opcheck(torch.ops.gdnkit.decode.default, (), args,
                          test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_dynamic"))


def test_custom_op_compiles():
    """A small GDN decode layer under torch.compile (aot_eager on CPU: functionalization of the mutated pool)."""
    g = gen("compile")
    args = small_decode_args(g)
    proj = torch.nn.Linear(8, 2 * 64 + 2 * 64 + 4, bias=False)

    def layer(x, state, slots):
        y = proj(x)
        q = y[:, :64].view(-1, 1, 64)
        k = y[:, 64:128].view(-1, 1, 64)
        v = y[:, 128:256].view(-1, 2, 64)
        a, b = y[:, 256:258], y[:, 258:260]
        return torch.ops.gdnkit.decode(q, k, v, state, slots, None, a=a, b=b, A_log=args["A_log"],
                                       dt_bias=args["dt_bias"]).sum(-1)

    x = randn(g, 3, 8)
    state_eager = args["state"].clone()
    state_comp = args["state"].clone()
    with torch.no_grad():
        ref = layer(x, state_eager, args["state_indices"])
        out = torch.compile(layer, backend="aot_eager", fullgraph=True)(x, state_comp, args["state_indices"])
    assert torch.equal(out, ref)
    assert torch.equal(state_comp, state_eager)


# ---- FLA adapter ------------------------------------------------------------------------------

def fla_problem(g, B, T, H=2, HV=4, K=64, V=128, dtype=torch.float32):
    return dict(q=randn(g, B, T, H, K, dtype=dtype), k=randn(g, B, T, H, K, dtype=dtype),
                v=randn(g, B, T, HV, V, dtype=dtype), g=-torch.rand(B, T, HV, generator=g) * 0.5,
                beta=torch.rand(B, T, HV, generator=g).to(dtype))


def check_fla(p, o, final, S0, cu, state_v_first=False, g=None, beta=None, l2norm=True, o_tol=2e-3, s_tol=5e-3):
    """o [B, T, HV, V] and final [N, HV, K, V] vs the recurrence per sequence."""
    g = p["g"] if g is None else g
    beta = p["beta"] if beta is None else beta
    flat = {n: t.reshape(-1, *t.shape[2:]) for n, t in dict(q=p["q"], k=p["k"], v=p["v"]).items()}
    g, beta = f64(g.reshape(-1, g.shape[-1])), f64(beta.reshape(-1, beta.shape[-1]))
    o = o.reshape(-1, *o.shape[2:])
    HV, K, V = p["v"].shape[2], p["q"].shape[3], p["v"].shape[3]
    for n in range(len(cu) - 1):
        r = slice(cu[n], cu[n + 1])
        s0 = np.zeros((HV, K, V)) if S0 is None else f64(S0[n])
        if state_v_first and S0 is not None:
            s0 = np.swapaxes(s0, -1, -2)
        ref_o, ref_S = ref_seq(s0, flat["q"][r], flat["k"][r], flat["v"][r], g[r], beta[r], l2norm=l2norm)
        if cu[n + 1] > cu[n]:
            assert rel(f64(o[r]), ref_o) < o_tol
        if final is not None:
            f = f64(final[n])
            assert rel(np.swapaxes(f, -1, -2) if state_v_first else f, ref_S) < s_tol


@pytest.mark.parametrize("fn", ["chunk", "recurrent"])
@pytest.mark.parametrize("T", [1, 4, 70])
def test_fla_fixed_length(fn, T):
    g = gen("fla-fixed", fn, T)
    B = 3
    p = fla_problem(g, B, T)
    h0 = 0.1 * randn(g, B, 4, 64, 128)
    h0_copy = h0.clone()
    if fn == "chunk":
        o, ht = fla_adapter.chunk_gated_delta_rule(p["q"], p["k"], p["v"], p["g"], p["beta"], initial_state=h0,
                                                   output_final_state=True, use_qk_l2norm_in_kernel=True)
    else:
        o, ht = fla_adapter.fused_recurrent_gated_delta_rule(p["q"], p["k"], p["v"], g=p["g"], beta=p["beta"],
                                                             initial_state=h0, output_final_state=True,
                                                             use_qk_l2norm_in_kernel=True)
    assert o.shape == p["v"].shape and o.dtype == p["v"].dtype
    assert ht.shape == (B, 4, 64, 128) and ht.dtype == torch.float32
    assert torch.equal(h0, h0_copy), "initial_state was modified"
    check_fla(p, o, ht, h0, [i * T for i in range(B + 1)])


@pytest.mark.parametrize("fn", ["chunk", "recurrent"])
def test_fla_varlen_state_v_first(fn):
    g = gen("fla-varlen", fn)
    lens = [20, 0, 45]
    cu = torch.tensor([0, 20, 20, 65], dtype=torch.int64)
    p = fla_problem(g, 1, sum(lens))
    h0 = 0.1 * randn(g, 3, 4, 128, 64)  # [N, HV, V, K]
    f = fla_adapter.chunk_gated_delta_rule if fn == "chunk" else fla_adapter.fused_recurrent_gated_delta_rule
    kw = dict(g=p["g"], beta=p["beta"])
    o, ht = f(p["q"], p["k"], p["v"], **kw, initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True,
              cu_seqlens=cu, state_v_first=True)
    assert ht.shape == (3, 4, 128, 64)
    check_fla(p, o, ht, h0, cu.tolist(), state_v_first=True)


def test_fla_no_initial_no_final_and_defaults():
    g = gen("fla-defaults")
    p = fla_problem(g, 2, 3)
    o, ht = fla_adapter.fused_recurrent_gated_delta_rule(p["q"], p["k"], p["v"])  # g None, beta None
    assert ht is None
    check_fla(p, o, None, None, [0, 3, 6], g=torch.zeros(2, 3, 4), beta=torch.ones(2, 3, 4), l2norm=False,
              o_tol=5e-5)
    o2, ht2 = fla_adapter.chunk_gated_delta_rule(p["q"], p["k"], p["v"], p["g"], p["beta"], scale=0.2)
    assert ht2 is None
    flat = {n: t.reshape(-1, *t.shape[2:]) for n, t in p.items()}
    ref_o, _ = run_tokens(np.zeros((4, 64, 128)), f64(flat["q"][:3]), f64(flat["k"][:3]), f64(flat["v"][:3]),
                          f64(flat["g"][:3]), f64(flat["beta"][:3]), 0.2, False)
    assert rel(f64(o2[0]), ref_o) < 2e-3


@pytest.mark.parametrize("gate_in_kernel", [False, True])
@pytest.mark.parametrize("beta_sigmoid", [False, True])
def test_fla_gate_options(gate_in_kernel, beta_sigmoid):
    g = gen("fla-gates", gate_in_kernel, beta_sigmoid)
    B, T, HV = 2, 6, 4
    p = fla_problem(g, B, T)
    raw_a, raw_b = randn(g, B, T, HV), randn(g, B, T, HV)
    A_log = torch.log(torch.rand(HV, generator=g) * 15 + 1)
    dt_bias = 0.5 * randn(g, HV)
    gate = raw_a if gate_in_kernel else p["g"]
    beta = raw_b if beta_sigmoid else p["beta"]
    o, ht = fla_adapter.fused_recurrent_gated_delta_rule(
        p["q"], p["k"], p["v"], g=gate, beta=beta, output_final_state=True, use_qk_l2norm_in_kernel=True,
        use_gate_in_kernel=gate_in_kernel, A_log=A_log, dt_bias=dt_bias, use_beta_sigmoid_in_kernel=beta_sigmoid)
    fg, _ = fused_gates(f64(raw_a.reshape(-1, HV)), f64(raw_b.reshape(-1, HV)), f64(A_log), f64(dt_bias))
    ref_g = torch.from_numpy(fg).reshape(B, T, HV) if gate_in_kernel else p["g"]
    ref_beta = torch.from_numpy(sigmoid(f64(raw_b))) if beta_sigmoid else p["beta"]
    check_fla(p, o, ht, None, [0, T, 2 * T], g=ref_g, beta=ref_beta, o_tol=5e-5, s_tol=1e-5)


def test_fla_bf16():
    g = gen("fla-bf16")
    p = fla_problem(g, 2, 33, dtype=torch.bfloat16)
    o, ht = fla_adapter.chunk_gated_delta_rule(p["q"], p["k"], p["v"], p["g"], p["beta"], output_final_state=True,
                                               use_qk_l2norm_in_kernel=True)
    assert o.dtype == torch.bfloat16
    check_fla(p, o, ht, None, [0, 33, 66], o_tol=5e-3, s_tol=5e-3)


def test_fla_unsupported_options():
    g = gen("fla-unsupported")
    p = fla_problem(g, 1, 2)
    with pytest.raises(NotImplementedError, match="gk / gv"):
        fla_adapter.fused_recurrent_gated_delta_rule(p["q"], p["k"], p["v"], gk=torch.zeros(1, 2, 4, 64))
    with pytest.raises(NotImplementedError, match="allow_neg_eigval"):
        fla_adapter.chunk_gated_delta_rule(p["q"], p["k"], p["v"], p["g"], p["beta"], allow_neg_eigval=True,
                                           use_beta_sigmoid_in_kernel=True)
    with pytest.raises(NotImplementedError, match="cp_context"):
        fla_adapter.chunk_gated_delta_rule(p["q"], p["k"], p["v"], p["g"], p["beta"], cp_context=object())
    with pytest.raises(NotImplementedError, match="head-wise beta"):
        fla_adapter.chunk_gated_delta_rule(p["q"], p["k"], p["v"], p["g"], torch.rand(1, 2, 4, 128))
    with pytest.raises(NotImplementedError, match="autograd"):
        fla_adapter.chunk_gated_delta_rule(p["q"].requires_grad_(), p["k"], p["v"], p["g"], p["beta"])
    with torch.no_grad():
        fla_adapter.chunk_gated_delta_rule(p["q"], p["k"], p["v"], p["g"], p["beta"])
    with pytest.raises(ValueError, match="batch size is expected to be 1"):
        fla_adapter.chunk_gated_delta_rule(torch.zeros(2, 2, 2, 64), torch.zeros(2, 2, 2, 64),
                                           torch.zeros(2, 2, 4, 128), p["g"].expand(2, 2, 4),
                                           p["beta"].expand(2, 2, 4), cu_seqlens=torch.tensor([0, 2, 4]))


# ---- SGLang adapter ---------------------------------------------------------------------------

def sglang_problem(g, B, T, H=2, HV=4, K=64, V=128, P=9):
    return dict(A_log=torch.log(torch.rand(HV, generator=g) * 15 + 1), a=randn(g, B * T, HV),
                dt_bias=0.5 * randn(g, HV), q=randn(g, B, T, H, K), k=randn(g, B, T, H, K),
                v=randn(g, B, T, HV, V), b=randn(g, B * T, HV), pool=0.1 * randn(g, P, HV, V, K))


def sglang_ref(p, rows, S0):
    gg, bb = fused_gates(f64(p["a"][rows]), f64(p["b"][rows]), f64(p["A_log"]), f64(p["dt_bias"]))
    q, k, v = (p[n].reshape(-1, *p[n].shape[2:])[rows] for n in "qkv")
    return run_tokens(S0, f64(q), f64(k), f64(v), gg, bb, q.shape[-1] ** -0.5, True, keep_states=True)


def test_sglang_decode_cu_seqlens():
    g = gen("sglang-decode")
    B = 4
    p = sglang_problem(g, 1, B)  # decode as SGLang calls it: q [1, B, H, K], cu_seqlens 0..B
    idx = torch.tensor([7, -1, 2, 5], dtype=torch.int32)
    before = p["pool"].clone()
    o = sglang_adapter.fused_sigmoid_gating_delta_rule_update(
        p["A_log"], p["a"], p["dt_bias"], 1.0, 20.0, p["q"], p["k"], p["v"], p["b"], p["pool"], idx,
        use_qk_l2norm_in_kernel=True, cu_seqlens=torch.arange(B + 1, dtype=torch.int32))
    assert o.shape == p["v"].shape
    for i, s in enumerate(idx.tolist()):
        if s < 0:
            assert torch.all(o[0, i] == 0)
            continue
        ref_o, ref_S, _ = sglang_ref(p, slice(i, i + 1), np.swapaxes(f64(before[s]), -1, -2))
        assert rel(f64(o[0, i]), ref_o[0]) < 5e-5
        assert rel(np.swapaxes(f64(p["pool"][s]), -1, -2), ref_S) < 1e-5
    for s in set(range(9)) - {7, 2, 5}:
        assert torch.equal(p["pool"][s], before[s])


@pytest.mark.parametrize("tree", [False, True])
def test_sglang_target_verify(tree):
    g = gen("sglang-verify", tree)
    B, T = 3, 4
    p = sglang_problem(g, 1, B * T)
    idx = torch.tensor([4, 1, 6], dtype=torch.int32)
    iidx = torch.tensor([2, 0, 1], dtype=torch.int32)
    inter = torch.full((3, T, 4, 128, 64), float("nan"))
    parent = None
    if tree:
        parent = torch.tensor([[-1, 0, 0, 1], [-1, 0, 1, 2], [-1, 0, 1, 1]], dtype=torch.int64)
    before = p["pool"].clone()
    o = sglang_adapter.fused_sigmoid_gating_delta_rule_update(
        p["A_log"], p["a"], p["dt_bias"], 1.0, 20.0, p["q"], p["k"], p["v"], p["b"], p["pool"], idx,
        use_qk_l2norm_in_kernel=True, cu_seqlens=torch.arange(0, B * T + 1, T, dtype=torch.int32),
        disable_state_update=True, intermediate_states_buffer=inter, intermediate_state_indices=iidx,
        cache_steps=T, retrieve_parent_token=parent)
    assert torch.equal(p["pool"], before), "disable_state_update: pool must not change"
    for bi in range(B):
        S0 = np.swapaxes(f64(before[idx[bi]]), -1, -2)
        states = []
        for t in range(T):
            par = t - 1 if parent is None else int(parent[bi, t])
            r = bi * T + t
            ref_o, ref_S, _ = sglang_ref(p, slice(r, r + 1), S0 if par < 0 else states[par])
            states.append(ref_S)
            assert rel(f64(o[0, r]), ref_o[0]) < 5e-5
            assert rel(np.swapaxes(f64(inter[iidx[bi], t]), -1, -2), ref_S) < 1e-5


@pytest.mark.parametrize("T", [3, 80])
def test_sglang_fixed_length_updates_state(T):
    g = gen("sglang-fixed", T)
    B = 2
    p = sglang_problem(g, B, T)
    idx = torch.tensor([3, 8], dtype=torch.int32)
    before = p["pool"].clone()
    o = sglang_adapter.fused_sigmoid_gating_delta_rule_update(
        p["A_log"], p["a"], p["dt_bias"], 1.0, 20.0, p["q"], p["k"], p["v"], p["b"], p["pool"], idx,
        use_qk_l2norm_in_kernel=True)
    tol_o, tol_s = (5e-5, 1e-5) if T <= 64 else (2e-3, 5e-3)
    for bi in range(B):
        ref_o, ref_S, _ = sglang_ref(p, slice(bi * T, bi * T + T), np.swapaxes(f64(before[idx[bi]]), -1, -2))
        assert rel(f64(o[bi]), ref_o) < tol_o
        assert rel(np.swapaxes(f64(p["pool"][idx[bi]]), -1, -2), ref_S) < tol_s


def test_sglang_unsupported():
    g = gen("sglang-unsupported")
    p = sglang_problem(g, 1, 2)
    args = (p["A_log"], p["a"], p["dt_bias"])
    rest = (p["q"], p["k"], p["v"], p["b"], p["pool"], torch.tensor([0], dtype=torch.int32))
    with pytest.raises(NotImplementedError, match="is_kda"):
        sglang_adapter.fused_sigmoid_gating_delta_rule_update(*args, 1.0, 20.0, *rest, is_kda=True)
    with pytest.raises(NotImplementedError, match="softplus_beta=2.0"):
        sglang_adapter.fused_sigmoid_gating_delta_rule_update(*args, 2.0, 20.0, *rest)
