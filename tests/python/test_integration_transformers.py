"""gdnkit.integrations.transformers: tiny random-weight Qwen3-Next / Qwen3.5 models of transformers run their
Gated DeltaNet layers on gdnkit (prefill and decode, with the model's cache).

Per model: greedy generation equals transformers' own path (in bf16, up to a token the reference run
itself nearly tied on); logits (a prompt, then decode steps with the cache) are no farther from an fp64
run than those of transformers' torch path; every call a layer makes, replayed alone, is no farther from
the fp64 recurrence than the torch path's (and FLA's, on CUDA). The switches (enable / disable / enabled /
patch_model) and the fallbacks are checked too. The fp64 reference
is the recurrence of docs/semantics.md in torch float64 (this file), run by a float64 copy of the model.

CPU tests run gdnkit's CPU backend (fp32 and bf16); the CUDA test (skipped without CUDA or a CUDA build)
runs bf16 at Qwen3-Next's head dims and adds FLA where ``fla`` imports. Skipped without torch or
transformers.
"""

import contextlib
import inspect
import sys
import warnings

import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed: transformers integration tests skipped")
transformers = pytest.importorskip("transformers",
                                   reason="transformers is not installed: transformers integration tests skipped")

import gdnkit  # noqa: E402
import gdnkit.integrations.transformers as gt  # noqa: E402
from reference import TOLERANCES  # noqa: E402

MODELS = [name for name in ("qwen3_next", "qwen3_5")
          if hasattr(transformers, {"qwen3_next": "Qwen3NextForCausalLM", "qwen3_5": "Qwen3_5ForCausalLM"}[name])]
if not MODELS:
    pytest.skip(f"transformers {transformers.__version__} has neither Qwen3-Next nor Qwen3.5",
                allow_module_level=True)

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::DeprecationWarning")


# ---- tiny models ----------------------------------------------------------------------------------

def config(name, H=2, HV=4, K=64, hidden=64, vocab=128, layers=4, init=0.1):
    """A few layers (all Gated DeltaNet but the last), small sizes, gdnkit's head dims."""
    common = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden, num_hidden_layers=layers,
                  num_attention_heads=2, num_key_value_heads=1, head_dim=32, linear_key_head_dim=K,
                  linear_value_head_dim=K, linear_num_key_heads=H, linear_num_value_heads=HV,
                  layer_types=["linear_attention"] * (layers - 1) + ["full_attention"], initializer_range=init,
                  pad_token_id=0, bos_token_id=1, eos_token_id=None)
    if name == "qwen3_next":
        cfg = transformers.Qwen3NextConfig(moe_intermediate_size=32, shared_expert_intermediate_size=32,
                                           num_experts=4, num_experts_per_tok=2, **common)
    else:
        cfg = transformers.Qwen3_5TextConfig(**common)
    # float64 reference runs: the grouped-mm experts refuse float64
    cfg._experts_implementation = "eager"
    return cfg


def model_class(name):
    return transformers.Qwen3NextForCausalLM if name == "qwen3_next" else transformers.Qwen3_5ForCausalLM


def build(name, dtype, device="cpu", seed=0, **kw):
    torch.manual_seed(seed)
    cfg = config(name, **kw)
    model = model_class(name)(cfg).eval()
    return model.to(device=device, dtype=dtype)


def copy_as(model, dtype):
    """The same weights in another dtype (a new model)."""
    other = type(model)(model.config).eval()
    other.load_state_dict(model.state_dict())
    return other.to(device=next(model.parameters()).device, dtype=dtype)


def gdn_layers(model):
    return [m for m in model.modules() if type(m).__name__.endswith("GatedDeltaNet")]


def modeling_module(model):
    return sys.modules[type(gdn_layers(model)[0]).__module__]


# ---- the seam, for the reference paths --------------------------------------------------------------

def torch_rules(module):
    """transformers' own torch code (unwrapped from FLA / hub-kernel selection and from gdnkit's dispatchers)."""
    return (inspect.unwrap(module.torch_chunk_gated_delta_rule),
            inspect.unwrap(module.torch_recurrent_gated_delta_rule))


