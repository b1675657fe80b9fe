"""gdnkit.adapters.fla (flash-linear-attention 0.6.0's chunk_gated_delta_rule and
fused_recurrent_gated_delta_rule): on the CPU backend against the fp64 recurrence, everywhere; on CUDA
against FLA's own functions where fla imports (the GPU machine), skipped otherwise."""

import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed: adapter tests skipped")

import gdnkit  # noqa: E402
from gdnkit.adapters import _common as C  # noqa: E402
from gdnkit.adapters import fla as adapter  # noqa: E402
from reference import fused_gates, rel, sigmoid  # noqa: E402
from cuda_support import CUDA, cuda_or_skip, needs_cuda, skip_without_peer  # noqa: E402
from test_adapters_common import (LAYOUTS, CopyCounter, assert_same_positional, assert_signature,  # noqa: E402
                                  copies_expected, f64, gen, randn, ref, strided, tol)

E = C.UNSET  # "no default" in the pinned signatures below
EMPTY = __import__("inspect").Parameter.empty

FLA_CHUNK_PARAMS = [("q", "p", EMPTY), ("k", "p", EMPTY), ("v", "p", EMPTY), ("g", "p", EMPTY), ("beta", "p", EMPTY),
                    ("scale", "p", None), ("initial_state", "p", None), ("output_final_state", "p", False),
                    ("use_qk_l2norm_in_kernel", "p", False), ("use_beta_sigmoid_in_kernel", "p", False),
                    ("allow_neg_eigval", "p", False), ("state_v_first", "p", False), ("cu_seqlens", "p", None),
                    ("cu_seqlens_cpu", "p", None), ("chunk_indices", "p", None), ("cp_context", "p", None),
                    # FLA reads these from **kwargs
                    ("use_gate_in_kernel", "k", False), ("A_log", "k", None), ("dt_bias", "k", None),
                    ("chunk_size", "k", 64), ("transpose_state_layout", "k", E), ("head_first", "k", E)]
FLA_RECURRENT_PARAMS = [("q", "p", EMPTY), ("k", "p", EMPTY), ("v", "p", EMPTY), ("g", "p", None), ("gk", "p", None),
                        ("gv", "p", None), ("beta", "p", None), ("scale", "p", None), ("initial_state", "p", None),
                        ("output_final_state", "p", False), ("use_qk_l2norm_in_kernel", "p", False),
                        ("use_gate_in_kernel", "p", False), ("A_log", "p", None), ("dt_bias", "p", None),
                        ("use_beta_sigmoid_in_kernel", "p", False), ("allow_neg_eigval", "p", False),
                        ("state_v_first", "p", False), ("cu_seqlens", "p", None),
                        ("transpose_state_layout", "k", E)]

FN = {"chunk": adapter.chunk_gated_delta_rule, "recurrent": adapter.fused_recurrent_gated_delta_rule}


def problem(g, B, T, H=2, HV=4, K=64, V=128, dtype=torch.float32, device="cpu"):
    return dict(q=randn(g, B, T, H, K, dtype=dtype, device=device), k=randn(g, B, T, H, K, dtype=dtype, device=device),
                v=randn(g, B, T, HV, V, dtype=dtype, device=device),
                g=(-torch.rand(B, T, HV, generator=g) * 0.5).to(device),
                beta=torch.rand(B, T, HV, generator=g).to(dtype=dtype, device=device))


def call(fn, p, q=None, k=None, v=None, **kw):
    q, k, v = (p["q"] if q is None else q), (p["k"] if k is None else k), (p["v"] if v is None else v)
    if fn == "chunk":
        return adapter.chunk_gated_delta_rule(q, k, v, kw.pop("g", p["g"]), kw.pop("beta", p["beta"]), **kw)
    kw.setdefault("g", p["g"])
    kw.setdefault("beta", p["beta"])
    return adapter.fused_recurrent_gated_delta_rule(q, k, v, **kw)


def kind_of(fn, T, cu):
    return "recurrent" if fn == "recurrent" and cu is None and T <= 64 else "prefill"


