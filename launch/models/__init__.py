"""Model builders from the typed config: tp-fuse's GPT (``build``), a Hugging Face decoder
(``hf``) and a megatron-core ``GPTModel`` (``megatron``), the last two through ``wrap()``.
"""
