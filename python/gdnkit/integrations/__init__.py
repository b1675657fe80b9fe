"""One-call switches that make model libraries run gdnkit's kernels.

    import gdnkit.integrations.transformers as gdnkit_tf
    gdnkit_tf.enable()          # transformers' Qwen3-Next / Qwen3.5 Gated DeltaNet layers on gdnkit

Each integration imports its library only when it is imported itself; this package imports nothing.
"""
