"""Every op on the CPU backend with NumPy arrays vs the fp64 recurrence in reference.py.

Outputs are NaN-poisoned before each call, untouched pool slots are NaN-poisoned and must be
bit-identical afterwards, inputs are fresh random per test (seeded per parametrization).
"""

import zlib

import numpy as np
import pytest

import gdnkit
from reference import (TOLERANCES, Problem, bits_equal, from_layout, poison, pool_shape, random_pool, rel,
                       run_tokens, to_layout)

LAYOUTS = ["k_last", "v_last"]
DTYPES = {"fp32": np.float32, "fp16": np.float16}


def rng_for(*key):
    return np.random.default_rng(zlib.crc32(repr(key).encode()))


def tol(kind, what, dtype_name):
    return TOLERANCES[(kind, what, dtype_name)]


def make_pool(rng, P, p, layout, touched):
    """A random pool whose untouched slots are NaN (so a stray read shows up as NaN in the results)."""
    pool = random_pool(rng, P, p.HV, p.K, p.V, layout)
    for s in range(P):
        if s not in touched:
            pool[s] = np.nan
    return pool


def check_untouched(pool, before, touched):
    for s in range(pool.shape[0]):
        if s not in touched:
            assert bits_equal(pool[s], before[s]), f"untouched slot {s} changed"


# ---- decode -----------------------------------------------------------------------------------

@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("gating", ["fused", "given"])
@pytest.mark.parametrize("dt", ["fp32", "fp16"])
@pytest.mark.parametrize("views", [False, True], ids=["contig", "fused_views"])
def test_decode(layout, gating, dt, views):
    rng = rng_for("decode", layout, gating, dt, views)
    B, P = 6, 11
    p = Problem(rng, B, dtype=DTYPES[dt], gating=gating, fused_views=views)
    slots = rng.permutation(P)[:B].astype(np.int32)
    slots[2] = -1  # a padding row
    pool = make_pool(rng, P, p, layout, set(slots.tolist()))
    before = pool.copy()
    o = poison(p.v.shape, p.v.dtype)
    out = gdnkit.decode(p.q, p.k, p.v, pool, slots, layout=layout, o=o, **p.gate_kwargs())
    assert out is o
    scale = p.K ** -0.5
    for i, s in enumerate(slots):
        if s < 0:
            assert np.all(o[i] == 0), "padding row: o must be 0"
            continue
        S0 = from_layout(before[s], layout)
        ref_o, ref_S = run_tokens(S0, *p.tokens(slice(i, i + 1)), scale, True)
        assert rel(o[i], ref_o[0]) < tol("recurrent", "o", dt)
        assert rel(from_layout(pool[s], layout), ref_S) < tol("recurrent", "state", "fp32")
    check_untouched(pool, before, set(slots[slots >= 0].tolist()))


def test_decode_allocates_output_and_scale():
    rng = rng_for("decode-alloc")
    p = Problem(rng, 3, H=1, HV=2, K=64, V=64)
    pool = random_pool(rng, 3, p.HV, p.K, p.V, "k_last")
    before = pool.copy()
    slots = np.array([2, 0, 1], np.int32)
    o = gdnkit.decode(p.q, p.k, p.v, pool, slots, layout="k_last", scale=0.3, use_qk_l2norm=False,
                      **p.gate_kwargs())
    assert isinstance(o, np.ndarray) and o.shape == p.v.shape and o.dtype == p.v.dtype
    for i, s in enumerate(slots):
        ref_o, _ = run_tokens(from_layout(before[s], "k_last"), *p.tokens(slice(i, i + 1)), 0.3, False)
        assert rel(o[i], ref_o[0]) < 5e-5


def test_decode_error_flag_counts_slots_out_of_range():
    rng = rng_for("decode-flag")
    p = Problem(rng, 3)
    pool = random_pool(rng, 4, p.HV, p.K, p.V, "k_last")
    before = pool.copy()
    flag = np.zeros(1, np.int32)
    slots = np.array([1, 7, 2], np.int32)  # 7 >= P: skipped and counted
    o = gdnkit.decode(p.q, p.k, p.v, pool, slots, error_flag=flag, **p.gate_kwargs())
    assert flag[0] == 1
    assert np.all(o[1] == 0)
    assert bits_equal(pool[0], before[0]) and bits_equal(pool[3], before[3])


