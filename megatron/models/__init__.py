"""Model families, one folder each: gpt/ (GPT-2, the Llama family with its MoE members, BLOOM), bert/, t5/. A folder
holds what is the family's own: its models and heads, and its Hugging Face mappings and adapters, one adapter per
module (see docs/architecture.md "Adding a family"). What two families' HF mappings share is in hf_common.py, never
in another family's folder: no family imports another's modules (tests/test_house_rules.py). The parts every family
shares (attention, MLP, norms, rotary, embeddings, layer specs, the MoE layer) live in megatron/layers/. Hugging Face
adapters are found through registry.py.
"""
