"""The DeepSeek-V3 family (issue #37): multi-latent attention, multi-token prediction, its layer spec, Hugging Face
adapter and checkpoint layout, built on the shared parts in megatron/layers/."""
