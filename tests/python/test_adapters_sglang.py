"""gdnkit.adapters.sglang (SGLang 0.5.23's fused_sigmoid_gating_delta_rule_update): on the CPU backend
against the fp64 recurrence, everywhere; on CUDA against SGLang's own function where sglang imports (the
GPU machine), skipped otherwise."""

import inspect

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed: adapter tests skipped")

import gdnkit  # noqa: E402
from gdnkit.adapters import sglang as adapter  # noqa: E402
from reference import fused_gates, rel, sigmoid  # noqa: E402
from cuda_support import CUDA, cuda_or_skip, needs_cuda, skip_without_peer  # noqa: E402
import peer_sources  # noqa: E402
from test_adapters_common import (LAYOUTS, CopyCounter, assert_same_positional, assert_signature,  # noqa: E402
                                  bits_equal, copies_expected, f64, gen, kv_last, randn, ref, strided, tol)

EMPTY = inspect.Parameter.empty
SGLANG_PARAMS = [(n, "p", EMPTY) for n in ("A_log", "a", "dt_bias", "softplus_beta", "softplus_threshold", "q", "k",
                                           "v", "b", "initial_state_source", "initial_state_indices")] + [
    ("scale", "p", None), ("use_qk_l2norm_in_kernel", "p", False), ("cu_seqlens", "p", None), ("is_kda", "p", False),
    ("lower_bound", "p", None), ("disable_state_update", "p", False), ("intermediate_states_buffer", "p", None),
    ("intermediate_state_indices", "p", None), ("cache_steps", "p", None), ("retrieve_parent_token", "p", None),
    ("cache_ring", "p", False), ("replayssm_rawv", "p", None), ("replayssm_rawk", "p", None),
    ("replayssm_g", "p", None), ("replayssm_beta", "p", None), ("match_cutedsl_decode", "p", False)]

fsg = adapter.fused_sigmoid_gating_delta_rule_update


def problem(g, B, T, H=2, HV=4, K=64, V=128, P=9, dtype=torch.float32, device="cpu"):
    return dict(A_log=torch.log(torch.rand(HV, generator=g) * 15 + 1).to(device),
                a=randn(g, B * T, HV, dtype=dtype, device=device), dt_bias=0.5 * randn(g, HV, device=device),
                q=randn(g, B, T, H, K, dtype=dtype, device=device), k=randn(g, B, T, H, K, dtype=dtype, device=device),
                v=randn(g, B, T, HV, V, dtype=dtype, device=device), b=randn(g, B * T, HV, dtype=dtype, device=device),
                pool=0.1 * randn(g, P, HV, V, K, device=device))


def run(p, idx, pool=None, q=None, k=None, v=None, a=None, b=None, sp=(1.0, 20.0), **kw):
    kw.setdefault("use_qk_l2norm_in_kernel", True)
    return fsg(p["A_log"], p["a"] if a is None else a, p["dt_bias"], sp[0], sp[1], p["q"] if q is None else q,
               p["k"] if k is None else k, p["v"] if v is None else v, p["b"] if b is None else b,
               p["pool"] if pool is None else pool, idx, **kw)


def gates_of(p, rows, sp=(1.0, 20.0), lower_bound=None):
    a = f64(p["a"])[rows]
    b = f64(p["b"])[rows]
    A, dt = f64(p["A_log"]), f64(p["dt_bias"])
    if lower_bound is not None:
        return lower_bound * sigmoid(np.exp(A)[None] * (a + dt[None])), sigmoid(b)
    if sp == (1.0, 20.0):
        return fused_gates(a, b, A, dt)
    x = (a + dt[None]) * sp[0]
    soft = np.where(x > sp[1], a + dt[None], np.log1p(np.exp(np.minimum(x, sp[1]))) / sp[0])
    return -np.exp(A)[None] * soft, sigmoid(b)


def ref_rows(p, rows, S0, **gkw):
    gg, bb = gates_of(p, rows, **gkw)
    q, k, v = (p[n].reshape(-1, *p[n].shape[2:])[rows] for n in "qkv")
    return ref(S0, q, k, v, gg, bb)


def assert_untouched(pool, before, touched):
    for s in range(before.shape[0]):
        if s not in touched:
            assert bits_equal(pool[s], before[s]), f"slot {s} changed"


