"""gdnkit.distributed on the CPU backend: ranks simulated in one process (the exchange one array every rank writes
its block of, as an in-place all-gather leaves it) against gdnkit.prefill of the whole batch."""

import numpy as np
import pytest

import gdnkit
import gdnkit.distributed as gd
from reference import Problem, poison, pool_shape, random_pool, rel


def run_split(p, cu, cuts, pool, initial, final, layout, ckpt=None, interval=0, every_rank=False):
    """Rank r holds tokens [cuts[r], cuts[r+1]) of the packed batch; returns o and each rank's pool and checkpoints."""
    G, N = len(cuts) - 1, len(cu) - 1
    elems = gd.exchange_elems(N, p.HV, p.K, p.V)
    exchange = np.full(G * elems, np.nan, np.float32)
    o = poison(p.v.shape, p.v.dtype)
    pools = [pool.copy() for _ in range(G)]
    ckpts = [None if ckpt is None else ckpt.copy() for _ in range(G)]
    gates = p.gate_kwargs()
    args = []
    for r in range(G):
        t0, t1 = cuts[r], cuts[r + 1]
        local_cu = (np.clip(cu, t0, t1) - t0).astype(np.int32)
        offsets = (np.clip(t0, cu[:-1], cu[1:]) - cu[:-1]).astype(np.int64)
        rows = slice(t0, t1)
        kw = dict(layout=layout, state=pools[r], initial_indices=initial, final_indices=final,
                  piece_offsets=offsets, piece_offsets_cpu=offsets, final_on_every_rank=every_rank,
                  **{n: (x[rows] if x.ndim == 2 else x) for n, x in gates.items()})
        if ckpt is not None:
            kw.update(checkpoints=ckpts[r], checkpoint_interval=interval,
                      checkpoint_indices=np.arange(N, dtype=np.int32))
        args.append(((p.q[rows], p.k[rows], p.v[rows], o[rows], local_cu), kw))
    for r, (a, kw) in enumerate(args):
        gd.split_prefill_begin(*a, rank=r, num_ranks=G, exchange=exchange, **kw)
    for r, (a, kw) in enumerate(args):
        gd.split_prefill_end(*a, rank=r, num_ranks=G, exchange=exchange, **kw)
    return o, pools, ckpts


@pytest.mark.parametrize("layout", ["k_last", "v_last"])
@pytest.mark.parametrize("cuts", [[0, 400], [0, 130, 400], [0, 64, 64, 301, 400]])
def test_split_matches_whole_prefill(layout, cuts):
    rng = np.random.default_rng(sum(cuts) + len(layout))
    lens = [250, 0, 100, 50]
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
    p = Problem(rng, int(cu[-1]), H=1, HV=2, K=64, V=64)
    initial = np.array([1, 2, -1, 3], np.int32)
    final = np.array([1, 4, 5, -1], np.int32)
    pool = random_pool(rng, 8, p.HV, p.K, p.V, layout)
    whole = pool.copy()
    ref_o = gdnkit.prefill(p.q, p.k, p.v, cu.astype(np.int32), state=whole, initial_indices=initial,
                           final_indices=final, layout=layout, **p.gate_kwargs())
    o, pools, _ = run_split(p, cu, cuts, pool, initial, final, layout, every_rank=True)
    assert rel(o, ref_o) < 1e-5
    for r, got in enumerate(pools):
        assert rel(got, whole) < 1e-5, f"pool of rank {r}"


def test_split_checkpoints_on_every_rank():
    rng = np.random.default_rng(7)
    lens = [320, 90]
    cu = np.array([0, 320, 410], np.int64)
    p = Problem(rng, 410, H=1, HV=2, K=64, V=64)
    initial = np.array([0, -1], np.int32)
    final = np.array([0, 1], np.int32)
    pool = random_pool(rng, 3, p.HV, p.K, p.V, "k_last")
    shape = (2, 5) + pool_shape(1, p.HV, p.K, p.V, "k_last")[1:]
    ref_ckpt = poison(shape)
    whole = pool.copy()
    ref_o = gdnkit.prefill(p.q, p.k, p.v, cu.astype(np.int32), state=whole, initial_indices=initial,
                           final_indices=final, checkpoints=ref_ckpt, checkpoint_interval=64,
                           checkpoint_indices=np.arange(2, dtype=np.int32), **p.gate_kwargs())
    o, pools, ckpts = run_split(p, cu, [0, 128, 192, 410], pool, initial, final, "k_last", ckpt=poison(shape),
                                interval=64)
    assert rel(o, ref_o) < 1e-5
    assert rel(pools[-1], whole) < 1e-5
    merged = poison(shape)
    for c in ckpts:  # each entry written by exactly one rank
        written = ~np.isnan(c)
        assert not np.any(written & ~np.isnan(merged))
        merged[written] = c[written]
    assert np.array_equal(np.isnan(merged), np.isnan(ref_ckpt))
    assert rel(merged[~np.isnan(merged)], ref_ckpt[~np.isnan(ref_ckpt)]) < 1e-5


def test_split_errors_name_the_argument():
    rng = np.random.default_rng(3)
    p = Problem(rng, 100, H=1, HV=2, K=64, V=64)
    cu = np.array([0, 100], np.int32)
    o = poison(p.v.shape)
    with pytest.raises(gdnkit.GdnkitError, match="exchange: expected a contiguous float32 array of 32768"):
        gd.split_prefill_begin(p.q, p.k, p.v, o, cu, rank=0, num_ranks=2, exchange=poison((10,)),
                               **p.gate_kwargs())
    ex = poison((2 * gd.exchange_elems(1, 2, 64, 64),))
    with pytest.raises(gdnkit.GdnkitError, match="rank: expected 0..1, got 2"):
        gd.split_prefill_begin(p.q, p.k, p.v, o, cu, rank=2, num_ranks=2, exchange=ex, **p.gate_kwargs())
    ck = poison((1, 2) + pool_shape(1, 2, 64, 64, "k_last")[1:])
    with pytest.raises(gdnkit.GdnkitError, match="piece_offsets_cpu: sequence 0's piece starts 10 tokens"):
        gd.split_prefill_begin(p.q, p.k, p.v, o, cu, rank=1, num_ranks=2, exchange=ex, checkpoints=ck,
                               checkpoint_interval=64, checkpoint_indices=np.zeros(1, np.int32),
                               piece_offsets=np.array([10]), piece_offsets_cpu=np.array([10]), **p.gate_kwargs())
    with pytest.raises(TypeError, match="unexpected keyword argument 'groupp'"):
        gd.split_prefill_begin(p.q, p.k, p.v, o, cu, rank=0, num_ranks=1, exchange=ex[:ex.size // 2], groupp=1)
    # nothing written by the refused calls: o, the exchange and the checkpoints all still NaN
    assert np.all(np.isnan(o)) and np.all(np.isnan(ex)) and np.all(np.isnan(ck))


def test_prefill_without_process_group_is_one_rank():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(5)
    p = Problem(rng, 150, H=1, HV=2, K=64, V=64)
    cu = torch.tensor([0, 150], dtype=torch.int32)
    t = {n: torch.from_numpy(np.ascontiguousarray(x)) for n, x in p.gate_kwargs().items()}
    q, k, v = (torch.from_numpy(x) for x in (p.q, p.k, p.v))
    o = gd.prefill(q, k, v, cu, **t)
    ref = gdnkit.prefill(q, k, v, cu, **t)
    assert rel(o.numpy(), ref.numpy()) < 1e-6
