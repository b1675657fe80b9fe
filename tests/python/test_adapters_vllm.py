"""gdnkit.adapters.vllm (vLLM 0.33.0's FLA-derived ops: chunk_gated_delta_rule,
fused_recurrent_gated_delta_rule, fused_sigmoid_gating_delta_rule_update,
fused_recurrent_gated_delta_rule_packed_decode): on the CPU backend against the fp64 recurrence with
vLLM's indexing (null block 0, spec-decode slots per token, num_accepted_tokens), everywhere; on CUDA
against vLLM's own functions where vllm imports (the GPU machine), skipped otherwise."""

import inspect

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed: adapter tests skipped")

import gdnkit  # noqa: E402
from gdnkit.adapters import vllm as adapter  # noqa: E402
from reference import fused_gates, rel, sigmoid  # noqa: E402
from cuda_support import CUDA, cuda_or_skip, needs_cuda, skip_without_peer  # noqa: E402
import peer_sources  # noqa: E402
from test_adapters_common import (LAYOUTS, CopyCounter, assert_same_positional, assert_signature,  # noqa: E402
                                  bits_equal, copies_expected, f64, gen, kv_last, randn, ref, strided, tol)

EMPTY = inspect.Parameter.empty


def _p(*names):
    return [(n, "p", EMPTY) for n in names]


VLLM_CHUNK = _p("q", "k", "v", "g", "beta") + [
    ("scale", "p", None), ("initial_state", "p", None), ("output_final_state", "p", False), ("cu_seqlens", "p", None),
    ("chunk_indices", "p", None), ("chunk_offsets", "p", None), ("use_qk_l2norm_in_kernel", "p", False),
    ("core_attn_out", "p", None)]
VLLM_RECURRENT = _p("q", "k", "v", "g") + [
    ("beta", "p", None), ("scale", "p", None), ("initial_state", "p", None), ("inplace_final_state", "p", True),
    ("cu_seqlens", "p", None), ("ssm_state_indices", "p", None), ("num_accepted_tokens", "p", None),
    ("use_qk_l2norm_in_kernel", "p", False)]
VLLM_SIGMOID = _p("A_log", "a", "b", "dt_bias", "q", "k", "v") + [
    ("beta", "p", 1.0), ("threshold", "p", 20.0), ("scale", "p", None), ("initial_state", "p", None),
    ("inplace_final_state", "p", True), ("cu_seqlens", "p", None), ("ssm_state_indices", "p", None),
    ("num_accepted_tokens", "p", None), ("use_qk_l2norm_in_kernel", "p", False), ("is_kda", "p", False)]
VLLM_PACKED = _p("mixed_qkv", "a", "b", "A_log", "dt_bias", "scale", "initial_state", "out", "ssm_state_indices") + [
    ("use_qk_l2norm_in_kernel", "p", False)]

H, HV, K, V = 2, 4, 64, 128


def problem(g, B, T, P=12, dtype=torch.float32, device="cpu", gating="given"):
    p = dict(q=randn(g, B, T, H, K, dtype=dtype, device=device), k=randn(g, B, T, H, K, dtype=dtype, device=device),
             v=randn(g, B, T, HV, V, dtype=dtype, device=device), pool=0.1 * randn(g, P, HV, V, K, device=device))
    p["a"] = randn(g, B * T, HV, dtype=dtype, device=device)
    p["b"] = randn(g, B * T, HV, dtype=dtype, device=device)
    p["A_log"] = torch.log(torch.rand(HV, generator=g) * 15 + 1).to(device)
    p["dt_bias"] = 0.5 * randn(g, HV, device=device)
    p["g"] = (-torch.rand(B, T, HV, generator=g) * 0.5).to(device)
    p["beta"] = torch.rand(B, T, HV, generator=g).to(dtype=dtype, device=device)
    p["gating"] = gating
    return p


