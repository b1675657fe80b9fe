"""Bad input: the C++ library's messages arrive unchanged as Python exceptions, nothing is written.

gdnkit.GdnkitError subclasses ValueError (kInvalidArgument); GdnkitNotImplementedError subclasses
NotImplementedError; GdnkitRuntimeError (no device, CUDA errors) subclasses RuntimeError.
"""

import numpy as np
import pytest

import gdnkit
from gdnkit import _testing
from reference import Problem, bits_equal, poison, random_pool


def test_exception_classes():
    assert issubclass(gdnkit.GdnkitError, ValueError)
    assert issubclass(gdnkit.GdnkitNotImplementedError, NotImplementedError)
    assert issubclass(gdnkit.GdnkitRuntimeError, RuntimeError)


@pytest.mark.parametrize("mode", [0, 1, 2, 3])
def test_library_errors_reach_python(mode):
    """Errors thrown by the binding (0) and by the library (1: GIL held, 2: the path every op takes,
    3: GIL released)."""
    msg = "debug: thrown by the binding" if mode == 0 else "q: H=3 does not divide HV=4"
    with pytest.raises(gdnkit.GdnkitError) as info:
        _testing.raise_error(mode)
    assert str(info.value) == msg


def decode_case(rng=None, **kw):
    rng = rng or np.random.default_rng(7)
    H = kw.pop("H", 2)
    p = Problem(rng, 3, H=H, HV=4, K=64, V=64)
    pool = random_pool(rng, 4, p.HV, p.K, p.V, "k_last")
    args = dict(q=p.q, k=p.k, v=p.v, state=pool, state_indices=np.array([0, 2, 3], np.int32),
                o=poison(p.v.shape), layout="k_last", **p.gate_kwargs())
    args.update(kw)
    return args


def call_decode(args):
    a = dict(args)
    return gdnkit.decode(a.pop("q"), a.pop("k"), a.pop("v"), a.pop("state"), a.pop("state_indices"), **a)


def expect_unchanged(args, before_pool):
    assert bits_equal(args["state"], before_pool), "state written although validation failed"
    assert np.all(np.isnan(args["o"])), "o written although validation failed"


def raises_exact(exc, message, args):
    before = args["state"].copy()
    with pytest.raises(exc) as info:
        call_decode(args)
    assert str(info.value) == message
    expect_unchanged(args, before)


def test_heads_do_not_divide():
    # H = 3 q/k heads vs HV = 4 value heads: reported by the library's validation (src/api/validate.cpp)
    raises_exact(gdnkit.GdnkitError, "q: H=3 does not divide HV=4", decode_case(H=3))


def test_unsupported_head_dim():
    rng = np.random.default_rng(1)
    p = Problem(rng, 2, H=1, HV=1, K=64, V=64)
    q = rng.standard_normal((2, 1, 32)).astype(np.float32)
    pool = random_pool(rng, 2, 1, 32, 64, "k_last")
    with pytest.raises(gdnkit.GdnkitError, match=r"^q: head dim K=32 is not supported \(expected 64, 128 or 256\)$"):
        gdnkit.decode(q, q.copy(), p.v, pool, np.array([0, 1], np.int32), **p.gate_kwargs())


def test_q_dtype_names_tensor():
    args = decode_case()
    args["q"] = args["q"].astype(np.int32)
    raises_exact(gdnkit.GdnkitError, "q: expected dtype float32, bfloat16 or float16, got int32", args)


def test_k_dtype_must_match_q():
    args = decode_case()
    args["k"] = args["k"].astype(np.float16)
    raises_exact(gdnkit.GdnkitError, "k: expected dtype float32 (the dtype of q), got float16", args)


def test_state_dtype():
    args = decode_case()
    args["state"] = args["state"].astype(np.float16)
    raises_exact(gdnkit.GdnkitError, "state: expected dtype float32 or bfloat16, got float16", args)


def test_state_shape_vs_layout():
    rng = np.random.default_rng(3)
    p = Problem(rng, 2, H=1, HV=2, K=64, V=128)
    pool = random_pool(rng, 3, 2, 64, 128, "k_last")  # [P, HV, V, K]
    with pytest.raises(gdnkit.GdnkitError) as info:
        gdnkit.decode(p.q, p.k, p.v, pool, np.array([0, 1], np.int32), layout="v_last", **p.gate_kwargs())
    assert str(info.value) == ("state: expected shape [P, 2, 64, 128] (v_last: [.., HV, K, V] with HV=2, K=64, "
                               "V=128), got [3, 2, 128, 64]")


def test_bad_layout_name():
    args = decode_case(layout="kv")
    raises_exact(gdnkit.GdnkitError, "layout: expected 'k_last' ([P, HV, V, K]) or 'v_last' ([P, HV, K, V]), got 'kv'",
                 args)


def test_indices_dtype():
    args = decode_case(state_indices=np.array([0, 1, 2], np.int64))
    raises_exact(gdnkit.GdnkitError, "state_indices: expected dtype int32, got int64", args)


def test_last_dim_contiguous():
    args = decode_case()
    q = np.asfortranarray(args["q"])  # last dim strided
    args["q"] = q
    before = args["state"].copy()
    with pytest.raises(gdnkit.GdnkitError, match=r"^q: the last dim must be contiguous \(stride 1\)"):
        call_decode(args)
    expect_unchanged(args, before)


