"""Integrations with serving and quantization frameworks.

- ``moewire.integrations.vllm``: vLLM's native Mega-MoE experts (registration, calibration
  worker extension, the ``vllm.general_plugins`` entry point); see docs/vllm.md.
- ``moewire.integrations.modelopt``: ModelOpt-style configs.

Nothing is imported here: each integration imports its framework, which may be absent.
"""
