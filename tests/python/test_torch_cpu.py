"""PyTorch on the CPU backend: DLPack round trips (bf16 included) and the torch.library custom ops. Skipped
(visibly) without torch. The adapters (gdnkit.adapters.*) are tested in test_adapters_*.py."""

import zlib

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed: torch tests skipped")

import gdnkit  # noqa: E402
import gdnkit.torch_ops  # noqa: E402,F401
from reference import fused_gates, rel, run_tokens  # noqa: E402


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
    pool = 0.1 * randn(g, 2, 1, 64, 64)
    pool_plain = pool.clone()
    slots, gates = torch.tensor([0, 1], dtype=torch.int32), dict(g=-0.1 * torch.ones(2, 1), beta=0.5 * torch.ones(2, 1))
    o = gdnkit.decode(q, k, v, pool, slots, **gates)
    o_plain = gdnkit.decode(q.detach().clone(), k, v, pool_plain, slots, **gates)  # the same values, no grad
    assert not o.requires_grad
    assert torch.equal(o, o_plain) and torch.equal(pool, pool_plain) and torch.isfinite(o).all()


def test_cuda_tensor_mixed_with_cpu_is_named():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device to build a mixed-device call")
    q = torch.randn(2, 1, 64)
    with pytest.raises(gdnkit.GdnkitError, match=r"^v: is on cuda:0 but q is on cpu"):
        gdnkit.decode(q, q, q.cuda(), torch.zeros(2, 1, 64, 64), torch.zeros(2, dtype=torch.int32),
                      g=torch.zeros(2, 1), beta=torch.ones(2, 1))


# ---- float8_e4m3fn states: the pool, caches and checkpoints with their block scales --------------------
#
# An fp8 array (torch.float8_e4m3fn) and its scales (uint8, one E8M0 byte per 32 elements of a head in its layout)
# against an fp32 twin holding the dequantized values: the CPU backend computes in the same precision either way,
# so the outputs agree to fp32 rounding and the stored fp8 states dequantize to the twin's states within e4m3's
# rounding (2^-4 per element, rel ~2e-2 over a state); untouched slots and scales stay bit-identical.

FP8_BLOCK = 32


