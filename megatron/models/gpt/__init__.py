"""The GPT family: GPT-2, the Llama family (Llama, Mistral, Qwen2), its MoE members (Mixtral, Qwen2-MoE) and BLOOM;
one module per Hugging Face adapter, each with its mapping: hf_gpt2.py, hf_llama.py, hf_moe.py, hf_bloom.py."""
