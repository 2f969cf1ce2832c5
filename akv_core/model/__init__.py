"""The model side of the engine: loading weights, the forward pass, RoPE and the KV tensors.

Nothing here is imported eagerly: `akv_core.chat` resolves model files through
`akv_core.model.locate` and must stay free of torch.
"""
