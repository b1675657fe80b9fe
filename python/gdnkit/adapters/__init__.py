"""Drop-in adapters: the call signatures serving engines use today, computed by gdnkit.

    from gdnkit.adapters.fla import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
    from gdnkit.adapters.sglang import fused_sigmoid_gating_delta_rule_update

They need PyTorch (they take and return torch tensors) and are inference-only: no autograd. Options the
gdnkit ops do not cover raise NotImplementedError naming the option; nothing falls back silently.
"""
