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