def call(p, pool=None, q=None, k=None, v=None, sp=(1.0, 20.0), **kw):
    kw.setdefault("use_qk_l2norm_in_kernel", True)
    q, k, v = (p["q"] if q is None else q), (p["k"] if k is None else k), (p["v"] if v is None else v)
    pool = p["pool"] if pool is None else pool
    if p["gating"] == "given":
        return adapter.fused_recurrent_gated_delta_rule(q, k, v, p["g"], p["beta"], initial_state=pool, **kw)
    return adapter.fused_sigmoid_gating_delta_rule_update(p["A_log"], p["a"], p["b"], p["dt_bias"], q, k, v,
                                                          beta=sp[0], threshold=sp[1], initial_state=pool, **kw)


def gates_of(p, sp=(1.0, 20.0)):
    if p["gating"] == "given":
        return f64(p["g"]).reshape(-1, HV), f64(p["beta"]).reshape(-1, HV)
    a, b, A, dt = f64(p["a"]), f64(p["b"]), f64(p["A_log"]), f64(p["dt_bias"])
    if sp == (1.0, 20.0):
        return fused_gates(a, b, A, dt)
    x = (a + dt[None]) * sp[0]
    soft = np.where(x > sp[1], a + dt[None], np.log1p(np.exp(np.minimum(x, sp[1]))) / sp[0])
    return -np.exp(A)[None] * soft, sigmoid(b)


def slot_at(idx, n, j):
    """vLLM's kernel's ``ssm_state_indices + n*stride(0) + j`` for a 2-D or contiguous 1-D tensor."""
    if idx.dim() == 2:
        return int(idx[n, j]) if 0 <= j < idx.shape[1] else -1
    return int(idx[n + j]) if 0 <= n + j < idx.shape[0] else -1


def vllm_ref(p, before, lens, idx=None, nacc=None, inplace=True, sp=(1.0, 20.0)):
    """What vLLM's recurrent kernel computes (fp64) from the pool ``before`` the call: per-sequence outputs
    (None: skipped) and the expected pool (inplace) or per-token final states [T_total]."""
    pool0 = f64(before)
    gg, bb = gates_of(p, sp)
    flat = {n: p[n].reshape(-1, *p[n].shape[2:]) for n in "qkv"}
    outs, pool, final = [], pool0.copy(), {}
    bos = 0
    for n, ln in enumerate(lens):
        r = slice(bos, bos + ln)
        if idx is not None:
            read = slot_at(idx, n, (int(nacc[n]) - 1) if nacc is not None else 0)
            if read <= 0:
                outs.append(None)
                bos += ln
                continue
        else:
            read = bos
        o, _, states = ref(np.swapaxes(pool0[read], -1, -2), flat["q"][r], flat["k"][r], flat["v"][r], gg[r], bb[r])
        outs.append(o)
        for t in range(ln):
            if inplace:
                w = slot_at(idx, n, t)
                if w > 0:
                    pool[w] = np.swapaxes(states[t], -1, -2)
            else:
                final[bos + t] = np.swapaxes(states[t], -1, -2)
        bos += ln
    return outs, pool, final


def check(p, o, outs, lens, pool=None, expect_pool=None, touched=(), before=None, kind="recurrent"):
    of = o.reshape(-1, HV, V)
    bos = 0
    for n, ln in enumerate(lens):
        if outs[n] is None:
            assert torch.all(of[bos:bos + ln] == 0), f"skipped sequence {n}: o must be 0"
        elif ln:
            assert rel(f64(of[bos:bos + ln]), outs[n]) < tol(kind, "o", p["q"].dtype)
        bos += ln
    if pool is not None:
        for s in range(pool.shape[0]):
            if s in touched:
                assert rel(f64(pool[s]), expect_pool[s]) < tol(kind, "state", pool.dtype), f"slot {s}"
            else:
                assert bits_equal(pool[s], before[s]), f"slot {s} changed"


def written_slots(idx, lens, nacc=None):
    out = set()
    for n, ln in enumerate(lens):
        if slot_at(idx, n, (int(nacc[n]) - 1) if nacc is not None else 0) <= 0:
            continue
        out |= {slot_at(idx, n, t) for t in range(ln) if slot_at(idx, n, t) > 0}
    return out


GATINGS = ["given", "fused"]


# ---- signatures and keywords -------------------------------------------------------------------------

