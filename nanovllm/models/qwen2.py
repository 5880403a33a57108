"""Qwen2ForCausalLM: the Llama decoder with biases on the q, k and v projections."""
from nanovllm.models.llama import DecoderConfig, LlamaForCausalLM
from nanovllm.models.registry import register_model


@register_model("Qwen2ForCausalLM")
class Qwen2ForCausalLM(LlamaForCausalLM):
    @staticmethod
    def parse_config(hf_config: dict) -> DecoderConfig:
        return DecoderConfig.from_hf(hf_config, qkv_bias=True)