# ---- signature and keywords -------------------------------------------------------------------------

def test_signature_is_sglang_0523():
    assert_signature(fsg, SGLANG_PARAMS)


@pytest.mark.parametrize("name", ["inplace_final_state", "ssm_state_indices", "num_accepted_tokens", "typo"])
def test_unknown_keyword_is_a_type_error_naming_it(name):
    p = problem(gen("sg-kw"), 1, 1)
    with pytest.raises(TypeError, match=f"'{name}'"):
        run(p, torch.tensor([0], dtype=torch.int32), **{name: True})


# ---- decode -------------------------------------------------------------------------------------------

def test_decode_cu_seqlens_padding_and_untouched_slots():
    g = gen("sg-decode")
    B = 4
    p = problem(g, 1, B)  # decode as SGLang calls it: q [1, B, H, K], cu_seqlens 0..B
    idx = torch.tensor([7, -1, 2, 5, 3, 3], dtype=torch.int32)  # engines pass the padded buffer
    before = p["pool"].clone()
    o = run(p, idx, cu_seqlens=torch.arange(B + 1, dtype=torch.int32))
    assert o.shape == p["v"].shape and o.dtype == p["v"].dtype and o.is_contiguous()
    for i, s in enumerate(idx[:B].tolist()):
        if s < 0:
            assert torch.all(o[0, i] == 0)  # gdnkit's padding row (SGLang: computed from S = 0)
            continue
        ref_o, ref_S, _ = ref_rows(p, slice(i, i + 1), kv_last(before[s]))
        assert rel(f64(o[0, i]), ref_o[0]) < tol("recurrent", "o", torch.float32)
        assert rel(kv_last(p["pool"][s]), ref_S) < tol("recurrent", "state", torch.float32)
    assert_untouched(p["pool"], before, {7, 2, 5})


def test_decode_views_of_projections_are_not_copied(monkeypatch):
    """q/k/v and a/b as views of fused projections (SGLang passes them strided): no copies."""
    g = gen("sg-views")
    B, H, HV, K, V = 3, 2, 4, 64, 128
    p = problem(g, B, 1)
    q, k, v = strided("projection", p["q"], p["k"], p["v"])
    ba = torch.cat([p["b"], p["a"]], dim=-1)
    bv, av = ba[:, :HV], ba[:, HV:]
    idx = torch.tensor([4, 0, 8], dtype=torch.int32)
    before = p["pool"].clone()
    counter = CopyCounter(monkeypatch)
    o = run(p, idx, q=q, k=k, v=v, a=av, b=bv)
    assert counter.count == 0
    for i, s in enumerate(idx.tolist()):
        ref_o, ref_S, _ = ref_rows(p, slice(i, i + 1), kv_last(before[s]))
        assert rel(f64(o[i]), ref_o) < tol("recurrent", "o", torch.float32)
        assert rel(kv_last(p["pool"][s]), ref_S) < tol("recurrent", "state", torch.float32)


def test_no_source_and_disable_state_update():
    g = gen("sg-nosource")
    B = 3
    p = problem(g, B, 1)
    o = fsg(p["A_log"], p["a"], p["dt_bias"], 1.0, 20.0, p["q"], p["k"], p["v"], p["b"], None, None,
            use_qk_l2norm_in_kernel=True)
    for i in range(B):
        assert rel(f64(o[i]), ref_rows(p, slice(i, i + 1), None)[0]) < tol("recurrent", "o", torch.float32)
    before = p["pool"].clone()
    idx = torch.tensor([1, 6, 2], dtype=torch.int32)
    o = run(p, idx, disable_state_update=True)
    assert bits_equal(p["pool"], before)
    for i, s in enumerate(idx.tolist()):
        assert rel(f64(o[i]), ref_rows(p, slice(i, i + 1), kv_last(before[s]))[0]) < tol("recurrent", "o",
                                                                                        torch.float32)


# ---- target verify --------------------------------------------------------------------------------