def check(p, o, final, S0, cu, kind, state_v_first=False, g=None, beta=None, l2norm=True, scale=None):
    """o [B, T, HV, V] and final [N, ...] vs the fp64 recurrence per sequence."""
    g = p["g"] if g is None else g
    beta = p["beta"] if beta is None else beta
    flat = {n: p[n].reshape(-1, *p[n].shape[2:]) for n in "qkv"}
    g, beta = f64(g).reshape(-1, g.shape[-1]), f64(beta).reshape(-1, beta.shape[-1])
    o = o.reshape(-1, *o.shape[2:])
    dt = p["v"].dtype
    for n in range(len(cu) - 1):
        r = slice(cu[n], cu[n + 1])
        s0 = None
        if S0 is not None:
            s0 = f64(S0[n])
            s0 = np.swapaxes(s0, -1, -2) if state_v_first else s0
        ref_o, ref_S, _ = ref(s0, flat["q"][r], flat["k"][r], flat["v"][r], g[r], beta[r], scale=scale, l2norm=l2norm)
        if cu[n + 1] > cu[n]:
            assert rel(f64(o[r]), ref_o) < tol(kind, "o", dt)
        if final is not None:
            f = f64(final[n])
            assert rel(np.swapaxes(f, -1, -2) if state_v_first else f, ref_S) < tol(kind, "state", torch.float32)


# ---- signatures and keywords ----------------------------------------------------------------------

def test_signatures_are_fla_060():
    assert_signature(adapter.chunk_gated_delta_rule, FLA_CHUNK_PARAMS)
    assert_signature(adapter.fused_recurrent_gated_delta_rule, FLA_RECURRENT_PARAMS)
    assert adapter.chunk_gdn is adapter.chunk_gated_delta_rule
    assert adapter.fused_recurrent_gdn is adapter.fused_recurrent_gated_delta_rule


@pytest.mark.parametrize("fn", ["chunk", "recurrent"])
@pytest.mark.parametrize("name", ["inplace_final_state", "ssm_state_indices", "num_accepted_tokens", "typo_scale"])
def test_unknown_keyword_is_a_type_error_naming_it(fn, name):
    """FLA swallows unknown keywords through **kwargs; the adapter names them (vLLM's keywords among them)."""
    p = problem(gen("kw", fn, name), 1, 2)
    with pytest.raises(TypeError, match=f"'{name}'"):
        call(fn, p, **{name: True})


def test_fla_keyword_options():
    p = problem(gen("fla-kw"), 1, 3)
    with pytest.raises(DeprecationWarning, match="head_first has been removed"):
        adapter.chunk_gated_delta_rule(p["q"], p["k"], p["v"], p["g"], p["beta"], head_first=False)
    with pytest.raises(ValueError, match="chunk_size"):
        adapter.chunk_gated_delta_rule(p["q"], p["k"], p["v"], p["g"], p["beta"], chunk_size=128)
    # FLA's chunk sizes are accepted and change nothing here (gdnkit's chunk is its own)
    outs = [adapter.chunk_gated_delta_rule(p["q"], p["k"], p["v"], p["g"], p["beta"], chunk_size=cs)[0]
            for cs in (16, 32, 64)]
    assert all(torch.equal(o, outs[-1]) for o in outs) and torch.isfinite(outs[-1]).all()
    h0 = 0.1 * randn(gen("fla-kw-h0"), 1, 4, 128, 64)
    with pytest.warns(DeprecationWarning, match="transpose_state_layout"):
        o1, s1 = call("recurrent", p, initial_state=h0, output_final_state=True, transpose_state_layout=True)
    o2, s2 = call("recurrent", p, initial_state=h0, output_final_state=True, state_v_first=True)
    assert torch.equal(o1, o2) and torch.equal(s1, s2)
    with pytest.raises(ValueError, match="Cannot pass both"):
        call("chunk", p, state_v_first=True, transpose_state_layout=True)


# ---- results vs the recurrence ---------------------------------------------------------------------

