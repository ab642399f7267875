from rayzero.models.gpt import GPT, ModelConfig, PRESETS

__all__ = ["GPT", "ModelConfig", "PRESETS"]