@pytest.mark.parametrize("tree", [False, True])
@pytest.mark.parametrize("buffer", ["exact", "wider_pitch", "flat"])
def test_target_verify(tree, buffer):
    g = gen("sg-verify", tree, buffer)
    B, T, HV, K, V = 3, 4, 4, 64, 128
    p = problem(g, 1, B * T)
    idx = torch.tensor([4, 1, 6], dtype=torch.int32)
    iidx = torch.tensor([2, 0, 1], dtype=torch.int32)
    if buffer == "exact":
        inter = torch.full((3, T, HV, V, K), float("nan"))
        steps_of = inter
    elif buffer == "wider_pitch":  # SGLang's adaptive spec: the pitch of stride(0) stays, T shrinks
        full = torch.full((3, T + 2, HV, V, K), float("nan"))
        inter, steps_of = full[:, :T], full
    else:  # [Q, S*HV*V*K]: slot pitch from stride(0)
        flat = torch.full((3, T * HV * V * K), float("nan"))
        inter, steps_of = flat, flat.view(3, T, HV, V, K)
    parent = torch.tensor([[-1, 0, 0, 1], [-1, 0, 1, 2], [-1, 0, 1, 1]], dtype=torch.int64) if tree else None
    before = p["pool"].clone()
    o = run(p, idx, cu_seqlens=torch.arange(0, B * T + 1, T, dtype=torch.int32), disable_state_update=True,
            intermediate_states_buffer=inter, intermediate_state_indices=iidx, cache_steps=T,
            retrieve_parent_token=parent)
    assert bits_equal(p["pool"], before), "disable_state_update: the pool must not change"
    for bi in range(B):
        S0 = kv_last(before[idx[bi]])
        states = []
        for t in range(T):
            par = t - 1 if parent is None else int(parent[bi, t])
            r = bi * T + t
            ref_o, ref_S, _ = ref_rows(p, slice(r, r + 1), S0 if par < 0 else states[par])
            states.append(ref_S)
            assert rel(f64(o[0, r]), ref_o[0]) < tol("recurrent", "o", torch.float32)
            assert rel(kv_last(steps_of[iidx[bi], t]), ref_S) < tol("recurrent", "state", torch.float32)


def test_tree_without_buffer_is_a_chain():
    """SGLang reads tree parents from the intermediate buffer: without one the drafts run as a chain."""
    g = gen("sg-tree-nobuf")
    B, T = 2, 3
    p = problem(g, 1, B * T)
    idx = torch.tensor([3, 5], dtype=torch.int32)
    parent = torch.tensor([[-1, 0, 0], [-1, 0, 0]])
    before = p["pool"].clone()
    cu = torch.arange(0, B * T + 1, T, dtype=torch.int32)
    o = run(p, idx, cu_seqlens=cu, retrieve_parent_token=parent, disable_state_update=True)
    for bi in range(B):
        ref_o, _, _ = ref_rows(p, slice(bi * T, bi * T + T), kv_last(before[idx[bi]]))
        assert rel(f64(o[0, bi * T: bi * T + T]), ref_o) < tol("recurrent", "o", torch.float32)


@pytest.mark.parametrize("T", [3, 80])
def test_fixed_length_updates_state(T):
    g = gen("sg-fixed", T)
    B = 2
    p = problem(g, B, T)
    idx = torch.tensor([3, 8], dtype=torch.int32)
    before = p["pool"].clone()
    o = run(p, idx)
    kind = "recurrent" if T <= 64 else "prefill"
    for bi in range(B):
        ref_o, ref_S, _ = ref_rows(p, slice(bi * T, bi * T + T), kv_last(before[idx[bi]]))
        assert rel(f64(o[bi]), ref_o) < tol(kind, "o", torch.float32)
        assert rel(kv_last(p["pool"][idx[bi]]), ref_S) < tol(kind, "state", torch.float32)
    assert_untouched(p["pool"], before, {3, 8})


