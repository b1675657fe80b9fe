"""Bad-input fuzzing of the Python API: valid calls of every op, then seeded random mutations of one argument
(a wrong Python type, None where an array is required, a 0-d array, a wrong dtype, shape or device, a
non-contiguous layout, out-of-order cu_seqlens). Each mutated call either succeeds or raises one of the
library's exceptions (GdnkitError, a ValueError, or TypeError) whose message names the argument, and the output,
pool and cache arrays are unchanged when it raises. test_errors.py holds the exact messages of the common
cases; this file covers the space around them. A failure prints the seed and the mutation.

GDNKIT_FUZZ_SEED and GDNKIT_FUZZ_ITERATIONS override the seed and the number of calls per op.
"""

import os
import re

import numpy as np
import pytest

import gdnkit
from reference import Problem, bits_equal, poison, random_pool

SEED = int(os.environ.get("GDNKIT_FUZZ_SEED", "20240611"))
ITERATIONS = int(os.environ.get("GDNKIT_FUZZ_ITERATIONS", "250"))
LIBRARY_ERRORS = (gdnkit.GdnkitError, TypeError, ValueError)


# ---- valid calls --------------------------------------------------------------------------------------

def decode_call(rng):
    p = Problem(rng, 3, H=2, HV=4, K=64, V=64, gating=rng.choice(["fused", "given"]))
    return "decode", dict(q=p.q, k=p.k, v=p.v, state=random_pool(rng, 5, 4, 64, 64, "k_last"),
                          state_indices=np.array([0, 3, -1], np.int32), o=poison(p.v.shape),
                          error_flag=np.zeros(1, np.int32), **p.gate_kwargs())


def verify_call(rng):
    p = Problem(rng, 6, H=1, HV=2, K=64, V=64)
    args = dict(q=p.q, k=p.k, v=p.v, state=random_pool(rng, 4, 2, 64, 64, "k_last"),
                state_indices=np.array([2, 0], np.int32), o=poison(p.v.shape),
                intermediate=poison((3, 3, 2, 64, 64)), intermediate_indices=np.array([1, 2], np.int32),
                **p.gate_kwargs())
    if rng.random() < 0.5:
        args.update(cu_seqlens=np.array([0, 2, 5], np.int32), num_draft_tokens=3, q=p.q[:5], k=p.k[:5], v=p.v[:5],
                    o=poison((5, 2, 64)), **p.gate_kwargs(slice(0, 5)))
    else:
        args.update(parent=np.array([[-1, 0, 0], [-1, 0, 1]], np.int32))
    return "verify", args


def commit_call(rng):
    p = Problem(rng, 6, H=1, HV=2, K=64, V=64)
    return "commit", dict(k=p.k, v=p.v, state=random_pool(rng, 4, 2, 64, 64, "k_last"),
                          state_indices=np.array([2, 0], np.int32), accepted=np.array([1, 3], np.int32),
                          source=str(rng.choice(["cache", "recompute"])),
                          intermediate=random_pool(rng, 2, 3 * 2, 64, 64, "k_last").reshape(2, 3, 2, 64, 64),
                          intermediate_indices=np.array([1, 0], np.int32), **p.gate_kwargs())


def prefill_call(rng):
    p = Problem(rng, 70, H=1, HV=2, K=64, V=64)
    cu = np.array([0, 66, 66, 70], rng.choice([np.int32, np.int64]))
    return "prefill", dict(q=p.q, k=p.k, v=p.v, cu_seqlens=cu, state=random_pool(rng, 5, 2, 64, 64, "v_last"),
                           layout="v_last", initial_indices=np.array([0, -1, 3], np.int32),
                           final_indices=np.array([1, 2, 3], np.int32), checkpoints=poison((3, 1, 2, 64, 64)),
                           checkpoint_interval=64, checkpoint_indices=np.array([2, 0, 1], np.int32),
                           cu_seqlens_cpu=cu.copy(), o=poison(p.v.shape), **p.gate_kwargs())


def layout_call(rng):
    src = random_pool(rng, 3, 2, 64, 64, "k_last")
    return "convert_layout", dict(src=src, src_layout="k_last", dst=poison(src.shape))


CALLS = [decode_call, verify_call, commit_call, prefill_call, layout_call]
POSITIONAL = {
    "decode": ["q", "k", "v", "state", "state_indices"],
    "verify": ["q", "k", "v", "state", "state_indices"],
    "commit": ["k", "v", "state", "state_indices", "accepted"],
    "prefill": ["q", "k", "v", "cu_seqlens"],
    "convert_layout": ["src"],
}
WRITTEN = ["o", "state", "intermediate", "checkpoints", "dst", "error_flag"]  # what a failed call must not touch
POOLS = {"state", "intermediate", "checkpoints", "src", "dst"}  # fewer or more slots (axis 0) are valid


