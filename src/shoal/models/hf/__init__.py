"""Hugging Face families: one module each (llama, mistral, qwen2, qwen3, mixtral, qwen2_moe,
qwen3_moe, gpt2) holding its config in and out, weight names and layouts, and refusals; `families` finds a family and
runs the mapping (the Transformer adapter's weight map); `model` is `shoal.from_hf`."""