def test_varlen_prefill_negative_slot_starts_from_zero():
    """Varlen sequences run the prefill, which treats a negative slot as SGLang does: S = 0, nothing stored."""
    g = gen("sg-varlen")
    lens = [5, 70, 0, 3]
    cu = torch.tensor(np.concatenate([[0], np.cumsum(lens)]), dtype=torch.int64)
    p = problem(g, 1, sum(lens))
    idx = torch.tensor([2, -1, 7, 4], dtype=torch.int32)
    before = p["pool"].clone()
    o = run(p, idx, cu_seqlens=cu)
    for n, s in enumerate(idx.tolist()):
        r = slice(int(cu[n]), int(cu[n + 1]))
        S0 = kv_last(before[s]) if s >= 0 else None
        ref_o, ref_S, _ = ref_rows(p, r, S0)
        if lens[n]:
            assert rel(f64(o[0, r]), ref_o) < tol("prefill", "o", torch.float32)
        if s >= 0:
            assert rel(kv_last(p["pool"][s]), ref_S) < tol("prefill", "state", torch.float32)
    assert_untouched(p["pool"], before, {2, 7, 4})


@pytest.mark.parametrize("layout", LAYOUTS)
def test_strided_inputs(layout, monkeypatch):
    g = gen("sg-strided", layout)
    B, T = 2, 4
    p = problem(g, B, T)
    idx = torch.tensor([5, 1], dtype=torch.int32)
    pool0 = p["pool"].clone()
    base = run(p, idx, pool=pool0.clone())
    q, k, v = strided(layout, p["q"], p["k"], p["v"])
    pool = pool0.clone()
    counter = CopyCounter(monkeypatch)
    o = run(p, idx, pool=pool, q=q, k=k, v=v)
    assert counter.count == copies_expected(layout, B, T)
    assert torch.equal(o, base)
    for bi in range(B):
        ref_o, ref_S, _ = ref_rows(p, slice(bi * T, bi * T + T), kv_last(pool0[idx[bi]]))
        assert rel(f64(o[bi]), ref_o) < tol("recurrent", "o", torch.float32)
        assert rel(kv_last(pool[idx[bi]]), ref_S) < tol("recurrent", "state", torch.float32)


@pytest.mark.parametrize("sp,lower_bound", [((2.0, 15.0), None), ((1.0, 5.0), None), ((1.0, 20.0), -3.0)])
def test_softplus_parameters_and_lower_bound(sp, lower_bound):
    g = gen("sg-softplus", sp, lower_bound)
    B, T = 2, 3
    p = problem(g, B, T)
    p["a"] = p["a"] * 8  # reach past the thresholds
    idx = torch.tensor([0, 6], dtype=torch.int32)
    before = p["pool"].clone()
    o = run(p, idx, sp=sp, lower_bound=lower_bound)
    for bi in range(B):
        ref_o, ref_S, _ = ref_rows(p, slice(bi * T, bi * T + T), kv_last(before[idx[bi]]), sp=sp,
                                   lower_bound=lower_bound)
        assert rel(f64(o[bi]), ref_o) < tol("recurrent", "o", torch.float32)
        assert rel(kv_last(p["pool"][idx[bi]]), ref_S) < tol("recurrent", "state", torch.float32)


def ring_buffers(g, slots, H, HV, K, V, L):
    return dict(replayssm_rawv=randn(g, slots, HV, L, V), replayssm_rawk=randn(g, slots, H, L, K),
                replayssm_g=randn(g, slots, HV, L), replayssm_beta=randn(g, slots, HV, L))


@pytest.mark.parametrize("varlen", [False, True])
def test_cache_ring(varlen):
    """ReplaySSM rings: the raw v, the raw k, the gate and beta of step t < L at the sequence's pool slot."""
    g = gen("sg-ring", varlen)
    H, HV, K, V, L = 2, 4, 64, 128, 3
    if varlen:
        lens, idx = [4, 1, 0, 2], torch.tensor([5, 2, 7, -1], dtype=torch.int32)
        p = problem(g, 1, sum(lens))
        cu = torch.tensor(np.concatenate([[0], np.cumsum(lens)]), dtype=torch.int32)
    else:
        lens, idx = [4, 4, 4], torch.tensor([5, -1, 0], dtype=torch.int32)
        p = problem(g, 3, 4)
        cu = None
    rings = ring_buffers(g, 9, H, HV, K, V, L)
    before = {n: r.clone() for n, r in rings.items()}
    inter = torch.zeros(len(lens), 4, HV, V, K)
    run(p, idx, cu_seqlens=cu, disable_state_update=True, intermediate_states_buffer=inter,
        intermediate_state_indices=torch.arange(len(lens), dtype=torch.int32), cache_ring=True, **rings)
    expect = {n: r.clone() for n, r in before.items()}
    gg, bb = gates_of(p, slice(None))
    kf, vf = p["k"].reshape(-1, H, K), p["v"].reshape(-1, HV, V)
    start = 0
    for n, ln in enumerate(lens):
        s = int(idx[n])
        for t in range(min(ln, L)):
            if s >= 0:
                expect["replayssm_rawv"][s, :, t] = vf[start + t]
                expect["replayssm_rawk"][s, :, t] = kf[start + t]
                expect["replayssm_g"][s, :, t] = torch.from_numpy(gg[start + t]).float()
                expect["replayssm_beta"][s, :, t] = torch.from_numpy(bb[start + t]).float()
        start += ln
    for n in rings:
        if n in ("replayssm_g", "replayssm_beta"):
            assert torch.allclose(rings[n], expect[n], rtol=1e-5, atol=1e-6), n
        else:
            assert bits_equal(rings[n], expect[n]), n


