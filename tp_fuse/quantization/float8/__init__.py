"""Per-tensor FP8: ``Float8Tensor`` and Transformer Engine's Float8 quantizer names."""
