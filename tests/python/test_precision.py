"""python -m gdnkit.precision on the CPU backend, small: every pool's run against the fp64 recurrence."""

import json

import pytest

torch = pytest.importorskip("torch")

from gdnkit import precision  # noqa: E402


def test_pools_against_fp64(tmp_path):
    rc = precision.main(["--out", str(tmp_path), "--prefill", "200", "--steps", "12", "--heads", "2", "--no-fla",
                         "--seed", "5"])
    assert rc == 0
    rows = json.loads((tmp_path / "precision_long_horizon.json").read_text())["rows"]
    err = {(r["regime"], r["state"]): (r["o_rel"], r["state_rel"]) for r in rows}
    assert set(err) == {(g, p) for g in ("long memory", "mixed") for p in precision.POOLS}
    for regime in ("long memory", "mixed"):
        o32, s32 = err[(regime, "fp32")]
        assert o32 < 5e-3 and s32 < 1e-5  # o rounds to bf16; the fp32 pool only to its arithmetic
        # each narrower pool costs more state error than the wider one, none beyond what it can hold
        assert s32 < err[(regime, "fp16")][1] < err[(regime, "bf16")][1] < err[(regime, "fp8")][1] < 0.5


def test_reference_last_step_by_hand():
    x = precision.inputs(3, 1, True, 1, "cpu")
    o, S = precision.reference(x, 2)  # o of token 2, the state after it
    _, S2 = precision.reference({n: t[:2] for n, t in x.items()}, 2)  # the state after tokens 0, 1
    q, k, v = (x[n][2, 0].double() for n in ("q", "k", "v"))
    q, k = q / torch.sqrt((q * q).sum() + 1e-6), k / torch.sqrt((k * k).sum() + 1e-6)
    g, beta = x["g"][2, 0].double(), x["beta"][2, 0].double()
    S3 = torch.exp(g) * S2[0]  # [V, K]
    S3 = S3 + torch.outer(beta * (v - S3 @ k), k)
    assert torch.allclose(S[0], S3, rtol=1e-12, atol=1e-12)
    assert torch.allclose(o[0, 0], S3 @ q / precision.K ** 0.5, rtol=1e-12, atol=1e-12)


def test_bad_arguments():
    assert precision.main(["--pools", "fp64", "--no-fla"]) == 2
