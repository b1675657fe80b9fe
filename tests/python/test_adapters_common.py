"""The adapters' shared machinery (gdnkit.adapters._common): which layouts reach the kernels without a
copy, the device-side scatters; and helpers the per-peer adapter tests import (problems, strided
variants of q/k/v, the fp64 reference). Skipped (visibly) without torch."""

import inspect
import zlib

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed: adapter tests skipped")

import gdnkit  # noqa: E402
from gdnkit.adapters import _common as C  # noqa: E402
from reference import TOLERANCES, rel, run_tokens  # noqa: E402

DTYPE_NAME = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


def gen(*key):
    return torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))


def randn(g, *shape, dtype=torch.float32, device="cpu"):
    return torch.randn(*shape, generator=g).to(dtype=dtype, device=device)


def f64(t):
    return t.detach().to("cpu", torch.float64).numpy()


def tol(kind, what, dtype):
    """docs/semantics.md's tolerance for an op kind ("recurrent" / "prefill"), o or state, and a dtype."""
    return TOLERANCES[(kind, what, DTYPE_NAME.get(dtype, dtype))]


def ref(S0, q, k, v, g, beta, scale=None, l2norm=True):
    """The fp64 recurrence over one sequence: q, k [T, H, K], v [T, HV, V], g, beta [T, HV] (tensors or
    arrays) from S0 [HV, K, V] (math layout, None: zeros). Returns (o [T, HV, V], S_final, states)."""
    q, k, v = (np.asarray(f64(x) if isinstance(x, torch.Tensor) else x, np.float64) for x in (q, k, v))
    g, beta = (np.asarray(f64(x) if isinstance(x, torch.Tensor) else x, np.float64) for x in (g, beta))
    if S0 is None:
        S0 = np.zeros((v.shape[1], q.shape[2], v.shape[2]))
    return run_tokens(S0, q, k, v, g, beta, q.shape[-1] ** -0.5 if scale is None else scale, l2norm,
                      keep_states=True)


def kv_last(x):
    """A stored K-last block [.., V, K] in the math layout [.., K, V] (float64)."""
    return np.swapaxes(f64(x) if isinstance(x, torch.Tensor) else x, -1, -2)


def bits_equal(x, y):
    return x.shape == y.shape and x.dtype == y.dtype and torch.equal(
        x.contiguous().view(torch.uint8), y.contiguous().view(torch.uint8))


# ---- strided variants of q, k, v -----------------------------------------------------------------

LAYOUTS = ["contiguous", "projection", "head_padded", "time_slice", "conv_transposed"]


def strided(kind, q, k, v):
    """q, k [B, T, H, K] and v [B, T, HV, V] with the same values in another memory layout:

    - projection: views of one fused projection [B, T, 2*H*K + HV*V + 16] split on the last dim
      (``proj(x).split(...)``): token stride larger than heads*dim, batch axis continuing it (no copy);
    - head_padded: heads 8 elements further apart than dim (no copy);
    - time_slice: ``x[:, :T]`` of buffers of T + 3 tokens: a batch gap (copied when B > 1 and T > 1);
    - conv_transposed: split from a [B, D, T] conv output transposed to [B, T, D], as transformers'
      Qwen3-Next does: the last dim is strided (copied when T > 1).
    """
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    if kind == "contiguous":
        return q.contiguous(), k.contiguous(), v.contiguous()
    if kind == "projection":
        proj = torch.zeros(B, T, 2 * H * K + HV * V + 16, dtype=q.dtype, device=q.device)
        qq, kk, vv, _ = proj.split([H * K, H * K, HV * V, 16], dim=-1)
        for dst, src in ((qq, q), (kk, k), (vv, v)):
            dst.copy_(src.reshape(B, T, -1))
        return qq.view(B, T, H, K), kk.view(B, T, H, K), vv.view(B, T, HV, V)
    if kind == "head_padded":
        out = []
        for x in (q, k, v):
            buf = torch.zeros(*x.shape[:3], x.shape[3] + 8, dtype=x.dtype, device=x.device)
            buf[..., : x.shape[3]] = x
            out.append(buf[..., : x.shape[3]])
        return tuple(out)
    if kind == "time_slice":
        out = []
        for x in (q, k, v):
            buf = torch.zeros(x.shape[0], x.shape[1] + 3, *x.shape[2:], dtype=x.dtype, device=x.device)
            buf[:, : x.shape[1]] = x
            out.append(buf[:, : x.shape[1]])
        return tuple(out)
    if kind == "conv_transposed":
        D = 2 * H * K + HV * V
        conv = torch.empty(B, D, T, dtype=q.dtype, device=q.device)  # [B, D, T] contiguous, as a conv1d output
        mixed = conv.transpose(1, 2)  # [B, T, D], strides (D*T, 1, T)
        qq, kk, vv = torch.split(mixed, [H * K, H * K, HV * V], dim=-1)
        qq.copy_(q.reshape(B, T, -1))
        kk.copy_(k.reshape(B, T, -1))
        vv.copy_(v.reshape(B, T, -1))
        return qq.reshape(B, T, H, K), kk.reshape(B, T, H, K), vv.reshape(B, T, HV, V)
    raise ValueError(kind)