def test_signatures_are_vllm_0330():
    assert_signature(adapter.chunk_gated_delta_rule, VLLM_CHUNK)
    assert_signature(adapter.fused_recurrent_gated_delta_rule, VLLM_RECURRENT)
    assert_signature(adapter.fused_sigmoid_gating_delta_rule_update, VLLM_SIGMOID)
    assert_signature(adapter.fused_recurrent_gated_delta_rule_packed_decode, VLLM_PACKED)


@pytest.mark.parametrize("name", ["output_final_state", "state_v_first", "typo"])
def test_unknown_keyword_is_a_type_error_naming_it(name):
    p = problem(gen("v-kw"), 1, 1)
    with pytest.raises(TypeError, match=f"'{name}'"):
        call(p, ssm_state_indices=torch.tensor([1]), **{name: True})
    with pytest.raises(TypeError, match=f"'{name}'"):
        call(dict(p, gating="fused"), ssm_state_indices=torch.tensor([1]), **{name: True})


@pytest.mark.parametrize("name", ["inplace_final_state", "ssm_state_indices", "chunk_size", "state_v_first"])
def test_chunk_unknown_keyword_is_a_type_error_naming_it(name):
    p = problem(gen("v-kw-chunk"), 1, 2)
    with pytest.raises(TypeError, match=f"'{name}'"):
        adapter.chunk_gated_delta_rule(p["q"], p["k"], p["v"], p["g"], p["beta"], **{name: True})


# ---- recurrent: decode ---------------------------------------------------------------------------------

@pytest.mark.parametrize("gating", GATINGS)
@pytest.mark.parametrize("form", ["varlen_1d", "fixed_1d", "fixed_2d"])
def test_decode_in_place(gating, form):
    """One token per sequence, read and written at ssm_state_indices[n] (or [n, 0]); slot 0 (null block) and
    negative slots skip the sequence: o = 0, no state I/O."""
    g = gen("v-decode", gating, form)
    N = 5
    if form == "varlen_1d":
        p = problem(g, 1, N, gating=gating)
        kw = dict(cu_seqlens=torch.arange(N + 1, dtype=torch.int32))
        idx = torch.tensor([7, 0, 3, -1, 10, 4, 4], dtype=torch.int32)  # padded buffer: first N used
    else:
        p = problem(g, N, 1, gating=gating)
        kw = {}
        idx = torch.tensor([7, 0, 3, -1, 10], dtype=torch.int64)
        if form == "fixed_2d":
            idx = torch.stack([idx, torch.full_like(idx, 11)], dim=1)
    before = p["pool"].clone()
    res = call(p, ssm_state_indices=idx, **kw)
    assert isinstance(res, tuple) and len(res) == 2 and res[1] is p["pool"]
    o = res[0]
    assert o.shape == p["v"].shape and o.dtype == p["q"].dtype
    lens = [1] * N
    idx_n = idx[:N]
    outs, expect, _ = vllm_ref(p, before, lens, idx_n)
    check(p, o, outs, lens, p["pool"], expect, written_slots(idx_n, lens), before)


# ---- recurrent: spec decode ------------------------------------------------------------------------------

