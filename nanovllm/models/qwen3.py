"""Qwen3ForCausalLM: the Llama decoder with RMSNorm on each query and key head before RoPE."""
from nanovllm.models.llama import DecoderConfig, LlamaForCausalLM
from nanovllm.models.registry import register_model


@register_model("Qwen3ForCausalLM")
class Qwen3ForCausalLM(LlamaForCausalLM):
    @staticmethod
    def parse_config(hf_config: dict) -> DecoderConfig:
        return DecoderConfig.from_hf(hf_config, qk_norm=True)