def call(op, args, module=gdnkit):
    a = dict(args)
    pos = [a.pop(n) for n in POSITIONAL[op]]
    return getattr(module, op)(*pos, **a)


# ---- mutations: (what, argument names the message may name, whether the call must raise) -----------------

INDEX_ARGS = {"state_indices", "accepted", "intermediate_indices", "parent", "initial_indices", "final_indices",
              "checkpoint_indices", "cu_seqlens", "cu_seqlens_cpu", "error_flag"}
OPTIONAL = {"o", "error_flag", "g", "beta", "a", "b", "A_log", "dt_bias", "parent", "cu_seqlens",
            "intermediate", "intermediate_indices", "initial_indices", "final_indices", "checkpoints",
            "checkpoint_indices", "cu_seqlens_cpu", "dst", "state"}


def mutate(rng, op, args):
    """Mutates one argument of args in place; returns (what, names, must_raise)."""
    arrays = [n for n, x in args.items() if isinstance(x, np.ndarray)]
    name = str(rng.choice(arrays))
    x = args[name]
    kind = str(rng.choice(["list", "none", "int", "zero_d", "dtype", "shape", "strided", "reversed", "values",
                           "scalar"]))
    if kind == "list":
        args[name] = x.tolist()
        return f"{name}=list", {name}, True
    if kind == "none":
        if name in OPTIONAL and name not in POSITIONAL[op]:
            args[name] = None
            # Dropping an optional array is valid unless another argument needs it (then that one is named).
            return f"{name}=None", {name, "intermediate", "intermediate_indices", "state", "checkpoints",
                                    "checkpoint_interval", "checkpoint_indices", "g", "beta", "a", "b", "A_log",
                                    "dt_bias", "gating"}, False
        args[name] = None
        return f"{name}=None", {name, "q", "k", "v"}, name not in ("cu_seqlens",)
    if kind == "int":
        args[name] = int(rng.integers(-3, 4))
        return f"{name}={args[name]}", {name}, True
    if kind == "zero_d":
        args[name] = np.array(x.flat[0] if x.size else 0, dtype=x.dtype)
        # A 0-d index array of one element is a [1] array: the shapes it must match name the mismatch.
        return f"{name}=0-d", {name, "q", "k", "v", "o", "state_indices", "cu_seqlens"}, name != "error_flag"
    if kind == "dtype":
        choices = [np.float64, np.int64, np.int16, np.uint8, np.complex64, np.bool_] if name not in INDEX_ARGS else \
            [np.float32, np.int16, np.uint32, np.float64]
        dt = rng.choice(choices)
        if name in ("cu_seqlens", "cu_seqlens_cpu") and dt == np.int64:
            dt = np.float32
        args[name] = x.astype(dt)
        return f"{name}.dtype={np.dtype(dt).name}", {name, "k", "v", "o", "q"}, True
    if kind == "shape":
        if x.ndim == 0 or x.shape[0] == 0:
            return None
        axis = int(rng.integers(0, x.ndim))
        if x.shape[axis] < 2 and rng.random() < 0.5:
            args[name] = np.concatenate([x, x], axis=axis)
        else:
            sl = [slice(None)] * x.ndim
            sl[axis] = slice(0, max(x.shape[axis] - 1, 0))
            args[name] = np.ascontiguousarray(x[tuple(sl)])
        # A shape that disagrees with another array: the message names the array it finds odd, which is
        # this one or the array it is compared with.
        return f"{name}.shape {x.shape}->{args[name].shape}", {name, "q", "k", "v", "o", "state", "state_indices",
                                                               "a", "b", "g", "beta", "cu_seqlens", "src", "dst",
                                                               "intermediate", "checkpoints", "num_draft_tokens",
                                                               "accepted", "parent", "final_indices",
                                                               "initial_indices", "checkpoint_indices",
                                                               "cu_seqlens_cpu", "intermediate_indices"}, \
            not (name == "error_flag" and args[name].size >= 1) and not (name in POOLS and axis == 0) \
            and not (name in ("intermediate", "checkpoints") and axis == 1) and not (op == "commit" and name == "k")
    if kind == "strided":
        # Every element twice along the last axis, then every other one: a view with last stride 2.
        if x.ndim == 0 or x.shape[-1] < 2:
            return None
        wide = np.repeat(x, 2, axis=-1)
        args[name] = wide[..., ::2]
        # Gates and error_flag take any strides; everything else needs a contiguous last dim (or array).
        ok = name in ("a", "b", "g", "beta", "error_flag", "cu_seqlens_cpu")
        return f"{name} last-dim stride 2", {name}, not ok
    if kind == "reversed":
        if x.ndim == 0 or x.shape[0] < 2:
            return None
        args[name] = x[::-1]
        # Reversed token rows overlap backwards (negative stride): rejected where a stride is checked.
        return f"{name}[::-1]", {name, "cu_seqlens", "cu_seqlens_cpu", "accepted", "parent", "state_indices"}, False
    if kind == "values":
        if name not in ("cu_seqlens", "cu_seqlens_cpu") or len(x) < 3:
            return None
        y = x.copy()
        i = int(rng.integers(0, len(y)))
        y[i] = {0: 1, len(y) - 1: y[-1] + 1}.get(i, y[i - 1] - 1) if i > 0 else 1
        args[name] = y
        return f"{name}={y.tolist()}", {name, "cu_seqlens", "cu_seqlens_cpu", "accepted"}, True
    # scalar options of the wrong type or value
    opts = {"layout": ["kv", 0, None], "scale": ["x", [1.0], float("nan"), -1.0], "use_qk_l2norm": [1, "no"],
            "num_draft_tokens": [2.5, "3", -1], "checkpoint_interval": [64.5, 48, -64], "source": ["both", 1],
            "src_layout": ["K-last", None], "cpu_algorithm": ["fast"], "update_state": ["yes"]}
    present = [n for n in opts if n in args or (n in ("layout", "scale", "use_qk_l2norm") and op != "convert_layout")]
    if op == "verify":
        present.append("update_state")
    if not present:
        return None
    n = str(rng.choice(present))
    vals = opts[n]
    args[n] = vals[int(rng.integers(0, len(vals)))]
    return f"{n}={args[n]!r}", {n}, True