# ---- verify -----------------------------------------------------------------------------------

def chain_parent(B, T):
    return np.tile(np.arange(-1, T - 1, dtype=np.int32), (B, 1))


def tree_parent(rng, B, T):
    par = np.empty((B, T), np.int32)
    for b in range(B):
        par[b, 0] = -1
        for t in range(1, T):
            par[b, t] = rng.integers(-1, t)
    return par


def ref_verify(p, before, layout, slots, seq_rows, parent):
    """Per sequence: outputs and the state after each token (parent: [B, T] or None for chains)."""
    scale = p.K ** -0.5
    outs, states = {}, {}
    for b, s in enumerate(slots):
        rows = seq_rows[b]
        if s < 0:
            continue
        S0 = from_layout(before[s], layout)
        o_b, st_b = [], []
        for t, r in enumerate(rows):
            par = (t - 1) if parent is None else parent[b, t]
            S = S0 if par < 0 else st_b[par]
            o_t, S1, _ = run_tokens(S, *p.tokens(slice(r, r + 1)), scale, True, keep_states=True)
            o_b.append(o_t[0])
            st_b.append(S1)
        outs[b], states[b] = o_b, st_b
    return outs, states


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("mode", ["chain", "tree", "varlen"])
def test_verify(layout, mode):
    rng = rng_for("verify", layout, mode)
    B, T, P, Q = 4, 4, 9, 6
    if mode == "varlen":
        lens = np.array([3, 0, 4, 2])
        cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    else:
        lens = np.full(B, T)
        cu = None
    T_total = int(lens.sum())
    p = Problem(rng, T_total, gating="fused")
    offs = np.concatenate([[0], np.cumsum(lens)])
    seq_rows = [list(range(offs[b], offs[b + 1])) for b in range(B)]
    slots = rng.permutation(P)[:B].astype(np.int32)
    islots = rng.permutation(Q)[:B].astype(np.int32)
    islots[1] = -1  # not cached
    parent = tree_parent(rng, B, T) if mode == "tree" else None
    pool = make_pool(rng, P, p, layout, set(slots.tolist()))
    before = pool.copy()
    inter = poison((Q, T) + pool_shape(1, p.HV, p.K, p.V, layout)[1:])
    o = poison(p.v.shape, p.v.dtype)
    update = mode != "tree"
    gdnkit.verify(p.q, p.k, p.v, pool, slots, layout=layout, o=o, cu_seqlens=cu, parent=parent,
                  intermediate=inter, intermediate_indices=islots, update_state=update,
                  num_draft_tokens=T if mode == "varlen" else None, **p.gate_kwargs())
    outs, states = ref_verify(p, before, layout, slots, seq_rows, parent)
    for b in range(B):
        for t, r in enumerate(seq_rows[b]):
            assert rel(o[r], outs[b][t]) < tol("recurrent", "o", "fp32")
            if islots[b] >= 0:
                assert rel(from_layout(inter[islots[b], t], layout), states[b][t]) < tol("recurrent", "state", "fp32")
        s = slots[b]
        if update and len(seq_rows[b]) > 0:
            assert rel(from_layout(pool[s], layout), states[b][-1]) < tol("recurrent", "state", "fp32")
        else:
            assert bits_equal(pool[s], before[s]), "pool changed without update_state"
        if islots[b] >= 0:  # steps past the sequence's length stay untouched
            for t in range(len(seq_rows[b]), T):
                assert np.all(np.isnan(inter[islots[b], t]))
    untouched_q = set(range(Q)) - set(islots.tolist())
    for qs in untouched_q:
        assert np.all(np.isnan(inter[qs]))
    check_untouched(pool, before, set(slots.tolist()))


# ---- commit -----------------------------------------------------------------------------------