@pytest.mark.parametrize("gating", GATINGS)
@pytest.mark.parametrize("varlen", [False, True])
def test_spec_decode(gating, varlen):
    """2-D ssm_state_indices [N, S]: sequence n starts from [n, num_accepted_tokens[n] - 1] and the state after
    token t goes to [n, t] (skipped where <= 0); a sequence whose start slot is <= 0 is skipped."""
    g = gen("v-spec", gating, varlen)
    S = 4
    idx = torch.tensor([[1, 2, 3, 4], [5, 0, 6, 7], [8, 9, 10, 11], [0, 12, 13, 14], [15, 16, 17, 18]],
                       dtype=torch.int32)
    nacc = torch.tensor([2, 1, 4, 1, 3], dtype=torch.int32)  # sequence 3 starts at slot 0: skipped
    N = idx.shape[0]
    if varlen:
        lens = [4, 2, 3, 4, 1]
        p = problem(g, 1, sum(lens), P=20, gating=gating)
        kw = dict(cu_seqlens=torch.tensor(np.concatenate([[0], np.cumsum(lens)]), dtype=torch.int32))
    else:
        lens = [S] * N
        p = problem(g, N, S, P=20, gating=gating)
        kw = {}
    before = p["pool"].clone()
    o, final = call(p, ssm_state_indices=idx, num_accepted_tokens=nacc, **kw)
    assert final is p["pool"]
    outs, expect, _ = vllm_ref(p, before, lens, idx, nacc)
    check(p, o, outs, lens, p["pool"], expect, written_slots(idx, lens, nacc), before)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_spec_decode_strided_inputs(layout, monkeypatch):
    g = gen("v-spec-strided", layout)
    N, S = 3, 4
    p = problem(g, N, S, P=14)
    idx = torch.arange(1, 13, dtype=torch.int32).view(N, S)
    nacc = torch.tensor([1, 3, 2], dtype=torch.int32)
    before = p["pool"].clone()
    base_pool = p["pool"].clone()
    base_o, _ = call(p, pool=base_pool, ssm_state_indices=idx, num_accepted_tokens=nacc)
    q, k, v = strided(layout, p["q"], p["k"], p["v"])
    counter = CopyCounter(monkeypatch)
    o, _ = call(p, q=q, k=k, v=v, ssm_state_indices=idx, num_accepted_tokens=nacc)
    assert counter.count == copies_expected(layout, N, S)
    assert torch.equal(o, base_o) and torch.equal(p["pool"], base_pool)
    outs, expect, _ = vllm_ref(p, before, [S] * N, idx, nacc)
    check(p, o, outs, [S] * N, p["pool"], expect, written_slots(idx, [S] * N, nacc), before)


def test_decode_views_are_not_copied(monkeypatch):
    """vLLM's decode passes q/k/v split from the conv output [T, D] and a/b from a projection: no copies."""
    g = gen("v-decode-views")
    N = 4
    p = problem(g, 1, N, gating="fused")
    mixed = torch.cat([p["q"].reshape(N, -1), p["k"].reshape(N, -1), p["v"].reshape(N, -1)], dim=-1)
    q = mixed[:, :H * K].view(1, N, H, K)
    k = mixed[:, H * K:2 * H * K].view(1, N, H, K)
    v = mixed[:, 2 * H * K:].view(1, N, HV, V)
    ba = torch.cat([p["b"], p["a"]], dim=-1)
    p2 = dict(p, a=ba[:, HV:], b=ba[:, :HV])
    idx = torch.tensor([3, 5, 1, 8], dtype=torch.int32)
    before = p["pool"].clone()
    counter = CopyCounter(monkeypatch)
    o, _ = call(p2, q=q, k=k, v=v, cu_seqlens=torch.arange(N + 1, dtype=torch.int32), ssm_state_indices=idx)
    assert counter.count == 0
    outs, expect, _ = vllm_ref(p, before, [1] * N, idx)
    check(p, o, outs, [1] * N, p["pool"], expect, {3, 5, 1, 8}, before)


@pytest.mark.parametrize("sp", [(2.0, 10.0), (1.0, 4.0)])
def test_sigmoid_gating_softplus_parameters(sp):
    g = gen("v-softplus", sp)
    N = 3
    p = problem(g, N, 2, gating="fused")
    p["a"] = p["a"] * 8
    idx = torch.tensor([[1, 2], [3, 4], [5, 6]], dtype=torch.int32)
    before = p["pool"].clone()
    o, _ = call(p, sp=sp, ssm_state_indices=idx)
    outs, expect, _ = vllm_ref(p, before, [2] * N, idx, sp=sp)
    check(p, o, outs, [2] * N, p["pool"], expect, written_slots(idx, [2] * N), before)


# ---- recurrent: inplace_final_state=False ----------------------------------------------------------