def copies_expected(kind, B, T):
    """Which of q, k, v the adapters must copy for a layout (the kernels read the others as they are)."""
    if kind == "time_slice" and B > 1 and T > 1:
        return 3
    if kind == "conv_transposed" and T > 1:
        return 3
    return 0


class CopyCounter:
    """Counts the copies the adapters make of inputs the kernels cannot read (gdnkit.adapters._common._copy)."""

    def __init__(self, monkeypatch):
        self.shapes = []
        real = C._copy

        def spy(t):
            self.shapes.append(tuple(t.shape))
            return real(t)

        monkeypatch.setattr(C, "_copy", spy)

    @property
    def count(self):
        return len(self.shapes)


def assert_signature(fn, params):
    """fn's parameters are exactly ``params``: (name, kind, default) in order, kind 'p' positional-or-keyword,
    'k' keyword-only; default ``inspect.Parameter.empty`` for none (a pinned peer's signature)."""
    kinds = {"p": inspect.Parameter.POSITIONAL_OR_KEYWORD, "k": inspect.Parameter.KEYWORD_ONLY}
    got = [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]
    want = [(n, kinds[kd], d) for n, kd, d in params]
    assert [(n, kd) for n, kd, _ in got] == [(n, kd) for n, kd, _ in want]
    for (n, _, d), (_, _, e) in zip(got, want):
        if e is not C.UNSET:
            assert d == e or (d is e), f"{n}: default {d!r}, peer's {e!r}"


def assert_same_positional(fn, peer_fn):
    """The adapter takes the peer's parameters in the peer's order with the peer's defaults (the peer's
    ``**kwargs`` are keyword-only here)."""
    mine = inspect.signature(fn).parameters
    theirs = [p for p in inspect.signature(peer_fn).parameters.values() if p.kind != inspect.Parameter.VAR_KEYWORD]
    assert [p.name for p in theirs] == [n for n in mine][: len(theirs)]
    for p in theirs:
        if p.default is not inspect.Parameter.empty:
            assert mine[p.name].default == p.default, p.name


# ---- pinned peers ---------------------------------------------------------------------------------

def test_pinned_peer_versions():
    """Each adapter module names the peer release whose signatures it takes, in PEER and its docstring."""
    from gdnkit.adapters import fla, sglang, vllm

    for mod, pin in ((fla, "flash-linear-attention 0.6.0"), (sglang, "SGLang 0.5.23"), (vllm, "vLLM 0.33.0")):
        assert mod.PEER == pin
        assert pin.split()[-1] in (mod.__doc__ or "")
        for name in mod.__all__:
            assert getattr(mod, name).__doc__, f"{mod.__name__}.{name} has no docstring"


# ---- what reaches the kernels without a copy ------------------------------------------------------

@pytest.mark.parametrize("kind", LAYOUTS)
@pytest.mark.parametrize("B,T", [(1, 1), (1, 5), (3, 1), (3, 5)])
def test_token_layouts(kind, B, T):
    g = gen("layouts", kind, B, T)
    q, k, v = randn(g, B, T, 2, 64), randn(g, B, T, 2, 64), randn(g, B, T, 4, 128)
    views = strided(kind, q, k, v)
    for x, y in zip(views, (q, k, v)):
        assert torch.equal(x, y)
    readable = [C.readable(x, 2) for x in views]
    assert readable.count(False) == copies_expected(kind, B, T), (kind, B, T, readable)
    for x in views:
        y = C.tokens(x)
        assert torch.equal(x, y)
        assert (y is x) == C.readable(x, 2)
        assert C.readable(y, 2)