@pytest.mark.parametrize("fn", ["chunk", "recurrent"])
@pytest.mark.parametrize("T", [1, 4, 70])
@pytest.mark.parametrize("init,final", [(True, True), (True, False), (False, True), (False, False)])
def test_fixed_length(fn, T, init, final):
    g = gen("fla-fixed", fn, T, init, final)
    B = 3
    p = problem(g, B, T)
    h0 = 0.1 * randn(g, B, 4, 64, 128) if init else None
    h0_copy = None if h0 is None else h0.clone()
    out = call(fn, p, initial_state=h0, output_final_state=final, use_qk_l2norm_in_kernel=True)
    assert isinstance(out, tuple) and len(out) == 2
    o, ht = out
    assert o.shape == p["v"].shape and o.dtype == p["q"].dtype and o.is_contiguous()
    if final:
        assert ht.shape == (B, 4, 64, 128) and ht.dtype == torch.float32 and ht is not h0
    else:
        assert ht is None
    if h0 is not None:
        assert torch.equal(h0, h0_copy), "initial_state was modified"
    check(p, o, ht, h0, [i * T for i in range(B + 1)], kind_of(fn, T, None))


@pytest.mark.parametrize("fn", ["chunk", "recurrent"])
def test_varlen_state_v_first(fn):
    g = gen("fla-varlen", fn)
    cu = torch.tensor([0, 20, 20, 65], dtype=torch.int64)
    p = problem(g, 1, 65)
    h0 = 0.1 * randn(g, 3, 4, 128, 64)  # [N, HV, V, K]
    o, ht = call(fn, p, initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True, cu_seqlens=cu,
                 state_v_first=True)
    assert ht.shape == (3, 4, 128, 64)
    check(p, o, ht, h0, cu.tolist(), "prefill", state_v_first=True)
    if fn == "chunk":
        o2, ht2 = call(fn, p, initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True,
                       cu_seqlens=cu.int(), cu_seqlens_cpu=cu, chunk_indices=torch.zeros(3, 2, dtype=torch.int64),
                       state_v_first=True)
        assert torch.equal(o, o2) and torch.equal(ht, ht2)


@pytest.mark.parametrize("fn", ["chunk", "recurrent"])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("B,T", [(2, 1), (2, 5), (1, 70), (2, 70)])
def test_strided_inputs(fn, layout, B, T, monkeypatch):
    """q/k/v views of a fused projection, head-padded, time-sliced and conv-transposed (transformers 5.x's
    Qwen3-Next): the same results as contiguous inputs, copies only where the kernels cannot read them."""
    g = gen("fla-strided", fn, layout, B, T)
    p = problem(g, B, T)
    h0 = 0.1 * randn(g, B, 4, 64, 128)
    base_o, base_s = call(fn, p, initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True)
    q, k, v = strided(layout, p["q"], p["k"], p["v"])
    counter = CopyCounter(monkeypatch)
    o, s = call(fn, p, q, k, v, initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True)
    assert counter.count == copies_expected(layout, B, T), counter.shapes
    assert torch.equal(o, base_o) and torch.equal(s, base_s)
    check(p, o, s, h0, [i * T for i in range(B + 1)], kind_of(fn, T, None))


@pytest.mark.parametrize("fn", ["chunk", "recurrent"])
def test_strided_gates(fn, monkeypatch):
    """g and beta as views of one projection, and beta broadcast over heads (copied: its heads overlap)."""
    g = gen("fla-gates-strided", fn)
    B, T, HV = 2, 6, 4
    p = problem(g, B, T)
    proj = torch.cat([p["g"], p["beta"]], dim=-1)
    gv, bv = proj[..., :HV], proj[..., HV:]
    counter = CopyCounter(monkeypatch)
    o, s = call(fn, p, g=gv, beta=bv, output_final_state=True)
    assert counter.count == 0
    check(p, o, s, None, [0, T, 2 * T], kind_of(fn, T, None), l2norm=False)
    one = torch.rand(B, T, 1, generator=g).expand(B, T, HV)
    o, s = call(fn, p, beta=one, output_final_state=True)
    assert counter.count == 1
    check(p, o, s, None, [0, T, 2 * T], kind_of(fn, T, None), beta=one, l2norm=False)


def test_no_initial_no_final_and_defaults():
    g = gen("fla-defaults")
    p = problem(g, 2, 3)
    o, ht = adapter.fused_recurrent_gated_delta_rule(p["q"], p["k"], p["v"])  # g None, beta None
    assert ht is None
    check(p, o, None, None, [0, 3, 6], "recurrent", g=torch.zeros(2, 3, 4), beta=torch.ones(2, 3, 4), l2norm=False)
    o2, ht2 = adapter.chunk_gated_delta_rule(p["q"], p["k"], p["v"], p["g"], p["beta"], scale=0.2)
    assert ht2 is None
    check(p, o2, None, None, [0, 3, 6], "prefill", l2norm=False, scale=0.2)


