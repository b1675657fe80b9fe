"""Drop-in adapters: the call signatures serving engines use today, computed by gdnkit.

    from gdnkit.adapters.fla import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
    from gdnkit.adapters.sglang import fused_sigmoid_gating_delta_rule_update
    from gdnkit.adapters.vllm import (chunk_gated_delta_rule, fused_recurrent_gated_delta_rule,
                                      fused_recurrent_gated_delta_rule_packed_decode,
                                      fused_sigmoid_gating_delta_rule_update)
    from gdnkit.adapters.flashinfer import (chunk_gated_delta_rule, gated_delta_rule_decode,
                                            gated_delta_rule_decode_pretranspose, gated_delta_rule_mtp)

Pinned peers: flash-linear-attention 0.6.0 (``fla``), SGLang 0.5.23 (``sglang``), vLLM 0.33.0 (``vllm``),
FlashInfer 0.7.2 (``flashinfer``; its prefill ``g`` is the decay factor exp(g)).
Each function takes every argument of its peer's function with the peer's defaults and returns what the
peer returns; a keyword the peer does not have raises TypeError naming it. Strided inputs (views of a
fused projection, time slices) reach the kernels without copies wherever the kernels can read them; the
module docstrings say where a copy is made and why.

They need PyTorch (they take and return torch tensors) and are inference-only: no autograd. Options gdnkit
does not compute raise NotImplementedError naming the option; nothing falls back silently.
"""