def test_errors():
    g = gen("sg-errors")
    p = problem(g, 1, 2)
    idx = torch.tensor([0], dtype=torch.int32)
    before = p["pool"].clone()
    with pytest.raises(NotImplementedError, match="is_kda"):
        run(p, idx, is_kda=True)
    with pytest.raises(ValueError, match="match_cutedsl_decode"):
        run(p, idx, match_cutedsl_decode=True)
    with pytest.raises(NotImplementedError, match="autograd"):
        run(p, idx, q=p["q"].clone().requires_grad_())
    with pytest.raises(ValueError, match="intermediate_state_indices is required"):
        run(p, idx, intermediate_states_buffer=torch.zeros(1, 2, 4, 128, 64))
    with pytest.raises(NotImplementedError, match="retrieve_parent_token with disable_state_update=False"):
        run(p, idx, intermediate_states_buffer=torch.zeros(1, 2, 4, 128, 64),
            intermediate_state_indices=torch.zeros(1, dtype=torch.int32),
            retrieve_parent_token=torch.tensor([[-1, 0]]))
    with pytest.raises(NotImplementedError, match="float16 initial_state_source"):
        run(p, idx, pool=p["pool"].half())
    with pytest.raises(ValueError, match="scale must be positive"):
        run(p, idx, scale=-1.0)
    assert bits_equal(p["pool"], before), "the pool written by a refused call"


# ---- CUDA: against SGLang's own function --------------------------------------------------------------

peer = peer_sources.sglang_fused_sigmoid_gating() if CUDA else None
needs_peer = skip_without_peer(peer is not None, peer_sources.why_missing("sglang"))
GH, GHV, GK, GV = 16, 32, 128, 128




def both(p, idx, mutable=(), **kw):
    """Run the adapter and SGLang on clones of the pool and of the tensors named in ``mutable`` (kw keys).
    Returns ((o, pool, {name: tensor}) mine, (...) theirs)."""
    out = []
    for f in (fsg, peer):
        pool = p["pool"].clone()
        kw2 = {n: (t.clone() if n in mutable else t) for n, t in kw.items()}
        with torch.no_grad():
            o = cuda_or_skip(run, p, idx, pool=pool, **kw2) if f is fsg else \
                f(p["A_log"], kw2.pop("a", p["a"]), p["dt_bias"], *kw2.pop("sp", (1.0, 20.0)),
                  kw2.pop("q", p["q"]), kw2.pop("k", p["k"]), kw2.pop("v", p["v"]), kw2.pop("b", p["b"]), pool,
                  idx, **{"use_qk_l2norm_in_kernel": True, **kw2})
        torch.cuda.synchronize()
        out.append((o, pool, {n: kw2[n] for n in mutable if n in kw2} if f is peer else
                    {n: kw2[n] for n in mutable}))
    return out


def gpu_problem(key, B, T, P=64):
    p = problem(gen(*key), B, T, GH, GHV, GK, GV, P=P, dtype=torch.bfloat16, device="cuda")
    return p


