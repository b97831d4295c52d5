"""FlashAttention's ``flash_attn.layers``: :mod:`.rotary`."""
