"""Text generation for GPT: batched sampling with the KV cache (generate) and model loading for inference."""
from megatron.text_generation.generation import GenerationOutput, generate, generate_tokens
from megatron.text_generation.model_loading import InferenceLoadError, build_inference_model, load_model_for_inference
from megatron.text_generation.sampling import filter_top_k, filter_top_p, sample

__all__ = [
    "GenerationOutput",
    "InferenceLoadError",
    "build_inference_model",
    "filter_top_k",
    "filter_top_p",
    "generate",
    "generate_tokens",
    "load_model_for_inference",
    "sample",
]