@pytest.mark.parametrize("fn", ["chunk", "recurrent"])
@pytest.mark.parametrize("gate_in_kernel", [False, True])
@pytest.mark.parametrize("beta_sigmoid,neg_eigval", [(False, False), (True, False), (True, True)])
def test_gate_options(fn, gate_in_kernel, beta_sigmoid, neg_eigval):
    g = gen("fla-gates", fn, gate_in_kernel, beta_sigmoid, neg_eigval)
    B, T, HV = 2, 6, 4
    p = problem(g, B, T)
    raw_a, raw_b = randn(g, B, T, HV), randn(g, B, T, HV)
    A_log = torch.log(torch.rand(HV, generator=g) * 15 + 1)
    dt_bias = 0.5 * randn(g, HV)
    kw = dict(g=raw_a if gate_in_kernel else p["g"], beta=raw_b if beta_sigmoid else p["beta"],
              output_final_state=True, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=gate_in_kernel, A_log=A_log,
              dt_bias=dt_bias, use_beta_sigmoid_in_kernel=beta_sigmoid, allow_neg_eigval=neg_eigval)
    o, ht = call(fn, p, **kw)
    fg, _ = fused_gates(f64(raw_a.reshape(-1, HV)), f64(raw_b.reshape(-1, HV)), f64(A_log), f64(dt_bias))
    ref_g = torch.from_numpy(fg).reshape(B, T, HV) if gate_in_kernel else p["g"]
    ref_beta = torch.from_numpy(sigmoid(f64(raw_b)) * (2.0 if neg_eigval else 1.0)) if beta_sigmoid else p["beta"]
    check(p, o, ht, None, [0, T, 2 * T], kind_of(fn, T, None), g=ref_g, beta=ref_beta)


@pytest.mark.parametrize("T", [1, 33])
def test_bf16(T):
    g = gen("fla-bf16", T)
    p = problem(g, 2, T, dtype=torch.bfloat16)
    h0 = (0.1 * randn(g, 2, 4, 64, 128)).to(torch.bfloat16)
    for fn in ("chunk", "recurrent"):
        o, ht = call(fn, p, initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True)
        assert o.dtype == torch.bfloat16 and ht.dtype == torch.float32
        check(p, o, ht, h0, [0, T, 2 * T], kind_of(fn, T, None))


def test_initial_state_of_other_dtype_and_strides():
    """A float16 or strided initial_state is read (from a float32 copy) and never written."""
    g = gen("fla-h0")
    p = problem(g, 2, 3)
    h0 = 0.1 * randn(g, 2, 4, 64, 128)
    for h in (h0.half(), h0.transpose(-1, -2).contiguous().transpose(-1, -2)):  # [N, HV, K, V], strided dims
        keep = h.clone()
        for fn in ("chunk", "recurrent"):
            o, ht = call(fn, p, initial_state=h, output_final_state=fn == "chunk", use_qk_l2norm_in_kernel=True)
            assert torch.equal(h, keep)
            check(p, o, ht, h, [0, 3, 6], kind_of(fn, 3, None))


# ---- errors ------------------------------------------------------------------------------------------

