from nanovllm.models.registry import model_class_for, register_model

__all__ = ["model_class_for", "register_model"]
