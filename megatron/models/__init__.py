"""Model families, one folder each: gpt/ (GPT-2, the Llama family with its MoE members, BLOOM), bert/, t5/. A folder
holds what is the family's own (its Hugging Face mapping and adapter; see docs/architecture.md "Adding a family");
the parts every family shares (attention, MLP, norms, rotary, embeddings, layer specs, the MoE layer) live in
megatron/layers/. Hugging Face adapters are found through registry.py.
"""