def test_errors():
    g = gen("fla-errors")
    p = problem(g, 1, 2)
    with pytest.raises(NotImplementedError, match="gk / gv"):
        adapter.fused_recurrent_gated_delta_rule(p["q"], p["k"], p["v"], gk=torch.zeros(1, 2, 4, 64))
    with pytest.raises(NotImplementedError, match="cp_context"):
        adapter.chunk_gated_delta_rule(p["q"], p["k"], p["v"], p["g"], p["beta"], cp_context=object())
    with pytest.raises(NotImplementedError, match="per-channel beta"):
        adapter.chunk_gated_delta_rule(p["q"], p["k"], p["v"], p["g"], torch.rand(1, 2, 4, 128))
    with pytest.raises(NotImplementedError, match="autograd"):
        adapter.chunk_gated_delta_rule(p["q"].clone().requires_grad_(), p["k"], p["v"], p["g"], p["beta"])
    with torch.no_grad():  # under no_grad a tensor that requires grad is only read
        o_ng = adapter.chunk_gated_delta_rule(p["q"].clone().requires_grad_(), p["k"], p["v"], p["g"], p["beta"])[0]
    assert torch.equal(o_ng, adapter.chunk_gated_delta_rule(p["q"], p["k"], p["v"], p["g"], p["beta"])[0])
    with pytest.raises(ValueError, match="allow_neg_eigval=True` requires"):
        adapter.chunk_gated_delta_rule(p["q"], p["k"], p["v"], p["g"], p["beta"], allow_neg_eigval=True)
    with pytest.raises(ValueError, match="batch size is expected to be 1"):
        adapter.chunk_gated_delta_rule(torch.zeros(2, 2, 2, 64), torch.zeros(2, 2, 2, 64), torch.zeros(2, 2, 4, 128),
                                       p["g"].expand(2, 2, 4), p["beta"].expand(2, 2, 4),
                                       cu_seqlens=torch.tensor([0, 2, 4]))
    with pytest.raises(ValueError, match="number of initial states"):
        adapter.fused_recurrent_gated_delta_rule(p["q"], p["k"], p["v"], initial_state=torch.zeros(2, 4, 64, 128))
    with pytest.raises(ValueError, match="same number of heads"):
        adapter.chunk_gated_delta_rule(p["q"], p["k"][:, :, :1], p["v"], p["g"], p["beta"])
    with pytest.raises(ValueError, match="evenly divisible"):
        adapter.chunk_gated_delta_rule(p["q"], p["k"], p["v"][:, :, :3], p["g"][..., :3], p["beta"][..., :3])
    with pytest.raises(ValueError, match="A_log"):
        adapter.fused_recurrent_gated_delta_rule(p["q"], p["k"], p["v"], g=p["g"], use_gate_in_kernel=True)


# ---- CUDA: against FLA's own functions ------------------------------------------------------------

fla_chunk = fla_recurrent = None
if CUDA:
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_chunk  # noqa: E402
        from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule as fla_recurrent  # noqa: E402
    except Exception:  # noqa: BLE001
        fla_chunk = fla_recurrent = None
needs_fla = skip_without_peer(fla_chunk is not None, "fla (flash-linear-attention) is not importable")
GH, GHV, GK, GV = 16, 32, 128, 128  # qwen3-next




def both(fn, p, q=None, k=None, v=None, **kw):
    """(adapter result, FLA result) of one call on the same inputs."""
    q, k, v = (p["q"] if q is None else q), (p["k"] if k is None else k), (p["v"] if v is None else v)
    gkw = dict(kw)
    with torch.no_grad():
        if fn == "chunk":
            mine = cuda_or_skip(adapter.chunk_gated_delta_rule, q, k, v, gkw.pop("g", p["g"]),
                                gkw.pop("beta", p["beta"]), **gkw)
            gkw = dict(kw)
            theirs = fla_chunk(q, k, v, gkw.pop("g", p["g"]), gkw.pop("beta", p["beta"]), **gkw)
        else:
            gkw.setdefault("g", p["g"])
            gkw.setdefault("beta", p["beta"])
            mine = cuda_or_skip(adapter.fused_recurrent_gated_delta_rule, q, k, v, **gkw)
            theirs = fla_recurrent(q, k, v, **gkw)
    return mine, theirs


def assert_close(mine, theirs, limit=1e-2):
    assert isinstance(mine, tuple) and len(mine) == len(theirs) == 2
    for a, b in zip(mine, theirs):
        assert (a is None) == (b is None)
        if a is None:
            continue
        assert a.shape == b.shape and a.dtype == b.dtype, (a.shape, b.shape, a.dtype, b.dtype)
        assert rel(f64(a), f64(b)) < limit


@needs_cuda
@needs_fla
@pytest.mark.parametrize("fn", ["chunk", "recurrent"])
@pytest.mark.parametrize("T", [1, 3, 200])
@pytest.mark.parametrize("init,final", [(True, True), (False, True), (True, False)])
def test_vs_fla(fn, T, init, final):
    g = gen("fla-gpu", fn, T, init, final)
    B = 4
    p = problem(g, B, T, GH, GHV, GK, GV, dtype=torch.bfloat16, device="cuda")
    p["g"] = p["g"] * 0.6
    h0 = 0.1 * randn(g, B, GHV, GK, GV, device="cuda") if init else None
    assert_close(*both(fn, p, initial_state=h0, output_final_state=final, use_qk_l2norm_in_kernel=True))