@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("source", ["cache", "recompute"])
@pytest.mark.parametrize("mode", ["chain", "tree"])
def test_commit(layout, source, mode):
    rng = rng_for("commit", layout, source, mode)
    B, T, P = 4, 4, 7
    p = Problem(rng, B * T, gating="given")
    slots = rng.permutation(P)[:B].astype(np.int32)
    islots = np.arange(B, dtype=np.int32)[::-1].copy()
    parent = tree_parent(rng, B, T) if mode == "tree" else None
    pool = make_pool(rng, P, p, layout, set(slots.tolist()))
    before = pool.copy()
    inter = poison((B, T) + pool_shape(1, p.HV, p.K, p.V, layout)[1:])
    gdnkit.verify(p.q, p.k, p.v, pool, slots, layout=layout, parent=parent, intermediate=inter,
                  intermediate_indices=islots, **p.gate_kwargs())
    assert bits_equal(pool, before)
    seq_rows = [list(range(b * T, b * T + T)) for b in range(B)]
    _, states = ref_verify(p, before, layout, slots, seq_rows, parent)
    accepted = np.array([0, 1, T, 2], np.int32)
    path = None
    if mode == "tree":
        # a root-to-node path of the tree per sequence, accepted[b] tokens long
        path = np.full((B, T), -1, np.int32)
        for b in range(B):
            node_paths = {}
            for t in range(T):
                par = parent[b, t]
                node_paths[t] = (node_paths[par] if par >= 0 else []) + [t]
            longest = max(node_paths.values(), key=len)
            accepted[b] = min(accepted[b], len(longest))
            path[b, : accepted[b]] = longest[: accepted[b]]
    gdnkit.commit(p.k, p.v, pool, slots, accepted, source=source, layout=layout, q=p.q, parent=parent,
                  intermediate=inter, intermediate_indices=islots, accepted_path=path, **p.gate_kwargs())
    for b in range(B):
        s = slots[b]
        n = accepted[b]
        if n == 0:
            assert bits_equal(pool[s], before[s])
            continue
        last = (path[b, n - 1] if path is not None else n - 1)
        assert rel(from_layout(pool[s], layout), states[b][last]) < tol("recurrent", "state", "fp32")
    check_untouched(pool, before, set(slots.tolist()))


# ---- prefill ----------------------------------------------------------------------------------

@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("algorithm", ["recurrent", "chunked"])
@pytest.mark.parametrize("gating", ["fused", "given"])
@pytest.mark.parametrize("cu_dtype", [np.int32, np.int64])
def test_prefill(layout, algorithm, gating, cu_dtype):
    rng = rng_for("prefill", layout, algorithm, gating, cu_dtype)
    lens = [70, 0, 130, 5]
    N, P = len(lens), 8
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(cu_dtype)
    p = Problem(rng, int(cu[-1]), K=64, V=64, gating=gating)
    initial = np.array([3, 5, -1, 6], np.int32)
    final = np.array([3, 1, 2, -1], np.int32)  # sequence 0: read-before-write on one slot
    pool = make_pool(rng, P, p, layout, set(initial.tolist()) | set(final.tolist()))
    before = pool.copy()
    ckpt = poison((N, 3) + pool_shape(1, p.HV, p.K, p.V, layout)[1:])
    o = poison(p.v.shape, p.v.dtype)
    gdnkit.prefill(p.q, p.k, p.v, cu, state=pool, initial_indices=initial, final_indices=final, layout=layout,
                   checkpoints=ckpt, checkpoint_interval=64, checkpoint_indices=np.arange(N, dtype=np.int32),
                   cpu_algorithm=algorithm, o=o, **p.gate_kwargs())
    kind = "recurrent" if algorithm == "recurrent" else "prefill"
    for n in range(N):
        rows = slice(int(cu[n]), int(cu[n + 1]))
        S0 = from_layout(before[initial[n]], layout) if initial[n] >= 0 else np.zeros((p.HV, p.K, p.V))
        ref_o, ref_S, states = run_tokens(S0, *p.tokens(rows), p.K ** -0.5, True, keep_states=True)
        if lens[n]:
            assert rel(o[rows], ref_o) < tol(kind, "o", "fp32")
        if final[n] >= 0:
            assert rel(from_layout(pool[final[n]], layout), ref_S) < tol(kind, "state", "fp32")
        for j in range(3):
            if (j + 1) * 64 <= lens[n]:
                assert rel(from_layout(ckpt[n, j], layout), states[(j + 1) * 64 - 1]) < tol(kind, "state", "fp32")
            else:
                assert np.all(np.isnan(ckpt[n, j])), f"checkpoint {j} of sequence {n} written past its length"
    check_untouched(pool, before, set(final[final >= 0].tolist()))