@needs_cuda
@needs_peer
def test_decode_vs_sglang():
    p = gpu_problem(("sg-gpu-decode",), 1, 48)
    idx = torch.randperm(64, generator=gen("perm"))[:48].to(torch.int32).cuda()
    (o, pool, _), (o_ref, pool_ref, _) = both(p, idx, cu_seqlens=torch.arange(49, dtype=torch.int32, device="cuda"))
    assert o.shape == o_ref.shape and o.dtype == o_ref.dtype
    assert rel(f64(o), f64(o_ref)) < 1e-2
    assert rel(f64(pool[idx.long()]), f64(pool_ref[idx.long()])) < 1e-2


@needs_cuda
@needs_peer
@pytest.mark.parametrize("tree", [False, True])
def test_target_verify_vs_sglang(tree):
    B, T = 8, 4
    p = gpu_problem(("sg-gpu-verify", tree), 1, B * T)
    idx = torch.arange(B, dtype=torch.int32, device="cuda") * 3
    inter = torch.zeros(B, T, GHV, GV, GK, device="cuda")
    parent = torch.tensor([[-1, 0, 0, 1]] * B, device="cuda") if tree else None
    kw = dict(cu_seqlens=torch.arange(0, B * T + 1, T, dtype=torch.int32, device="cuda"), disable_state_update=True,
              intermediate_states_buffer=inter, intermediate_state_indices=torch.arange(B, dtype=torch.int32,
                                                                                        device="cuda"),
              cache_steps=T, retrieve_parent_token=parent)
    (o, pool, m), (o_ref, pool_ref, m_ref) = both(p, idx, mutable=("intermediate_states_buffer",), **kw)
    assert rel(f64(o), f64(o_ref)) < 1e-2
    assert torch.equal(pool, pool_ref)
    assert rel(f64(m["intermediate_states_buffer"]), f64(m_ref["intermediate_states_buffer"])) < 1e-2


@needs_cuda
@needs_peer
@pytest.mark.parametrize("layout", ["contiguous", "projection"])  # the layouts SGLang reads (heads packed)
@pytest.mark.parametrize("sp", [(1.0, 20.0), (2.0, 10.0)])
def test_fixed_length_strided_vs_sglang(layout, sp):
    B, T = 4, 3
    p = gpu_problem(("sg-gpu-fixed", layout, sp), B, T)
    q, k, v = strided(layout, p["q"], p["k"], p["v"])
    idx = torch.tensor([9, 1, 33, 2], dtype=torch.int32, device="cuda")
    (o, pool, _), (o_ref, pool_ref, _) = both(p, idx, q=q, k=k, v=v, sp=sp)
    assert rel(f64(o), f64(o_ref)) < 1e-2
    assert rel(f64(pool[idx.long()]), f64(pool_ref[idx.long()])) < 1e-2


@needs_cuda
@needs_peer
def test_cache_ring_vs_sglang():
    B, T, L = 4, 4, 3
    p = gpu_problem(("sg-gpu-ring",), 1, B * T)
    idx = torch.tensor([3, -1, 0, 7], dtype=torch.int32, device="cuda")
    rings = {n: r.cuda() for n, r in ring_buffers(gen("rings"), 64, GH, GHV, GK, GV, L).items()}
    rings["replayssm_rawv"] = rings["replayssm_rawv"].bfloat16()
    rings["replayssm_rawk"] = rings["replayssm_rawk"].bfloat16()
    kw = dict(cu_seqlens=torch.arange(0, B * T + 1, T, dtype=torch.int32, device="cuda"), disable_state_update=True,
              intermediate_states_buffer=torch.zeros(B, T, GHV, GV, GK, device="cuda"),
              intermediate_state_indices=torch.arange(B, dtype=torch.int32, device="cuda"), cache_ring=True, **rings)
    (o, _, m), (o_ref, _, m_ref) = both(p, idx, mutable=tuple(rings) + ("intermediate_states_buffer",), **kw)
    keep = idx >= 0
    assert rel(f64(o.view(B, T, GHV, GV)[keep]), f64(o_ref.view(B, T, GHV, GV)[keep])) < 1e-2
    for n in rings:
        assert rel(f64(m[n]), f64(m_ref[n])) < 1e-5, n


@needs_cuda
@needs_peer
def test_same_positional_parameters_as_sglang():
    assert_same_positional(fsg, peer)