@needs_cuda
@needs_fla
@pytest.mark.parametrize("fn", ["chunk", "recurrent"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_strided_vs_fla(fn, layout):
    """Views of a fused projection, time slices and transformers' conv-transposed q/k/v, vs FLA."""
    g = gen("fla-gpu-strided", fn, layout)
    B, T = 2, (300 if fn == "chunk" else 3)
    p = problem(g, B, T, GH, GHV, GK, GV, dtype=torch.bfloat16, device="cuda")
    q, k, v = strided(layout, p["q"], p["k"], p["v"])
    h0 = 0.1 * randn(g, B, GHV, GK, GV, device="cuda")
    assert_close(*both(fn, p, q, k, v, initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True))


@needs_cuda
@needs_fla
@pytest.mark.parametrize("fn", ["chunk", "recurrent"])
def test_gate_options_varlen_state_v_first_vs_fla(fn):
    g = gen("fla-gpu-fused-varlen", fn)
    cu = torch.tensor(np.concatenate([[0], np.cumsum([100, 1, 64, 257])]), dtype=torch.int64, device="cuda")
    T = int(cu[-1])
    p = problem(g, 1, T, GH, GHV, GK, GV, dtype=torch.bfloat16, device="cuda")
    a, b = randn(g, 1, T, GHV, dtype=torch.bfloat16, device="cuda"), randn(g, 1, T, GHV, dtype=torch.bfloat16,
                                                                             device="cuda")
    A_log = torch.log(torch.rand(GHV, generator=g) * 15 + 1).to("cuda")
    dt_bias = 0.5 * randn(g, GHV, device="cuda")
    h0 = 0.1 * randn(g, 4, GHV, GV, GK, device="cuda")
    for neg in (False, True):
        kw = dict(g=a, beta=b, use_qk_l2norm_in_kernel=True, output_final_state=True, cu_seqlens=cu,
                  use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias, use_beta_sigmoid_in_kernel=True,
                  allow_neg_eigval=neg, initial_state=h0, state_v_first=True)
        assert_close(*both(fn, p, **kw))


@needs_cuda
@pytest.mark.parametrize("fn", ["chunk", "recurrent"])
def test_misaligned_views_are_copied_on_cuda(fn, monkeypatch):
    """Views whose rows are not 16-byte aligned (a projection split at an odd offset) are copied on CUDA
    (the kernels load 16-byte vectors) and give the results of aligned inputs."""
    g = gen("fla-gpu-misaligned", fn)
    B, T = 2, 5
    p = problem(g, B, T, GH, GHV, GK, GV, dtype=torch.bfloat16, device="cuda")
    proj = torch.zeros(B, T, 1 + 2 * GH * GK + GHV * GV, dtype=torch.bfloat16, device="cuda")
    _, qq, kk, vv = proj.split([1, GH * GK, GH * GK, GHV * GV], dim=-1)
    for dst, src in ((qq, p["q"]), (kk, p["k"]), (vv, p["v"])):
        dst.copy_(src.reshape(B, T, -1))
    q, k, v = qq.view(B, T, GH, GK), kk.view(B, T, GH, GK), vv.view(B, T, GHV, GV)
    base = cuda_or_skip(call, fn, p, output_final_state=True, use_qk_l2norm_in_kernel=True)
    counter = CopyCounter(monkeypatch)
    got = cuda_or_skip(call, fn, p, q, k, v, output_final_state=True, use_qk_l2norm_in_kernel=True)
    assert counter.count == 3
    assert rel(f64(got[0]), f64(base[0])) < 1e-6 and rel(f64(got[1]), f64(base[1])) < 1e-6


@needs_cuda
@needs_fla
def test_same_positional_parameters_as_fla():
    assert_same_positional(adapter.chunk_gated_delta_rule, fla_chunk)
    assert_same_positional(adapter.fused_recurrent_gated_delta_rule, fla_recurrent)


def test_warnings_are_not_errors():
    """Nothing in a plain call warns."""
    p = problem(gen("fla-nowarn"), 1, 2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        call("chunk", p)
        call("recurrent", p)