@pytest.mark.parametrize("algorithm", ["recurrent", "chunked"])
def test_prefill_long_memory(algorithm):
    """A_log = log U(1e-3, 1e-2): the state keeps accumulating over a long sequence."""
    rng = rng_for("prefill-long", algorithm)
    T = 1500
    p = Problem(rng, T, H=1, HV=2, K=64, V=64, long_memory=True)
    pool = np.zeros(pool_shape(1, p.HV, p.K, p.V, "k_last"), np.float32)
    o = gdnkit.prefill(p.q, p.k, p.v, np.array([0, T], np.int32), state=pool,
                       final_indices=np.zeros(1, np.int32), cpu_algorithm=algorithm, **p.gate_kwargs())
    ref_o, ref_S = run_tokens(np.zeros((p.HV, p.K, p.V)), *p.tokens(slice(None)), p.K ** -0.5, True)
    kind = "recurrent" if algorithm == "recurrent" else "prefill"
    assert rel(o, ref_o) < tol(kind, "o", "fp32")
    assert rel(from_layout(pool[0], "k_last"), ref_S) < tol(kind, "state", "fp32")


def test_prefill_batch_shape_without_cu_seqlens():
    """[B, T, H, K] arrays without cu_seqlens: B sequences of T tokens, starting from S = 0."""
    rng = rng_for("prefill-batch")
    B, T = 3, 20
    p = Problem(rng, B * T, H=1, HV=2, K=64, V=64)
    q, k, v = (x.reshape(B, T, *x.shape[1:]) for x in (p.q, p.k, p.v))
    gk = {n: (x.reshape(B, T, -1) if x.ndim == 2 else x) for n, x in p.gate_kwargs().items()}
    o = gdnkit.prefill(q, k, v, **gk)
    assert o.shape == v.shape
    for b in range(B):
        ref_o, _ = run_tokens(np.zeros((p.HV, p.K, p.V)), *p.tokens(slice(b * T, b * T + T)), p.K ** -0.5, True)
        assert rel(o[b], ref_o) < 2e-3


# ---- layout -----------------------------------------------------------------------------------

@pytest.mark.parametrize("src_layout", LAYOUTS)
def test_convert_layout(src_layout):
    rng = rng_for("layout", src_layout)
    src = random_pool(rng, 3, 2, 64, 128, src_layout)
    dst = gdnkit.convert_layout(src, src_layout=src_layout)
    assert dst.shape == (3, 2) + src.shape[:1:-1]
    assert bits_equal(dst, np.swapaxes(src, -1, -2))
    back = gdnkit.convert_layout(dst, src_layout="v_last" if src_layout == "k_last" else "k_last")
    assert bits_equal(back, src)


def test_convert_layout_in_place():
    rng = rng_for("layout-inplace")
    pool = random_pool(rng, 4, 2, 64, 64, "k_last")
    expect = np.swapaxes(pool, -1, -2).copy()
    out = gdnkit.convert_layout(pool, src_layout="k_last", dst=pool)
    assert out is pool and bits_equal(pool, expect)


def test_strided_pool_slots():
    """A pool that is a strided view (slot stride larger than HV*K*V) is indexed by its real stride."""
    rng = rng_for("strided-pool")
    p = Problem(rng, 2, H=1, HV=2, K=64, V=64)
    big = random_pool(rng, 4, 2 * p.HV, p.K, p.V, "k_last")  # each slot holds 2x the heads
    pool = big[:, : p.HV]
    before = big.copy()
    slots = np.array([3, 1], np.int32)
    o = gdnkit.decode(p.q, p.k, p.v, pool, slots, **p.gate_kwargs())
    for i, s in enumerate(slots):
        ref_o, ref_S = run_tokens(from_layout(before[s, : p.HV], "k_last"), *p.tokens(slice(i, i + 1)),
                                  p.K ** -0.5, True)
        assert rel(o[i], ref_o[0]) < 5e-5
        assert rel(from_layout(pool[s], "k_last"), ref_S) < 1e-5
    assert bits_equal(big[:, p.HV:], before[:, p.HV:]), "the other half of each slot changed"
    assert bits_equal(big[0], before[0]) and bits_equal(big[2], before[2])