def test_both_gating_modes():
    args = decode_case()
    args["g"] = np.zeros((3, 4), np.float32)
    args["beta"] = np.zeros((3, 4), np.float32)
    raises_exact(gdnkit.GdnkitError,
                 "gating: pass either g and beta (given gates) or a, b, A_log and dt_bias (fused gating), not both",
                 args)


def test_missing_fused_gate():
    args = decode_case()
    del args["dt_bias"]
    raises_exact(gdnkit.GdnkitError, "dt_bias: required for fused gating (a, b [T, HV], A_log, dt_bias [HV] float32)",
                 args)


def test_gate_shape():
    args = decode_case()
    args["a"] = args["a"][:2]
    raises_exact(gdnkit.GdnkitError, "a: expected shape [3, 4] (tokens, HV), got [2, 4]", args)


def test_cu_seqlens_decreasing():
    rng = np.random.default_rng(5)
    p = Problem(rng, 32, H=1, HV=2, K=64, V=64)
    pool = random_pool(rng, 4, 2, 64, 64, "k_last")
    before = pool.copy()
    o = poison(p.v.shape)
    cu = np.array([0, 10, 40, 32], np.int32)
    with pytest.raises(gdnkit.GdnkitError) as info:
        gdnkit.prefill(p.q, p.k, p.v, cu, state=pool, final_indices=np.arange(3, dtype=np.int32), o=o,
                       **p.gate_kwargs())
    assert str(info.value) == "cu_seqlens: must be non-decreasing (index 3: 40 > 32)"
    assert bits_equal(pool, before) and np.all(np.isnan(o))


def test_verify_update_state_with_tree():
    rng = np.random.default_rng(9)
    p = Problem(rng, 4, H=1, HV=2, K=64, V=64)
    pool = random_pool(rng, 2, 2, 64, 64, "k_last")
    parent = np.array([[-1, 0], [-1, -1]], np.int32)
    with pytest.raises(gdnkit.GdnkitError, match="^update_state: only for chain drafts"):
        gdnkit.verify(p.q, p.k, p.v, pool, np.array([0, 1], np.int32), parent=parent, update_state=True,
                      **p.gate_kwargs())


def test_prefill_checkpoint_interval():
    rng = np.random.default_rng(11)
    p = Problem(rng, 8, H=1, HV=2, K=64, V=64)
    ck = poison((1, 1, 2, 64, 64))
    with pytest.raises(gdnkit.GdnkitError) as info:
        gdnkit.prefill(p.q, p.k, p.v, np.array([0, 8], np.int32), checkpoints=ck, checkpoint_interval=48,
                       checkpoint_indices=np.zeros(1, np.int32), **p.gate_kwargs())
    assert str(info.value) == "checkpoint_interval: expected 0 or a multiple of 64 (the chunk), got 48"


def test_unmergeable_batch_axes():
    rng = np.random.default_rng(2)
    q = rng.standard_normal((2, 4, 1, 64)).astype(np.float32)[:, :2]  # [2, 2, 1, 64], stride(0) != 2*stride(1)
    k = np.ascontiguousarray(q).reshape(4, 1, 64)
    v = rng.standard_normal((4, 2, 64)).astype(np.float32)
    pool = random_pool(rng, 4, 2, 64, 64, "k_last")
    with pytest.raises(gdnkit.GdnkitError, match=r"^q: the batch and token axes of shape \[2, 2, 1, 64\] cannot"):
        gdnkit.decode(q, k, v, pool, np.arange(4, dtype=np.int32), g=np.zeros((4, 2), np.float32),
                      beta=np.zeros((4, 2), np.float32))


def test_commit_needs_cache():
    rng = np.random.default_rng(4)
    p = Problem(rng, 4, H=1, HV=2, K=64, V=64)
    pool = random_pool(rng, 2, 2, 64, 64, "k_last")
    with pytest.raises(gdnkit.GdnkitError, match=r"^intermediate: required pointer is null"):
        gdnkit.commit(p.k, p.v, pool, np.array([0, 1], np.int32), np.array([1, 2], np.int32), source="cache",
                      **p.gate_kwargs())


def test_commit_bad_source():
    rng = np.random.default_rng(4)
    p = Problem(rng, 4, H=1, HV=2, K=64, V=64)
    pool = random_pool(rng, 2, 2, 64, 64, "k_last")
    with pytest.raises(gdnkit.GdnkitError, match=r"^source: expected 'cache' or 'recompute', got 'x'$"):
        gdnkit.commit(p.k, p.v, pool, np.array([0, 1], np.int32), np.array([1, 2], np.int32), source="x",
                      **p.gate_kwargs())


def test_no_cuda_reported_as_runtime_error_or_skips():
    """Without a CUDA build the library reports it; nothing here can create CUDA arrays, so only the
    query functions are checked."""
    assert isinstance(gdnkit.cuda_compiled(), bool)
    assert isinstance(gdnkit.cuda_available(), bool)
    if not gdnkit.cuda_compiled():
        assert not gdnkit.cuda_available()
        assert "built without CUDA" in gdnkit.build_info()