def fp8_states(g, lead, HV, K, V):
    """Random e4m3 values and scale bytes for `lead` entries ([lead..., HV, V, K] k_last) and their fp32 value."""
    x = randn(g, *lead, HV, V, K).to(torch.float8_e4m3fn)
    n = int(np.prod(lead))
    scales = torch.randint(118, 126, (n, HV * V * K // FP8_BLOCK), generator=g, dtype=torch.uint8)
    return x, scales, dequant(x, scales)


def dequant(x, scales):
    f = x.to(torch.float32).reshape(scales.shape[0], -1, FP8_BLOCK)
    sc = torch.pow(2.0, scales.to(torch.float32) - 127).reshape(scales.shape[0], -1, 1)
    return (f * sc).reshape(x.shape)


def fp8_tokens(g, T, H, HV, K, V):
    return dict(q=randn(g, T, H, K), k=randn(g, T, H, K), v=randn(g, T, HV, V), a=randn(g, T, HV),
                b=randn(g, T, HV), A_log=torch.log(torch.rand(HV, generator=g) * 15 + 1), dt_bias=0.5 * randn(g, HV))


def test_fp8_pool_decode_verify_commit_against_fp32_twin():
    g = gen("fp8-steps")
    B, T, H, HV, K, V, P = 3, 3, 1, 2, 64, 64, 5
    pool, pscales, twin = fp8_states(g, (P,), HV, K, V)
    pool0, pscales0 = pool.clone(), pscales.clone()
    slots = torch.tensor([4, 0, 2], dtype=torch.int32)
    tok = fp8_tokens(g, B, H, HV, K, V)
    gates = dict(a=tok["a"], b=tok["b"], A_log=tok["A_log"], dt_bias=tok["dt_bias"])
    o8 = gdnkit.decode(tok["q"], tok["k"], tok["v"], pool, slots, state_scales=pscales, **gates)
    o32 = gdnkit.decode(tok["q"], tok["k"], tok["v"], twin, slots, **gates)
    assert rel(f64(o8), f64(o32)) < 1e-6
    for s in slots.tolist():
        assert rel(f64(dequant(pool[s:s + 1], pscales[s:s + 1])), f64(twin[s:s + 1])) < 3e-2
    for s in (1, 3):
        assert torch.equal(pool[s].view(torch.uint8), pool0[s].view(torch.uint8))
        assert torch.equal(pscales[s], pscales0[s])

    # verify with an fp8 cache, then commit from it: the kept state is the cached bytes
    twin = dequant(pool, pscales)
    tv = fp8_tokens(g, B * T, H, HV, K, V)
    gates = dict(a=tv["a"], b=tv["b"], A_log=tv["A_log"], dt_bias=tv["dt_bias"])
    cache = torch.full((B, T, HV, V, K), float("nan")).to(torch.float8_e4m3fn)
    cscales = torch.zeros(B * T, HV * V * K // FP8_BLOCK, dtype=torch.uint8)
    cache32 = torch.full((B, T, HV, V, K), float("nan"))
    cidx = torch.tensor([2, 0, 1], dtype=torch.int32)
    o8 = gdnkit.verify(tv["q"], tv["k"], tv["v"], pool, slots, intermediate=cache, intermediate_indices=cidx,
                       state_scales=pscales, intermediate_scales=cscales, **gates)
    o32 = gdnkit.verify(tv["q"], tv["k"], tv["v"], twin, slots, intermediate=cache32, intermediate_indices=cidx,
                        **gates)
    assert rel(f64(o8), f64(o32)) < 1e-6
    got = dequant(cache.reshape(B * T, HV, V, K), cscales).reshape(cache.shape)
    assert rel(f64(got), f64(cache32)) < 3e-2
    accepted = torch.tensor([2, 0, 3], dtype=torch.int32)
    gdnkit.commit(tv["k"], tv["v"], pool, slots, accepted, source="cache", intermediate=cache,
                  intermediate_indices=cidx, state_scales=pscales, intermediate_scales=cscales, **gates)
    for b, s in enumerate(slots.tolist()):
        if accepted[b] == 0:
            continue
        entry = int(cidx[b]) * T + int(accepted[b]) - 1
        assert torch.equal(pool[s].view(torch.uint8), cache[int(cidx[b]), int(accepted[b]) - 1].view(torch.uint8))
        assert torch.equal(pscales[s], cscales[entry])


def test_fp8_pool_prefill_with_fp8_checkpoints_against_fp32_twin():
    g = gen("fp8-prefill")
    H, HV, K, V, P = 1, 2, 64, 64, 3
    lens = [130, 64]
    pool, pscales, twin = fp8_states(g, (P,), HV, K, V)
    tok = fp8_tokens(g, sum(lens), H, HV, K, V)
    cu = torch.tensor([0, lens[0], sum(lens)], dtype=torch.int32)
    init, fin = torch.tensor([0, -1], dtype=torch.int32), torch.tensor([2, 1], dtype=torch.int32)
    ck8 = torch.zeros(2, 2, HV, V, K).to(torch.float8_e4m3fn)
    ck_scales = torch.zeros(4, HV * V * K // FP8_BLOCK, dtype=torch.uint8)
    ck32 = torch.zeros(2, 2, HV, V, K)
    cidx = torch.tensor([1, 0], dtype=torch.int32)
    common = dict(a=tok["a"], b=tok["b"], A_log=tok["A_log"], dt_bias=tok["dt_bias"], initial_indices=init,
                  final_indices=fin, checkpoint_interval=64, checkpoint_indices=cidx, cpu_algorithm="recurrent")
    o8 = gdnkit.prefill(tok["q"], tok["k"], tok["v"], cu, state=pool, state_scales=pscales, checkpoints=ck8,
                        checkpoint_scales=ck_scales, **common)
    o32 = gdnkit.prefill(tok["q"], tok["k"], tok["v"], cu, state=twin, checkpoints=ck32, **common)
    assert rel(f64(o8), f64(o32)) < 1e-6
    for s in (1, 2):
        assert rel(f64(dequant(pool[s:s + 1], pscales[s:s + 1])), f64(twin[s:s + 1])) < 3e-2
    got = dequant(ck8.reshape(4, HV, V, K), ck_scales).reshape(ck8.shape)
    assert rel(f64(got), f64(ck32)) < 3e-2


def test_fp8_pool_layout_round_trip():
    g = gen("fp8-layout")
    HV, K, V, P = 2, 64, 64, 3
    pool, pscales, twin = fp8_states(g, (P,), HV, K, V)
    dst = torch.empty(P, HV, K, V).to(torch.float8_e4m3fn)
    dscales = torch.empty_like(pscales)
    gdnkit.convert_layout(pool, src_layout="k_last", dst=dst, src_scales=pscales, dst_scales=dscales)
    back = dequant(dst, dscales)
    assert rel(f64(back.transpose(-1, -2)), f64(twin)) < 3e-2
    with pytest.raises(gdnkit.GdnkitError, match=r"^dst: required with src_scales"):
        gdnkit.convert_layout(pool, src_layout="k_last", src_scales=pscales)


def test_fp8_scales_named_in_errors():
    g = gen("fp8-errors")
    HV, K, V, P = 2, 64, 64, 3
    pool, pscales, twin = fp8_states(g, (P,), HV, K, V)
    tok = fp8_tokens(g, 2, 1, HV, K, V)
    slots = torch.tensor([0, 1], dtype=torch.int32)
    call = dict(a=tok["a"], b=tok["b"], A_log=tok["A_log"], dt_bias=tok["dt_bias"])
    before = pool.clone()
    with pytest.raises(gdnkit.GdnkitError, match=r"^state_scales: required with a float8_e4m3fn state \(uint8 "
                                                  r"\[P, HV\*K\*V/32\] = \[3, 256\]"):
        gdnkit.decode(tok["q"], tok["k"], tok["v"], pool, slots, **call)
    with pytest.raises(gdnkit.GdnkitError, match=r"^state_scales: expected dtype uint8 or float8_e8m0fnu, got int32"):
        gdnkit.decode(tok["q"], tok["k"], tok["v"], pool, slots, state_scales=pscales.to(torch.int32), **call)
    with pytest.raises(gdnkit.GdnkitError, match=r"^state_scales: expected \[P, HV\*K\*V/32\] = \[3, 256\] bytes, "
                                                  r"got shape \[2, 256\]"):
        gdnkit.decode(tok["q"], tok["k"], tok["v"], pool, slots, state_scales=pscales[:2], **call)
    with pytest.raises(gdnkit.GdnkitError, match=r"^state_scales: expected a contiguous array, got shape \[3, 256\]"):
        gdnkit.decode(tok["q"], tok["k"], tok["v"], pool, slots, state_scales=pscales.t().contiguous().t(), **call)
    with pytest.raises(gdnkit.GdnkitError, match=r"^state_scales: only with a float8_e4m3fn state, got state of "
                                                  r"dtype float32"):
        gdnkit.decode(tok["q"], tok["k"], tok["v"], twin, slots, state_scales=pscales, **call)
    assert torch.equal(pool.view(torch.uint8), before.view(torch.uint8))


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


# ---- custom ops on float8_e4m3fn pools --------------------------------------------------------------------------

def test_fp8_custom_ops_match_ops():
    """Each *_fp8 op writes the same bytes (states and scales) and outputs as the gdnkit function it wraps."""
    g = gen("fp8-custom-ops")
    B, T, H, HV, K, V, P = 2, 3, 1, 2, 64, 64, 4
    pool, pscales, _ = fp8_states(g, (P,), HV, K, V)
    slots = torch.tensor([3, 1], dtype=torch.int32)
    tok = fp8_tokens(g, B * T, H, HV, K, V)
    gates = dict(a=tok["a"], b=tok["b"], A_log=tok["A_log"], dt_bias=tok["dt_bias"])
    first = {n: x[:B] if x.dim() == 2 else x for n, x in gates.items()}

    def twins():
        return pool.clone(), pscales.clone()

    (p1, s1), (p2, s2) = twins(), twins()
    o1 = torch.ops.gdnkit.decode_fp8(tok["q"][:B], tok["k"][:B], tok["v"][:B], p1, s1, slots, None, **first)
    o2 = gdnkit.decode(tok["q"][:B], tok["k"][:B], tok["v"][:B], p2, slots, state_scales=s2, **first)
    assert torch.equal(o1, o2) and torch.equal(p1.view(torch.uint8), p2.view(torch.uint8)) and torch.equal(s1, s2)

    cache = [torch.zeros(B, T, HV, V, K).to(torch.float8_e4m3fn) for _ in range(2)]
    cscales = [torch.zeros(B * T, HV * V * K // FP8_BLOCK, dtype=torch.uint8) for _ in range(2)]
    cidx = torch.tensor([1, 0], dtype=torch.int32)
    (p1, s1), (p2, s2) = twins(), twins()
    o1 = torch.ops.gdnkit.verify_fp8(tok["q"], tok["k"], tok["v"], p1, s1, slots, cache[0], cscales[0], None,
                                     intermediate_indices=cidx, **gates)
    o2 = gdnkit.verify(tok["q"], tok["k"], tok["v"], p2, slots, intermediate=cache[1], intermediate_indices=cidx,
                       state_scales=s2, intermediate_scales=cscales[1], **gates)
    assert torch.equal(o1, o2)
    assert torch.equal(cache[0].view(torch.uint8), cache[1].view(torch.uint8))
    assert torch.equal(cscales[0], cscales[1])
    accepted = torch.tensor([2, 3], dtype=torch.int32)
    torch.ops.gdnkit.commit_fp8(tok["k"], tok["v"], p1, s1, slots, accepted, None, intermediate=cache[0],
                                intermediate_scales=cscales[0], intermediate_indices=cidx, **gates)
    gdnkit.commit(tok["k"], tok["v"], p2, slots, accepted, source="cache", intermediate=cache[1],
                  intermediate_indices=cidx, state_scales=s2, intermediate_scales=cscales[1], **gates)
    assert torch.equal(p1.view(torch.uint8), p2.view(torch.uint8)) and torch.equal(s1, s2)

    cu = torch.tensor([0, 2, B * T], dtype=torch.int32)
    (p1, s1), (p2, s2) = twins(), twins()
    o1 = torch.ops.gdnkit.prefill_fp8(tok["q"], tok["k"], tok["v"], cu, p1, s1, None, None, None,
                                      initial_indices=slots, final_indices=slots, **gates)
    o2 = gdnkit.prefill(tok["q"], tok["k"], tok["v"], cu, state=p2, state_scales=s2, initial_indices=slots,
                        final_indices=slots, **gates)
    assert torch.equal(o1, o2) and torch.equal(p1.view(torch.uint8), p2.view(torch.uint8)) and torch.equal(s1, s2)

    d1, ds1 = torch.ops.gdnkit.convert_layout_fp8(pool, pscales, "k_last")
    d2 = torch.empty(P, HV, K, V).to(torch.float8_e4m3fn)
    ds2 = torch.empty_like(pscales)
    gdnkit.convert_layout(pool, src_layout="k_last", dst=d2, src_scales=pscales, dst_scales=ds2)
    assert torch.equal(d1.view(torch.uint8), d2.view(torch.uint8)) and torch.equal(ds1, ds2)


def test_fp8_custom_op_opcheck_and_compile():
    g = gen("fp8-opcheck")
    B, H, HV, K, V, P = 2, 1, 2, 64, 64, 3
    pool, pscales, _ = fp8_states(g, (P,), HV, K, V)
    tok = fp8_tokens(g, B, H, HV, K, V)
    slots = torch.tensor([2, 0], dtype=torch.int32)
    args = dict(q=tok["q"], k=tok["k"], v=tok["v"], state=pool, state_scales=pscales, state_indices=slots,
                error_flag=torch.zeros(1, dtype=torch.int32), a=tok["a"], b=tok["b"], A_log=tok["A_log"],
                dt_bias=tok["dt_bias"])
    # (opcheck's test_schema compares tensors with arithmetic torch has no float8 kernels for on the CPU: the
    # mutations it would check are those test_fp8_custom_ops_match_ops and the compile below check)
    torch.library.opcheck(torch.ops.gdnkit.decode_fp8.default, (), args,
                          test_utils=("test_faketensor", "test_aot_dispatch_dynamic"))
    cu = torch.tensor([0, 1, B], dtype=torch.int32)
    torch.library.opcheck(torch.ops.gdnkit.prefill_fp8.default,
                          (tok["q"], tok["k"], tok["v"], cu, pool, pscales, None, None, None),
                          dict(initial_indices=slots, final_indices=slots, a=tok["a"], b=tok["b"],
                               A_log=tok["A_log"], dt_bias=tok["dt_bias"]), test_utils=("test_faketensor",))
    torch.library.opcheck(torch.ops.gdnkit.commit_fp8.default,
                          (tok["k"], tok["v"], pool, pscales, slots, torch.ones(B, dtype=torch.int32), None),
                          dict(source="recompute", a=tok["a"], b=tok["b"], A_log=tok["A_log"], dt_bias=tok["dt_bias"],
                               num_draft_tokens=1), test_utils=("test_faketensor",))

    def step(q, k, v, state, scales):
        return torch.ops.gdnkit.decode_fp8(q, k, v, state, scales, slots, None, a=tok["a"], b=tok["b"],
                                           A_log=tok["A_log"], dt_bias=tok["dt_bias"]) * 2

    p_eager, s_eager = pool.clone(), pscales.clone()
    p_comp, s_comp = pool.clone(), pscales.clone()
    with torch.no_grad():
        ref = step(tok["q"], tok["k"], tok["v"], p_eager, s_eager)
        out = torch.compile(step, backend="aot_eager", fullgraph=True)(tok["q"], tok["k"], tok["v"], p_comp, s_comp)
    assert torch.equal(out, ref)
    assert torch.equal(p_comp.view(torch.uint8), p_eager.view(torch.uint8)) and torch.equal(s_comp, s_eager)