@pytest.mark.parametrize("gating", GATINGS)
@pytest.mark.parametrize("form", ["fixed_no_idx", "varlen_no_idx", "varlen_2d"])
def test_per_token_final_states(gating, form):
    """inplace_final_state=False: the state after every token in a new [T, HV, V, K], row bos_n + t; without
    indices sequence n starts from initial_state[bos_n] (vLLM's indexing)."""
    g = gen("v-noinplace", gating, form)
    if form == "fixed_no_idx":
        lens, kw, idx = [5], {}, None
        p = problem(g, 1, 5, gating=gating)
    else:
        lens = [3, 0, 4, 1]
        p = problem(g, 1, sum(lens), P=12, gating=gating)
        kw = dict(cu_seqlens=torch.tensor(np.concatenate([[0], np.cumsum(lens)]), dtype=torch.int64))
        idx = torch.tensor([[2, 0, 0, 0], [3, 0, 0, 0], [0, 0, 0, 0], [9, 0, 0, 0]]) if form == "varlen_2d" else None
        if idx is not None:
            idx[2, 0] = 6
            kw["ssm_state_indices"] = idx
    before = p["pool"].clone()
    o, final = call(p, inplace_final_state=False, **kw)
    assert bits_equal(p["pool"], before)
    assert final.shape == (sum(lens), HV, V, K) and final.dtype == p["pool"].dtype and final is not p["pool"]
    outs, _, expect = vllm_ref(p, before, lens, idx, inplace=False)
    check(p, o, outs, lens)
    for row, S in expect.items():
        assert rel(f64(final[row]), S) < tol("recurrent", "state", torch.float32)


# ---- recurrent: errors -----------------------------------------------------------------------------------

def test_recurrent_errors():
    g = gen("v-errors")
    p = problem(g, 2, 3)
    before = p["pool"].clone()
    with pytest.raises(ValueError, match="initial_state is required"):
        adapter.fused_recurrent_gated_delta_rule(p["q"], p["k"], p["v"], p["g"], p["beta"])
    with pytest.raises(ValueError, match="needs ssm_state_indices"):
        call(p)
    with pytest.raises(ValueError, match="1-D ssm_state_indices serve one token"):
        call(p, ssm_state_indices=torch.tensor([1, 2]))
    with pytest.raises(ValueError, match="B=2"):
        call(p, inplace_final_state=False)
    with pytest.raises(ValueError, match="batch size is expected to be 1"):
        call(p, ssm_state_indices=torch.tensor([[1], [2]]), cu_seqlens=torch.tensor([0, 3, 6]))
    with pytest.raises(NotImplementedError, match="per-channel beta"):
        adapter.fused_recurrent_gated_delta_rule(p["q"], p["k"], p["v"], p["g"], torch.rand(2, 3, HV, V),
                                                 initial_state=p["pool"], ssm_state_indices=torch.tensor([[1], [2]]))
    with pytest.raises(NotImplementedError, match="is_kda"):
        adapter.fused_sigmoid_gating_delta_rule_update(p["A_log"], p["a"], p["b"], p["dt_bias"], p["q"], p["k"],
                                                       p["v"], initial_state=p["pool"], is_kda=True)
    with pytest.raises(NotImplementedError, match="float16 initial_state"):
        call(p, pool=p["pool"].half(), ssm_state_indices=torch.tensor([[1, 2, 3], [4, 5, 6]]))
    with pytest.raises(NotImplementedError, match="autograd"):
        call(p, q=p["q"].clone().requires_grad_(), ssm_state_indices=torch.tensor([[1, 2, 3], [4, 5, 6]]))
    assert bits_equal(p["pool"], before), "the pool written by a refused call"


