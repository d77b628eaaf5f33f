"""The GPT family: GPT-2, the Llama family (Llama, Mistral, Qwen2 and the MoE members Mixtral, Qwen2-MoE) and BLOOM;
their Hugging Face mappings (hf.py, hf_moe.py, hf_bloom.py) and adapters (hf_adapter.py)."""