@contextlib.contextmanager
def rules(model, chunk, recurrent):
    """Run the model's GDN layers with the given functions (transformers >= 5.15: module globals;
    older: the layers' attributes)."""
    layers = gdn_layers(model)
    if "chunk_gated_delta_rule" in layers[0].__dict__:
        saved = [(l.chunk_gated_delta_rule, l.recurrent_gated_delta_rule) for l in layers]
        for l in layers:
            l.chunk_gated_delta_rule, l.recurrent_gated_delta_rule = chunk, recurrent
        try:
            yield
        finally:
            for l, (c, r) in zip(layers, saved):
                l.chunk_gated_delta_rule, l.recurrent_gated_delta_rule = c, r
    else:
        module = modeling_module(model)
        saved = (module.torch_chunk_gated_delta_rule, module.torch_recurrent_gated_delta_rule)
        module.torch_chunk_gated_delta_rule, module.torch_recurrent_gated_delta_rule = chunk, recurrent
        try:
            yield
        finally:
            module.torch_chunk_gated_delta_rule, module.torch_recurrent_gated_delta_rule = saved


@contextlib.contextmanager
def reference(model):
    """The fp64 recurrence in the model's GDN layers, and transformers' torch convolution (a causal-conv1d
    package, where installed, takes no float64)."""
    module = modeling_module(model)
    saved = {n: module.__dict__[n] for n in ("causal_conv1d_fn", "causal_conv1d_update")
             if callable(module.__dict__.get(n)) and hasattr(module.__dict__[n], "__wrapped__")}
    for n, fn in saved.items():
        setattr(module, n, inspect.unwrap(fn))
    try:
        with rules(model, fp64_rule, fp64_rule):
            yield
    finally:
        for n, fn in saved.items():
            setattr(module, n, fn)


@contextlib.contextmanager
def torch_path(model):
    with rules(model, *torch_rules(modeling_module(model))):
        yield


@contextlib.contextmanager
def gdnkit_path(model):
    gt.patch_model(model)
    try:
        yield
    finally:
        gt.unpatch_model(model)