# ---- chunk ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("init,final", [(True, True), (False, True), (True, False), (False, False)])
@pytest.mark.parametrize("varlen", [False, True])
def test_chunk(init, final, varlen):
    g = gen("v-chunk", init, final, varlen)
    if varlen:
        lens = [70, 0, 5, 130]
        p = problem(g, 1, sum(lens))
        cu = torch.tensor(np.concatenate([[0], np.cumsum(lens)]), dtype=torch.int32)
    else:
        lens = [40, 40]
        p = problem(g, 2, 40)
        cu = None
    N = len(lens)
    h0 = 0.1 * randn(g, N, HV, V, K) if init else None
    keep = None if h0 is None else h0.clone()
    res = adapter.chunk_gated_delta_rule(p["q"], p["k"], p["v"], p["g"], p["beta"], initial_state=h0,
                                         output_final_state=final, cu_seqlens=cu, use_qk_l2norm_in_kernel=True,
                                         chunk_indices=torch.zeros(1), chunk_offsets=torch.zeros(1))
    assert isinstance(res, tuple) and len(res) == 2
    o, ht = res
    assert o.shape == p["v"].shape and o.dtype == p["q"].dtype
    if final:
        assert ht.shape == (N, HV, V, K) and ht.dtype == torch.float32
    else:
        assert ht is None
    if h0 is not None:
        assert torch.equal(h0, keep)
    flat = {n: p[n].reshape(-1, *p[n].shape[2:]) for n in "qkv"}
    gg, bb = f64(p["g"]).reshape(-1, HV), f64(p["beta"]).reshape(-1, HV)
    of = o.reshape(-1, HV, V)
    bos = 0
    for n, ln in enumerate(lens):
        r = slice(bos, bos + ln)
        ro, rS, _ = ref(None if h0 is None else kv_last(h0[n]), flat["q"][r], flat["k"][r], flat["v"][r], gg[r], bb[r])
        if ln:
            assert rel(f64(of[r]), ro) < tol("prefill", "o", torch.float32)
        if final:
            assert rel(kv_last(ht[n]), rS) < tol("prefill", "state", torch.float32)
        bos += ln


def test_chunk_core_attn_out_and_strided_inputs(monkeypatch):
    g = gen("v-chunk-out")
    B, T = 2, 70
    p = problem(g, B, T)
    base, _ = adapter.chunk_gated_delta_rule(p["q"], p["k"], p["v"], p["g"], p["beta"], use_qk_l2norm_in_kernel=True)
    buf = torch.full((B * T * HV * V + 100,), float("nan"))
    q, k, v = strided("projection", p["q"], p["k"], p["v"])
    counter = CopyCounter(monkeypatch)
    o, _ = adapter.chunk_gated_delta_rule(q, k, v, p["g"], p["beta"], use_qk_l2norm_in_kernel=True,
                                          core_attn_out=buf)
    assert counter.count == 0
    assert o.data_ptr() == buf.data_ptr() and o.shape == p["v"].shape
    assert torch.equal(o, base) and torch.isnan(buf[B * T * HV * V:]).all()
    q, k, v = strided("time_slice", p["q"], p["k"], p["v"])
    o, _ = adapter.chunk_gated_delta_rule(q, k, v, p["g"], p["beta"], use_qk_l2norm_in_kernel=True)
    assert counter.count == 3 and torch.equal(o, base)
    with pytest.raises(ValueError, match="core_attn_out too small"):
        adapter.chunk_gated_delta_rule(p["q"], p["k"], p["v"], p["g"], p["beta"], core_attn_out=buf[:10])
    with pytest.raises(ValueError, match="beta must be of shape"):
        adapter.chunk_gated_delta_rule(p["q"], p["k"], p["v"], p["g"], p["beta"][..., None])


# ---- packed decode -----------------------------------------------------------------------------------

def test_packed_decode(monkeypatch):
    g = gen("v-packed")
    B = 5
    p = problem(g, 1, B, gating="fused")
    mixed = torch.cat([p["q"].reshape(B, -1), p["k"].reshape(B, -1), p["v"].reshape(B, -1)], dim=-1)
    out = torch.full((B, 1, HV, V), float("nan"))
    idx = torch.tensor([4, 0, 7, -3, 2], dtype=torch.int32)
    before = p["pool"].clone()
    counter = CopyCounter(monkeypatch)
    res = adapter.fused_recurrent_gated_delta_rule_packed_decode(mixed, p["a"], p["b"], p["A_log"], p["dt_bias"],
                                                                 K ** -0.5, p["pool"], out, idx,
                                                                 use_qk_l2norm_in_kernel=True)
    assert counter.count == 0
    assert res[0] is out and res[1] is p["pool"]
    outs, expect, _ = vllm_ref(p, before, [1] * B, idx)
    check(p, out.view(1, B, HV, V), outs, [1] * B, p["pool"], expect, {4, 7, 2}, before)
    with pytest.raises(ValueError, match="`out` must have shape"):
        adapter.fused_recurrent_gated_delta_rule_packed_decode(mixed, p["a"], p["b"], p["A_log"], p["dt_bias"], 0.1,
                                                               p["pool"], out.view(B, HV, V), idx)