def names(message, candidates):
    return any(re.search(rf"(?<![A-Za-z0-9_]){re.escape(c)}(?![A-Za-z0-9_])", message) for c in candidates)


def host_array(x):
    """x as a NumPy array over the same memory (NumPy arrays, CPU torch tensors), else None."""
    if isinstance(x, np.ndarray):
        return x
    if hasattr(x, "numpy") and str(getattr(x, "device", "")) == "cpu":
        return x.numpy()
    return None


def snapshot(args):
    views = {n: host_array(args.get(n)) for n in WRITTEN}
    return {n: np.array(v, copy=True) for n, v in views.items() if v is not None}


def check_one(rng, seed, make, module=gdnkit, convert=None):
    op, args = make(rng)
    m = mutate(rng, op, args)
    if m is None:
        return 0
    what, allowed, must_raise = m
    if convert is not None:
        args = {n: convert(x) for n, x in args.items()}
    before = snapshot(args)
    where = f"GDNKIT_FUZZ_SEED={SEED} seed {seed} {op}: {what}"
    try:
        call(op, args, module)
    except LIBRARY_ERRORS as e:
        assert names(str(e), allowed), f"{where}: {type(e).__name__} does not name the argument: {e}"
        for n, b in before.items():
            assert bits_equal(host_array(args[n]), b), f"{where}: {n} written although the call raised: {e}"
        return 1
    except Exception as e:  # noqa: BLE001 - any other exception is the failure being looked for
        pytest.fail(f"{where}: raised {type(e).__name__} (not a library error): {e}")
    assert not must_raise, f"{where}: accepted"
    return 1


@pytest.mark.parametrize("make", CALLS, ids=[c.__name__ for c in CALLS])
def test_random_mutations(make):
    count = 0
    for i in range(ITERATIONS):
        seed = SEED * 1000 + i
        count += check_one(np.random.default_rng(seed), seed, make)
    assert count > ITERATIONS // 2


def test_regressions():
    """Bad inputs fuzzing found in the Python layer (each once silently accepted or reported unnamed)."""
    rng = np.random.default_rng(3)
    op, args = decode_call(rng)
    args["q"] = None  # a required array as None: nanobind's TypeError named no argument
    with pytest.raises(TypeError, match=r"^q: expected an array: .*, got None$"):
        call(op, args)
    op, args = verify_call(rng)
    args["num_draft_tokens"] = 2.5  # truncated to 2 by int()
    with pytest.raises(TypeError, match=r"^num_draft_tokens: expected an int T or None, got float$"):
        call(op, args)
    args["num_draft_tokens"] = -1  # a negative T read as "not given"
    with pytest.raises(gdnkit.GdnkitError, match=r"^num_draft_tokens: expected an int T >= 1 or None, got -1$"):
        call(op, args)
    op, args = prefill_call(rng)
    args["checkpoint_interval"] = 64.5  # truncated to 64 by int()
    before = args["checkpoints"].copy()
    with pytest.raises(TypeError, match=r"^checkpoint_interval: expected an int \(a multiple of 64\), got float$"):
        call(op, args)
    assert bits_equal(args["checkpoints"], before)
    args["checkpoint_interval"] = 64
    args["cu_seqlens_cpu"] = np.array([1, 66, 66, 70], np.int64)  # named after the C++ field cu_seqlens_host
    with pytest.raises(gdnkit.GdnkitError, match=r"^cu_seqlens_cpu: must start at 0 \(index 0: 1\)$"):
        call(op, args)
    assert bits_equal(args["checkpoints"], before)
    op, args = layout_call(rng)
    args["src_layout"] = "K-last"  # named "layout", an argument convert_layout does not have
    with pytest.raises(gdnkit.GdnkitError, match=r"^src_layout: expected 'k_last'"):
        call(op, args)
    op, args = verify_call(rng)
    args["state_indices"] = np.array(2, np.int32)  # B comes from state_indices: the message says so
    with pytest.raises(gdnkit.GdnkitError, match=r"\(B = len\(state_indices\)\), got shape \[\d\]$"):
        call(op, args)


