"""Model execution: runner, batch inputs, KV tensors and the sampler. Torch from here down."""