def test_gate_layouts():
    g = gen("gate-layouts")
    proj = randn(g, 3, 5, 10)
    a, b = proj[..., :4], proj[..., 4:8]  # per-head scalars in a fused projection: read as they are
    assert C.gates(a) is a and C.gates(b) is b
    sliced = randn(g, 3, 8, 4)[:, :5]  # a batch gap
    assert not C.readable(sliced, 1) and torch.equal(C.gates(sliced), sliced)
    expanded = randn(g, 3, 5, 1).expand(3, 5, 4)  # heads overlap
    assert not C.readable(expanded, 1) and torch.equal(C.gates(expanded), expanded)
    flat = randn(g, 15, 4)
    assert C.token_gates(flat, 15, 4) is flat
    assert C.token_gates(flat.view(15 * 4), 15, 4).shape == (15, 4)


def test_pool_layouts():
    g = gen("pools")
    pool = randn(g, 6, 4, 128, 64)
    assert C.pool_readable(pool) and C.pool_read_only(pool) is pool
    assert C.pool_readable(pool[::2])  # any slot stride
    envelope = randn(g, 6, 3, 4, 128, 64)[:, 1]  # one layer of a page-major pool
    assert C.pool_readable(envelope) and C.pool_in_place("f", "pool", envelope) is envelope
    half = pool.half()
    assert not C.pool_readable(half) and C.pool_read_only(half).dtype == torch.float32
    with pytest.raises(NotImplementedError, match="float16 pool"):
        C.pool_in_place("f", "pool", half)
    with pytest.raises(gdnkit.GdnkitError, match="last three dims contiguous"):
        C.pool_in_place("f", "pool", pool.transpose(-1, -2))


def test_scatter_states_restores_slot_zero():
    g = gen("scatter-states")
    pool = randn(g, 5, 2, 3)
    before = pool.clone()
    states = randn(g, 4, 2, 3)
    slots = torch.tensor([3, 0, 1, 4])
    valid = torch.tensor([True, False, True, False])
    C.scatter_states(pool, slots, valid, states)
    assert torch.equal(pool[3], states[0]) and torch.equal(pool[1], states[2])
    for s in (0, 2, 4):
        assert bits_equal(pool[s], before[s])


@pytest.mark.parametrize("any_valid", [True, False])
def test_scatter_rows(any_valid):
    g = gen("scatter-rows", any_valid)
    dst = randn(g, 4, 3, 2)
    before = dst.clone()
    s, t = torch.tensor([0, 2, 3, 0]), torch.tensor([0, 1, 2, 2])
    valid = torch.tensor([True, False, True, False]) if any_valid else torch.zeros(4, dtype=torch.bool)
    vals = randn(g, 4, 2)
    C.scatter_rows(dst, (s, t), valid, vals)
    expect = before.clone()
    for i in range(4):
        if valid[i]:
            expect[s[i], t[i]] = vals[i]
    assert bits_equal(dst, expect)


def test_token_positions_and_lengths():
    cu = torch.tensor([0, 2, 2, 5], dtype=torch.int32)
    seq, pos = C.token_positions(cu, 5)
    assert seq.tolist() == [0, 0, 2, 2, 2] and pos.tolist() == [0, 1, 0, 1, 2]
    assert C.seq_lengths(cu, 3, 0, "cpu").tolist() == [2, 0, 3]
    assert C.seq_starts(None, 3, 4, "cpu").tolist() == [0, 4, 8]


def test_softplus_gate_matches_torch():
    a = torch.linspace(-30, 30, 61).view(61, 1).expand(61, 2)
    A_log, dt = torch.tensor([0.5, 1.0]), torch.tensor([0.1, -0.2])
    for beta, thr in ((1.0, 20.0), (2.0, 10.0)):
        got = C.softplus_gate(a, A_log, dt, beta, thr)
        x = (a + dt).double()
        sp = torch.where(beta * x > thr, x, torch.log1p(torch.exp(beta * x)) / beta)
        assert torch.allclose(got.double(), -torch.exp(A_log.double()) * sp, rtol=1e-6)