# ---- the same through torch CPU tensors, the torch ops and a meta device ---------------------------------

def test_random_mutations_torch():
    torch = pytest.importorskip("torch", reason="PyTorch is not installed: torch fuzzing skipped")
    import torch.utils.dlpack  # noqa: F401

    def to_torch(x):
        if not isinstance(x, np.ndarray):
            return x
        if x.dtype == np.float32 and x.ndim >= 1 and x.size and x.strides[-1] == 4:
            return torch.from_numpy(x) if x.strides[0] >= 0 else torch.from_numpy(np.ascontiguousarray(x))
        if any(s < 0 for s in x.strides):
            return x  # torch has no negative strides: the numpy array is passed as it is
        return torch.from_numpy(x)

    count = 0
    for i in range(ITERATIONS // 2):
        seed = SEED * 1000 + 500000 + i
        rng = np.random.default_rng(seed)
        count += check_one(rng, seed, CALLS[i % len(CALLS)], convert=to_torch)
    assert count > ITERATIONS // 4


def test_meta_and_wrong_device_tensors_are_named():
    torch = pytest.importorskip("torch", reason="PyTorch is not installed: meta-tensor checks skipped")
    rng = np.random.default_rng(SEED)
    for make in CALLS:
        op, args = make(rng)
        for name in [n for n, x in args.items() if isinstance(x, np.ndarray)]:
            targs = {n: (torch.from_numpy(np.ascontiguousarray(x)) if isinstance(x, np.ndarray) else x)
                     for n, x in args.items()}
            before = {n: targs[n].clone() for n in WRITTEN if n in targs and targs[n] is not None}
            targs[name] = targs[name].to("meta")
            with pytest.raises(LIBRARY_ERRORS) as info:
                call(op, targs)
            assert names(str(info.value), {name}), f"{op}: meta {name}: {info.value}"
            for n, b in before.items():
                if n != name:
                    assert torch.equal(targs[n], b) or bits_equal(targs[n].numpy(), b.numpy()), f"{op}: {n} written"


def test_torch_ops_reject_bad_arguments_without_writing():
    torch = pytest.importorskip("torch", reason="PyTorch is not installed: torch ops skipped")
    from gdnkit import torch_ops  # noqa: F401  (registers torch.ops.gdnkit)

    rng = np.random.default_rng(SEED + 1)
    p = Problem(rng, 3, H=2, HV=4, K=64, V=64)
    t = {n: torch.from_numpy(np.ascontiguousarray(x)) for n, x in
         dict(q=p.q, k=p.k, v=p.v, a=p.a, b=p.b, A_log=p.A_log, dt_bias=p.dt_bias).items()}
    state = torch.from_numpy(random_pool(rng, 4, 4, 64, 64, "k_last"))
    idx = torch.tensor([0, 2, 3], dtype=torch.int32)
    cases = [
        (dict(q=t["q"].double()), "q"),
        (dict(k=t["k"][:2]), "k"),
        (dict(state=state.double()), "state"),
        (dict(state_indices=idx.long()), "state_indices"),
        (dict(a=t["a"][:, :3]), "a"),
        (dict(A_log=t["A_log"][:2]), "A_log"),
        (dict(v=torch.repeat_interleave(t["v"], 2, dim=-1)[..., ::2]), "v"),
    ]
    for change, name in cases:
        kw = dict(q=t["q"], k=t["k"], v=t["v"], state=state, state_indices=idx, a=t["a"], b=t["b"],
                  A_log=t["A_log"], dt_bias=t["dt_bias"])
        kw.update(change)
        before = state.clone()
        with pytest.raises(LIBRARY_ERRORS) as info:
            torch.ops.gdnkit.decode(kw.pop("q"), kw.pop("k"), kw.pop("v"), kw.pop("state"), kw.pop("state_indices"),
                                    None, **kw)
        assert names(str(info.value), {name}), f"torch.ops.gdnkit.decode {change.keys()}: {info.value}"
        assert torch.equal(state, before)
