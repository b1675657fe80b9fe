"""Long-horizon precision of state pools against the fp64 recurrence: ``python -m gdnkit.precision --out DIR``.

One sequence (``--heads`` independent heads, K = V = 128, bf16 q/k/v, given gates, q/k L2 norm in the kernel):
a ``--prefill``-token prefill from S = 0 whose final state goes into a pool slot, then ``--steps`` decode steps on
that slot, the pool stored in each dtype (fp32, bf16, fp16, float8_e4m3 with block scales). The same inputs run
through FLA (``chunk_gated_delta_rule`` for the prefill, ``fused_recurrent_gated_delta_rule`` for each step; its
state is fp32, and its "bf16 state" row rounds that state to bf16 between calls, as a bf16 pool of a serving
engine does). Each is compared with the recurrence in fp64 on the bf16-rounded inputs: the relative error
``||x - ref|| / ||ref||`` of the decode steps' outputs and of the final state.

Regimes (as tests/support/long_horizon.h): q, k, v ~ N(0, 1), beta = sigmoid(N(0, 1)); long memory
g ~ -U(0, 1e-3); mixed: one token in ten g ~ -U(0, 2). Writes precision_long_horizon.{json,md} to --out.
Runs on the CPU backend where there is no GPU (FLA then skipped); the defaults are sized for a GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

from .bench import _fla, _rel, _torch

K = V = 128
POOLS = ("fp32", "bf16", "fp16", "fp8")


def inputs(tokens: int, heads: int, mixed: bool, seed: int, device: str) -> Dict[str, Any]:
    torch = _torch()
    gen = torch.Generator(device="cpu").manual_seed(seed)
    q, k = torch.randn(tokens, heads, K, generator=gen), torch.randn(tokens, heads, K, generator=gen)
    v = torch.randn(tokens, heads, V, generator=gen)
    g = -1e-3 * torch.rand(tokens, heads, generator=gen)
    if mixed:
        fast = torch.rand(tokens, heads, generator=gen) < 0.1
        g = torch.where(fast, -2.0 * torch.rand(tokens, heads, generator=gen), g)
    beta = torch.sigmoid(torch.randn(tokens, heads, generator=gen))
    bf = torch.bfloat16
    return dict(q=q.to(bf).to(device), k=k.to(bf).to(device), v=v.to(bf).to(device), g=g.to(device),
                beta=beta.to(device))


def reference(x: Dict[str, Any], prefill: int) -> Tuple[Any, Any]:
    """The recurrence in fp64 (docs/semantics.md): the outputs of tokens >= prefill, [steps, heads, V], and the
    final state [heads, V, K] (K-last)."""
    torch = _torch()
    q, k, v = (x[n].double() for n in ("q", "k", "v"))
    q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6) / K ** 0.5
    k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    decay, beta = torch.exp(x["g"].double()), x["beta"].double()
    tokens, heads = q.shape[0], q.shape[1]
    S = torch.zeros(heads, V, K, dtype=torch.float64, device=q.device)
    o = torch.empty(tokens - prefill, heads, V, dtype=torch.float64, device=q.device)
    for t in range(tokens):
        S.mul_(decay[t][:, None, None])
        u = beta[t][:, None] * (v[t] - torch.einsum("hvk,hk->hv", S, k[t]))
        S.add_(u[:, :, None] * k[t][:, None, :])
        if t >= prefill:
            o[t - prefill] = torch.einsum("hvk,hk->hv", S, q[t])
    return o, S


def _dequantize_e4m3(x, scales):
    """A float8_e4m3fn pool slot and its E8M0 block scales (one per 32 consecutive elements) as fp32."""
    torch = _torch()
    blocks = x.float().reshape(-1, 32) * torch.exp2(scales.reshape(-1, 1).float() - 127.0)
    return blocks.reshape(x.shape)


def run_gdnkit(x: Dict[str, Any], prefill: int, pool_dtype: str) -> Tuple[Any, Any]:
    """gdnkit: prefill into slot 0 of a pool of pool_dtype, then one decode call per token."""
    torch = _torch()
    import gdnkit

    tokens, heads = x["q"].shape[0], x["q"].shape[1]
    dev = x["q"].device
    dt = dict(fp32=torch.float32, bf16=torch.bfloat16, fp16=torch.float16, fp8=torch.float8_e4m3fn)[pool_dtype]
    pool = torch.zeros(1, heads, V, K, dtype=torch.float32, device=dev).to(dt)
    scales = torch.full((1, heads * V * K // 32), 127, dtype=torch.uint8, device=dev) if pool_dtype == "fp8" else None
    slot = torch.zeros(1, dtype=torch.int32, device=dev)
    q, k, v, g, beta = (x[n] for n in ("q", "k", "v", "g", "beta"))
    gdnkit.prefill(q[:prefill], k[:prefill], v[:prefill], state=pool, final_indices=slot, g=g[:prefill],
                   beta=beta[:prefill], state_scales=scales)
    o = torch.empty(tokens - prefill, heads, V, dtype=torch.bfloat16, device=dev)
    for t in range(prefill, tokens):
        s = slice(t, t + 1)
        gdnkit.decode(q[s], k[s], v[s], pool, slot, g=g[s], beta=beta[s], state_scales=scales,
                      o=o[t - prefill:t - prefill + 1])
    state = _dequantize_e4m3(pool[0], scales[0]) if pool_dtype == "fp8" else pool[0].float()
    return o, state


def run_fla(x: Dict[str, Any], prefill: int, state_dtype: str, fla: Tuple[Callable, Callable]) -> Tuple[Any, Any]:
    """FLA: chunk_gated_delta_rule for the prefill, fused_recurrent_gated_delta_rule per step; state_dtype bf16
    rounds the state to bf16 between calls."""
    torch = _torch()
    chunk, recurrent = fla
    tokens = x["q"].shape[0]
    q, k, v, g, beta = (x[n][None] for n in ("q", "k", "v", "g", "beta"))
    kw = dict(scale=K ** -0.5, output_final_state=True, use_qk_l2norm_in_kernel=True)
    with torch.no_grad():
        _, h = chunk(q[:, :prefill], k[:, :prefill], v[:, :prefill], g=g[:, :prefill], beta=beta[:, :prefill],
                     initial_state=None, **kw)
        outs = []
        for t in range(prefill, tokens):
            if state_dtype == "bf16":
                h = h.to(torch.bfloat16)
            s = slice(t, t + 1)
            o_t, h = recurrent(q[:, s], k[:, s], v[:, s], g=g[:, s], beta=beta[:, s], initial_state=h, **kw)
            outs.append(o_t[0])
        if state_dtype == "bf16":
            h = h.to(torch.bfloat16)
    # FLA's state is [N, HV, K, V]: as gdnkit's K-last [HV, V, K]
    return torch.cat(outs), h[0].float().transpose(-1, -2)


def markdown(meta: Dict[str, Any], rows: List[Dict[str, Any]]) -> str:
    out = [f"## Long-horizon precision: {meta['device']}", "",
           f"- one sequence, {meta['heads']} heads, K = V = {K}, bf16 q/k/v, given gates, q/k L2 norm in the kernel: "
           f"a {meta['prefill']}-token prefill, then {meta['steps']} decode steps on the same slot",
           "- relative error against the fp64 recurrence on the same (bf16-rounded) inputs: "
           "o over the decode steps (stored in bf16, as the inputs: about 2e-3 of rounding alone), the final state",
           f"- FLA {meta.get('fla_version') or 'not run'}: its prefill and step kernels; "
           "its bf16 row rounds the (fp32) state to bf16 between calls", "",
           "| regime | library | state | o rel. error | final state rel. error |", "|---|---|---|--:|--:|"]
    for r in rows:
        out.append(f"| {r['regime']} | {r['library']} | {r['state']} | {r['o_rel']:.2e} | {r['state_rel']:.2e} |")
    return "\n".join(out)


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m gdnkit.precision", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="precision-out", help="folder for precision_long_horizon.{json,md}")
    ap.add_argument("--prefill", type=int, default=None, help="prefill tokens (default 32768; CPU: 256)")
    ap.add_argument("--steps", type=int, default=None, help="decode steps (default 4096; CPU: 32)")
    ap.add_argument("--heads", type=int, default=4, help="independent heads of the sequence")
    ap.add_argument("--pools", default=",".join(POOLS), help="gdnkit pool dtypes: " + ", ".join(POOLS))
    ap.add_argument("--no-fla", action="store_true", help="gdnkit rows only")
    ap.add_argument("--seed", type=int, default=11)
    args = ap.parse_args(argv)
    torch = _torch()
    cuda = torch.cuda.is_available()
    prefill = args.prefill if args.prefill is not None else (32768 if cuda else 256)
    steps = args.steps if args.steps is not None else (4096 if cuda else 32)
    pools = [p for p in args.pools.split(",") if p]
    bad = [p for p in pools if p not in POOLS]
    if bad or prefill < 1 or steps < 1 or args.heads < 1:
        print(f"[precision] bad arguments: pools {bad}, prefill {prefill}, steps {steps}, heads {args.heads}",
              file=sys.stderr)
        return 2
    fla = (None, None, None) if args.no_fla or not cuda else _fla()  # (chunk, recurrent, version)
    device = "cuda" if cuda else "cpu"
    meta = dict(device=torch.cuda.get_device_name() if cuda else f"CPU backend ({platform.machine()})",
                prefill=prefill, steps=steps, heads=args.heads, seed=args.seed,
                fla_version=fla[2], date=time.strftime("%Y-%m-%d"),
                command="python -m gdnkit.precision " + " ".join(argv if argv is not None else sys.argv[1:]))
    rows: List[Dict[str, Any]] = []
    os.makedirs(args.out, exist_ok=True)
    for regime, mixed in (("long memory", False), ("mixed", True)):
        x = inputs(prefill + steps, args.heads, mixed, args.seed, device)
        o_ref, s_ref = reference(x, prefill)
        runs: List[Tuple[str, str, Callable[[], Tuple[Any, Any]]]] = [
            ("gdnkit", p, (lambda p=p: run_gdnkit(x, prefill, p))) for p in pools]
        if fla[0] is not None:
            runs += [("FLA", p, (lambda p=p: run_fla(x, prefill, p, fla[:2]))) for p in ("fp32", "bf16")]
        for library, state, fn in runs:
            o, s = fn()
            rows.append(dict(regime=regime, library=library, state=state, o_rel=_rel(o, o_ref),
                             state_rel=_rel(s, s_ref)))
            print(f"[precision] {regime:11s} {library:6s} {state:4s} o {rows[-1]['o_rel']:.3e} "
                  f"state {rows[-1]['state_rel']:.3e}", file=sys.stderr)
        with open(os.path.join(args.out, "precision_long_horizon.json"), "w") as f:
            json.dump(dict(meta=meta, rows=rows), f, indent=1)
        with open(os.path.join(args.out, "precision_long_horizon.md"), "w") as f:
            f.write(markdown(meta, rows) + "\n")
    print(markdown(meta, rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