def test_helpers_reference_agrees_with_the_rule_written_out():
    """ref() against the delta rule written out token by token here (fp64, GVA: both value heads read q/k head 0),
    and with keep_states its last state is S_final."""
    g = gen("ref")
    q, k, v = randn(g, 3, 1, 64), randn(g, 3, 1, 64), randn(g, 3, 2, 64)
    gg, bb = -torch.rand(3, 2, generator=g), torch.rand(3, 2, generator=g)
    o, S, states = ref(None, q, k, v, gg, bb)
    assert o.shape == (3, 2, 64) and np.array_equal(states[-1], S)
    qn, kn = f64(q[:, 0]), f64(k[:, 0])
    qn, kn = (x / np.sqrt(np.sum(x * x, axis=1, keepdims=True) + 1e-6) for x in (qn, kn))  # eps inside the root
    for h in range(2):
        Sh = np.zeros((64, 64))
        for t in range(3):
            Sh = np.exp(float(gg[t, h])) * Sh
            Sh = Sh + np.outer(kn[t], float(bb[t, h]) * (f64(v[t, h]) - Sh.T @ kn[t]))
            assert rel(o[t, h], Sh.T @ qn[t] * 64 ** -0.5) < 1e-12
        assert rel(S[h], Sh) < 1e-12


# ---- torch.compile: the adapters trace into the custom ops --------------------------------------------

def _compile_cases(device="cpu", HV=4, K=64, V=128, dtype=torch.float32):
    """(name, fn(tensors...) -> tensors, args) for a decode-size call of each adapter; fn may mutate a pool."""
    from gdnkit.adapters import fla, sglang, vllm

    g = gen("compile")  # the same inputs on every device
    B, H = 3, 2
    q, k = randn(g, B, 1, H, K, dtype=dtype, device=device), randn(g, B, 1, H, K, dtype=dtype, device=device)
    v = randn(g, B, 1, HV, V, dtype=dtype, device=device)
    a, b = randn(g, B, HV, device=device), randn(g, B, HV, device=device)
    A_log, dt = torch.zeros(HV, device=device), torch.zeros(HV, device=device)
    gl, beta = -torch.rand(B, 1, HV, generator=g).to(device), torch.rand(B, 1, HV, generator=g).to(device)
    h0 = 0.1 * randn(g, B, HV, K, V, device=device)
    pool = 0.1 * randn(g, 16, HV, V, K, device=device)
    idx = torch.tensor([3, 0, 9], dtype=torch.int32, device=device)
    spec_idx = torch.tensor([[1, 2], [4, 5], [7, 0]], dtype=torch.int32, device=device)
    nacc = torch.tensor([1, 2, 2], dtype=torch.int32, device=device)
    q2, k2, v2 = (x.expand(B, 2, *x.shape[2:]).contiguous() for x in (q, k, v))
    a2, b2 = (x.repeat_interleave(2, dim=0) for x in (a, b))

    def fla_decode(q, k, v, gl, beta, h0):
        return fla.fused_recurrent_gated_delta_rule(q, k, v, g=gl, beta=beta, initial_state=h0, output_final_state=True,
                                                    use_qk_l2norm_in_kernel=True)

    def fla_chunk(q, k, v, gl, beta, h0):
        return fla.chunk_gated_delta_rule(q, k, v, gl, beta, initial_state=h0, output_final_state=True,
                                          use_qk_l2norm_in_kernel=True)

    def sg_decode(q, k, v, a, b, pool, idx):
        return sglang.fused_sigmoid_gating_delta_rule_update(A_log, a, dt, 1.0, 20.0, q, k, v, b, pool, idx,
                                                             use_qk_l2norm_in_kernel=True)

    def vl_decode(q, k, v, a, b, pool, idx):
        return vllm.fused_sigmoid_gating_delta_rule_update(A_log, a, b, dt, q, k, v, initial_state=pool,
                                                           ssm_state_indices=idx, use_qk_l2norm_in_kernel=True)[0]

    def vl_spec(q, k, v, a, b, pool, idx, nacc):
        return vllm.fused_sigmoid_gating_delta_rule_update(A_log, a, b, dt, q, k, v, initial_state=pool,
                                                           ssm_state_indices=idx, num_accepted_tokens=nacc,
                                                           use_qk_l2norm_in_kernel=True)[0]

    return [("fla_decode", fla_decode, (q, k, v, gl, beta, h0)), ("fla_chunk", fla_chunk, (q, k, v, gl, beta, h0)),
            ("sglang_decode", sg_decode, (q, k, v, a, b, pool, idx)),
            ("vllm_decode", vl_decode, (q, k, v, a, b, pool, idx)),
            ("vllm_spec", vl_spec, (q2, k2, v2, a2, b2, pool, spec_idx, nacc))]