# ---- CUDA: against vLLM's own functions --------------------------------------------------------------

peer = peer_sources.vllm_fla_ops() if CUDA else None
needs_peer = skip_without_peer(peer is not None, peer_sources.why_missing("vllm"))
GH, GHV, GK, GV = 16, 32, 128, 128


def gpu_problem(key, B, T, P=64, gating="given"):
    g = gen(*key)
    p = dict(q=randn(g, B, T, GH, GK, dtype=torch.bfloat16, device="cuda"),
             k=randn(g, B, T, GH, GK, dtype=torch.bfloat16, device="cuda"),
             v=randn(g, B, T, GHV, GV, dtype=torch.bfloat16, device="cuda"),
             pool=0.1 * randn(g, P, GHV, GV, GK, device="cuda"),
             a=randn(g, B * T, GHV, dtype=torch.bfloat16, device="cuda"),
             b=randn(g, B * T, GHV, dtype=torch.bfloat16, device="cuda"),
             A_log=torch.log(torch.rand(GHV, generator=g) * 15 + 1).cuda(), dt_bias=0.5 * randn(g, GHV, device="cuda"),
             g=(-torch.rand(B, T, GHV, generator=g) * 0.5).cuda(),
             beta=torch.rand(B, T, GHV, generator=g).to(torch.bfloat16).cuda(), gating=gating)
    return p




def both_recurrent(p, **kw):
    """(o, final, pool) of the adapter and of vLLM on clones of the pool."""
    res = []
    for mod in (adapter, peer):
        pool = p["pool"].clone()
        with torch.no_grad():
            if p["gating"] == "given":
                f = lambda: mod.fused_recurrent_gated_delta_rule(p["q"], p["k"], p["v"], p["g"], p["beta"],  # noqa
                                                                 initial_state=pool, use_qk_l2norm_in_kernel=True, **kw)
            else:
                f = lambda: mod.fused_sigmoid_gating_delta_rule_update(  # noqa: E731
                    p["A_log"], p["a"], p["b"], p["dt_bias"], p["q"], p["k"], p["v"], initial_state=pool,
                    use_qk_l2norm_in_kernel=True, **kw)
            o, final = cuda_or_skip(f) if mod is adapter else f()
        torch.cuda.synchronize()
        res.append((o, final, pool))
    return res


@needs_cuda
@needs_peer
@pytest.mark.parametrize("gating", GATINGS)
def test_decode_vs_vllm(gating):
    N = 48
    p = gpu_problem(("v-gpu-decode", gating), 1, N, gating=gating)
    idx = (torch.randperm(63, generator=gen("perm"))[:N] + 1).to(torch.int32).cuda()
    idx[5] = 0  # a null block: skipped by both
    (o, f, pool), (o_ref, f_ref, pool_ref) = both_recurrent(
        p, cu_seqlens=torch.arange(N + 1, dtype=torch.int32, device="cuda"), ssm_state_indices=idx)
    # vLLM's autograd.Function hands back an alias of the pool (a new tensor object); both are the pool in place.
    assert f is pool and f_ref.data_ptr() == pool_ref.data_ptr() and f_ref.shape == pool_ref.shape
    assert o.shape == o_ref.shape and o.dtype == o_ref.dtype
    keep = idx > 0
    assert rel(f64(o[0, keep]), f64(o_ref[0, keep])) < 1e-2
    assert rel(f64(pool), f64(pool_ref)) < 1e-2


@needs_cuda
@needs_peer
@pytest.mark.parametrize("gating", GATINGS)
@pytest.mark.parametrize("varlen", [False, True])
def test_spec_decode_vs_vllm(gating, varlen):
    N, S = 8, 4
    idx = (torch.arange(N * S, dtype=torch.int32) + 1).view(N, S).cuda()
    idx[2, 1] = 0
    nacc = torch.tensor([1, 2, 3, 4, 1, 2, 3, 4], dtype=torch.int32, device="cuda")
    if varlen:
        lens = [4, 3, 2, 1, 4, 4, 2, 3]
        p = gpu_problem(("v-gpu-spec", gating, varlen), 1, sum(lens), gating=gating)
        kw = dict(cu_seqlens=torch.tensor(np.concatenate([[0], np.cumsum(lens)]), dtype=torch.int32, device="cuda"))
    else:
        p = gpu_problem(("v-gpu-spec", gating, varlen), N, S, gating=gating)
        kw = {}
    (o, _, pool), (o_ref, _, pool_ref) = both_recurrent(p, ssm_state_indices=idx, num_accepted_tokens=nacc, **kw)
    assert rel(f64(o), f64(o_ref)) < 1e-2
    assert rel(f64(pool), f64(pool_ref)) < 1e-2
    assert torch.equal(pool[0], p["pool"][0])


