"""Bad input: the C++ library's messages arrive unchanged as Python exceptions, nothing is written; a wrong
Python type is a TypeError, and a shape mismatch names the array that is wrong.

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
    before, o = pool.copy(), poison(p.v.shape)
    with pytest.raises(gdnkit.GdnkitError, match=r"^q: head dim K=32 is not supported \(expected 64, 128 or 256\)$"):
        gdnkit.decode(q, q.copy(), p.v, pool, np.array([0, 1], np.int32), o=o, **p.gate_kwargs())
    assert bits_equal(pool, before) and np.all(np.isnan(o))


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
    args["state"] = args["state"].astype(np.int32)
    raises_exact(gdnkit.GdnkitError, "state: expected dtype float32, bfloat16, float16 or float8_e4m3fn, got int32", args)


def test_state_shape_vs_layout():
    rng = np.random.default_rng(3)
    p = Problem(rng, 2, H=1, HV=2, K=64, V=128)
    pool = random_pool(rng, 3, 2, 64, 128, "k_last")  # [P, HV, V, K]
    before, o = pool.copy(), poison(p.v.shape)
    with pytest.raises(gdnkit.GdnkitError) as info:
        gdnkit.decode(p.q, p.k, p.v, pool, np.array([0, 1], np.int32), layout="v_last", o=o, **p.gate_kwargs())
    assert str(info.value) == ("state: expected shape [P, 2, 64, 128] (v_last: [.., HV, K, V] with HV=2, K=64, "
                               "V=128), got [3, 2, 128, 64]")
    assert bits_equal(pool, before) and np.all(np.isnan(o))


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
    before, o = pool.copy(), poison(p.v.shape)
    with pytest.raises(gdnkit.GdnkitError, match="^update_state: only for chain drafts"):
        gdnkit.verify(p.q, p.k, p.v, pool, np.array([0, 1], np.int32), parent=parent, update_state=True, o=o,
                      **p.gate_kwargs())
    assert bits_equal(pool, before) and np.all(np.isnan(o))


def test_prefill_checkpoint_interval():
    rng = np.random.default_rng(11)
    p = Problem(rng, 8, H=1, HV=2, K=64, V=64)
    ck = poison((1, 1, 2, 64, 64))
    with pytest.raises(gdnkit.GdnkitError) as info:
        gdnkit.prefill(p.q, p.k, p.v, np.array([0, 8], np.int32), checkpoints=ck, checkpoint_interval=48,
                       checkpoint_indices=np.zeros(1, np.int32), **p.gate_kwargs())
    assert str(info.value) == "checkpoint_interval: expected 0 or a multiple of 64 (the chunk), got 48"
    assert np.all(np.isnan(ck)), "checkpoints written although validation failed"


def test_unmergeable_batch_axes():
    rng = np.random.default_rng(2)
    q = rng.standard_normal((2, 4, 1, 64)).astype(np.float32)[:, :2]  # [2, 2, 1, 64], stride(0) != 2*stride(1)
    k = np.ascontiguousarray(q).reshape(4, 1, 64)
    v = rng.standard_normal((4, 2, 64)).astype(np.float32)
    pool = random_pool(rng, 4, 2, 64, 64, "k_last")
    before = pool.copy()
    with pytest.raises(gdnkit.GdnkitError, match=r"^q: the batch and token axes of shape \[2, 2, 1, 64\] cannot"):
        gdnkit.decode(q, k, v, pool, np.arange(4, dtype=np.int32), g=np.zeros((4, 2), np.float32),
                      beta=np.zeros((4, 2), np.float32))
    assert bits_equal(pool, before)


def test_commit_needs_cache():
    rng = np.random.default_rng(4)
    p = Problem(rng, 4, H=1, HV=2, K=64, V=64)
    pool = random_pool(rng, 2, 2, 64, 64, "k_last")
    before = pool.copy()
    with pytest.raises(gdnkit.GdnkitError, match=r"^intermediate: required pointer is null"):
        gdnkit.commit(p.k, p.v, pool, np.array([0, 1], np.int32), np.array([1, 2], np.int32), source="cache",
                      **p.gate_kwargs())
    assert bits_equal(pool, before)


def test_commit_bad_source():
    rng = np.random.default_rng(4)
    p = Problem(rng, 4, H=1, HV=2, K=64, V=64)
    pool = random_pool(rng, 2, 2, 64, 64, "k_last")
    before = pool.copy()
    with pytest.raises(gdnkit.GdnkitError, match=r"^source: expected 'cache' or 'recompute', got 'x'$"):
        gdnkit.commit(p.k, p.v, pool, np.array([0, 1], np.int32), np.array([1, 2], np.int32), source="x",
                      **p.gate_kwargs())
    assert bits_equal(pool, before)


def test_no_cuda_reported_as_runtime_error_or_skips():
    """Without a CUDA build the library reports it; nothing here can create CUDA arrays, so only the
    query functions are checked."""
    assert isinstance(gdnkit.cuda_compiled(), bool)
    assert isinstance(gdnkit.cuda_available(), bool)
    if not gdnkit.cuda_compiled():
        assert not gdnkit.cuda_available()
        assert "built without CUDA" in gdnkit.build_info()


# ---- a wrong Python type: the message names the argument and what it takes ------------------------

ARRAY_TYPE = r"expected an array: torch.Tensor, numpy.ndarray, cupy.ndarray or another object with __dlpack__"


@pytest.mark.parametrize("name", ["q", "k", "v", "state", "state_indices", "a", "A_log", "o"])
def test_list_as_array_names_the_argument(name):
    args = decode_case()
    args[name] = args[name].tolist()
    before = args["state"].copy() if name != "state" else None
    with pytest.raises(TypeError) as info:
        call_decode(args)
    assert str(info.value) == (f"{name}: {ARRAY_TYPE}, got list "
                               "(convert it first, e.g. with numpy.asarray or torch.tensor)")
    if before is not None:
        expect_unchanged(args, before)


def test_other_object_as_array():
    args = decode_case(error_flag=object())
    with pytest.raises(TypeError, match=rf"^error_flag: {ARRAY_TYPE}, got object$") as info:
        call_decode(args)
    assert info.value.__suppress_context__  # nanobind's message is not shown below it


def test_library_errors_are_not_rediagnosed():
    """A gdnkit error passes through unchanged even when another argument has an odd type."""
    args = decode_case(H=3, scale=np.float64(0.125))
    raises_exact(gdnkit.GdnkitError, "q: H=3 does not divide HV=4", args)


@pytest.mark.parametrize("kw, message", [
    (dict(scale="0.1"), "scale: expected a float > 0 or None (1/sqrt(K)), got str"),
    (dict(layout=0), "layout: expected a string, 'k_last' or 'v_last', got int"),
    (dict(use_qk_l2norm="yes"), "use_qk_l2norm: expected a bool, got str"),
    (dict(stream="default"), "stream: expected an int cudaStream_t, or None for the current stream of the arrays' "
                             "framework, got str"),
    (dict(use_qk_l2norm=None), "use_qk_l2norm: expected a bool, got NoneType"),
])
def test_scalar_of_wrong_type(kw, message):
    args = decode_case(**kw)
    raises_exact(TypeError, message, args)


def test_numpy_scalars():
    # NumPy scalars act as the Python ones (scale 0.25, not K = 64's default 1/8, so that it must be applied)
    args = decode_case(scale=np.float32(0.25), stream=np.int64(0))
    call_decode(args)
    same = decode_case(scale=0.25, stream=0)
    call_decode(same)
    assert bits_equal(args["o"], same["o"]) and bits_equal(args["state"], same["state"])
    default = decode_case()
    call_decode(default)
    assert np.all(np.isfinite(args["o"])) and not bits_equal(args["o"], default["o"])
    args = decode_case(use_qk_l2norm=np.bool_(True))
    with pytest.raises(TypeError, match=r"^use_qk_l2norm: expected a bool, got numpy\.bool_?$"):
        call_decode(args)


def test_verify_and_prefill_scalars():
    rng = np.random.default_rng(9)
    p = Problem(rng, 4, H=1, HV=2, K=64, V=64)
    pool = random_pool(rng, 2, 2, 64, 64, "k_last")
    with pytest.raises(TypeError, match=r"^num_draft_tokens: expected an int T or None, got list$"):
        gdnkit.verify(p.q, p.k, p.v, pool, np.array([0, 1], np.int32), num_draft_tokens=[2], **p.gate_kwargs())
    with pytest.raises(TypeError, match=r"^update_state: expected a bool, got NoneType$"):
        gdnkit.verify(p.q, p.k, p.v, pool, np.array([0, 1], np.int32), update_state=None, **p.gate_kwargs())
    with pytest.raises(TypeError, match=r"^source: expected a string, 'cache' or 'recompute', got int$"):
        gdnkit.commit(p.k, p.v, pool, np.array([0, 1], np.int32), np.array([1, 2], np.int32), source=1,
                      **p.gate_kwargs())
    with pytest.raises(TypeError, match=r"^cpu_algorithm: expected a string, 'auto', 'recurrent' or 'chunked', "
                                        r"got NoneType$"):
        gdnkit.prefill(p.q, p.k, p.v, np.array([0, 4], np.int32), cpu_algorithm=None, **p.gate_kwargs())
    with pytest.raises(TypeError, match=rf"^cu_seqlens: {ARRAY_TYPE}, got list"):
        gdnkit.prefill(p.q, p.k, p.v, [0, 4], **p.gate_kwargs())
    with pytest.raises(TypeError, match=rf"^src: {ARRAY_TYPE}, got list"):
        gdnkit.convert_layout(pool.tolist(), src_layout="k_last")


def test_meta_tensor_names_the_argument():
    torch = pytest.importorskip("torch", reason="PyTorch is not installed: meta-tensor check skipped")
    args = {n: (torch.from_numpy(np.ascontiguousarray(x)) if isinstance(x, np.ndarray) else x)
            for n, x in decode_case().items()}
    before = args["state"].clone()
    args["state"] = args["state"].to("meta")
    with pytest.raises(gdnkit.GdnkitError, match=r"^state: a tensor on the meta device has no data \(expected a "
                                                 r"cpu or cuda tensor"):
        call_decode(args)
    args["state"] = before
    args["v"] = args["v"].to("meta")
    args["o"] = None
    with pytest.raises(gdnkit.GdnkitError, match=r"^v: a tensor on the meta device has no data"):
        call_decode(args)


# ---- shapes that disagree: the message names the array that is wrong --------------------------------

def test_v_with_wrong_head_count_is_named():
    args = decode_case()
    args["v"] = np.ascontiguousarray(args["v"][:, :3])
    args["o"] = poison(args["v"].shape)
    raises_exact(gdnkit.GdnkitError, "v: shape [3, 3, 64] has HV=3 value heads, but state [4, 4, 64, 64] "
                                     "(k_last: [.., HV, V, K]) has HV=4 and the gates have HV=4", args)


def test_state_with_wrong_head_count_is_named():
    """v and the gates agree on HV: the pool is the odd one out."""
    args = decode_case()
    args["state"] = np.ascontiguousarray(args["state"][:, :3])
    raises_exact(gdnkit.GdnkitError, "state: expected shape [P, 4, 64, 64] (k_last: [.., HV, V, K] with HV=4, K=64, "
                                     "V=64), got [4, 3, 64, 64]", args)


def test_v_with_wrong_head_dim_is_named():
    args = decode_case()
    args["v"] = np.ascontiguousarray(args["v"][:, :, :32])
    args["o"] = poison(args["v"].shape)
    raises_exact(gdnkit.GdnkitError, "v: shape [3, 4, 32] has head dim V=32, but state [4, 4, 64, 64] "
                                     "(k_last: [.., HV, V, K]) has V=64", args)


@pytest.mark.parametrize("what, cut, got", [
    ("K", (slice(None), slice(None), slice(0, 32)), "[3, 2, 32]"),
    ("H", (slice(None), slice(0, 1)), "[3, 1, 64]"),
    ("tokens", (slice(0, 2),), "[2, 2, 64]"),
])
def test_k_with_wrong_shape_is_named(what, cut, got):
    args = decode_case()
    args["k"] = np.ascontiguousarray(args["k"][cut])
    raises_exact(gdnkit.GdnkitError, f"k: expected shape [tokens, H, K] = [3, 2, 64] (that of q), got {got}", args)


def test_q_with_wrong_token_count_is_named():
    """k and v agree on the token count: q is the odd one out."""
    args = decode_case()
    args["q"] = np.ascontiguousarray(args["q"][:2])
    raises_exact(gdnkit.GdnkitError, "q: expected shape [tokens, H, K] = [3, 2, 64] (that of k), got [2, 2, 64]",
                 args)


def test_q_with_wrong_head_dim_is_named():
    """k and the pool agree on K: q is the odd one out."""
    args = decode_case()
    args["q"] = np.ascontiguousarray(args["q"][:, :, :32])
    raises_exact(gdnkit.GdnkitError, "q: expected shape [tokens, H, K] = [3, 2, 64] (that of k), got [3, 2, 32]",
                 args)


def test_commit_k_with_wrong_head_dim_is_named():
    rng = np.random.default_rng(4)
    p = Problem(rng, 4, H=1, HV=2, K=64, V=64)
    pool = random_pool(rng, 2, 2, 64, 64, "k_last")
    before = pool.copy()
    k = np.ascontiguousarray(p.k[:, :, :32])
    with pytest.raises(gdnkit.GdnkitError) as info:
        gdnkit.commit(k, p.v, pool, np.array([0, 1], np.int32), np.array([1, 2], np.int32), source="recompute",
                      **p.gate_kwargs())
    assert str(info.value) == ("k: shape [4, 1, 32] has head dim K=32, but state [2, 2, 64, 64] "
                               "(k_last: [.., HV, V, K]) has K=64")
    assert bits_equal(pool, before)


def test_prefill_v_with_wrong_head_count_is_named():
    rng = np.random.default_rng(5)
    p = Problem(rng, 8, H=1, HV=2, K=64, V=64)
    pool = random_pool(rng, 2, 2, 64, 64, "k_last")
    before = pool.copy()
    v = rng.standard_normal((8, 1, 64)).astype(np.float32)
    with pytest.raises(gdnkit.GdnkitError) as info:
        gdnkit.prefill(p.q, p.k, v, np.array([0, 8], np.int32), state=pool, final_indices=np.zeros(1, np.int32),
                       **p.gate_kwargs())
    assert str(info.value) == ("v: shape [8, 1, 64] has HV=1 value heads, but state [2, 2, 64, 64] "
                               "(k_last: [.., HV, V, K]) has HV=2 and the gates have HV=2")
    assert bits_equal(pool, before)


def test_prefill_k_with_wrong_shape_is_named():
    rng = np.random.default_rng(5)
    p = Problem(rng, 8, H=1, HV=2, K=64, V=64)
    k = np.ascontiguousarray(p.k[:, :, :32])
    with pytest.raises(gdnkit.GdnkitError, match=r"^k: expected shape \[tokens, H, K\] = \[8, 1, 64\] \(that of q\), "
                                                 r"got \[8, 1, 32\]$"):
        gdnkit.prefill(p.q, k, p.v, np.array([0, 8], np.int32), **p.gate_kwargs())