def _clone_args(args):
    return tuple(x.clone() if isinstance(x, torch.Tensor) else x for x in args)


def _results(out, args):
    outs = out if isinstance(out, tuple) else (out,)
    return [x for x in outs if x is not None] + [x for x in args if isinstance(x, torch.Tensor)]


@pytest.mark.parametrize("case", [c[0] for c in _compile_cases()])
def test_adapters_under_torch_compile(case):
    """Each adapter traces with fullgraph=True (aot_eager on CPU: the custom ops' fakes, the pool's
    functionalized mutation) and gives the eager results."""
    name, fn, args = next(c for c in _compile_cases() if c[0] == case)
    eager_args, comp_args = _clone_args(args), _clone_args(args)
    with torch.no_grad():
        ref_out = fn(*eager_args)
        out = torch.compile(fn, backend="aot_eager", fullgraph=True)(*comp_args)
    for x, y in zip(_results(out, comp_args), _results(ref_out, eager_args)):
        assert torch.equal(x, y)


# ---- CUDA: the adapters on the CUDA backend vs the CPU backend, CUDA-graph capture --------------------

CUDA = torch.cuda.is_available() and gdnkit.cuda_compiled()
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA device and a CUDA build of gdnkit")


@needs_cuda
@pytest.mark.parametrize("case", [c[0] for c in _compile_cases()])
def test_cuda_matches_cpu(case):
    """The same adapter call on CUDA and on the CPU backend (K = V = 128: the CUDA recurrent kernels)."""
    cpu = next(c for c in _compile_cases("cpu", 8, 128, 128) if c[0] == case)
    gpu = next(c for c in _compile_cases("cuda", 8, 128, 128) if c[0] == case)
    with torch.no_grad():
        out_c = cpu[1](*cpu[2])
        try:
            out_g = gpu[1](*gpu[2])
            torch.cuda.synchronize()
        except gdnkit.GdnkitNotImplementedError as e:
            pytest.skip(f"CUDA kernel not available: {e}")
    limit = 5e-3 if case == "fla_chunk" else 1e-4  # the CUDA prefill multiplies fp32 inputs in fp16
    for x, y in zip(_results(out_g, gpu[2]), _results(out_c, cpu[2])):
        assert x.shape == y.shape and x.dtype == y.dtype
        assert rel(f64(x), f64(y)) < limit


@needs_cuda
@pytest.mark.parametrize("case", ["fla_decode", "sglang_decode", "vllm_decode", "vllm_spec"])
def test_cuda_graph_capture(case):
    """The recurrent adapters (decode, spec decode with its scatter) capture into a CUDA graph: no host
    synchronization; a replay gives the eager results."""
    _, fn, args = next(c for c in _compile_cases("cuda", 8, 128, 128) if c[0] == case)
    eager_args, graph_args = _clone_args(args), _clone_args(args)
    start = _clone_args(args)
    with torch.no_grad():
        try:
            ref_out = fn(*eager_args)
            fn(*_clone_args(args))  # warm-up
        except gdnkit.GdnkitNotImplementedError as e:
            pytest.skip(f"CUDA kernel not available: {e}")
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
            out = fn(*graph_args)
        torch.cuda.current_stream().wait_stream(stream)
        for dst, src in zip(graph_args, start):  # capture does not run: reset, replay
            if isinstance(dst, torch.Tensor):
                dst.copy_(src)
        graph.replay()
        torch.cuda.synchronize()
    for x, y in zip(_results(out, graph_args), _results(ref_out, eager_args)):
        assert rel(f64(x), f64(y)) < 1e-5