@needs_cuda
@needs_peer
def test_per_token_final_states_vs_vllm():
    lens = [5, 3, 7]
    p = gpu_problem(("v-gpu-noinplace",), 1, sum(lens))
    idx = torch.tensor([[3] + [0] * 6, [9] + [0] * 6, [4] + [0] * 6], dtype=torch.int32, device="cuda")
    cu = torch.tensor(np.concatenate([[0], np.cumsum(lens)]), dtype=torch.int32, device="cuda")
    (o, f, pool), (o_ref, f_ref, pool_ref) = both_recurrent(p, inplace_final_state=False, cu_seqlens=cu,
                                                            ssm_state_indices=idx)
    assert f.shape == f_ref.shape and f.dtype == f_ref.dtype
    assert rel(f64(o), f64(o_ref)) < 1e-2 and rel(f64(f), f64(f_ref)) < 1e-2
    assert torch.equal(pool, pool_ref)


@needs_cuda
@needs_peer
@pytest.mark.parametrize("layout", LAYOUTS)
def test_chunk_vs_vllm(layout):
    lens = [100, 1, 64, 257]
    T = sum(lens)
    p = gpu_problem(("v-gpu-chunk", layout), 1, T)
    q, k, v = strided(layout, p["q"], p["k"], p["v"])
    cu = torch.tensor(np.concatenate([[0], np.cumsum(lens)]), dtype=torch.int32, device="cuda")
    h0 = 0.1 * randn(gen("h0"), 4, GHV, GV, GK, device="cuda")
    kw = dict(initial_state=h0, output_final_state=True, cu_seqlens=cu, use_qk_l2norm_in_kernel=True)
    with torch.no_grad():
        o, s = cuda_or_skip(adapter.chunk_gated_delta_rule, q, k, v, p["g"], p["beta"], **kw)
        o_ref, s_ref = peer.chunk_gated_delta_rule(q, k, v, p["g"], p["beta"], **kw)
    assert o.shape == o_ref.shape and o.dtype == o_ref.dtype and s.shape == s_ref.shape and s.dtype == s_ref.dtype
    assert rel(f64(o), f64(o_ref)) < 1e-2 and rel(f64(s), f64(s_ref)) < 1e-2


@needs_cuda
@needs_peer
def test_packed_decode_vs_vllm():
    B = 32
    p = gpu_problem(("v-gpu-packed",), 1, B, gating="fused")
    mixed = torch.cat([p["q"].reshape(B, -1), p["k"].reshape(B, -1), p["v"].reshape(B, -1)], dim=-1)
    idx = (torch.arange(B, dtype=torch.int32, device="cuda") * 2) % 64
    res = []
    for mod in (adapter, peer):
        pool, out = p["pool"].clone(), torch.empty(B, 1, GHV, GV, dtype=torch.bfloat16, device="cuda")
        mod.fused_recurrent_gated_delta_rule_packed_decode(mixed, p["a"], p["b"], p["A_log"], p["dt_bias"], GK ** -0.5,
                                                           pool, out, idx, use_qk_l2norm_in_kernel=True)
        torch.cuda.synchronize()
        res.append((out, pool))
    assert rel(f64(res[0][0]), f64(res[1][0])) < 1e-2 and rel(f64(res[0][1]), f64(res[1][1])) < 1e-2


@needs_cuda
@needs_peer
def test_same_positional_parameters_as_vllm():
    for name in adapter.__all__:
        if hasattr(peer, name):
            assert_same_positional(getattr(adapter, name), getattr(peer, name))