def fp64_rule(query, key, value, g, beta, chunk_size=64, initial_state=None, output_final_state=False,
              use_qk_l2norm_in_kernel=False, cu_seqlens=None, **kwargs):
    """The recurrence of docs/semantics.md in float64, token by token, with transformers' arguments."""
    q, k, v = query.double(), key.double(), value.double()
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    if cu_seqlens is not None:  # packed sequences: one at a time
        assert B == 1 and initial_state is None
        outs, states = [], []
        cu = cu_seqlens.tolist()
        for s, e in zip(cu[:-1], cu[1:]):
            o, st = fp64_rule(query[:, s:e], key[:, s:e], value[:, s:e], g[:, s:e], beta[:, s:e],
                              output_final_state=True, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)
            outs.append(o)
            states.append(st)
        return torch.cat(outs, 1), (torch.cat(states) if output_final_state else None)
    q = q.repeat_interleave(HV // H, dim=2)  # value head h reads q/k head h // (HV // H)
    k = k.repeat_interleave(HV // H, dim=2)
    if use_qk_l2norm_in_kernel:
        q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6)
        k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    q = q * K ** -0.5
    g, beta = g.double(), beta.double()
    S = (torch.zeros(B, HV, K, V, dtype=torch.float64, device=q.device) if initial_state is None
         else initial_state.double().clone())
    o = torch.empty(B, T, HV, V, dtype=torch.float64, device=q.device)
    for t in range(T):
        S = S * g[:, t].exp()[..., None, None]
        u = beta[:, t, :, None] * (v[:, t] - torch.einsum("bhkv,bhk->bhv", S, k[:, t]))
        S = S + k[:, t, :, :, None] * u[:, :, None, :]
        o[:, t] = torch.einsum("bhkv,bhk->bhv", S, q[:, t])
    return o.to(value.dtype), (S if output_final_state else None)


@contextlib.contextmanager
def counting():
    """Counts the calls that reach gdnkit's two rules."""
    calls = {"chunk": 0, "recurrent": 0}
    chunk, recurrent = gt.chunk_gated_delta_rule, gt.recurrent_gated_delta_rule

    def c(*a, **k):
        calls["chunk"] += 1
        return chunk(*a, **k)

    def r(*a, **k):
        calls["recurrent"] += 1
        return recurrent(*a, **k)

    gt.chunk_gated_delta_rule, gt.recurrent_gated_delta_rule = c, r
    try:
        yield calls
    finally:
        gt.chunk_gated_delta_rule, gt.recurrent_gated_delta_rule = chunk, recurrent


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny CPU ops: torch's thread pool only costs time here (a lot on a loaded machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def _transformers_torch_code():
    """Where FLA is installed, transformers' wrappers pick its Triton kernels, which take no CPU tensor: the
    models' own path in these tests is transformers' torch code (the CUDA test adds FLA explicitly)."""
    import importlib
    saved = []
    for name in gt.MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        wrapped = False
        for fn in ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule"):
            f = module.__dict__.get(fn)
            if f is not None and hasattr(f, "__wrapped__"):
                saved.append((module, fn, f))
                setattr(module, fn, inspect.unwrap(f))
                wrapped = True
        for fn in ("chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule"):  # < 5.15: bound in __init__
            if not wrapped and module.__dict__.get(fn) is not None:
                saved.append((module, fn, module.__dict__[fn]))
                setattr(module, fn, None)
    yield
    for module, fn, f in reversed(saved):
        setattr(module, fn, f)


@pytest.fixture(autouse=True)
def _clean():
    yield
    gt.disable()
    assert not gt._replaced, "dispatchers left installed"


# ---- runs -------------------------------------------------------------------------------------------

def stepwise_logits(model, ids, prompt, attention_mask=None):
    """Logits of the last prompt token (one prefill with a cache), then of each following token fed one at
    a time with the cache (decode): [B, 1 + L - prompt, vocab] float64."""
    with torch.no_grad():
        mask = None if attention_mask is None else attention_mask[:, :prompt]
        out = model(input_ids=ids[:, :prompt], attention_mask=mask, use_cache=True)
        logits, cache = [out.logits[:, -1]], out.past_key_values
        for j in range(prompt, ids.shape[1]):
            mask = None if attention_mask is None else attention_mask[:, :j + 1]
            out = model(input_ids=ids[:, j:j + 1], attention_mask=mask, past_key_values=cache, use_cache=True)
            logits.append(out.logits[:, -1])
            cache = out.past_key_values
    return torch.stack(logits, 1).double()


def greedy(model, ids, new_tokens=8, attention_mask=None):
    with torch.no_grad():
        return model.generate(input_ids=ids, attention_mask=attention_mask, max_new_tokens=new_tokens,
                              do_sample=False, min_new_tokens=new_tokens)


def assert_same_greedy(seq, seq_ref, prompt, judge, tie):
    """Greedy continuations equal, or first parting where the model itself was nearly indifferent: ``judge(ids)``
    (the model's logits, on a path that does not round more than the runs compared) puts the two tokens less than
    ``tie`` apart. Past that the runs see different tokens and are not compared."""
    for b in range(seq.shape[0]):
        diff = (seq[b, prompt:] != seq_ref[b, prompt:]).nonzero()
        if len(diff) == 0:
            continue
        j = prompt + int(diff[0])
        with torch.no_grad():
            logits = judge(seq_ref[b:b + 1, :j])[0, -1].double()
        margin = abs(float(logits[seq[b, j]] - logits[seq_ref[b, j]]))
        assert margin < tie, (f"sequence {b} parts at token {j - prompt}: {seq[b, prompt:].tolist()} vs "
                              f"{seq_ref[b, prompt:].tolist()}, the reference's logit margin {margin:.3g} "
                              f"(a tie below {tie})")


def errors(x, ref):
    d = (x - ref).abs()
    return float(d.max()), float(d.pow(2).mean().sqrt())


def record_calls(model, ids, prompt, chunk, recurrent):
    """Every call the GDN layers make in a stepwise run (prompt, then decode), its tensors cloned."""
    calls = []

    def recorder(rule, fn):
        def rec(*args, **kwargs):
            clone = lambda x: x.clone() if isinstance(x, torch.Tensor) else x  # noqa: E731
            calls.append((rule, [clone(a) for a in args], {k: clone(v) for k, v in kwargs.items()}))
            return fn(*args, **kwargs)
        return rec

    with rules(model, recorder("chunk", chunk), recorder("recurrent", recurrent)):
        stepwise_logits(model, ids, prompt)
    return calls


def layer_errors(calls, implementations):
    """Replays each call with every implementation: per implementation and rule ("chunk" / "recurrent"),
    the largest relative error of o and of the final state vs the fp64 recurrence."""
    worst = {name: {"chunk": [0.0, 0.0], "recurrent": [0.0, 0.0]} for name in implementations}
    for rule, args, kwargs in calls:
        kw = {k: v for k, v in kwargs.items() if k in ("g", "beta", "initial_state", "output_final_state",
                                                       "use_qk_l2norm_in_kernel")}
        o_ref, s_ref = fp64_rule(*[a.double() if isinstance(a, torch.Tensor) else a for a in args], **kw)
        for name, (chunk, recurrent) in implementations.items():
            with torch.no_grad():
                o, s = (chunk if rule == "chunk" else recurrent)(*args, **kw)
            w = worst[name][rule]
            w[0] = max(w[0], float((o.double() - o_ref).norm() / o_ref.norm()))
            if s_ref is not None:
                w[1] = max(w[1], float((s.double() - s_ref).norm() / s_ref.norm()))
    return worst


# ---- CPU: the model on gdnkit's CPU backend ------------------------------------------------------------

PROMPT, NEW = 70, 8  # the prompt spans two of gdnkit's 64-token chunks


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_generate_matches_own_path(name, dtype):
    model = build(name, dtype)
    ids = torch.randint(2, 128, (2, PROMPT), generator=torch.Generator().manual_seed(1))
    ref = greedy(model, ids)  # transformers' own path (its torch code on CPU)
    with counting() as calls, gdnkit_path(model):
        out = greedy(model, ids)
    layers = len(gdn_layers(model))
    assert calls == {"chunk": layers, "recurrent": layers * (NEW - 1)}, calls
    if dtype == torch.float32:
        assert torch.equal(out, ref), (out[:, PROMPT:], ref[:, PROMPT:])
    else:
        # judged by the fp64 model: the bf16 model's own logits carry its rounding, several times a near tie
        ref64 = copy_as(model, torch.float64)
        with reference(ref64):
            assert_same_greedy(out, ref, PROMPT, lambda x: ref64(input_ids=x).logits, tie=0.1)


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_logits_vs_fp64(name, dtype):
    """Prompt + decode steps with the cache: gdnkit's logits are as close to the fp64 model's as the torch
    path's (the rest of the model dominates both errors, hence the slack); each layer call alone is closer."""
    model = build(name, dtype)
    ids = torch.randint(2, 128, (2, PROMPT + NEW), generator=torch.Generator().manual_seed(2))
    ref64 = copy_as(model, torch.float64)
    with reference(ref64):
        want = stepwise_logits(ref64, ids, PROMPT)
    with torch_path(model):
        own = stepwise_logits(model, ids, PROMPT)
    with gdnkit_path(model):
        got = stepwise_logits(model, ids, PROMPT)
    e_own, e_got = errors(own, want), errors(got, want)
    print(f"\n{name} {dtype}: logits vs fp64 (max, rms): torch path {e_own}, gdnkit {e_got}")
    assert e_got[0] <= 1.5 * e_own[0] and e_got[1] <= 1.25 * e_own[1], (e_got, e_own)

    calls = record_calls(model, ids, PROMPT, *torch_rules(modeling_module(model)))
    assert {c[0] for c in calls} == {"chunk", "recurrent"}
    worst = layer_errors(calls, {"torch": torch_rules(modeling_module(model)),
                                 "gdnkit": (gt.chunk_gated_delta_rule, gt.recurrent_gated_delta_rule)})
    print(f"{name} {dtype}: layer calls, worst rel error (o, state): {worst}")
    floor = 1e-6 if dtype == torch.float32 else 5e-3  # output rounding
    for rule in ("chunk", "recurrent"):  # the CPU backend computes in fp64: as close as the torch path
        assert worst["gdnkit"][rule][0] <= max(1.05 * worst["torch"][rule][0], floor), worst
        assert worst["gdnkit"][rule][1] <= max(1.05 * worst["torch"][rule][1], 1e-6), worst


@pytest.mark.parametrize("name", MODELS)
def test_left_padding(name):
    """A left-padded batch: the layers zero masked tokens before the rule, gdnkit follows the own path."""
    model = build(name, torch.float32)
    ids = torch.randint(2, 128, (3, 40), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    mask[1, :13] = 0
    mask[2, :39] = 0
    ids = ids.masked_fill(mask == 0, 0)
    ref = greedy(model, ids, attention_mask=mask)
    with gdnkit_path(model):
        out = greedy(model, ids, attention_mask=mask)
    assert torch.equal(out, ref), (out[:, 40:], ref[:, 40:])
    full = torch.cat([ids, ref[:, 40:]], 1)
    full_mask = torch.cat([mask, torch.ones_like(ref[:, 40:])], 1)
    own = stepwise_logits(model, full, 40, full_mask)
    with gdnkit_path(model):
        got = stepwise_logits(model, full, 40, full_mask)
    assert errors(got, own)[0] < 1e-4 * max(1.0, float(own.abs().max()))


@pytest.mark.parametrize("name", MODELS)
def test_forward_without_cache(name):
    """A plain forward (no cache: no final state asked for) equals the own path's."""
    model = build(name, torch.float32)
    ids = torch.randint(2, 128, (2, 130), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        own = model(input_ids=ids, use_cache=False).logits
        with gt.enabled():
            got = model(input_ids=ids, use_cache=False).logits
    assert errors(got, own)[0] < 1e-4 * max(1.0, float(own.abs().max()))


# ---- the rules alone: strides, varlen, the state -----------------------------------------------------

def rand_inputs(B, T, H, HV, K, dtype, seed, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    # q, k, v as transformers makes them: channels of one [B, C, T] convolution output, transposed
    C = 2 * H * K + HV * K
    mixed = torch.randn(B, C, T + 3, generator=g)[:, :, :T].to(device=device, dtype=dtype).transpose(1, 2)
    q, k, v = torch.split(mixed, [H * K, H * K, HV * K], dim=-1)
    q, k, v = q.reshape(B, T, H, K), k.reshape(B, T, H, K), v.reshape(B, T, HV, K)
    gate = (-torch.rand(B, T, HV, generator=g) * 0.5).to(device)
    beta = torch.rand(B, T, HV, generator=g).to(device=device, dtype=dtype)
    h0 = (0.1 * torch.randn(B, HV, K, K, generator=g)).to(device)
    return q, k, v, gate, beta, h0


@pytest.mark.parametrize("T", [1, 5, 70])
def test_rules_strided_views_and_state(T):
    q, k, v, g, beta, h0 = rand_inputs(2, T, 2, 4, 64, torch.float32, seed=T)
    assert q.stride(-1) != 1 or T == 1  # the views the models pass
    h0_before = h0.clone()
    kw = dict(g=g, beta=beta, initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True)
    o_ref, s_ref = fp64_rule(q, k, v, **kw)
    for rule in (gt.chunk_gated_delta_rule, gt.recurrent_gated_delta_rule):
        o, s = rule(q, k, v, **kw)
        assert torch.equal(h0, h0_before), "initial_state was modified"
        assert o.dtype == v.dtype and o.shape == v.shape and s.dtype == torch.float32 and s.shape == h0.shape
        assert float((o.double() - o_ref).norm() / o_ref.norm()) < 1e-5
        assert float((s.double() - s_ref).norm() / s_ref.norm()) < 1e-5
    o, s = gt.chunk_gated_delta_rule(q, k, v, g=g, beta=beta, initial_state=h0, use_qk_l2norm_in_kernel=True)
    assert s is None and float((o.double() - o_ref).norm() / o_ref.norm()) < 1e-5
    # overlapping rows (an expanded head) are copied, not read in place
    qe, ke = q[:, :, :1].expand(-1, -1, 2, -1), k[:, :, :1].expand(-1, -1, 2, -1)
    o_ref_e = fp64_rule(qe, ke, v, **kw)[0]
    o = gt.chunk_gated_delta_rule(qe, ke, v, **kw)[0]
    assert float((o.double() - o_ref_e).norm() / o_ref_e.norm()) < 1e-5
    # float64 inputs (a float64 model) are computed in float32 and returned as float64
    o, s = gt.chunk_gated_delta_rule(q.double(), k.double(), v.double(), **kw)
    assert o.dtype == torch.float64 and float((o - o_ref).norm() / o_ref.norm()) < 1e-5


def test_rules_varlen():
    lens = [5, 64, 1, 70]
    cu = torch.tensor([0, 5, 69, 70, 140], dtype=torch.int64)
    q, k, v, g, beta, _ = rand_inputs(1, 140, 1, 2, 64, torch.bfloat16, seed=9)
    kw = dict(g=g, beta=beta, output_final_state=True, use_qk_l2norm_in_kernel=True, cu_seqlens=cu)
    o_ref, s_ref = fp64_rule(q, k, v, **kw)
    o, s = gt.chunk_gated_delta_rule(q, k, v, **kw)
    assert s.shape == (len(lens), 2, 64, 64)
    assert float((o.double() - o_ref.double()).norm() / o_ref.double().norm()) < TOLERANCES[("prefill", "o", "bf16")]
    assert float((s.double() - s_ref).norm() / s_ref.norm()) < TOLERANCES[("prefill", "state", "fp32")]
    with pytest.raises(gdnkit.GdnkitError):
        gt.chunk_gated_delta_rule(q.expand(2, -1, -1, -1), k.expand(2, -1, -1, -1), v.expand(2, -1, -1, -1),
                                  g=g.expand(2, -1, -1), beta=beta.expand(2, -1, -1), cu_seqlens=cu)


# ---- switches and fallbacks ----------------------------------------------------------------------------

def run_counted(model, ids):
    with counting() as calls, torch.no_grad():
        model(input_ids=ids, use_cache=True)
    return calls["chunk"]


def test_enable_disable_patch():
    name = MODELS[0]
    a = build(name, torch.float32, seed=5)
    ids = torch.randint(2, 128, (1, 10), generator=torch.Generator().manual_seed(5))
    module = modeling_module(a)
    originals = {n: module.__dict__.get(n) for n in ("torch_chunk_gated_delta_rule",
                                                      "torch_recurrent_gated_delta_rule")}
    n = len(gdn_layers(a))
    # transformers < 5.15 binds the rules in the layers' __init__: enable() reaches layers built after it
    bound_in_init = "chunk_gated_delta_rule" in gdn_layers(a)[0].__dict__
    assert run_counted(a, ids) == 0

    done = gt.enable()
    assert module.__name__ in done and gt.is_enabled()
    late = build(name, torch.float32, seed=7)  # built while enabled
    assert run_counted(a, ids) == (0 if bound_in_init else n) and run_counted(late, ids) == n
    gt.disable()
    assert not gt.is_enabled() and run_counted(a, ids) == 0 and run_counted(late, ids) == 0
    assert {k: module.__dict__.get(k) for k in originals} == originals

    b = build(name, torch.float32, seed=6)
    with gt.enabled():
        b = b if not bound_in_init else build(name, torch.float32, seed=6)
        assert run_counted(b, ids) == n
    assert run_counted(b, ids) == 0

    assert gt.patch_model(a) == n and gt.patch_model(a) == 0
    assert run_counted(a, ids) == n and run_counted(b, ids) == 0
    with gt.enabled():  # patched and enabled; leaving the block keeps the patch
        assert run_counted(a, ids) == n and run_counted(b, ids) == n
    assert run_counted(a, ids) == n and run_counted(b, ids) == 0
    assert gt.unpatch_model(a) == n
    assert run_counted(a, ids) == 0
    assert {k: module.__dict__.get(k) for k in originals} == originals

    with pytest.raises(ValueError):
        gt.patch_model(torch.nn.Linear(2, 2))


def test_autograd_falls_back():
    model = build(MODELS[0], torch.float32)
    ids = torch.randint(2, 128, (1, 12), generator=torch.Generator().manual_seed(8))
    own = model(input_ids=ids).logits
    gt._warned.discard("autograd")
    with gdnkit_path(model), pytest.warns(RuntimeWarning, match="autograd"):
        got = model(input_ids=ids).logits
    assert got.requires_grad and torch.equal(got, own)


# ---- CUDA: bf16 at Qwen3-Next's head dims, vs the torch path and FLA ----------------------------------------

def _fla_rules():
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
    except Exception:  # noqa: BLE001
        return None

    def only_known(fn):
        params = inspect.signature(fn).parameters

        def call(*args, **kwargs):
            return fn(*args, **{k: v for k, v in kwargs.items() if k in params})
        return call
    return only_known(chunk_gated_delta_rule), only_known(fused_recurrent_gated_delta_rule)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.skipif(not gdnkit.cuda_compiled(), reason="gdnkit was built without CUDA")
@pytest.mark.parametrize("name", MODELS)
def test_cuda_bf16_vs_torch_and_fla(name):
    fla = _fla_rules()
    if fla is None:
        warnings.warn("fla (flash-linear-attention) is not importable: the CUDA test compares with the torch "
                      "path only")
    bf16_vs_paths(name, "cuda", {} if fla is None else {"fla": fla})


def bf16_vs_paths(name, device, others):
    """A bf16 model at Qwen3-Next's head dims on ``device``: gdnkit vs transformers' torch path and ``others``
    ({name: (chunk, recurrent)}): greedy tokens, logits vs the fp64 model, each layer call vs fp64."""
    prompt, new = 150, 8  # three chunks
    model = build(name, torch.bfloat16, device=device, H=2, HV=4, K=128, hidden=128, vocab=256)
    ref64 = copy_as(model, torch.float64)
    ids = torch.randint(2, 256, (2, prompt), generator=torch.Generator().manual_seed(11)).to(device)
    paths = dict({"torch": torch_rules(modeling_module(model))}, **others)

    with gdnkit_path(model):
        out = greedy(model, ids, new)
    for pname, fns in paths.items():
        with rules(model, *fns):
            ref = greedy(model, ids, new)
            assert_same_greedy(out, ref, prompt, lambda x: model(input_ids=x).logits, tie=0.25)

    full = torch.cat([ids, out[:, prompt:]], 1)
    with reference(ref64):
        want = stepwise_logits(ref64, full, prompt)
    errs = {}
    for pname, fns in paths.items():
        with rules(model, *fns):
            errs[pname] = errors(stepwise_logits(model, full, prompt), want)
    with gdnkit_path(model):
        errs["gdnkit"] = errors(stepwise_logits(model, full, prompt), want)
    print(f"\n{name} {device} bf16: logits vs fp64 (max, rms): {errs}")
    for pname in paths:
        assert errs["gdnkit"][0] <= 1.5 * errs[pname][0] and errs["gdnkit"][1] <= 1.25 * errs[pname][1], errs

    calls = record_calls(model, full, prompt, *paths["torch"])
    impls = dict(paths, gdnkit=(gt.chunk_gated_delta_rule, gt.recurrent_gated_delta_rule))
    worst = layer_errors(calls, impls)
    print(f"{name} {device} bf16: layer calls, worst rel error (o, state): {worst}")
    for rule, op in (("chunk", "prefill"), ("recurrent", "recurrent")):
        # docs/semantics.md's tolerances, and no worse than FLA where FLA is farther than them
        tol_o, tol_s = TOLERANCES[(op, "o", "bf16")], TOLERANCES[(op, "state", "fp32")]
        for pname in paths:
            assert worst["gdnkit"][rule][0] <= max(1.1 * worst[pname][rule][0], tol_o), (rule, worst)
            assert worst["gdnkit"][rule][1] <= max(1.1 * worst[pname][rule][1], tol_s), (rule, worst)
